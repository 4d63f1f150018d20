"""msgpack encoding of wire types; encoders and decoders built once per type."""

from __future__ import annotations

from functools import lru_cache
from typing import TypeVar

import msgspec

T = TypeVar("T")

_encoder = msgspec.msgpack.Encoder()


class DecodeError(ValueError):
    """A payload that does not decode to, or validate as, the expected type."""


def encode(msg: object) -> bytes:
    return _encoder.encode(msg)


@lru_cache(maxsize=None)
def decoder(typ: type[T]) -> msgspec.msgpack.Decoder:
    return msgspec.msgpack.Decoder(typ)


def decode(typ: type[T], data: bytes) -> T:
    try:
        return decoder(typ).decode(data)
    except (msgspec.DecodeError, msgspec.ValidationError) as e:
        raise DecodeError(f"cannot decode {typ.__name__}: {e}") from e

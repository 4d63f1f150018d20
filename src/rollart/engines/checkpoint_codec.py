"""The trainer's full checkpoint as data that cannot run code: one safetensors file.

A full checkpoint is a nested tree (model and optimizer tensors, AdamW's ``param_groups``,
the LR schedule, RNG states, the ledger and counters). ``torch.save`` pickles it, and
unpickling runs whatever constructor the bytes name: a checkpoint fetched from the run's
object store (:mod:`rollart.actors.trainer.checkpoint_store`) is written by another process, so a
pickle there is code execution on the head. Here the tree is split in two:

- every tensor goes into the safetensors file under the path that leads to it
  (``backend/optimizer/state/3/exp_avg``); tensors that are one (tied embeddings) are stored
  once and come back as one;
- the rest (dicts with ``int`` or ``str`` keys, lists, tuples, ints, floats, bools, str,
  bytes, None) is a :class:`Record` of tagged msgspec structs with a :class:`Ref` in each
  tensor's place, msgpack-encoded (base64) in the file's ``__metadata__``.

Decoding is safetensors (a bounded JSON header and raw buffers) plus msgspec into those
types: nothing in it looks up a callable by name. A file is decoded only once its SHA-256
equals the one the trainer recorded (:func:`load_file`), and every size read from the bytes
is bounded before anything is allocated from it (:data:`MAX_HEADER_BYTES`). The same codec
carries rank 0's state to the other ranks (:mod:`rollart.engines.trainer_ranks`).
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import json
import os
import struct
from pathlib import Path
from typing import Any, BinaryIO, Union

import msgspec

from .safe_files import open_regular

CODEC_FORMAT = 1
META_KEY = "rollart.checkpoint"
MAX_HEADER_BYTES = 64 << 20
"""Bytes the safetensors header (tensor table and the record) may have: refused above it
before it is read. A 1.5B model's table is ~1 MB."""
MAX_DEPTH = 64
"""Nesting a tree may have (a checkpoint's is ~6)."""


class CheckpointRefused(ValueError):
    """A checkpoint that is not loaded: its bytes do not match the recorded digest, it does
    not decode, or it is in the old pickle format. The message names the file and what is
    wrong, never the file's content."""


class Ref(msgspec.Struct, tag="r", forbid_unknown_fields=True):
    """A tensor of the file, by its name there."""
    key: str


class Lst(msgspec.Struct, tag="l", forbid_unknown_fields=True):
    items: list["Node"]


class Tup(msgspec.Struct, tag="t", forbid_unknown_fields=True):
    items: list["Node"]


class Dct(msgspec.Struct, tag="d", forbid_unknown_fields=True):
    keys: list[Union[int, str]]
    values: list["Node"]


class Raw(msgspec.Struct, tag="b", forbid_unknown_fields=True):
    data: bytes


Node = Union[None, bool, int, float, str, Ref, Lst, Tup, Dct, Raw]


class Record(msgspec.Struct, forbid_unknown_fields=True):
    """What the file's metadata holds besides the tensors."""
    format: int
    tree: Node


_encoder = msgspec.msgpack.Encoder()
_decoder = msgspec.msgpack.Decoder(Record)


def split(state: Any) -> tuple[Record, dict[str, Any]]:
    """``state`` as a record and its tensors by name (CPU, contiguous, no two sharing memory).
    A value of another type raises ``TypeError`` naming its path."""
    import torch  # optional dependency: only a training process writes checkpoints

    tensors: dict[str, torch.Tensor] = {}
    by_view: dict[tuple, str] = {}
    storages: set[int] = set()

    def walk(x: Any, path: str, depth: int) -> Node:
        if depth > MAX_DEPTH:
            raise TypeError(f"checkpoint value at {path or '/'}: nested deeper than {MAX_DEPTH}")
        if isinstance(x, torch.Tensor):
            t = x.detach()
            view = (t.untyped_storage().data_ptr(), t.storage_offset(), tuple(t.shape),
                    t.stride(), t.dtype, t.device)
            if view in by_view:  # the same tensor under two names: stored once
                return Ref(by_view[view])
            t = t.to("cpu")
            ptr = t.untyped_storage().data_ptr()
            if ptr in storages or not t.is_contiguous() or \
                    t.untyped_storage().nbytes() != t.numel() * t.element_size():
                t = t.contiguous().clone()  # another view of a stored buffer: its own copy
            storages.add(t.untyped_storage().data_ptr())
            key, n = path or "/", 1
            while key in tensors:
                key, n = f"{path}#{n}", n + 1
            tensors[key] = t
            by_view[view] = key
            return Ref(key)
        if isinstance(x, dict):
            keys = list(x)
            bad = next((k for k in keys if type(k) not in (int, str)), None)
            if bad is not None:
                raise TypeError(f"checkpoint value at {path or '/'}: a key of type "
                                f"{type(bad).__name__} (int and str keys only)")
            return Dct(keys, [walk(x[k], f"{path}/{k}", depth + 1) for k in keys])
        if isinstance(x, (list, tuple)):
            items = [walk(v, f"{path}/{i}", depth + 1) for i, v in enumerate(x)]
            return Tup(items) if isinstance(x, tuple) else Lst(items)
        if isinstance(x, (bytes, bytearray)):
            return Raw(bytes(x))
        if x is None or isinstance(x, (bool, str, float)) or (isinstance(x, int) and
                                                              -(1 << 63) <= x < (1 << 64)):
            return x
        raise TypeError(f"checkpoint value at {path or '/'}: {type(x).__name__} is not "
                        f"storable (tensors, dicts, lists, tuples, numbers, str, bytes, None)")

    tree = walk(state, "", 0)
    return Record(format=CODEC_FORMAT, tree=tree), tensors


def _metadata(record: Record) -> dict[str, str]:
    return {META_KEY: base64.b64encode(_encoder.encode(record)).decode("ascii")}


def dumps(state: Any) -> bytes:
    """``state`` as the bytes of one safetensors file (in memory: rank 0 to the other ranks)."""
    from safetensors.torch import save  # optional dependency: the train extra

    record, tensors = split(state)
    return save(tensors, metadata=_metadata(record))


def _sha256(f: BinaryIO) -> str:
    """The SHA-256 (hex) of what is left in ``f``, read a MiB at a time."""
    h = hashlib.sha256()
    for chunk in iter(lambda: f.read(1 << 20), b""):
        h.update(chunk)
    return h.hexdigest()


def save_file(state: Any, path: Path) -> tuple[int, str]:
    """Write ``state`` to ``path`` atomically (a temp file, fsynced, renamed; the folder
    fsynced); returns its bytes and the SHA-256 (hex) of them."""
    from safetensors.torch import save_file as st_save  # optional dependency: the train extra

    record, tensors = split(state)
    tmp = path.with_name(f"{path.name}.tmp{os.getpid()}")
    st_save(tensors, tmp, metadata=_metadata(record))
    del tensors
    with open(tmp, "rb") as f:
        digest = _sha256(f)
        os.fsync(f.fileno())
    size = tmp.stat().st_size
    os.replace(tmp, path)
    fd = os.open(path.parent, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
    return size, digest


def _check_header(head: bytes, total: int, what: str) -> None:
    """The safetensors header length (first 8 bytes) is bounded before anything is parsed."""
    if len(head) < 8:
        raise CheckpointRefused(f"{what}: {total} bytes, too short for a safetensors file")
    (n,) = struct.unpack("<Q", head[:8])
    if n > MAX_HEADER_BYTES or 8 + n > total:
        raise CheckpointRefused(f"{what}: a header of {n} bytes (at most {MAX_HEADER_BYTES}, "
                                f"and within the file's {total})")


def _record(metadata: dict[str, str] | None, what: str) -> Record:
    raw = (metadata or {}).get(META_KEY)
    if raw is None:
        raise CheckpointRefused(f"{what}: not a rollart checkpoint (no {META_KEY} record)")
    try:
        rec = _decoder.decode(base64.b64decode(raw, validate=True))
    except (binascii.Error, ValueError, msgspec.DecodeError, msgspec.ValidationError,
            RecursionError) as e:
        raise CheckpointRefused(f"{what}: its record does not decode ({type(e).__name__}: "
                                f"{str(e)[:200]})") from None
    if rec.format != CODEC_FORMAT:
        raise CheckpointRefused(f"{what}: record format {rec.format}, this trainer reads "
                                f"format {CODEC_FORMAT}")
    return rec


def join(record: Record, tensors: dict[str, Any], what: str) -> Any:
    """The tree of ``record`` with its tensors in place (dict int keys stay ints, tuples
    stay tuples)."""
    def build(x: Node, depth: int) -> Any:
        if depth > MAX_DEPTH:
            raise CheckpointRefused(f"{what}: nested deeper than {MAX_DEPTH}")
        if isinstance(x, Ref):
            if x.key not in tensors:
                raise CheckpointRefused(f"{what}: the record names a tensor the file does not "
                                        f"hold ({x.key[:200]!r})")
            return tensors[x.key]
        if isinstance(x, Dct):
            if len(x.keys) != len(x.values):
                raise CheckpointRefused(f"{what}: a map of {len(x.keys)} keys and "
                                        f"{len(x.values)} values")
            return {k: build(v, depth + 1) for k, v in zip(x.keys, x.values)}
        if isinstance(x, Lst):
            return [build(v, depth + 1) for v in x.items]
        if isinstance(x, Tup):
            return tuple(build(v, depth + 1) for v in x.items)
        if isinstance(x, Raw):
            return x.data
        return x

    return build(record.tree, 0)


def _safetensors_error() -> tuple[type[BaseException], ...]:
    from safetensors import SafetensorError  # optional dependency: the train extra

    return (SafetensorError, ValueError, TypeError, RuntimeError, OverflowError)


def loads(data: bytes, *, what: str = "checkpoint state") -> Any:
    """The tree :func:`dumps` wrote; :class:`CheckpointRefused` when it does not decode."""
    from safetensors.torch import load  # optional dependency: the train extra

    _check_header(data[:8], len(data), what)
    try:
        header = json.loads(data[8:8 + struct.unpack("<Q", data[:8])[0]])
        meta = header.get("__metadata__") if isinstance(header, dict) else None
        record = _record(meta if isinstance(meta, dict) else None, what)
        tensors = load(data)  # checks the header's offsets against the bytes
    except CheckpointRefused:
        raise
    except (*_safetensors_error(), RecursionError) as e:
        raise CheckpointRefused(f"{what}: not a valid safetensors file ({type(e).__name__}: "
                                f"{str(e)[:200]})") from None
    return join(record, tensors, what)


def load_file(path: Path, *, sha256: str, size: int) -> Any:
    """The tree in ``path``, only if its bytes are the ``size`` bytes of SHA-256 ``sha256``
    the trainer recorded (checked before anything in it is parsed); else
    :class:`CheckpointRefused` naming the file. Not followed through a symlink."""
    from safetensors import safe_open  # optional dependency: the train extra

    try:
        with open_regular(path, None, str(path), CheckpointRefused) as (fh, found):
            if found != size:
                raise CheckpointRefused(f"{path}: {found} bytes, the durable state recorded "
                                        f"{size}")
            if _sha256(fh) != sha256:
                raise CheckpointRefused(f"{path}: its SHA-256 is not the one the durable state "
                                        f"recorded (changed or replaced since the trainer wrote "
                                        f"it)")
            fh.seek(0)
            _check_header(fh.read(8), size, str(path))
    except FileNotFoundError:
        raise CheckpointRefused(f"{path} is missing: the durable state names it") from None
    try:
        with safe_open(path, framework="pt", device="cpu") as f:
            record = _record(f.metadata(), str(path))
            tensors = {k: f.get_tensor(k) for k in f.keys()}
    except CheckpointRefused:
        raise
    except (*_safetensors_error(), RecursionError) as e:
        raise CheckpointRefused(f"{path}: not a valid safetensors file ({type(e).__name__}: "
                                f"{str(e)[:200]})") from None
    return join(record, tensors, str(path))

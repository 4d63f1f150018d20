"""Weights by content: the digest of a safetensors file's tensors, not of its bytes (no torch).

The trainer's backend (:mod:`rollart.engines.torch_trainer`) computes it from memory, the
trainer and the policy readers (:mod:`rollart.actors.kernel.policy`) from files and fetched bytes;
it lives here, below both.
"""

from __future__ import annotations

import hashlib
import io
import json
import os
import struct
from collections.abc import Iterable
from typing import BinaryIO


class DigestMismatch(ValueError):
    """Weight bytes whose digest differs from the published one."""


def sha256_digest(data: bytes) -> str:
    """``"sha256:<hex>"`` of a file's bytes (the old digest; still accepted by :func:`check_digest`)."""
    return "sha256:" + hashlib.sha256(data).hexdigest()


# -- content digests: the tensors, not the file's bytes ---------------------------------
#
# safetensors writes its JSON header in a different key order per process, so the same
# tensors saved twice give different bytes. A content digest hashes, per tensor in name
# order, ``[name, dtype, shape, nbytes]`` and the raw (little-endian) data, and ignores the
# header's order, its ``__metadata__`` and padding. Parsed here without torch.

CONTENT_PREFIX = "tensors-sha256:"
_MAGIC = b"rollart-tensors-v1\n"
_MAX_HEADER = 100 * 1024 * 1024
_CHUNK = 1 << 22
_DTYPE_BITS = {"BOOL": 8, "U8": 8, "I8": 8, "F8_E4M3": 8, "F8_E4M3FNUZ": 8, "F8_E5M2": 8,
               "F8_E5M2FNUZ": 8, "F8_E8M0": 8, "I16": 16, "U16": 16, "F16": 16, "BF16": 16,
               "I32": 32, "U32": 32, "F32": 32, "I64": 64, "U64": 64, "F64": 64, "C64": 64}


class TensorDigest:
    """Incremental content digest; :meth:`add` the tensors in name order, then :meth:`hexdigest`."""

    def __init__(self) -> None:
        self._h = hashlib.sha256(_MAGIC)
        self._last: str | None = None
        self._open: list | None = None  # [name, declared bytes, bytes so far] of begin()

    def add(self, name: str, dtype: str, shape: Iterable[int], nbytes: int,
            chunks: Iterable[bytes | memoryview]) -> None:
        self.begin(name, dtype, shape, nbytes)
        for c in chunks:
            self.update(c)
        self.end()

    def begin(self, name: str, dtype: str, shape: Iterable[int], nbytes: int) -> None:
        """Start tensor ``name`` (its data follows in :meth:`update` calls, then :meth:`end`):
        for data that arrives in pieces across calls, e.g. a tensor split across the buckets
        of a streamed version (:mod:`rollart.engines.weight_stream`)."""
        if self._open is not None:
            raise ValueError(f"tensor {self._open[0]!r} is not ended")
        if self._last is not None and name <= self._last:
            raise ValueError(f"tensors must be added in name order: {name!r} after {self._last!r}")
        self._last = name
        self._h.update(json.dumps([name, dtype, [int(d) for d in shape], int(nbytes)],
                                  separators=(",", ":")).encode() + b"\n")
        self._open = [name, int(nbytes), 0]

    def update(self, chunk: bytes | memoryview) -> None:
        """More data of the tensor :meth:`begin` started."""
        if self._open is None:
            raise ValueError("update() outside begin()/end()")
        self._open[2] += len(chunk)
        self._h.update(chunk)

    def end(self) -> None:
        name, nbytes, n = self._open if self._open is not None else ("?", 0, 0)
        self._open = None
        if n != nbytes:
            raise ValueError(f"tensor {name!r}: {n} bytes of data, {nbytes} declared")

    def hexdigest(self) -> str:
        if self._open is not None:
            raise ValueError(f"tensor {self._open[0]!r} is not ended")
        return CONTENT_PREFIX + self._h.hexdigest()


def _entries(header: object, data_len: int) -> list[tuple[str, str, list[int], int, int]]:
    """``(name, dtype, shape, begin, end)`` per tensor of a safetensors header, name order;
    raises :class:`DigestMismatch` for a malformed header."""
    if not isinstance(header, dict):
        raise DigestMismatch("malformed safetensors header: not a JSON object")
    out = []
    for name, e in header.items():
        if name == "__metadata__":
            continue
        try:
            dtype, shape, (b, end) = e["dtype"], e["shape"], e["data_offsets"]
            ok = (isinstance(dtype, str) and isinstance(shape, list)
                  and all(isinstance(d, int) and d >= 0 for d in shape)
                  and isinstance(b, int) and isinstance(end, int) and 0 <= b <= end <= data_len)
        except (TypeError, KeyError, ValueError):
            ok = False
        if not ok:
            raise DigestMismatch(f"malformed safetensors header entry {name!r}")
        bits = _DTYPE_BITS.get(dtype)
        count = 1
        for d in shape:
            count *= d
        if bits is not None and (count * bits + 7) // 8 != end - b:
            raise DigestMismatch(f"malformed safetensors: tensor {name!r} {dtype}{shape} "
                                 f"has {end - b} bytes")
        out.append((name, dtype, shape, b, end))
    out.sort()
    return out


def _read_header(f: BinaryIO, size: int) -> tuple[list[tuple[str, str, list[int], int, int]], int]:
    raw = f.read(8)
    if len(raw) != 8:
        raise DigestMismatch("not a safetensors file: shorter than 8 bytes")
    (n,) = struct.unpack("<Q", raw)
    if n > min(size - 8, _MAX_HEADER):
        raise DigestMismatch(f"not a safetensors file: header length {n} of a {size}-byte file")
    try:
        header = json.loads(f.read(n))
    except ValueError as e:
        raise DigestMismatch(f"malformed safetensors header: {e}") from None
    return _entries(header, size - 8 - n), 8 + n


def _digest_stream(f: BinaryIO, size: int) -> str:
    entries, base = _read_header(f, size)
    d = TensorDigest()
    for name, dtype, shape, b, end in entries:
        def chunks(b=b, end=end):
            f.seek(base + b)
            left = end - b
            while left > 0:
                c = f.read(min(_CHUNK, left))
                if not c:
                    raise DigestMismatch(f"truncated safetensors data in tensor {name!r}")
                left -= len(c)
                yield c
        d.add(name, dtype, shape, end - b, chunks())
    return d.hexdigest()


# -- bucket-tree digests: a streamed version (rollart.engines.weight_stream) --------------
#
# A streamed version's data section is cut into leaves (byte ranges, in order: pieces of its
# buckets); its digest hashes the safetensors header of its tensors (names, dtypes, shapes,
# offsets: the layout) and, per leaf, its length and the SHA-256 of its bytes. A generator
# that patches only the leaves a delta changed verifies the whole version by hashing those
# leaves' new bytes: the others' digests are the ones it verified for the version it holds.

TREE_PREFIX = "buckets-sha256:"
_TREE_MAGIC = b"rollart-buckets-v1\n"


def bucket_tree_digest(header: bytes, buckets: Iterable[tuple[int, str]]) -> str:
    """``"buckets-sha256:<hex>"`` of a version: ``header`` (the staged file's size + JSON
    prefix, :func:`rollart.engines.weight_stream.header_bytes`) and ``(length, sha256 hex)``
    of each leaf of its data, in order."""
    h = hashlib.sha256(_TREE_MAGIC)
    h.update(hashlib.sha256(header).digest())
    for n, hexd in buckets:
        h.update(struct.pack("<Q", int(n)) + bytes.fromhex(hexd))
    return TREE_PREFIX + h.hexdigest()


def file_bucket_digest(path: str | os.PathLike, sizes: Iterable[int]) -> str:
    """The bucket-tree digest of a staged file whose data is cut into leaves of ``sizes``
    bytes (every byte read: for tests and tools, blocking)."""
    with open(path, "rb") as f:
        (n,) = struct.unpack("<Q", f.read(8))
        if n > _MAX_HEADER:
            raise DigestMismatch(f"not a safetensors file: header length {n}")
        header = struct.pack("<Q", n) + f.read(n)
        out = []
        for size in sizes:
            h, left = hashlib.sha256(), int(size)
            while left > 0:
                c = f.read(min(_CHUNK, left))
                if not c:
                    raise DigestMismatch("truncated data")
                h.update(c)
                left -= len(c)
            out.append((size, h.hexdigest()))
        if f.read(1):
            raise DigestMismatch("data past the last bucket")
    return bucket_tree_digest(header, out)


def content_digest(data: bytes) -> str:
    """``"tensors-sha256:<hex>"`` of safetensors bytes (blocking: call it off the loop)."""
    return _digest_stream(io.BytesIO(data), len(data))


def file_content_digest(path: str | os.PathLike) -> str:
    """``"tensors-sha256:<hex>"`` of a safetensors file, streamed (blocking: off the loop)."""
    with open(path, "rb") as f:
        return _digest_stream(f, os.fstat(f.fileno()).st_size)


def check_digest(data: bytes, digest: str) -> str:
    """The digest of ``data`` in ``digest``'s scheme (``tensors-sha256:`` or ``sha256:``);
    raises :class:`DigestMismatch` when it differs, or when the data cannot be parsed."""
    if digest.startswith(CONTENT_PREFIX):
        got = content_digest(data)
    elif digest.startswith("sha256:"):
        got = sha256_digest(data)
    else:
        raise DigestMismatch(f"unknown digest scheme {digest.split(':', 1)[0]!r}: "
                             f"use {CONTENT_PREFIX!r} or 'sha256:'")
    if got != digest:
        raise DigestMismatch(f"digest {got}")
    return got

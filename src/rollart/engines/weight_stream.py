"""Streamed weight versions (``trainer.sync.format: stream``): a manifest and buckets, full
"anchors" and XOR deltas in the serving dtype, assembled by a generator into one verified
safetensors file before its engine sees a byte of it.

Why not one file per version: a version is the whole model, every step, and a generator
held it all in memory to check its digest. Here a version is

- **buckets** of about ``trainer.sync.bucket_mb`` each: the tensors' bytes in name order,
  a large tensor split across buckets, each bucket zstd-compressed and named in the
  manifest with its raw size, wire size and the SHA-256 of its wire bytes;
- a **manifest** (JSON, :class:`Manifest`): tensors, buckets, the content digest of the
  whole result (:class:`rollart.engines.digest.TensorDigest`, the digest the trainer
  publishes), and stats. It is written LAST: the commit point. A trainer killed
  mid-publish leaves buckets no manifest names, and no generator ever sees that version.

A **delta** bucket holds ``zstd(new XOR base)`` over the same byte range of the previous
version, both in the serving dtype (``proxy.dtype``): after one optimizer step most
bf16 elements keep their bytes, so the XOR is mostly zeros and compresses to a small
fraction of the full size. Every ``anchor_every`` versions (and whenever the trainer has no
base) the version is a full **anchor**. A generator whose loaded version is not the
delta's parent walks the parents back to the newest anchor (or to its own version) and
applies them in order; the store keeps every version from the anchor the kept versions need.

The generator writes the result into a staging file (temp name, then ``os.replace``),
computing its content digest on the way; only a complete file with the published digest is
handed to the engine, so an engine never serves a half-applied version, and a failure
anywhere leaves the old weights serving with a reason (which bucket, which digest). Peak
extra memory is a few buckets, never the model.

No torch at import (numpy and zstandard); torch only in :class:`TorchTensors`, which casts
the trainer's fp32 masters to the serving dtype. All functions here block: the async ones
run them through :func:`asyncio.to_thread`.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import json
import math
import os
import secrets
import struct
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any, Literal, NamedTuple, Protocol
from urllib.parse import unquote, urlparse

import msgspec
import numpy as np
import xxhash

from .digest import TensorDigest
from .weight_files import DTYPE_BYTES

__all__ = [
    "SERVING_DTYPES",
    "Assembled",
    "BucketEntry",
    "DirBlobs",
    "Manifest",
    "ObjectBlobs",
    "StagedFile",
    "StreamError",
    "TensorSpec",
    "TorchTensors",
    "TrainerBase",
    "assemble_version",
    "blobs_for_uri",
    "header_bytes",
    "manifest_name",
    "plan_buckets",
    "read_manifest",
    "serving_dtype",
    "shm_dir",
    "write_version",
]

SERVING_DTYPES = {"float32": "F32", "bfloat16": "BF16", "float16": "F16"}
"""``proxy.dtype`` -> the safetensors dtype of the tensors a streamed version holds."""

FORMAT = "rollart-stream-v1"
ZSTD_LEVEL = 3
"""zstd level of the buckets: deltas are mostly zeros (any level shrinks them); 3 is zstd's
default, fast enough not to be the publish's bottleneck here."""
_UINT = {1: np.uint8, 2: np.uint16, 4: np.uint32, 8: np.uint64}


class StreamError(ValueError):
    """A streamed version that cannot be published or assembled; the message says why."""


# ======================================================================================
# The manifest
# ======================================================================================
class TensorSpec(msgspec.Struct, frozen=True, array_like=True):
    """A tensor of a version: ``[name, dtype, shape]`` (safetensors dtype names)."""

    name: str
    dtype: str
    shape: list[int]

    @property
    def nbytes(self) -> int:
        return DTYPE_BYTES[self.dtype] * math.prod(self.shape)

    @property
    def elements(self) -> int:
        return math.prod(self.shape)


class Span(msgspec.Struct, frozen=True, array_like=True):
    """``[tensor, offset, length]``: bytes ``offset..offset+length`` of tensor ``tensor``
    (an index into :attr:`Manifest.tensors`)."""

    tensor: int
    offset: int
    length: int


class BucketEntry(msgspec.Struct, frozen=True):
    name: str
    """Object name in the version's store."""
    raw: int
    """Bytes of tensor data it carries (decoded)."""
    wire: int
    """Bytes stored (zstd)."""
    xxh3: str
    """Hex XXH3-128 of the stored (wire) bytes, checked as the bucket arrives: it names the
    bucket that was damaged (a fast hash, ~20 GB/s here, against SHA-256's ~1.5: a version's
    integrity rests on the SHA-256 content digest the trainer announces on the bus, checked
    once over the assembled tensors, not on this)."""
    spans: list[Span]
    """The tensor bytes it covers, in order (consecutive in the data stream)."""
    codec: Literal["raw", "zstd"] = "zstd"
    """``zstd``: the byte planes of the data (a delta's: of the XOR), zstd-compressed;
    ``raw``: the tensor bytes as they are (anchors: weights compress only to ~75-90%, at
    zstd's ~0.25 GB/s here, a loss next to a link's GB/s)."""


class StreamStats(msgspec.Struct, frozen=True):
    changed: int
    """Elements whose bytes differ from the parent's (delta), or every element (anchor)."""
    total: int
    """Elements of the version."""
    wire_bytes: int
    """Bytes of its buckets in the store."""
    full_bytes: int
    """Bytes of its tensors in the serving dtype (what a full file would hold)."""
    encode_s: float
    """Seconds the trainer took to cast, encode and store the buckets."""


class Manifest(msgspec.Struct, frozen=True, kw_only=True):
    """A streamed version (see the module docstring); JSON in the store."""

    format: str = FORMAT
    version: int
    kind: Literal["full", "delta"]
    parent_version: int | None = None
    """The version a delta applies to (None for an anchor)."""
    parent_digest: str = ""
    """Its content digest: a generator applies the delta only over exactly these tensors."""
    anchor: int
    """The newest anchor at or below this version (this version for an anchor)."""
    dtype: str
    """The serving dtype (``proxy.dtype``) the float tensors are cast to."""
    shuffle: bool = True
    """Each span's bytes are stored as byte planes (every element's first byte, then every
    second byte...) before zstd: the XOR of a small update is zero in the high (sign and
    exponent) bytes, and a plane of zeros compresses to nothing (~10% fewer wire bytes
    than interleaved on the quickstart's bf16 deltas)."""
    tensors: list[TensorSpec]
    buckets: list[BucketEntry]
    digest: str
    """Content digest of the assembled version (the published one)."""
    stats: StreamStats


def manifest_name(version: int, digest: str) -> str:
    """The manifest's object name: by version and digest, so a version trained again after a
    resume (other tensors) never overwrites the one generators may be reading."""
    return f"stream.v{int(version):06d}-{digest.rsplit(':', 1)[-1][:16]}.manifest"


def _version_of(name: str) -> int | None:
    if name.startswith("stream.v") and name[8:14].isdigit():
        return int(name[8:14])
    return None


def check_manifest(man: Manifest, what: str) -> None:
    """``StreamError`` unless the buckets' spans cover the tensors in order, exactly."""
    if man.format != FORMAT:
        raise StreamError(f"{what}: unknown stream format {man.format!r} (expected {FORMAT!r})")
    names = [t.name for t in man.tensors]
    if names != sorted(set(names)) or any(t.dtype not in DTYPE_BYTES for t in man.tensors):
        raise StreamError(f"{what}: tensors must be unique, in name order, of known dtypes")
    want = [(i, t.nbytes) for i, t in enumerate(man.tensors) if t.nbytes]
    pos, k = 0, 0  # k: index into want; pos: bytes of want[k] covered so far
    for j, b in enumerate(man.buckets):
        if sum(s.length for s in b.spans) != b.raw:
            raise StreamError(f"{what}: bucket {j} ({b.name}) spans {b.raw} raw bytes it does not list")
        for s in b.spans:
            if k >= len(want) or s.tensor != want[k][0] or s.offset != pos or s.length <= 0:
                raise StreamError(f"{what}: bucket {j} ({b.name}) has a span out of order: {s}")
            pos += s.length
            if pos > want[k][1]:
                raise StreamError(f"{what}: bucket {j} ({b.name}) runs past tensor "
                                  f"{man.tensors[s.tensor].name}")
            if pos == want[k][1]:
                k, pos = k + 1, 0
    if k != len(want):
        raise StreamError(f"{what}: the buckets do not cover tensor {man.tensors[want[k][0]].name}")


def plan_buckets(tensors: Sequence[TensorSpec], bucket_bytes: int) -> list[list[Span]]:
    """The spans of each bucket: tensors in order, each bucket at most ``bucket_bytes``
    (at least one element), a tensor split at element boundaries where it does not fit."""
    cap = max(8, int(bucket_bytes))
    out: list[list[Span]] = []
    cur: list[Span] = []
    fill = 0
    for i, t in enumerate(tensors):
        es, off, n = DTYPE_BYTES[t.dtype], 0, t.nbytes
        while off < n:
            room = cap - fill
            take = min(n - off, room - room % es)
            if take <= 0:
                out.append(cur)
                cur, fill = [], 0
                continue
            cur.append(Span(i, off, take))
            fill += take
            off += take
            if fill >= cap - 7:
                out.append(cur)
                cur, fill = [], 0
    if cur:
        out.append(cur)
    return out


def header_bytes(tensors: Sequence[TensorSpec]) -> bytes:
    """The safetensors prefix (size + JSON header) of a version's staged file: tensors in
    name order, data back to back. The same tensors always give the same bytes, which is
    how a base file is known to have the layout of the version that applies to it."""
    header: dict[str, Any] = {}
    off = 0
    for t in tensors:
        header[t.name] = {"dtype": t.dtype, "shape": list(t.shape), "data_offsets": [off, off + t.nbytes]}
        off += t.nbytes
    header["__metadata__"] = {"format": "pt"}
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)
    return struct.pack("<Q", len(raw)) + raw


# ======================================================================================
# Where versions are stored: a directory, or the run's object store
# ======================================================================================
class Blobs(Protocol):
    where: str

    async def get(self, name: str) -> bytes:
        """Raise ``KeyError`` when ``name`` is not stored."""

    async def put(self, name: str, data: bytes) -> None: ...

    async def delete(self, name: str) -> None: ...

    async def exists(self, name: str) -> bool: ...

    def uri(self, name: str) -> str: ...


class DirBlobs:
    """Blobs as files of one directory (``<run>/weights/stream`` or ``/dev/shm/rollart-<run>``);
    each put is a temp file, then a rename (a reader sees a whole blob or none). No fsync:
    the order readers see (buckets, then the manifest that names them) holds in the page
    cache whatever happens to the trainer's process; a host that loses its page cache
    loses the trainer with it, which resumes from its checkpoint and publishes again (a
    generator that meets a torn bucket refuses it by its check). An fsync per bucket cost
    ~0.3 s per 150 MB on this machine's disk."""

    def __init__(self, root: str | os.PathLike):
        self.root = Path(root)
        self.where = str(self.root)

    def _put(self, name: str, data: bytes) -> None:
        self.root.mkdir(parents=True, exist_ok=True)
        tmp = self.root / f".{name}.{os.getpid()}.tmp"
        with open(tmp, "wb") as f:
            f.write(data)
        os.replace(tmp, self.root / name)

    def _get(self, name: str) -> bytes:
        try:
            return (self.root / name).read_bytes()
        except FileNotFoundError:
            raise KeyError(name) from None

    async def get(self, name: str) -> bytes:
        return await asyncio.to_thread(self._get, name)

    async def put(self, name: str, data: bytes) -> None:
        await asyncio.to_thread(self._put, name, data)

    async def delete(self, name: str) -> None:
        await asyncio.to_thread((self.root / name).unlink, missing_ok=True)

    async def exists(self, name: str) -> bool:
        return await asyncio.to_thread((self.root / name).exists)

    def uri(self, name: str) -> str:
        return (self.root / name).resolve().as_uri()


class ObjectBlobs:
    """Blobs in the run's object store (``trainer.weights: object``)."""

    def __init__(self, store: Any, bucket: str):
        self.store = store
        self.bucket = bucket
        self.where = f"object store {bucket}"

    async def get(self, name: str) -> bytes:
        return await self.store.get(name)

    async def put(self, name: str, data: bytes) -> None:
        await self.store.put(name, data if isinstance(data, bytes) else bytes(data))

    async def delete(self, name: str) -> None:
        await self.store.delete(name)

    async def exists(self, name: str) -> bool:
        return await self.store.exists(name)

    def uri(self, name: str) -> str:
        return f"obj://{self.bucket}/{name}"


class ServedDirBlobs(DirBlobs):
    """``trainer.weights: tcp``: the trainer's stream folder, written as a :class:`DirBlobs`,
    named to generators by the URIs of the weight server that serves it."""

    def __init__(self, root: str | os.PathLike, server: Any):
        super().__init__(root)
        self.server = server
        self.where = f"{self.root} (served at {server.base_uri.rsplit('/', 1)[0]})"

    def uri(self, name: str) -> str:
        return self.server.uri(name)


def shm_dir(run: str) -> Path:
    """``trainer.weights: shm``: where a run's streamed versions live (one host only)."""
    return Path("/dev/shm") / f"rollart-{run}"


async def blobs_for_uri(bus: Any, uri: str) -> tuple[Any, str]:
    """The store and the manifest's name behind a stream version's uri (``file:///...`` or
    ``obj://bucket/name``); ``StreamError`` for a shared-memory folder this host lacks."""
    u = urlparse(uri)
    if u.scheme == "file":
        path = Path(unquote(u.path))
        if path.parts[:3] == ("/", "dev", "shm") and not await asyncio.to_thread(path.parent.is_dir):
            raise StreamError(f"{uri}: the trainer's shared-memory folder {path.parent} is not on "
                              f"this host (trainer.weights: shm serves generators on the trainer's "
                              f"host only): use trainer.weights: object for generators elsewhere")
        return DirBlobs(path.parent), path.name
    if u.scheme == "obj":
        return ObjectBlobs(await bus.object_store(u.netloc), u.netloc), u.path.lstrip("/")
    if u.scheme == "tcp":
        from .weight_tcp import TcpBlobs, parse_tcp_uri

        try:
            host, port, token, name = parse_tcp_uri(uri)
        except ValueError as e:
            raise StreamError(str(e)) from None
        return TcpBlobs(host, port, token), name
    raise StreamError(f"unsupported stream uri {uri!r}: use file://, obj:// or tcp://")


# ======================================================================================
# Staged files: written in order, digest on the way, renamed only when whole and right
# ======================================================================================
class StagedFile:
    """A safetensors file written front to back (header from the tensors, then their data
    in order, in pieces of any size) under a temp name; :meth:`commit` checks it is whole
    and its content digest and renames it into place (no fsync: a staged file, or the
    trainer's base, is rebuilt after a crash, never trusted across one). Blocking."""

    def __init__(self, final: str | os.PathLike, tensors: Sequence[TensorSpec]):
        self.final = Path(final)
        self.tmp = self.final.with_name(f".{self.final.name}.{os.getpid()}.tmp")
        self.tensors = list(tensors)
        self._digest = TensorDigest()
        self._i = 0
        self._left: int | None = None
        # The content digest (SHA-256, ~1.5 GB/s) runs in its own thread, one piece behind
        # the file write and the caller's next fetch: SHA-256 and file writes release the GIL,
        # so on two cores a version assembles at the speed of the slower of the two, not of
        # their sum. One piece at a time: a caller may reuse a piece's buffer after the
        # next write() returns (TcpBlobs alternates two buffers for that).
        self._hasher = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="stage-digest")
        self._pending: concurrent.futures.Future | None = None
        self.final.parent.mkdir(parents=True, exist_ok=True)
        self._f = open(self.tmp, "wb")  # noqa: SIM115 - closed in commit() or abort()
        self._f.write(header_bytes(self.tensors))
        self._advance()

    def _advance(self) -> None:
        while self._left is None and self._i < len(self.tensors):
            t = self.tensors[self._i]
            self._digest.begin(t.name, t.dtype, t.shape, t.nbytes)
            self._left = t.nbytes
            if self._left == 0:
                self._digest.end()
                self._i, self._left = self._i + 1, None

    def write(self, data: Any) -> None:
        """The next bytes of the data section (the buffer must stay unchanged until the next
        write() or commit() returns)."""
        mv = memoryview(data).cast("B")
        self._wait()
        self._pending = self._hasher.submit(self._hash, mv)
        self._f.write(mv)

    def _hash(self, mv: memoryview) -> None:
        pos = 0
        while pos < len(mv):
            if self._left is None:
                raise StreamError(f"{self.final.name}: more data than its tensors hold")
            n = min(self._left, len(mv) - pos)
            self._digest.update(mv[pos:pos + n])
            pos += n
            self._left -= n
            if self._left == 0:
                self._digest.end()
                self._i, self._left = self._i + 1, None
                self._advance()

    def _wait(self) -> None:
        """The previous piece hashed (its error raised here)."""
        if self._pending is not None:
            p, self._pending = self._pending, None
            p.result()

    def commit(self, expected: str | None = None) -> str:
        """Rename the whole file into place and return its content digest; ``StreamError``
        (and no file) when data is missing or the digest is not ``expected``."""
        try:
            self._wait()
            if self._i < len(self.tensors):
                raise StreamError(f"{self.final.name}: incomplete, tensor "
                                  f"{self.tensors[self._i].name} lacks {self._left} bytes")
            digest = self._digest.hexdigest()
            if expected is not None and digest != expected:
                raise StreamError(f"assembled digest {digest} is not the published {expected}")
            self._f.close()
            os.replace(self.tmp, self.final)
            self._hasher.shutdown()
            return digest
        except BaseException:
            self.abort()
            raise

    def abort(self) -> None:
        with contextlib.suppress(Exception):
            self._wait()
        self._hasher.shutdown()
        with contextlib.suppress(OSError):
            self._f.close()
        self.tmp.unlink(missing_ok=True)


class _BaseReader:
    """Byte ranges of a base version's staged file, checked to have the given layout."""

    def __init__(self, path: Path, tensors: Sequence[TensorSpec], what: str):
        want = header_bytes(tensors)
        try:
            self._f = open(path, "rb")  # noqa: SIM115 - closed in close()
        except OSError as e:
            raise StreamError(f"{what}: base {path} cannot be read: {e}") from None
        if self._f.read(len(want)) != want:
            self._f.close()
            raise StreamError(f"{what}: base {path.name} holds other tensors than the delta's")
        self._start = len(want)

    def read(self, offset: int, n: int) -> np.ndarray:
        """A writable copy of ``n`` data bytes from ``offset``."""
        buf = np.empty(n, np.uint8)
        self._f.seek(self._start + offset)
        if self._f.readinto(memoryview(buf)) != n:
            raise StreamError(f"base file truncated at data byte {offset + n}")
        return buf

    def close(self) -> None:
        self._f.close()


def _planes(buf: np.ndarray, spans: Sequence[Span], tensors: Sequence[TensorSpec],
            *, undo: bool = False) -> np.ndarray:
    """``buf`` (the bytes of ``spans``) with each span's elements split into byte planes
    (``undo``: joined back)."""
    out = np.empty_like(buf)
    pos = 0
    for s in spans:
        es = DTYPE_BYTES[tensors[s.tensor].dtype]
        seg = buf[pos:pos + s.length]
        if es == 1:
            out[pos:pos + s.length] = seg
        elif undo:
            out[pos:pos + s.length].reshape(-1, es)[...] = seg.reshape(es, -1).T
        else:
            out[pos:pos + s.length].reshape(es, -1)[...] = seg.reshape(-1, es).T
        pos += s.length
    return out


def _changed(xor: np.ndarray, spans: Sequence[Span], tensors: Sequence[TensorSpec]) -> int:
    n, pos = 0, 0
    for s in spans:
        es = DTYPE_BYTES[tensors[s.tensor].dtype]
        n += int(np.count_nonzero(xor[pos:pos + s.length].view(_UINT[es])))
        pos += s.length
    return n


# ======================================================================================
# The trainer's side
# ======================================================================================
_TORCH_NAMES = {"float32": "F32", "bfloat16": "BF16", "float16": "F16", "float64": "F64",
                "int64": "I64", "int32": "I32", "int16": "I16", "int8": "I8", "uint8": "U8",
                "bool": "BOOL"}


class TorchTensors:
    """The trainer's tensors as bytes in the serving dtype (float tensors cast, others
    as they are), cast one tensor at a time (the last one is kept for the next span):
    never a serving-dtype copy of the whole model in memory."""

    def __init__(self, tensors: Mapping[str, Any], dtype: str):
        import torch  # optional dependency: the trainer has it

        if dtype not in SERVING_DTYPES:
            raise ValueError(f"serving dtype must be one of {sorted(SERVING_DTYPES)}, got {dtype!r}")
        self._torch = torch
        self._target = getattr(torch, dtype)
        self._tensors = tensors
        self.names = sorted(tensors)
        self.specs = []
        for name in self.names:
            t = tensors[name]
            dt = self._target if t.is_floating_point() else t.dtype
            self.specs.append(TensorSpec(name, _TORCH_NAMES[str(dt).removeprefix("torch.")],
                                         [int(d) for d in t.shape]))
        self._cached: tuple[int, np.ndarray] | None = None

    def read(self, i: int, offset: int, length: int) -> np.ndarray:
        if self._cached is None or self._cached[0] != i:
            self._cached = None  # free the previous tensor before casting the next
            t = self._tensors[self.names[i]].detach().to("cpu")
            if t.is_floating_point():
                t = t.to(self._target)
            self._cached = (i, t.contiguous().reshape(-1).view(self._torch.uint8).numpy())
        return self._cached[1][offset:offset + length]


class TrainerBase(NamedTuple):
    """The trainer's previous published stream version: its serving-dtype file (on disk)."""

    path: Path
    version: int
    digest: str
    anchor: int


def _encode_bucket(source: Any, spans: list[Span], tensors: list[TensorSpec],
                   base: _BaseReader | None, start: int, writer: StagedFile,
                   cctx: Any) -> tuple[bytes | memoryview, int, int]:
    parts = [source.read(s.tensor, s.offset, s.length) for s in spans]
    raw = parts[0] if len(parts) == 1 else np.concatenate(parts)
    writer.write(raw)
    if base is None:
        changed, payload = sum(s.length // DTYPE_BYTES[tensors[s.tensor].dtype] for s in spans), raw
    else:
        payload = base.read(start, len(raw))
        np.bitwise_xor(payload, raw, out=payload)
        changed = _changed(payload, spans, tensors)
    if base is None:  # an anchor: the bytes as they are (see BucketEntry.codec)
        return memoryview(raw), len(raw), changed
    return cctx.compress(memoryview(_planes(payload, spans, tensors))), len(raw), changed


async def write_version(blobs: Any, source: Any, *, version: int, dtype: str,
                        bucket_bytes: int, base: TrainerBase | None, delta: bool,
                        anchor_every: int, base_out: Path) -> tuple[Manifest, str]:
    """Store version ``version`` of ``source`` (:class:`TorchTensors`) in ``blobs``: the
    buckets, then the manifest (the commit point). A delta over ``base`` when ``delta``,
    the base has the same tensors and its anchor is fewer than ``anchor_every`` versions
    back; else an anchor. The serving-dtype file of the version is written to ``base_out``
    (the next base; the caller moves it into place once the version is announced). Returns
    the manifest and its name; on a failure the buckets written are deleted again."""
    import zstandard

    t0 = time.perf_counter()
    specs: list[TensorSpec] = list(source.specs)
    what = f"stream version {version}"
    reader = None
    if delta and base is not None and version - base.anchor < max(1, anchor_every):
        try:
            reader = await asyncio.to_thread(_BaseReader, base.path, specs, what)
        except StreamError:
            reader = None  # another layout or no file: an anchor
    plan = plan_buckets(specs, bucket_bytes)
    nonce = secrets.token_hex(4)
    cctx = zstandard.ZstdCompressor(level=ZSTD_LEVEL)
    writer = await asyncio.to_thread(StagedFile, base_out, specs)
    entries: list[BucketEntry] = []
    written: list[str] = []
    changed, start = 0, 0
    try:
        for i, spans in enumerate(plan):
            wire, raw, ch = await asyncio.to_thread(_encode_bucket, source, spans, specs, reader,
                                                    start, writer, cctx)
            check = xxhash.xxh3_128_hexdigest(wire)  # ~20 GB/s: not worth a thread hop
            name = f"stream.v{version:06d}-{nonce}.b{i:04d}"
            await blobs.put(name, wire)
            written.append(name)
            entries.append(BucketEntry(name=name, raw=raw, wire=len(wire), xxh3=check, spans=spans,
                                       codec="zstd" if reader is not None else "raw"))
            changed += ch
            start += raw
        digest = await asyncio.to_thread(writer.commit)
    except BaseException:
        writer.abort()
        for n in written:
            with contextlib.suppress(Exception):
                await blobs.delete(n)
        raise
    finally:
        if reader is not None:
            reader.close()
    total = sum(t.elements for t in specs)
    stats = StreamStats(changed=changed if reader is not None else total, total=total,
                        wire_bytes=sum(e.wire for e in entries), full_bytes=start,
                        encode_s=time.perf_counter() - t0)
    man = Manifest(version=version, kind="delta" if reader is not None else "full",
                   parent_version=base.version if reader is not None else None,
                   parent_digest=base.digest if reader is not None else "",
                   anchor=base.anchor if reader is not None else version, dtype=dtype,
                   tensors=specs, buckets=entries, digest=digest, stats=stats)
    mname = manifest_name(version, digest)
    if await blobs.exists(mname):  # the same tensors published before (a resume): keep that one
        for n in written:
            await blobs.delete(n)
        return await read_manifest(blobs, mname), mname
    await blobs.put(mname, msgspec.json.encode(man))  # the commit point
    return man, mname


# ======================================================================================
# The generator's side
# ======================================================================================
class Assembled(NamedTuple):
    """A verified staged version."""

    path: Path
    version: int
    digest: str


async def read_manifest(blobs: Any, name: str) -> Manifest:
    try:
        raw = await blobs.get(name)
    except KeyError:
        raise StreamError(f"manifest {name} is not in {blobs.where}: that version was never "
                          f"committed (a trainer stopped mid-publish leaves none) or was pruned") from None
    try:
        man = msgspec.json.decode(raw, type=Manifest)
    except msgspec.DecodeError as e:
        raise StreamError(f"manifest {name} in {blobs.where} is not a stream manifest: {e}") from None
    check_manifest(man, f"manifest {name}")
    return man


def _decode_bucket(wire: bytes, b: BucketEntry, j: int, man: Manifest, base: _BaseReader | None,
                   start: int, writer: StagedFile, dctx: Any) -> None:
    what = f"v{man.version} bucket {j} ({b.name})"
    got = xxhash.xxh3_128_hexdigest(wire)
    if len(wire) != b.wire or got != b.xxh3:
        raise StreamError(f"{what}: {len(wire)} bytes with xxh3 {got}, the manifest says "
                          f"{b.wire} bytes with xxh3 {b.xxh3}")
    if b.codec == "raw":
        data = np.frombuffer(wire, np.uint8)
        if base is not None:
            raise StreamError(f"{what}: a raw bucket in a delta")
        writer.write(data)
        return
    try:
        raw = dctx.decompress(wire, max_output_size=b.raw)
    except Exception as e:  # noqa: BLE001 - zstandard.ZstdError
        raise StreamError(f"{what}: not a zstd frame ({e})") from None
    if len(raw) != b.raw:
        raise StreamError(f"{what}: {len(raw)} bytes decoded, the manifest says {b.raw}")
    data = np.frombuffer(raw, np.uint8)
    if man.shuffle:
        data = _planes(data, b.spans, man.tensors, undo=True)
    del raw
    if base is not None:
        buf = base.read(start, b.raw)
        np.bitwise_xor(buf, data, out=buf)
        writer.write(buf)
    else:
        writer.write(data)


async def apply_manifest(blobs: Any, man: Manifest, stage: Path, base: Assembled | None,
                         *, suffix: str = "") -> tuple[Assembled, int]:
    """Fetch ``man``'s buckets one by one and stage the version (over ``base`` for a delta);
    returns it and the wire bytes fetched. ``StreamError`` names the bucket or digest."""
    import zstandard

    final = stage / f"v{man.version:06d}-{man.digest.rsplit(':', 1)[-1][:16]}{suffix}.safetensors"
    what = f"v{man.version}"
    reader = None
    if man.kind == "delta":
        if base is None or base.digest != man.parent_digest:
            raise StreamError(f"{what} is a delta over v{man.parent_version} ({man.parent_digest}), "
                              f"not over the base given")
        reader = await asyncio.to_thread(_BaseReader, base.path, man.tensors, what)
    writer = await asyncio.to_thread(StagedFile, final, man.tensors)
    dctx = zstandard.ZstdDecompressor()
    start, fetched = 0, 0
    try:
        for j, b in enumerate(man.buckets):
            try:
                wire = await blobs.get(b.name)
            except KeyError:
                raise StreamError(f"{what} bucket {j} ({b.name}) is missing from {blobs.where}") from None
            fetched += len(wire)
            await asyncio.to_thread(_decode_bucket, wire, b, j, man, reader, start, writer, dctx)
            del wire
            start += b.raw
        try:
            digest = await asyncio.to_thread(writer.commit, man.digest)
        except StreamError as e:
            raise StreamError(f"{what}: {e}") from None
    except BaseException:
        writer.abort()
        raise
    finally:
        if reader is not None:
            reader.close()
    return Assembled(final, man.version, digest), fetched


async def assemble_version(blobs: Any, name: str, stage: str | os.PathLike, *,
                           base: Assembled | None, digest: str) -> tuple[Assembled, dict[str, Any]]:
    """Stage the version whose manifest is ``name`` in ``stage`` and return it with stats
    (``path``: ``full``, ``delta`` or ``chain``; ``manifests``, ``wire_bytes``).

    An anchor is applied alone; a delta over ``base`` when it is the delta's parent; else
    (or when that fails) by walking the parents back to the newest anchor and applying
    them in order. Intermediate versions are deleted; ``base`` is the caller's to keep.
    ``StreamError`` says why each way failed; nothing is staged then."""
    stage = Path(stage)
    man = await read_manifest(blobs, name)
    if man.digest != digest:
        raise StreamError(f"manifest {name} is of digest {man.digest}, the published one is {digest}")
    if man.kind == "full":
        got, n = await apply_manifest(blobs, man, stage, None)
        return got, {"path": "full", "manifests": 1, "wire_bytes": n}
    reasons = []
    if base is not None and base.digest == man.parent_digest:
        try:
            got, n = await apply_manifest(blobs, man, stage, base)
            return got, {"path": "delta", "manifests": 1, "wire_bytes": n}
        except StreamError as e:
            reasons.append(f"delta over the loaded v{base.version}: {e}")
    else:
        reasons.append(f"the loaded weights ({base.digest if base else 'the model folder'}) are "
                       f"not its parent v{man.parent_version}")
    # the loaded version may be further down the chain (a replica that skipped versions):
    # from it first; then from the anchor
    starts = ([base] if base is not None and not reasons[0].startswith("delta") else []) + [None]
    for start in starts:
        try:
            got, info = await _apply_chain(blobs, man, stage, start)
            return got, info
        except StreamError as e:
            reasons.append(f"the chain from {f'the loaded v{start.version}' if start else f'anchor v{man.anchor}'}: {e}")
    raise StreamError(f"cannot assemble version {man.version} ({name}): " + "; ".join(reasons))


async def _apply_chain(blobs: Any, man: Manifest, stage: Path,
                       start: Assembled | None) -> tuple[Assembled, dict[str, Any]]:
    """Walk ``man``'s parents back to ``start`` (None: to the anchor) and apply them in order."""
    chain = [man]
    while chain[-1].kind == "delta":
        cur = chain[-1]
        if start is not None and start.digest == cur.parent_digest:
            break
        if start is not None and (cur.parent_version or 0) < start.version:
            raise StreamError(f"v{start.version} is not on the chain of v{man.version}")
        pname = manifest_name(cur.parent_version or 0, cur.parent_digest)
        try:
            parent = await read_manifest(blobs, pname)
        except StreamError as e:
            raise StreamError(f"incomplete: v{cur.parent_version} (parent of v{cur.version}): {e}") from None
        if parent.digest != cur.parent_digest or parent.version != cur.parent_version:
            raise StreamError(f"manifest {pname} is not the parent of v{cur.version}")
        chain.append(parent)
    else:
        start = None
    chain.reverse()
    made: list[Assembled] = []
    cur_base, wire = start, 0
    try:
        for k, mm in enumerate(chain):  # intermediates under their own name: never the caller's base
            nxt, n = await apply_manifest(blobs, mm, stage, cur_base,
                                          suffix="" if k == len(chain) - 1 else ".chain")
            wire += n
            if made:  # an intermediate version: only the next step needs it
                made.pop().path.unlink(missing_ok=True)
            made.append(nxt)
            cur_base = nxt
    except BaseException:
        for a in made:
            a.path.unlink(missing_ok=True)
        raise
    return cur_base, {"path": "chain", "manifests": len(chain), "wire_bytes": wire}


def serving_dtype(choice: str, model_dir: str | os.PathLike | None) -> str:
    """``proxy.dtype``: as given, or for ``auto`` the model folder's ``torch_dtype`` (or
    ``dtype``) when it is bfloat16 or float16, else float32 (tiny test models are fp32)."""
    if choice != "auto":
        if choice not in SERVING_DTYPES:
            raise ValueError(f"proxy.dtype must be auto or one of {sorted(SERVING_DTYPES)}, got {choice!r}")
        return choice
    cfg: dict = {}
    if model_dir is not None:
        with contextlib.suppress(OSError, ValueError):
            cfg = json.loads((Path(model_dir) / "config.json").read_text())
    text = cfg.get("text_config") if isinstance(cfg.get("text_config"), dict) else {}
    for d in (cfg.get("torch_dtype"), cfg.get("dtype"), text.get("torch_dtype"), text.get("dtype")):
        if d in ("bfloat16", "float16"):
            return d
    return "float32"


def stream_versions(names: Sequence[str]) -> dict[int, list[str]]:
    """Version -> the object names of it (manifests and buckets) among ``names``."""
    out: dict[int, list[str]] = {}
    for n in names:
        v = _version_of(n)
        if v is not None:
            out.setdefault(v, []).append(n)
    return out

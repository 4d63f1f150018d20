"""The trainer's side of streamed versions (:mod:`rollart.engines.weight_stream`): its fp32
masters cast to the serving dtype a tensor at a time, cut into buckets (raw for an anchor,
zstd of the XOR byte planes for a delta, nothing for a delta's bucket that did not change),
each hashed for the version's bucket tree, stored, and the manifest written last."""

from __future__ import annotations

import asyncio
import contextlib
import secrets
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any, NamedTuple

import msgspec
import numpy as np
import xxhash

from .weight_files import DTYPE_BYTES
from .weight_staging import BaseReader, StagedFile, byte_planes, changed_elements
from .weight_stream import (
    DEFAULT_LIMITS,
    LEAF_BYTES,
    SERVING_DTYPES,
    ZSTD_LEVEL,
    BucketEntry,
    Manifest,
    Span,
    StreamError,
    StreamLimits,
    StreamStats,
    TensorSpec,
    manifest_name,
    leaf_sizes,
    plan_buckets,
    read_manifest,
)
from .weight_blobs import Buffers

__all__ = ["TorchTensors", "TrainerBase", "write_version"]

_TORCH_NAMES = {"float32": "F32", "bfloat16": "BF16", "float16": "F16", "float64": "F64",
                "int64": "I64", "int32": "I32", "int16": "I16", "int8": "I8", "uint8": "U8",
                "bool": "BOOL"}


class TorchTensors:
    """The trainer's tensors as bytes in the serving dtype (float tensors cast, others
    as they are), cast one tensor at a time (the last one is kept for the next span):
    never a serving-dtype copy of the whole model in memory. A mapping with a ``meta(name)``
    method (:class:`rollart.engines.fsdp2_ranks.Fsdp2TrainBackend`'s, which gathers a tensor
    when it is read) is asked for shapes and dtypes by it, so tensors are read one at a time."""

    def __init__(self, tensors: Mapping[str, Any], dtype: str):
        import torch  # optional dependency: the trainer has it

        if dtype not in SERVING_DTYPES:
            raise ValueError(f"serving dtype must be one of {sorted(SERVING_DTYPES)}, got {dtype!r}")
        self._torch = torch
        self._target = getattr(torch, dtype)
        self._tensors = tensors
        self.names = sorted(tensors)
        self.specs = []
        meta = getattr(tensors, "meta", None)  # a lazy mapping (sharded ranks): shapes only
        for name in self.names:
            t = meta(name) if meta is not None else tensors[name]
            dt = self._target if t.is_floating_point() else t.dtype
            self.specs.append(TensorSpec(name, _TORCH_NAMES[str(dt).removeprefix("torch.")],
                                         [int(d) for d in t.shape]))
        self._cached: tuple[int, np.ndarray] | None = None
        self._scratch: Any = None  # the cast of the current tensor, reused (see Buffers)

    def read(self, i: int, offset: int, length: int) -> np.ndarray:
        """Bytes ``offset..offset+length`` of tensor ``i`` in the serving dtype (valid until
        the next tensor is read)."""
        if self._cached is None or self._cached[0] != i:
            torch = self._torch
            t = self._tensors[self.names[i]].detach().to("cpu")
            if t.is_floating_point() and t.dtype != self._target:
                n = t.numel()
                if self._scratch is None or self._scratch.numel() < n:
                    self._scratch = torch.empty(n, dtype=self._target)
                t = self._scratch[:n].copy_(t.reshape(-1))
            self._cached = (i, t.contiguous().reshape(-1).view(torch.uint8).numpy())
        return self._cached[1][offset:offset + length]


class TrainerBase(NamedTuple):
    """The trainer's previous published stream version: its serving-dtype file (on disk)."""

    path: Path
    version: int
    digest: str
    anchor: int


class _EncodeBuffers:
    """The trainer's buffers, reused bucket after bucket (:class:`Buffers`)."""

    def __init__(self) -> None:
        self.raw = Buffers(2)  # handed to the staged file, hashed one bucket behind
        self.xor = Buffers(1)
        self.planes = Buffers(1)


def _encode_bucket(source: Any, spans: list[Span], tensors: list[TensorSpec],
                   base: BaseReader | None, start: int, writer: StagedFile,
                   cctx: Any, bufs: _EncodeBuffers) -> tuple[bytes | memoryview | None, int, int]:
    """``(wire bytes, raw bytes, changed elements)`` of one bucket; wire None: a delta's
    bucket whose bytes are the base's (``same``: nothing stored)."""
    n = sum(s.length for s in spans)
    raw = bufs.raw.take(n)
    pos = 0
    for s in spans:  # a copy: the source's bytes change with its next tensor
        raw[pos:pos + s.length] = source.read(s.tensor, s.offset, s.length)
        pos += s.length
    writer.write(raw)
    if base is None:  # an anchor: the bytes as they are (see BucketEntry.codec)
        changed = sum(s.length // DTYPE_BYTES[tensors[s.tensor].dtype] for s in spans)
        return memoryview(raw), n, changed
    payload = base.read_into(start, bufs.xor.take(n))
    np.bitwise_xor(payload, raw, out=payload)
    changed = changed_elements(payload, spans, tensors)
    if not changed and not payload.any():  # -0.0 vs 0.0 differ in bytes: the bytes decide
        return None, n, 0
    planes = byte_planes(payload, spans, tensors, out=bufs.planes.take(n))
    return cctx.compress(memoryview(planes)), n, changed


async def write_version(blobs: Any, source: Any, *, version: int, dtype: str,
                        bucket_bytes: int, base: TrainerBase | None, delta: bool,
                        anchor_every: int, base_out: Path | None,
                        leaf_bytes: int = LEAF_BYTES) -> tuple[Manifest, str]:
    """Store version ``version`` of ``source`` (:class:`TorchTensors`) in ``blobs``: the
    buckets, then the manifest (the commit point). A delta over ``base`` when ``delta``,
    the base has the same tensors and its anchor is fewer than ``anchor_every`` versions
    back; else an anchor. The serving-dtype file of the version is written to ``base_out``
    (the next base; the caller moves it into place once the version is announced; None: no
    file, for a trainer that sends no deltas). Returns
    the manifest and its name; on a failure the buckets written are deleted again.
    ``leaf_bytes``: the leaf size of the version's digest tree (a multiple of 8)."""
    import zstandard

    t0 = time.perf_counter()
    specs: list[TensorSpec] = list(source.specs)
    what = f"stream version {version}"
    reader = None
    if delta and base is not None and version - base.anchor < max(1, anchor_every):
        try:
            reader = await asyncio.to_thread(BaseReader, base.path, specs, what)
        except StreamError:
            reader = None  # another layout or no file: an anchor
    plan = plan_buckets(specs, bucket_bytes)
    nonce = secrets.token_hex(4)
    cctx = zstandard.ZstdCompressor(level=ZSTD_LEVEL)
    bufs = _EncodeBuffers()
    leaves = [leaf_sizes(sum(s.length for s in spans), leaf_bytes) for spans in plan]
    writer = await asyncio.to_thread(StagedFile, base_out, specs, [n for ls in leaves for n in ls])
    made: list[tuple[str, int, int, str, list[Span], str]] = []
    written: list[str] = []
    changed, start = 0, 0
    try:
        for i, spans in enumerate(plan):
            wire, raw, ch = await asyncio.to_thread(_encode_bucket, source, spans, specs, reader,
                                                    start, writer, cctx, bufs)
            name = f"stream.v{version:06d}-{nonce}.b{i:04d}"
            if wire is None:
                made.append((name, raw, 0, "", spans, "same"))
            else:
                check = xxhash.xxh3_128_hexdigest(wire)  # ~20 GB/s: not worth a thread hop
                await blobs.put(name, wire)
                written.append(name)
                made.append((name, raw, len(wire), check, spans,
                             "zstd" if reader is not None else "raw"))
            changed += ch
            start += raw
        digest = await asyncio.to_thread(writer.commit)
        entries, k = [], 0
        for (n, r, w, x, sp, c), ls in zip(made, leaves, strict=True):
            entries.append(BucketEntry(name=n, raw=r, wire=w, xxh3=x, spans=sp, codec=c,
                                       leaves=writer.digests[k:k + len(ls)]))
            k += len(ls)
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
                   leaf_bytes=leaf_bytes, tensors=specs, buckets=entries, digest=digest, stats=stats)
    mname = manifest_name(version, digest)
    if await blobs.exists(mname):  # the same tensors published before (a resume): keep that one
        for n in written:
            await blobs.delete(n)
        own = StreamLimits(bucket_bytes=max(int(bucket_bytes), DEFAULT_LIMITS.bucket_bytes),
                           version_bytes=2**62)  # the trainer's own manifest: its own bounds
        return await read_manifest(blobs, mname, own), mname
    await blobs.put(mname, msgspec.json.encode(man))  # the commit point
    return man, mname


"""The generator's side of streamed versions (:mod:`rollart.engines.weight_stream`): fetch a
version's buckets one by one, check and decode them (over the base for a delta), write the
result into a staged file whose content digest must be the announced one; walk the chain
back to the loaded version or the newest anchor when the base is not the parent."""

from __future__ import annotations

import asyncio
import os
from pathlib import Path
from typing import Any, NamedTuple

import numpy as np
import xxhash

from .weight_files import DTYPE_BYTES
from .weight_staging import BaseReader, StagedFile, retire
from .weight_stream import (
    DEFAULT_LIMITS,
    BucketEntry,
    Manifest,
    StreamError,
    StreamLimits,
    manifest_name,
    read_manifest,
)
from .weight_blobs import Buffers

__all__ = ["Assembled", "apply_manifest", "assemble_version"]

class Assembled(NamedTuple):
    """A verified staged version."""

    path: Path
    version: int
    digest: str


_CHUNK = 4 << 20
"""Bytes decompressed at a time into :attr:`_DecodeBuffers.chunk` (a delta's decoded bucket
is never whole in memory: it is XORed into the base's bytes as it streams out of zstd)."""


class _DecodeBuffers:
    """The generator's buffers, reused bucket after bucket (:class:`Buffers`): the base's
    bytes of the bucket, which become the result (handed to the staged file, hashed one
    bucket behind: two), and one chunk of decompressed bytes."""

    def __init__(self) -> None:
        self.out = Buffers(2)
        self.chunk = np.empty(_CHUNK, np.uint8)


def _targets(out: np.ndarray, b: BucketEntry, man: Manifest):
    """The views of ``out`` that the decompressed stream fills, in stream order: each span's
    byte planes (``man.shuffle``: its elements' first bytes, then their second...), or the
    span's bytes as they are."""
    pos = 0
    for s in b.spans:
        seg = out[pos:pos + s.length]
        es = DTYPE_BYTES[man.tensors[s.tensor].dtype]
        if man.shuffle and es > 1:
            elements = seg.reshape(-1, es)
            for k in range(es):
                yield elements[:, k]
        else:
            yield seg
        pos += s.length


def _decode_bucket(wire: Any, b: BucketEntry, j: int, man: Manifest, base: BaseReader | None,
                   start: int, writer: StagedFile, dctx: Any, bufs: _DecodeBuffers) -> None:
    what = f"v{man.version} bucket {j} ({b.name})"
    # what was read is not named (its size, its hash): the refusal is published
    # (policy.loaded), and a manifest must not learn anything of a file it names
    if len(wire) != b.wire or xxhash.xxh3_128_hexdigest(wire) != b.xxh3:
        raise StreamError(f"{what}: the bytes stored do not match the manifest's {b.wire} bytes "
                          f"with xxh3 {b.xxh3} (damaged, or replaced)")
    if b.codec == "raw":
        if base is not None:
            raise StreamError(f"{what}: a raw bucket in a delta")
        writer.write(np.frombuffer(wire, np.uint8))
        return
    out = bufs.out.take(b.raw)
    if base is not None:
        base.read_into(start, out)
    else:
        out[...] = 0  # XOR into zeros: the bytes themselves
    chunk, mv = bufs.chunk, memoryview(bufs.chunk)
    try:
        with dctx.stream_reader(wire) as r:
            for t in _targets(out, b, man):
                off = 0
                while off < len(t):
                    n = r.readinto(mv[:min(len(chunk), len(t) - off)])
                    if not n:
                        raise StreamError(f"{what}: the zstd frame ends before the {b.raw} bytes "
                                          f"the manifest says")
                    np.bitwise_xor(t[off:off + n], chunk[:n], out=t[off:off + n])
                    off += n
            if r.read(1):
                raise StreamError(f"{what}: the zstd frame holds more than the {b.raw} bytes "
                                  f"the manifest says")
    except StreamError:
        raise
    except Exception as e:  # noqa: BLE001 - zstandard.ZstdError
        raise StreamError(f"{what}: not a zstd frame ({e})") from None
    writer.write(out)


def _check_stage(stage: Path) -> None:
    """``StreamError`` unless ``stage`` is a folder itself, not a link to one (a version is
    staged only where its holder made its staging folder)."""
    if stage.is_symlink() or (stage.exists() and not stage.is_dir()):
        raise StreamError(f"the staging folder {stage} is a link or not a folder")


async def apply_manifest(blobs: Any, man: Manifest, stage: Path, base: Assembled | None,
                         *, suffix: str = "") -> tuple[Assembled, int]:
    """Fetch ``man``'s buckets one by one and stage the version (over ``base`` for a delta);
    returns it and the wire bytes fetched. ``StreamError`` names the bucket or digest.
    ``man`` is a checked manifest (:func:`read_manifest`): its digest is hex, its names
    plain, its sizes within the caps; each bucket is read up to its manifest size only."""
    import zstandard

    manifest_name(man.version, man.digest)  # StreamError unless the digest is hex
    final = stage / f"v{man.version:06d}-{man.digest.rsplit(':', 1)[-1][:16]}{suffix}.safetensors"
    if final.parent != stage:
        raise StreamError(f"v{man.version}: the staged file would not be in the staging folder")
    await asyncio.to_thread(_check_stage, stage)
    what = f"v{man.version}"
    reader = None
    if man.kind == "delta":
        if base is None or base.digest != man.parent_digest:
            raise StreamError(f"{what} is a delta over v{man.parent_version} ({man.parent_digest}), "
                              f"not over the base given")
        reader = await asyncio.to_thread(BaseReader, base.path, man.tensors, what)
    writer = await asyncio.to_thread(StagedFile, final, man.tensors)
    dctx = zstandard.ZstdDecompressor()
    bufs = _DecodeBuffers()
    start, fetched = 0, 0
    try:
        for j, b in enumerate(man.buckets):
            try:
                wire = await blobs.get(b.name, max_bytes=b.wire)
            except KeyError:
                raise StreamError(f"{what} bucket {j} ({b.name}) is missing from {blobs.where}") from None
            fetched += len(wire)
            await asyncio.to_thread(_decode_bucket, wire, b, j, man, reader, start, writer, dctx, bufs)
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
                           base: Assembled | None, digest: str,
                           limits: StreamLimits = DEFAULT_LIMITS) -> tuple[Assembled, dict[str, Any]]:
    """Stage the version whose manifest is ``name`` in ``stage`` and return it with stats
    (``path``: ``full``, ``delta`` or ``chain``; ``manifests``, ``wire_bytes``).

    An anchor is applied alone; a delta over ``base`` when it is the delta's parent; else
    (or when that fails) by walking the parents back to the newest anchor and applying
    them in order. Intermediate versions are deleted; ``base`` is the caller's to keep.
    ``StreamError`` says why each way failed; nothing is staged then. Every manifest read
    is checked against ``limits`` before a bucket is fetched."""
    stage = Path(stage)
    man = await read_manifest(blobs, name, limits)
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
            got, info = await _apply_chain(blobs, man, stage, start, limits)
            return got, info
        except StreamError as e:
            reasons.append(f"the chain from {f'the loaded v{start.version}' if start else f'anchor v{man.anchor}'}: {e}")
    raise StreamError(f"cannot assemble version {man.version} ({name}): " + "; ".join(reasons))


async def _apply_chain(blobs: Any, man: Manifest, stage: Path, start: Assembled | None,
                       limits: StreamLimits) -> tuple[Assembled, dict[str, Any]]:
    """Walk ``man``'s parents back to ``start`` (None: to the anchor) and apply them in order
    (each parent is of an earlier version, :func:`check_manifest`: the walk ends)."""
    chain = [man]
    while chain[-1].kind == "delta":
        cur = chain[-1]
        if start is not None and start.digest == cur.parent_digest:
            break
        if start is not None and (cur.parent_version or 0) < start.version:
            raise StreamError(f"v{start.version} is not on the chain of v{man.version}")
        pname = manifest_name(cur.parent_version or 0, cur.parent_digest)
        try:
            parent = await read_manifest(blobs, pname, limits)
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
                retire(made.pop().path)
            made.append(nxt)
            cur_base = nxt
    except BaseException:
        for a in made:
            retire(a.path)
        raise
    return cur_base, {"path": "chain", "manifests": len(chain), "wire_bytes": wire}

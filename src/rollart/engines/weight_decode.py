"""The generator's side of streamed versions (:mod:`rollart.engines.weight_stream`): fetch a
version's buckets one by one, check and decode them (over the base for a delta), and stage
the result, verified against the announced bucket-tree digest; walk the chain back to the
loaded version or the newest anchor when the base is not the parent.

Two ways to stage a version:

- **written**: a new staged file (over the folder's spare, :func:`~.weight_staging.retire`),
  every bucket written and hashed (:class:`~.weight_staging.StagedFile`). Anchors, and
  deltas when patching in place is not allowed or not worth it.
- **patched in place** (``in_place``: the engine reads its staged file only inside a load,
  :attr:`rollart.engines.base.AsyncEngine.partial_loads`): a delta over the version the
  engine holds is written into that version's staged file, only the leaves (1 MiB pieces
  of its buckets, :attr:`~.weight_stream.Manifest.leaf_bytes`) whose bytes changed: a
  ``same`` bucket is neither fetched, read nor written; a changed bucket's XOR is
  decompressed and scanned for nonzero bytes, and only their leaves are read, XORed, hashed
  and written (a bucket much of which changed is read whole and compared leaf by leaf
  instead). The other leaves are verified by their digests, equal to those verified for the
  held version (the bucket tree, :mod:`rollart.engines.digest`). The bytes overwritten go
  to an :class:`Undo`; the file is renamed to the new version's name. A failure, or the
  engine refusing the version later (:meth:`Undo.revert`), writes them back and renames it
  back.

Why patch in place with an undo rather than into a second copy-on-write buffer: a second
buffer must first be brought to the held version (its own pages, the model's size again,
or a log of what it lacks), while an undo holds the changed leaves only and only until the
engine took the version; the held version's file is not read by anyone meanwhile (the
engine reads it only inside a load, under the pause). The price: a delta that changes much
of the model would need a model-sized undo, so when its changed buckets exceed
``PATCH_FRACTION`` of the model (or ``PATCH_MAX_BYTES``) the version is written instead. Engines that keep reading or link the
staged file after a load (vLLM hard-links it, SGLang symlinks it) get written versions.

Kept whole (over 450 lines): both ways share the bucket decoding, the checks and the chain
walk, which moves between them version by version; apart, each would reach into the other."""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
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
    header_bytes,
    leaf_sizes,
    manifest_name,
    read_manifest,
)
from .weight_blobs import Buffers

__all__ = ["PATCH_FRACTION", "PATCH_MAX_BYTES", "Assembled", "Undo", "apply_manifest",
           "assemble_version"]

PATCH_FRACTION = 0.5
"""A delta is patched in place when its changed buckets hold at most this fraction of the
version's bytes (the undo keeps the old bytes of their changed leaves in memory until the
engine took it: at most that much)."""
PATCH_MAX_BYTES = 1 << 30
"""... and at most this many bytes."""


class Undo:
    """What an in-place patch overwrote in a staged file (the first old bytes of each range)
    and the name it had; :meth:`revert` puts both back, :meth:`drop` forgets them once the
    engine holds the new version. Blocking."""

    def __init__(self, path: Path):
        self.origin = Path(path)
        self.path = Path(path)
        self._saved: dict[int, np.ndarray] = {}

    @property
    def nbytes(self) -> int:
        return sum(len(a) for a in self._saved.values())

    def save(self, offset: int, old: np.ndarray) -> None:
        """``old``: the bytes at file ``offset`` before the first patch there (copied)."""
        if offset not in self._saved:
            self._saved[offset] = old.copy()

    def rename(self, new: Path) -> None:
        os.replace(self.path, new)
        self.path = new

    def revert(self) -> None:
        if self._saved:
            fd = os.open(self.path, os.O_RDWR | os.O_NOFOLLOW | os.O_CLOEXEC)
            try:
                for off, old in self._saved.items():
                    _pwrite_all(fd, old, off)
            finally:
                os.close(fd)
        if self.path != self.origin:
            os.replace(self.path, self.origin)
            self.path = self.origin
        self._saved = {}

    def drop(self) -> None:
        self._saved = {}
        self.origin = self.path


class Assembled(NamedTuple):
    """A verified staged version."""

    path: Path
    version: int
    digest: str
    buckets: tuple[tuple[int, tuple[str, ...]], ...] = ()
    """``(raw bytes, leaf digests)`` of each of its buckets: verified, the leaves of
    ``digest`` (what a delta patched in place over it is checked against)."""
    leaf_bytes: int = 0
    """The leaf size of ``buckets``."""
    changed: frozenset[str] | None = None
    """Patched in place: the tensors whose bytes differ from the version it was patched
    over (the engine loads only those); None: a written version (load every tensor)."""
    undo: Undo | None = None
    """Patched in place: how to put back the version it was patched over (the caller
    reverts it when the engine refuses this one, drops it once the engine holds it)."""
    written: int = 0
    """Bytes of tensor data written into staged files to make it."""


def _pwrite_all(fd: int, buf: np.ndarray, offset: int) -> None:
    mv = memoryview(buf).cast("B")
    while len(mv):
        n = os.pwrite(fd, mv, offset)
        mv, offset = mv[n:], offset + n


def _pread_all(fd: int, out: np.ndarray, offset: int, what: str) -> None:
    mv = memoryview(out).cast("B")
    while len(mv):
        n = os.preadv(fd, [mv], offset)
        if not n:
            raise StreamError(f"{what}: the staged base ends before byte {offset}")
        mv, offset = mv[n:], offset + n


_CHUNK = 4 << 20
"""Bytes decompressed at a time into :attr:`_DecodeBuffers.chunk` (a delta's decoded bucket
is never whole in memory: it is XORed into the base's bytes as it streams out of zstd)."""


class _DecodeBuffers:
    """The generator's buffers, reused bucket after bucket (:class:`Buffers`): the base's
    bytes of the bucket, which become the result (handed to the staged file, hashed one
    bucket behind: two), the old bytes of a bucket patched in place, and one chunk of
    decompressed bytes."""

    def __init__(self) -> None:
        self.out = Buffers(2)
        self.old = Buffers(1)
        self.chunk = np.empty(_CHUNK + 8, np.uint8)  # + 8: a partial last word, zeroed


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


def _check_wire(wire: Any, b: BucketEntry, what: str) -> None:
    # what was read is not named (its size, its hash): the refusal is published
    # (policy.loaded), and a manifest must not learn anything of a file it names
    if len(wire) != b.wire or xxhash.xxh3_128_hexdigest(wire) != b.xxh3:
        raise StreamError(f"{what}: the bytes stored do not match the manifest's {b.wire} bytes "
                          f"with xxh3 {b.xxh3} (damaged, or replaced)")


def _xor_decode(wire: Any, b: BucketEntry, man: Manifest, out: np.ndarray, dctx: Any,
                bufs: _DecodeBuffers, what: str) -> None:
    """XOR the bucket's decompressed byte planes into ``out`` (the base's bytes, or zeros)."""
    chunk, mv = bufs.chunk, memoryview(bufs.chunk)
    with _zstd_frame(wire, dctx, what) as r:
        for t in _targets(out, b, man):
            off = 0
            while off < len(t):
                n = r.readinto(mv[:min(len(chunk), len(t) - off)])
                if not n:
                    raise _short_frame(b, what)
                np.bitwise_xor(t[off:off + n], chunk[:n], out=t[off:off + n])
                off += n
        _frame_ends(r, b, what)


@contextlib.contextmanager
def _zstd_frame(wire: Any, dctx: Any, what: str) -> Any:
    """A reader of the bucket's zstd frame; a zstandard error comes out as a StreamError."""
    try:
        with dctx.stream_reader(wire) as r:
            yield r
    except StreamError:
        raise
    except Exception as e:  # noqa: BLE001 - zstandard.ZstdError
        raise StreamError(f"{what}: not a zstd frame ({e})") from None


def _short_frame(b: BucketEntry, what: str) -> StreamError:
    return StreamError(f"{what}: the zstd frame ends before the {b.raw} bytes the manifest says")


def _frame_ends(r: Any, b: BucketEntry, what: str) -> None:
    """The frame holds no more than the bucket's bytes (all of which were read)."""
    if r.read(1):
        raise StreamError(f"{what}: the zstd frame holds more than the {b.raw} bytes "
                          f"the manifest says")


def _decode_bucket(wire: Any, b: BucketEntry, j: int, man: Manifest, base: BaseReader | None,
                   start: int, writer: StagedFile, dctx: Any, bufs: _DecodeBuffers) -> None:
    """One bucket of a written version: decoded (over the base's bytes) and written."""
    what = f"v{man.version} bucket {j} ({b.name})"
    if b.codec == "same":
        if base is None:
            raise StreamError(f"{what}: a 'same' bucket without a base")
        writer.write(base.read_into(start, bufs.out.take(b.raw)))
        return
    _check_wire(wire, b, what)
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
    _xor_decode(wire, b, man, out, dctx, bufs, what)
    writer.write(out)


_SPARSE = 64
"""A changed bucket is patched sparsely while at most 1 in this many of its XOR bytes is
nonzero (the positions found take 16 bytes each); beyond, it is patched densely."""


def _nonzero_xor(wire: Any, b: BucketEntry, man: Manifest, dctx: Any, bufs: _DecodeBuffers,
                 what: str) -> tuple[np.ndarray, np.ndarray] | None:
    """Stream positions and values of the nonzero bytes of a bucket's XOR, found a chunk at a
    time, 8 bytes at a time (mostly zeros: zstd writes those at memset's speed, and no
    bucket-sized buffer is touched); None when more than 1 in :data:`_SPARSE` is nonzero."""
    chunk = bufs.chunk
    mv = memoryview(chunk)
    cap = max(1024, b.raw // _SPARSE)
    found_p: list[np.ndarray] = []
    found_v: list[np.ndarray] = []
    count = got = 0
    with _zstd_frame(wire, dctx, what) as r:
        while got < b.raw:
            n = 0
            want = min(len(chunk) - 8, b.raw - got)
            while n < want:  # fill the chunk: positions are counted from its start
                k = r.readinto(mv[n:want])
                if not k:
                    raise _short_frame(b, what)
                n += k
            padded = -(-n // 8) * 8
            chunk[n:padded] = 0
            words = np.flatnonzero(chunk[:padded].view(np.uint64))
            if len(words):
                cand = (words[:, None] * 8 + np.arange(8)).ravel()
                cand = cand[chunk[cand] != 0]
                count += len(cand)
                if count > cap:
                    return None
                found_p.append(cand + got)
                found_v.append(chunk[cand])
            got += n
        _frame_ends(r, b, what)
    if not found_p:
        return np.empty(0, np.int64), np.empty(0, np.uint8)
    return np.concatenate(found_p), np.concatenate(found_v)


def _patch_bucket(wire: Any, b: BucketEntry, j: int, man: Manifest, fd: int, offset: int,
                  have: tuple[str, ...], undo: Undo, dctx: Any,
                  bufs: _DecodeBuffers) -> tuple[set[str], int]:
    """One changed bucket of a delta patched in place at file ``offset``: only the leaves
    its XOR changes are read, XORed, checked against their SHA-256, saved to ``undo`` and
    written; a leaf without a change must be the held version's (``have``). Sparse (the
    nonzero XOR bytes found, mapped from byte planes to the bucket's bytes: the bucket's
    bytes are never read) or, for a bucket much of which changed, dense (read whole, XORed,
    compared leaf by leaf). Returns the tensors whose bytes changed and the bytes written."""
    what = f"v{man.version} bucket {j} ({b.name})"
    _check_wire(wire, b, what)
    found = _nonzero_xor(wire, b, man, dctx, bufs, what)
    if found is None:
        return _patch_dense(wire, b, j, man, fd, offset, have, undo, dctx, bufs)
    sp, vals = found
    starts = np.cumsum([0] + [s.length for s in b.spans])  # a span's bytes: as many in the stream
    k = np.searchsorted(starts, sp, side="right") - 1  # the span of each
    pos = sp.copy()  # -> the byte of the bucket each XORs
    touched = np.unique(k).tolist()
    if man.shuffle:
        for i in touched:
            es = DTYPE_BYTES[man.tensors[b.spans[i].tensor].dtype]
            if es > 1:
                m = k == i
                q = sp[m] - starts[i]
                per = b.spans[i].length // es  # elements: the length of a plane
                pos[m] = starts[i] + (q % per) * es + q // per
    L = man.leaf_bytes
    leaf = pos // L
    order = np.argsort(leaf, kind="stable")
    leaf, pos, vals = leaf[order], pos[order], vals[order]
    dirty = np.unique(leaf).tolist()
    _check_clean(b, set(range(len(b.leaves))) - set(dirty), have, what)
    cuts = np.searchsorted(leaf, [*dirty, len(b.leaves)])
    written = 0
    for n, i in enumerate(dirty):
        a = i * L
        buf = bufs.old.take(min(L, b.raw - a))
        _pread_all(fd, buf, offset + a, what)
        undo.save(offset + a, buf)
        sel = slice(cuts[n], cuts[n + 1])
        buf[pos[sel] - a] ^= vals[sel]  # positions are unique: a plain fancy-index XOR
        _check_leaf(buf, b, i, what)
        _pwrite_all(fd, buf, offset + a)
        written += len(buf)
    return {man.tensors[b.spans[i].tensor].name for i in touched}, written


def _patch_dense(wire: Any, b: BucketEntry, j: int, man: Manifest, fd: int, offset: int,
                 have: tuple[str, ...], undo: Undo, dctx: Any,
                 bufs: _DecodeBuffers) -> tuple[set[str], int]:
    """:func:`_patch_bucket` for a bucket much of which changed: read whole, XORed as it
    streams out of zstd, the leaves that differ checked, saved and written."""
    what = f"v{man.version} bucket {j} ({b.name})"
    old, out = bufs.old.take(b.raw), bufs.out.take(b.raw)
    _pread_all(fd, old, offset, what)
    out[...] = old
    _xor_decode(wire, b, man, out, dctx, bufs, what)
    L, written, clean = man.leaf_bytes, 0, set()
    for i in range(len(b.leaves)):
        a, e = i * L, min(b.raw, (i + 1) * L)
        if np.array_equal(old[a:e], out[a:e]):
            clean.add(i)
            continue
        _check_leaf(out[a:e], b, i, what)
    _check_clean(b, clean, have, what)
    for i in range(len(b.leaves)):
        if i not in clean:
            a, e = i * L, min(b.raw, (i + 1) * L)
            undo.save(offset + a, old[a:e])
            _pwrite_all(fd, out[a:e], offset + a)
            written += e - a
    names, pos = set(), 0
    for s in b.spans:
        if not np.array_equal(old[pos:pos + s.length], out[pos:pos + s.length]):
            names.add(man.tensors[s.tensor].name)
        pos += s.length
    return names, written


def _check_leaf(buf: np.ndarray, b: BucketEntry, i: int, what: str) -> None:
    d = hashlib.sha256(buf).hexdigest()
    if d != b.leaves[i]:
        raise StreamError(f"{what}: leaf {i}: its decoded bytes have SHA-256 {d}, the manifest "
                          f"says {b.leaves[i]} (a damaged delta, or a base that is not its parent)")


def _check_clean(b: BucketEntry, clean: set[int], have: tuple[str, ...], what: str) -> None:
    """The leaves a delta leaves as they are must be the held version's."""
    for i in sorted(clean):
        if b.leaves[i] != have[i]:
            raise StreamError(f"{what}: leaf {i} is the parent's in the delta, but its digest "
                              f"{b.leaves[i]} is not the held version's {have[i]}")


def _check_stage(stage: Path) -> None:
    """``StreamError`` unless ``stage`` is a folder itself, not a link to one (a version is
    staged only where its holder made its staging folder)."""
    if stage.is_symlink() or (stage.exists() and not stage.is_dir()):
        raise StreamError(f"the staging folder {stage} is a link or not a folder")


def _patchable(man: Manifest, base: Assembled | None) -> bool:
    """Whether ``man`` (a delta over ``base``) may be patched into ``base``'s file: the same
    buckets (so ``same`` ones are the base's, by their digests) and few changed bytes."""
    if (man.kind != "delta" or base is None or len(base.buckets) != len(man.buckets)
            or base.leaf_bytes != man.leaf_bytes):
        return False
    if any(n != b.raw for (n, _), b in zip(base.buckets, man.buckets, strict=True)):
        return False
    total = sum(b.raw for b in man.buckets)
    changed = sum(b.raw for b in man.buckets if b.codec != "same")
    return changed <= min(PATCH_FRACTION * total, PATCH_MAX_BYTES)


def _staged_name(stage: Path, man: Manifest, suffix: str) -> Path:
    manifest_name(man.version, man.digest)  # StreamError unless the digest is hex
    final = stage / f"v{man.version:06d}-{man.digest.rsplit(':', 1)[-1][:16]}{suffix}.safetensors"
    if final.parent != stage:
        raise StreamError(f"v{man.version}: the staged file would not be in the staging folder")
    return final


async def apply_manifest(blobs: Any, man: Manifest, stage: Path, base: Assembled | None,
                         *, suffix: str = "", undo: Undo | None = None) -> tuple[Assembled, int]:
    """Fetch ``man``'s buckets and stage the version (over ``base`` for a delta); returns it
    and the wire bytes fetched. ``StreamError`` names the bucket or digest. With ``undo``
    (over ``base``'s file) a delta that :func:`_patchable` allows is patched into ``base``'s
    file in place (the undo collects what it overwrote; the caller reverts it on a
    failure); else the version is written into a new file. ``man`` is a checked manifest
    (:func:`read_manifest`): its digest is hex and the tree of its buckets' digests, its
    names plain, its sizes within the caps; each bucket is read up to its manifest size."""
    final = _staged_name(stage, man, suffix)
    await asyncio.to_thread(_check_stage, stage)
    what = f"v{man.version}"
    if man.kind == "delta" and (base is None or base.digest != man.parent_digest):
        raise StreamError(f"{what} is a delta over v{man.parent_version} ({man.parent_digest}), "
                          f"not over the base given")
    if undo is not None and _patchable(man, base):
        return await _patch(blobs, man, final, base, undo)
    return await _write(blobs, man, final, base)


async def _write(blobs: Any, man: Manifest, final: Path,
                 base: Assembled | None) -> tuple[Assembled, int]:
    import zstandard

    what = f"v{man.version}"
    reader = None
    if man.kind == "delta":
        reader = await asyncio.to_thread(BaseReader, base.path, man.tensors, what)
    sizes = [leaf_sizes(b.raw, man.leaf_bytes) for b in man.buckets]
    writer = await asyncio.to_thread(
        StagedFile, final, man.tensors, [n for ls in sizes for n in ls],
        [d for b in man.buckets for d in b.leaves],
        [j for j, ls in enumerate(sizes) for _ in ls])
    dctx = zstandard.ZstdDecompressor()
    bufs = _DecodeBuffers()
    start, fetched = 0, 0
    try:
        for j, b in enumerate(man.buckets):
            wire = b""
            if b.codec != "same":
                try:
                    wire = await blobs.get(b.name, max_bytes=b.wire)
                except KeyError:
                    raise StreamError(f"{what} bucket {j} ({b.name}) is missing from {blobs.where}") from None
            fetched += len(wire)
            try:
                await asyncio.to_thread(_decode_bucket, wire, b, j, man, reader, start, writer,
                                        dctx, bufs)
            except StreamError as e:
                if str(e).startswith("bucket "):  # the staged file's check: name the bucket
                    raise StreamError(f"{what} {e}") from None
                raise
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
    leaves = tuple((b.raw, tuple(b.leaves)) for b in man.buckets)  # each checked as written
    return Assembled(final, man.version, digest, leaves, man.leaf_bytes, written=start), fetched


async def _patch(blobs: Any, man: Manifest, final: Path, base: Assembled,
                 undo: Undo) -> tuple[Assembled, int]:
    """``man`` patched into ``base``'s file (see the module docstring); on a failure the file
    is left to the caller's ``undo``."""
    import zstandard

    what = f"v{man.version}"
    for j, ((_, have), b) in enumerate(zip(base.buckets, man.buckets, strict=True)):
        if b.codec == "same" and tuple(b.leaves) != have:
            raise StreamError(f"{what} bucket {j} ({b.name}): 'same' as its parent's, but its "
                              f"leaf digests are not the held version's")
    if undo.path != base.path:
        raise StreamError(f"{what}: the undo is not of the base's file")
    start = len(header_bytes(man.tensors))
    # the header: the base's (BaseReader checks it; the same tensors, the same bytes)
    await asyncio.to_thread(lambda: BaseReader(base.path, man.tensors, what).close())
    dctx = zstandard.ZstdDecompressor()
    bufs = _DecodeBuffers()
    fd = await asyncio.to_thread(os.open, base.path, os.O_RDWR | os.O_NOFOLLOW | os.O_CLOEXEC)
    fetched, written = 0, 0
    changed: set[str] = set(base.changed or ()) if base.undo is undo else set()
    try:
        for j, b in enumerate(man.buckets):
            if b.codec == "same":
                start += b.raw
                continue
            if b.codec != "zstd":
                raise StreamError(f"{what} bucket {j} ({b.name}): a {b.codec} bucket in a delta")
            try:
                wire = await blobs.get(b.name, max_bytes=b.wire)
            except KeyError:
                raise StreamError(f"{what} bucket {j} ({b.name}) is missing from {blobs.where}") from None
            fetched += len(wire)
            names, n = await asyncio.to_thread(_patch_bucket, wire, b, j, man, fd, start,
                                               base.buckets[j][1], undo, dctx, bufs)
            changed |= names
            del wire
            written += n
            start += b.raw
    finally:
        await asyncio.to_thread(os.close, fd)
    # every leaf is verified: the changed buckets hashed above, the others equal to the
    # held version's; the tree of the leaves is the published digest (check_manifest)
    await asyncio.to_thread(undo.rename, final)
    leaves = tuple((b.raw, tuple(b.leaves)) for b in man.buckets)
    return Assembled(final, man.version, man.digest, leaves, man.leaf_bytes, frozenset(changed),
                     undo, written + (base.written if base.undo is undo else 0)), fetched


async def assemble_version(blobs: Any, name: str, stage: str | os.PathLike, *,
                           base: Assembled | None, digest: str, in_place: bool = False,
                           limits: StreamLimits = DEFAULT_LIMITS) -> tuple[Assembled, dict[str, Any]]:
    """Stage the version whose manifest is ``name`` in ``stage`` and return it with stats
    (``path``: ``full``, ``delta``, ``patch`` or ``chain``; ``manifests``, ``wire_bytes``,
    ``written_bytes``: tensor bytes written into staged files).

    An anchor is applied alone; a delta over ``base`` when it is the delta's parent; else
    (or when that fails) by walking the parents back to the newest anchor and applying
    them in order. ``in_place``: deltas over ``base`` may be patched into ``base``'s file
    (the result's :attr:`Assembled.undo` puts it back: the caller's to revert or drop);
    else ``base``'s file is left as it is. Intermediate versions are deleted. ``StreamError``
    says why each way failed; nothing is staged then and ``base`` is as it was. Every
    manifest read is checked against ``limits`` before a bucket is fetched."""
    stage = Path(stage)
    man = await read_manifest(blobs, name, limits)
    if man.digest != digest:
        raise StreamError(f"manifest {name} is of digest {man.digest}, the published one is {digest}")
    if man.kind == "full":
        got, n = await apply_manifest(blobs, man, stage, None)
        return got, _info("full", 1, n, got)
    reasons = []
    if base is not None and base.digest == man.parent_digest:
        undo = Undo(base.path) if in_place else None
        try:
            got, n = await _reverting(apply_manifest(blobs, man, stage, base, undo=undo), undo)
            return got, _info("patch" if got.undo is not None else "delta", 1, n, got)
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
            got, info = await _apply_chain(blobs, man, stage, start, limits, in_place)
            return got, info
        except StreamError as e:
            reasons.append(f"the chain from {f'the loaded v{start.version}' if start else f'anchor v{man.anchor}'}: {e}")
    raise StreamError(f"cannot assemble version {man.version} ({name}): " + "; ".join(reasons))


def _info(path: str, manifests: int, wire: int, got: Assembled) -> dict[str, Any]:
    return {"path": path, "manifests": manifests, "wire_bytes": wire, "written_bytes": got.written,
            "changed_tensors": None if got.changed is None else len(got.changed)}


async def _reverting(work: Any, undo: Undo | None) -> Any:
    """``await work``; on a failure ``undo`` (if any) is reverted first: a refused delta
    leaves the held version's file as it was."""
    try:
        return await work
    except StreamError:
        if undo is not None:
            await asyncio.to_thread(undo.revert)
        raise
    except BaseException:
        if undo is not None:  # cancelled: no await here (changed buckets only: small)
            undo.revert()
        raise


async def _apply_chain(blobs: Any, man: Manifest, stage: Path, start: Assembled | None,
                       limits: StreamLimits, in_place: bool) -> tuple[Assembled, dict[str, Any]]:
    """Walk ``man``'s parents back to ``start`` (None: to the anchor) and apply them in order
    (each parent is of an earlier version, :func:`check_manifest`: the walk ends).
    ``in_place``: the deltas are patched into ``start``'s file (one undo for the chain,
    kept in the result) or into the anchor's new file, where allowed."""
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
    held = Undo(start.path) if in_place and start is not None else None  # the caller's file
    own: Assembled | None = None  # the newest version written anew by this walk
    own_undo: Undo | None = None  # its patches (never reverted: the file is retired on failure)
    cur_base, wire = start, 0
    try:
        for k, mm in enumerate(chain):  # intermediates under their own name: never the caller's base
            undo = own_undo if own is not None else held
            nxt, n = await apply_manifest(blobs, mm, stage, cur_base, undo=undo,
                                          suffix="" if k == len(chain) - 1 else ".chain")
            wire += n
            if nxt.undo is None:  # written anew from cur_base: what came before is not needed
                if held is not None:
                    await asyncio.to_thread(held.revert)  # the caller's file as it was
                    held = None
                if own is not None:
                    retire(own_undo.path if own_undo is not None else own.path)
                own = nxt
                own_undo = Undo(nxt.path) if in_place else None
            elif own is not None:
                own = nxt
            cur_base = nxt
    except BaseException:
        if held is not None:
            with contextlib.suppress(OSError):
                held.revert()
        if own is not None:
            retire(own_undo.path if own_undo is not None else own.path)
        raise
    if own is not None:  # a file of its own: the engine loads all of it
        if own_undo is not None:
            own_undo.drop()
        cur_base = cur_base._replace(changed=None, undo=None)
    return cur_base, _info("chain", len(chain), wire, cur_base)

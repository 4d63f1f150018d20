"""Streamed weight versions (``trainer.sync.format: stream``): a manifest and buckets, full
"anchors" and XOR deltas in the serving dtype, assembled by a generator into one verified
safetensors file before its engine sees a byte of it.

Why not one file per version: a version is the whole model, every step, and a generator
held it all in memory to check its digest. Here a version is

- **buckets** of about ``trainer.sync.bucket_mb`` each: the tensors' bytes in name order,
  a large tensor split across buckets, each named in the manifest with its raw size, the
  SHA-256 of each ``leaf_bytes`` piece (leaf) of its raw (decoded) bytes, its wire size and
  the XXH3 of its wire bytes;
- a **manifest** (JSON, :class:`Manifest`): tensors, buckets, the version's digest and
  stats. It is written LAST: the commit point. A trainer killed mid-publish leaves buckets
  no manifest names, and no generator ever sees that version.

The version's digest (the one the trainer publishes) is a **bucket tree**
(:func:`rollart.engines.digest.bucket_tree_digest`): the SHA-256 of the staged file's
header and of each leaf's length and SHA-256 (``leaf_bytes``, 1 MiB: a leaf, not a 64 MiB
bucket, is what a one-element change costs). :func:`check_manifest` recomputes it from the
manifest, so the manifest commits to every leaf's digest; a generator then checks each
leaf it writes against its digest, and a leaf it did not write (a delta's ``same`` bucket,
or a leaf of a changed bucket whose XOR is zero, patched in place) against the digest it
verified for the version it holds: verifying a version costs the bytes that changed, not
the model.

A **delta** bucket holds ``zstd(new XOR base)`` over the same byte range of the previous
version, both in the serving dtype (``proxy.dtype``): after one optimizer step most
bf16 elements keep their bytes, so the XOR is mostly zeros and compresses to a small
fraction of the full size. A bucket whose bytes did not change at all is ``same``: nothing
stored, nothing fetched, nothing written. Every ``anchor_every`` versions (and whenever the trainer has no
base) the version is a full **anchor**. A generator whose loaded version is not the
delta's parent walks the parents back to the newest anchor (or to its own version) and
applies them in order; the store keeps every version from the anchor the kept versions need.

The generator writes an anchor into a staging file (temp name, then ``os.replace``),
hashing each bucket on the way; a delta over the version it holds is patched into that
version's staged file in place, bucket by bucket, with an undo of the bytes it overwrote
(:mod:`rollart.engines.weight_decode`). Only a complete file with the published digest is
handed to the engine, so an engine never serves a half-applied version, and a failure
anywhere (or the engine's refusal) puts the old bytes back and leaves the old weights
serving with a reason (which bucket, which digest). Peak extra memory is a few buckets
plus the undo of a patch (at most ``PATCH_FRACTION`` of the model; a larger delta is
written into a new file instead).

This module is the format (manifest, bucket plan, the staged file's header); where versions
are stored is :mod:`rollart.engines.weight_blobs` (a folder, the object store, the trainer's
weight server of :mod:`rollart.engines.weight_tcp`); the trainer's side is
:mod:`rollart.engines.weight_encode`, the generator's :mod:`rollart.engines.weight_decode`,
the staged file both write :mod:`rollart.engines.weight_staging`. No torch at import (numpy,
zstandard, xxhash); torch only where the trainer casts its fp32 masters to the serving
dtype. Blocking work runs through :func:`asyncio.to_thread`.
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import re
import struct
from collections.abc import Sequence
from pathlib import Path
from typing import Annotated, Any, Literal, NamedTuple

import msgspec
from msgspec import Meta

from .digest import bucket_tree_digest
from .weight_files import DTYPE_BYTES

__all__ = [
    "DEFAULT_LIMITS",
    "LEAF_BYTES",
    "SERVING_DTYPES",
    "BucketEntry",
    "Manifest",
    "Span",
    "StreamError",
    "StreamLimits",
    "StreamStats",
    "TensorSpec",
    "check_blob_name",
    "check_manifest",
    "header_bytes",
    "leaf_sizes",
    "manifest_name",
    "plan_buckets",
    "read_manifest",
    "serving_dtype",
    "tree_digest",
]

SERVING_DTYPES = {"float32": "F32", "bfloat16": "BF16", "float16": "F16"}
"""``proxy.dtype`` -> the safetensors dtype of the tensors a streamed version holds."""

FORMAT = "rollart-stream-v2"
LEAF_BYTES = 1 << 20
"""The leaf size of the digest tree the trainer writes (:attr:`Manifest.leaf_bytes`): what a
generator reads, hashes and writes for a delta that changes one element (a 1.5B model's
manifest holds ~3k leaf digests, ~200 KB)."""
ZSTD_LEVEL = 1
"""zstd level of delta buckets: on the byte planes of a bf16 XOR, level 1 gives level 3's
ratio (0.044 / 0.149 / 0.59 of raw after steps at lr 1e-6 / 1e-5 / 3e-3) 25-55% faster
(0.3-0.9 GB/s on this machine), and the encode is the trainer's part of every publish."""


from .weight_limits import (  # re-exported: the stream's checks live apart (weight_tcp uses them)
    StreamError,
    DIGEST_RE,
    BLOB_NAME_RE,
    _DIGEST,
    _BLOB_NAME,
    Size,
    Digest,
    BlobName,
    MAX_MANIFEST_BYTES,
    StreamLimits,
    DEFAULT_LIMITS,
    wire_bound,
    check_blob_name,
)


# ======================================================================================
# The manifest
# ======================================================================================
class TensorSpec(msgspec.Struct, frozen=True, array_like=True):
    """A tensor of a version: ``[name, dtype, shape]`` (safetensors dtype names)."""

    name: Annotated[str, Meta(min_length=1, max_length=1024)]
    dtype: Annotated[str, Meta(max_length=16)]
    shape: Annotated[list[Size], Meta(max_length=16)]

    @property
    def nbytes(self) -> int:
        return DTYPE_BYTES[self.dtype] * math.prod(self.shape)

    @property
    def elements(self) -> int:
        return math.prod(self.shape)


class Span(msgspec.Struct, frozen=True, array_like=True):
    """``[tensor, offset, length]``: bytes ``offset..offset+length`` of tensor ``tensor``
    (an index into :attr:`Manifest.tensors`)."""

    tensor: Size
    offset: Size
    length: Size


class BucketEntry(msgspec.Struct, frozen=True):
    name: BlobName
    """Object name in the version's store (a plain file name: :data:`BLOB_NAME_RE`)."""
    raw: Size
    """Bytes of tensor data it carries (decoded)."""
    wire: Size
    """Bytes stored (zstd)."""
    xxh3: Annotated[str, Meta(pattern=r"^([0-9a-f]{32})?$")]
    """Hex XXH3-128 of the stored (wire) bytes, checked as the bucket arrives: it names the
    bucket that was damaged (a fast hash, ~20 GB/s here, against SHA-256's ~1.5: a version's
    integrity rests on :attr:`sha256` and the bucket-tree digest the trainer announces on
    the bus, not on this). Empty for a ``same`` bucket."""
    leaves: list[Annotated[str, Meta(pattern=r"^[0-9a-f]{64}$")]]
    """Hex SHA-256 of each :attr:`Manifest.leaf_bytes` piece of the bucket's raw (decoded)
    bytes (the last one shorter): the leaves of the version's digest."""
    spans: list[Span]
    """The tensor bytes it covers, in order (consecutive in the data stream)."""
    codec: Literal["raw", "zstd", "same"] = "zstd"
    """``zstd``: the byte planes of the data (a delta's: of the XOR), zstd-compressed;
    ``raw``: the tensor bytes as they are (anchors: weights compress only to ~75-90%, at
    zstd's ~0.25 GB/s here, a loss next to a link's GB/s); ``same`` (deltas only): the
    parent's bytes unchanged, nothing stored (``wire`` 0; ``name`` is never fetched)."""


class StreamStats(msgspec.Struct, frozen=True):
    changed: Size
    """Elements whose bytes differ from the parent's (delta), or every element (anchor)."""
    total: Size
    """Elements of the version."""
    wire_bytes: Size
    """Bytes of its buckets in the store."""
    full_bytes: Size
    """Bytes of its tensors in the serving dtype (what a full file would hold)."""
    encode_s: float
    """Seconds the trainer took to cast, encode and store the buckets."""


class Manifest(msgspec.Struct, frozen=True, kw_only=True):
    """A streamed version (see the module docstring); JSON in the store."""

    format: Annotated[str, Meta(max_length=64)] = FORMAT
    version: Size
    kind: Literal["full", "delta"]
    parent_version: Size | None = None
    """The version a delta applies to (None for an anchor)."""
    parent_digest: Annotated[str, Meta(pattern=r"^(buckets-sha256:[0-9a-f]{64})?$")] = ""
    """Its digest: a generator applies the delta only over exactly these tensors
    (the parent's manifest name is made of it: hex only)."""
    anchor: Size
    """The newest anchor at or below this version (this version for an anchor)."""
    dtype: Annotated[str, Meta(max_length=16)]
    """The serving dtype (``proxy.dtype``) the float tensors are cast to."""
    leaf_bytes: Annotated[int, Meta(ge=4096, le=1 << 30, multiple_of=8)] = LEAF_BYTES
    """The size of a leaf of the digest tree (see :attr:`BucketEntry.leaves`)."""
    shuffle: bool = True
    """Each span's bytes are stored as byte planes (every element's first byte, then every
    second byte...) before zstd: the XOR of a small update is zero in the high (sign and
    exponent) bytes, and a plane of zeros compresses to nothing (~10% fewer wire bytes
    than interleaved on the quickstart's bf16 deltas)."""
    tensors: list[TensorSpec]
    buckets: list[BucketEntry]
    digest: Digest
    """Bucket-tree digest of the version (the published one, see the module docstring;
    the staged file's name is made of it: hex only)."""
    stats: StreamStats


def manifest_name(version: int, digest: str) -> str:
    """The manifest's object name: by version and digest, so a version trained again after a
    resume (other tensors) never overwrites the one generators may be reading. A name read
    from a store is made of a checked digest only (``StreamError`` else)."""
    if not isinstance(digest, str) or not _DIGEST.match(digest):
        raise StreamError(f"v{version}: {digest[:80]!r} is not a content digest (buckets-sha256:<64 hex>)")
    return f"stream.v{int(version):06d}-{digest.rsplit(':', 1)[-1][:16]}.manifest"


def check_manifest(man: Manifest, what: str, limits: StreamLimits = DEFAULT_LIMITS) -> None:
    """``StreamError`` unless the buckets' spans cover the tensors in order, exactly, a delta
    names an earlier parent, every size is within ``limits`` and the digest is the bucket
    tree of the tensors and the buckets' digests (the manifest commits to them)."""
    if man.format != FORMAT:
        raise StreamError(f"{what}: unknown stream format {man.format!r} (expected {FORMAT!r})")
    if man.kind == "delta":
        if man.parent_version is None or not man.parent_digest:
            raise StreamError(f"{what}: a delta without parent_version and parent_digest")
        if not man.anchor <= man.parent_version < man.version:
            raise StreamError(f"{what}: parent_version must be below the version and at or "
                              f"above its anchor (a chain walks to ever older versions)")
    elif man.anchor != man.version:
        raise StreamError(f"{what}: an anchor is its own anchor")
    names = [t.name for t in man.tensors]
    if names != sorted(set(names)) or any(t.dtype not in DTYPE_BYTES for t in man.tensors):
        raise StreamError(f"{what}: tensors must be unique, in name order, of known dtypes")
    total = sum(t.nbytes for t in man.tensors)
    if total > limits.version_bytes:
        raise StreamError(f"{what}: {total} bytes of tensors, more than the "
                          f"{limits.version_bytes} a version may have (trainer.sync.max_version_gb)")
    want = [(i, t.nbytes) for i, t in enumerate(man.tensors) if t.nbytes]
    pos, k = 0, 0  # k: index into want; pos: bytes of want[k] covered so far
    for j, b in enumerate(man.buckets):
        if b.raw > limits.bucket_bytes:
            raise StreamError(f"{what}: bucket {j} ({b.name}) holds {b.raw} bytes, more than the "
                              f"{limits.bucket_bytes} a bucket may (trainer.sync.max_bucket_mb)")
        if b.wire > (b.raw if b.codec == "raw" else wire_bound(b.raw)):
            raise StreamError(f"{what}: bucket {j} ({b.name}) stores {b.wire} bytes for {b.raw} "
                              f"raw ones ({b.codec})")
        if b.codec == "same" and (man.kind != "delta" or b.wire != 0):
            raise StreamError(f"{what}: bucket {j} ({b.name}) is 'same' with {b.wire} wire bytes "
                              f"in a {man.kind} version (only a delta's, and none stored)")
        if b.codec != "same" and not b.xxh3:
            raise StreamError(f"{what}: bucket {j} ({b.name}) has no xxh3 of its stored bytes")
        if len(b.leaves) != -(-b.raw // man.leaf_bytes):
            raise StreamError(f"{what}: bucket {j} ({b.name}) has {len(b.leaves)} leaf digests for "
                              f"{b.raw} bytes in leaves of {man.leaf_bytes}")
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
    if tree_digest(man) != man.digest:
        raise StreamError(f"{what}: its digest {man.digest} is not the bucket tree of its tensors "
                          f"and buckets")


def leaf_sizes(raw: int, leaf_bytes: int) -> list[int]:
    """The sizes of the leaves of a bucket of ``raw`` bytes."""
    return [min(leaf_bytes, raw - a) for a in range(0, raw, leaf_bytes)]


def tree_digest(man: Manifest) -> str:
    """The bucket-tree digest the manifest's tensors and leaf digests make."""
    return bucket_tree_digest(header_bytes(man.tensors),
                              [(n, d) for b in man.buckets
                               for n, d in zip(leaf_sizes(b.raw, man.leaf_bytes), b.leaves, strict=True)])


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


_FIELD = re.compile(r"at `\$\.(buckets\[\d+\]\.name|digest|parent_digest)`")


async def read_manifest(blobs: Any, name: str, limits: StreamLimits = DEFAULT_LIMITS) -> Manifest:
    """The manifest ``name`` of ``blobs``, decoded and checked (:func:`check_manifest`);
    ``StreamError`` that says what is wrong, never what a named file holds."""
    try:
        raw = await blobs.get(name, max_bytes=limits.manifest_bytes)
    except KeyError:
        raise StreamError(f"manifest {name} is not in {blobs.where}: that version was never "
                          f"committed (a trainer stopped mid-publish leaves none) or was pruned") from None
    try:
        man = msgspec.json.decode(raw, type=Manifest)
    except msgspec.ValidationError as e:
        f = _FIELD.search(str(e))
        if f is not None and f.group(1).endswith("name"):
            j = f.group(1).split("[")[1].split("]")[0]
            raise StreamError(f"manifest {name}: bucket {j} name is not a stream object name "
                              f"(letters, digits, '.', '_', '-')") from None
        if f is not None:
            raise StreamError(f"manifest {name}: {f.group(1)} is not a content digest "
                              f"(buckets-sha256:<64 hex>)") from None
        raise StreamError(f"manifest {name} in {blobs.where} is not a stream manifest: {e}") from None
    except msgspec.DecodeError as e:
        raise StreamError(f"manifest {name} in {blobs.where} is not a stream manifest: {e}") from None
    check_manifest(man, f"manifest {name}", limits)
    return man


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


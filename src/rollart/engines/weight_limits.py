"""What a streamed version from another process may hold, and the error that refuses it
(issue 43): the names, digests and size caps :mod:`rollart.engines.weight_stream` checks a
manifest against, apart so that the weight server and client
(:mod:`rollart.engines.weight_tcp`) check the same names without importing the stream."""

from __future__ import annotations

import re
from typing import Annotated, Any, NamedTuple

from msgspec import Meta


class StreamError(ValueError):
    """A streamed version that cannot be published or assembled; the message says why."""


# -- what a manifest from another process may hold (issue 43) ------------------------------
# A manifest names files (its buckets, its parent's manifest) and sizes that the generator
# allocates and stages: every name is a plain file name of the store, every digest the hex of
# a bucket-tree digest (a staged file's name is made of it), every size within the caps below,
# all checked before a byte of a bucket is fetched.
DIGEST_RE = r"^buckets-sha256:[0-9a-f]{64}$"
"""A version's bucket-tree digest (:func:`rollart.engines.digest.bucket_tree_digest`)."""
BLOB_NAME_RE = r"^[A-Za-z0-9][A-Za-z0-9._-]{0,199}$"
_DIGEST = re.compile(DIGEST_RE)
_BLOB_NAME = re.compile(BLOB_NAME_RE)
Size = Annotated[int, Meta(ge=0, le=2**62)]
Digest = Annotated[str, Meta(pattern=DIGEST_RE)]
BlobName = Annotated[str, Meta(pattern=BLOB_NAME_RE)]

MAX_MANIFEST_BYTES = 64 << 20
"""The largest manifest a generator reads (a 70B model's is ~2 MB)."""


class StreamLimits(NamedTuple):
    """What a generator allocates and stages for one version at most (``trainer.sync``'s
    ``max_bucket_mb`` and ``max_version_gb``): a manifest that declares more is refused
    before anything is fetched, so a peer's numbers never size a buffer unchecked."""

    bucket_bytes: int
    """Raw bytes of one bucket (a bucket's wire bytes may exceed them by zstd's bound)."""
    version_bytes: int
    """Bytes of tensors of one version (the staged file)."""
    manifest_bytes: int = MAX_MANIFEST_BYTES

    @classmethod
    def of(cls, sync: Any) -> StreamLimits:
        """The caps of a :class:`rollart.config.trainer.SyncConfig`."""
        bucket_mb = sync.max_bucket_mb if sync.max_bucket_mb is not None else 2 * sync.bucket_mb
        return cls(bucket_bytes=int(bucket_mb * 2**20), version_bytes=int(sync.max_version_gb * 2**30))


DEFAULT_LIMITS = StreamLimits(bucket_bytes=128 << 20, version_bytes=1 << 40)
"""The caps of the default ``trainer.sync`` (64 MiB buckets: twice that; 1 TiB a version)."""


def wire_bound(raw: int) -> int:
    """The most bytes zstd may store ``raw`` bytes in (``ZSTD_COMPRESSBOUND``, rounded up)."""
    return raw + (raw >> 7) + (64 << 10)


def check_blob_name(name: str, what: str) -> str:
    """``name`` when it is a plain file name of a store (no folder, no leading dot), else a
    ``StreamError`` that does not repeat it (it may be a path to a local file)."""
    if not isinstance(name, str) or not _BLOB_NAME.match(name):
        raise StreamError(f"{what} is not a stream object name (letters, digits, '.', '_', "
                          f"'-', at most 200, not starting with '.')")
    return name

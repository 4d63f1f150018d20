"""Reading the published policy: KV watch, weight fetch and digest check (no torch; the
digests themselves are :mod:`rollart.engines.digest`)."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator
from pathlib import Path
from urllib.parse import unquote, urlparse

from rollart import messages as m
from rollart.actors.kernel.records import put_record, watch_record
from rollart.bus import Bus
from rollart.bus.codec import decode
from rollart.engines.digest import (  # re-exported: the digests of the policy's weights
    CONTENT_PREFIX,
    DigestMismatch,
    TensorDigest,
    check_digest,
    content_digest,
    file_content_digest,
    sha256_digest,
)
from rollart.engines.safe_files import read_regular

__all__ = ["CONTENT_PREFIX", "DigestMismatch", "TensorDigest", "check_digest", "content_digest",
           "current_policy", "fetch_weights", "file_content_digest", "set_policy",
           "sha256_digest", "watch_policy"]

log = logging.getLogger(__name__)


async def current_policy(bus: Bus, run: str) -> m.PolicyPublished | None:
    kv = await bus.key_value(m.kv_bucket(run))
    e = await kv.get(m.POLICY_KEY)
    return decode(m.PolicyPublished, e.value) if e and e.value else None


async def watch_policy(bus: Bus, run: str) -> AsyncIterator[m.PolicyPublished]:
    """The current policy (if any), then each newly published one."""
    async for pub in watch_record(bus, run, m.POLICY_KEY, m.PolicyPublished,
                                  what="policy record", validate=True):
        yield pub


async def set_policy(bus: Bus, run: str, pub: m.PolicyPublished) -> None:
    """Store ``pub`` as the run's policy record (one put; a bus error is raised)."""
    await put_record(bus, run, m.POLICY_KEY, pub, what=f"setting policy v{pub.version}",
                     attempts=1, logger=log)


MAX_WEIGHT_FILE_BYTES = 1 << 40
"""The largest ``file://`` or ``obj://`` weight version a holder reads (1 TiB): the record
names the file, so without a bound a forged ``file:///dev/zero`` would be read forever."""


def _read_weight_file(path: str, max_bytes: int) -> bytes:
    """The bytes of the regular file at ``path``, refused before anything is read when it
    is a link, not a regular file (a device, a FIFO) or larger than ``max_bytes``. The
    refusal names the path the record gave, never the content or size of what is there."""
    try:
        return read_regular(path, max_bytes, repr(path), DigestMismatch)
    except FileNotFoundError:
        raise DigestMismatch(f"cannot open {path!r} (no such file)") from None


async def fetch_weights(bus: Bus, pub: m.PolicyPublished, *,
                        max_bytes: int = MAX_WEIGHT_FILE_BYTES) -> bytes:
    """The bytes behind ``pub.uri`` (``file://`` or ``obj://bucket/name``), digest-checked
    (a content digest, or the older file-bytes ``sha256:``); reads and hashes off the loop.

    The record comes from another process, so what it names is untrusted: a file must be a
    regular file (no link followed, no device) within ``max_bytes``; a refusal says that the
    bytes do not match, never what they are (their size, digest or tensor names would tell a
    forger about a local file: the detail goes to this process's debug log only)."""
    u = urlparse(pub.uri)
    if u.scheme == "file":
        data = await asyncio.to_thread(_read_weight_file, unquote(u.path), max_bytes)
    elif u.scheme == "obj":
        data = await (await bus.object_store(u.netloc)).get(u.path.lstrip("/"))
        if len(data) > max_bytes:
            raise DigestMismatch(f"{pub.uri} is larger than the {max_bytes}-byte cap")
    else:
        raise ValueError(f"unsupported weight uri {pub.uri!r}: use file:// or obj://")
    try:
        await asyncio.to_thread(check_digest, data, pub.digest)
    except DigestMismatch as e:
        log.debug("weights of version %d at %s: %s", pub.version, pub.uri, e)
        raise DigestMismatch(
            f"weights of version {pub.version} at {pub.uri} do not match the published digest "
            f"{pub.digest} (or are not a safetensors file): refusing to load"
        ) from None
    return data

"""Reading the published policy: KV watch, weight fetch and digest check (no torch; the
digests themselves are :mod:`rollart.engines.digest`)."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator
from pathlib import Path
from urllib.parse import unquote, urlparse

from rollart import messages as m
from rollart.actors.records import put_record, watch_record
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


async def fetch_weights(bus: Bus, pub: m.PolicyPublished) -> bytes:
    """The bytes behind ``pub.uri`` (``file://`` or ``obj://bucket/name``), digest-checked
    (a content digest, or the older file-bytes ``sha256:``); reads and hashes off the loop."""
    u = urlparse(pub.uri)
    if u.scheme == "file":
        data = await asyncio.to_thread(Path(unquote(u.path)).read_bytes)
    elif u.scheme == "obj":
        data = await (await bus.object_store(u.netloc)).get(u.path.lstrip("/"))
    else:
        raise ValueError(f"unsupported weight uri {pub.uri!r}: use file:// or obj://")
    try:
        await asyncio.to_thread(check_digest, data, pub.digest)
    except DigestMismatch as e:
        raise DigestMismatch(
            f"weights of version {pub.version} at {pub.uri}: {e}, "
            f"published digest {pub.digest}: refusing to load"
        ) from None
    return data

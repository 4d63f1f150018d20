"""Reading the published policy: KV watch, weight fetch and digest check (no torch)."""

from __future__ import annotations

import hashlib
import logging
from collections.abc import AsyncIterator
from pathlib import Path
from urllib.parse import urlparse

from rollart import messages as m
from rollart.bus import Bus
from rollart.bus.codec import DecodeError, decode, encode

log = logging.getLogger(__name__)


class DigestMismatch(ValueError):
    """Weight bytes whose digest differs from the published one."""


def sha256_digest(data: bytes) -> str:
    return "sha256:" + hashlib.sha256(data).hexdigest()


async def current_policy(bus: Bus, run: str) -> m.PolicyPublished | None:
    kv = await bus.key_value(m.kv_bucket(run))
    e = await kv.get(m.POLICY_KEY)
    return decode(m.PolicyPublished, e.value) if e and e.value else None


async def watch_policy(bus: Bus, run: str) -> AsyncIterator[m.PolicyPublished]:
    """The current policy (if any), then each newly published one."""
    kv = await bus.key_value(m.kv_bucket(run))
    async for e in kv.watch(m.POLICY_KEY):
        if e.deleted or not e.value:
            continue
        try:
            yield decode(m.PolicyPublished, e.value)
        except DecodeError as err:
            log.error("ignoring malformed policy record: %s", err)


async def set_policy(bus: Bus, run: str, pub: m.PolicyPublished) -> None:
    kv = await bus.key_value(m.kv_bucket(run))
    await kv.put(m.POLICY_KEY, encode(pub))


async def fetch_weights(bus: Bus, pub: m.PolicyPublished) -> bytes:
    """The bytes behind ``pub.uri`` (``file://`` or ``obj://bucket/name``), digest-checked."""
    u = urlparse(pub.uri)
    if u.scheme == "file":
        data = Path(u.path).read_bytes()
    elif u.scheme == "obj":
        data = await (await bus.object_store(u.netloc)).get(u.path.lstrip("/"))
    else:
        raise ValueError(f"unsupported weight uri {pub.uri!r}: use file:// or obj://")
    got = sha256_digest(data)
    if got != pub.digest:
        raise DigestMismatch(
            f"weights of version {pub.version} at {pub.uri} have digest {got}, "
            f"published {pub.digest}: refusing to load"
        )
    return data

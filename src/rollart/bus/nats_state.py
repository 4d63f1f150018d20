"""The state layer of :class:`rollart.bus.nats.NatsBus`: KV buckets (get, put, delete,
watch) and object stores, on JetStream.

- A KV watch is re-made after every reconnect: nats-py watches through an in-memory
  ordered consumer, which a server restart loses (see :meth:`NatsKeyValue.watch`).
- Under a JetStream domain (a client of a site's leaf server) KV writes go to
  ``$JS.<domain>.API.$KV.<bucket>.<key>``, which the hub maps back to ``$KV.<bucket>.<key>``:
  nats-server denies the plain ``$KV.>`` across a leaf link, and nats-py (2.16) writes the
  plain subject whatever its domain. Reads and watches go through the API prefix already.
- An object read that stalls stops instead of waiting forever (see
  :meth:`NatsObjectStore.get`).
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import hashlib
import logging
from collections.abc import AsyncIterator

import nats.errors
import nats.js.errors

from rollart.bus.base import BusError, BusTimeout, KVEntry, KeyValue, ObjectStore, ObjectTooLarge
from rollart.bus.nats_connection import NatsConnection, replicas_hint, translated

log = logging.getLogger(__name__)

KV_HISTORY = 16
"""Revisions kept per key. A watch is a server-side consumer that may lag the writer; with a
history of 1, a revision overwritten before the consumer delivered it is gone and the
watcher never sees it (measured: ~1% of put-put watches on a loaded 2-core host skipped the
middle revision). Keeping 16 means a watcher misses a change only when 16 newer ones of the
same key land while it lags."""

async def open_key_value(conn: NatsConnection, bucket: str, replicas: int) -> NatsKeyValue:
    """Bucket ``bucket``, created with ``replicas`` copies when missing."""
    js = conn._jetstream()
    with translated(f"kv bucket {bucket}"):
        try:
            kv = await js.key_value(bucket)
        except nats.js.errors.BucketNotFoundError:
            with replicas_hint(f"kv bucket {bucket}", replicas):
                kv = await js.create_key_value(bucket=bucket, history=KV_HISTORY, direct=True,
                                               replicas=replicas)
    return NatsKeyValue(kv, bucket, conn)


async def open_object_store(conn: NatsConnection, bucket: str, replicas: int,
                            ttl: float = 0.0, max_bytes: int = 0) -> NatsObjectStore:
    """Object store ``bucket``, created with ``replicas`` copies (objects kept ``ttl``
    seconds, 0: forever; at most ``max_bytes`` in all, 0: no limit) when missing."""
    js = conn._jetstream()
    with translated(f"object store {bucket}"):
        try:
            obs = await js.object_store(bucket)
        except nats.js.errors.BucketNotFoundError:
            with replicas_hint(f"object store {bucket}", replicas):
                obs = await js.create_object_store(
                    bucket, replicas=replicas, **({"ttl": ttl} if ttl > 0 else {}),
                    **({"max_bytes": int(max_bytes)} if max_bytes > 0 else {}))
    return NatsObjectStore(obs, bucket, conn)


class KeyWatch:
    """One live nats-py key watcher; stopped on reconnect (to be re-made) or on close."""

    __slots__ = ("restart", "watcher")

    def __init__(self, watcher) -> None:
        self.watcher = watcher
        self.restart = False

    async def stop(self, restart: bool = False) -> None:
        self.restart = restart
        with contextlib.suppress(nats.errors.Error):  # already stopped
            await self.watcher.stop()  # also wakes the iterator with a stop marker


class NatsKeyValue(KeyValue):
    def __init__(self, kv, bucket: str, bus: NatsConnection) -> None:
        self._kv = kv
        self._bucket = bucket
        self._bus = bus
        self._write_pre = f"$JS.{bus.domain}.API.$KV.{bucket}." if bus.domain else None

    async def get(self, key: str) -> KVEntry | None:
        with translated(f"kv get {self._bucket}/{key}"):
            try:
                e = await self._kv.get(key)
            except nats.js.errors.NotFoundError:  # missing, deleted or purged
                return None
        return KVEntry(key=key, value=e.value, revision=e.revision)

    async def put(self, key: str, value: bytes) -> int:
        with translated(f"kv put {self._bucket}/{key}"):
            if self._write_pre is None:
                return await self._kv.put(key, value)
            return (await self._bus._jetstream().publish(self._write_pre + key, value)).seq

    async def delete(self, key: str) -> None:
        with translated(f"kv delete {self._bucket}/{key}"):
            if self._write_pre is None:
                await self._kv.delete(key)
            else:
                await self._bus._jetstream().publish(self._write_pre + key,
                                                     headers={"KV-Operation": "DEL"})

    async def watch(self, key: str) -> AsyncIterator[KVEntry]:
        # nats-py watches through an in-memory ordered consumer, which a server restart
        # loses; nats-py notices only after missing heartbeats for ~10 s. So the bus
        # stops every watcher on reconnect and this loop makes a new one, skipping
        # revisions already yielded. A re-watch replays the key's kept history
        # (KV_HISTORY revisions), so changes made during the outage are not skipped.
        what = f"kv watch {self._bucket}/{key}"
        last, delay, first = 0, 0.05, True
        while True:
            try:
                with translated(what):
                    watcher = await self._kv.watch(key, include_history=last > 0)
            except BusError as err:
                if first or self._bus._closed:
                    raise  # the first watch fails loudly
                log.warning("%s: re-watch failed (%s); retrying", what, err)
                await asyncio.sleep(delay)
                delay = min(delay * 2, 2.0)
                continue
            first, delay = False, 0.05
            rec = KeyWatch(watcher)
            self._bus._watches.add(rec)
            try:
                async for e in watcher:
                    if e is None or e.revision <= last:  # None: nats-py's "initial values done"
                        continue
                    last = e.revision
                    deleted = e.operation in ("DEL", "PURGE")
                    yield KVEntry(key=e.key, value=None if deleted else e.value, revision=e.revision, deleted=deleted)
            finally:
                self._bus._watches.discard(rec)
                if not rec.restart:
                    await rec.stop()
            if not rec.restart or self._bus._closed:
                return


class NatsObjectStore(ObjectStore):
    def __init__(self, obs, bucket: str, bus: NatsConnection) -> None:
        self._obs = obs
        self._bucket = bucket
        self._bus = bus

    async def put(self, name: str, data: bytes) -> None:
        with translated(f"object put {self._bucket}/{name}"):
            await self._obs.put(name, data)

    async def get(self, name: str, *, max_bytes: int | None = None) -> bytes:
        """The object's bytes. With ``max_bytes``, an object whose info announces more, or
        a link, is refused before a chunk is read (:class:`ObjectTooLarge`), and the chunks
        go into one buffer of the announced size: a chunk past it is refused too. Unlike
        nats-py's ``get``, which waits forever for a chunk that never comes (an object deleted or replaced while it is read: a trainer with
        ``keep_weights: 1`` purges v1 as it publishes v2), a read that receives no chunk for
        ``stall_s`` stops: :class:`KeyError` if the object is gone or replaced meanwhile,
        else :class:`BusTimeout`. The digest is checked off the event loop."""
        what = f"object get {self._bucket}/{name}"
        with translated(what):
            info = await self._info(name)
            if max_bytes is not None:
                if info.is_link():
                    raise ObjectTooLarge(f"{what}: a link, not an object (refused: a bound "
                                         "was asked)")
                if (info.size or 0) > max_bytes:
                    raise ObjectTooLarge(f"{what}: the object's info says {info.size} bytes, "
                                         f"larger than the {max_bytes} asked for")
                buf = bytearray(info.size or 0)
            elif info.is_link() or not info.size:
                return (await self._obs.get(name)).data
            stall_s = self._bus.object_stall_s
            sub = await self._bus._jetstream().subscribe(f"$O.{self._bucket}.C.{info.nuid}",
                                                        ordered_consumer=True)
            chunks, got = [], 0
            try:
                while got < info.size:
                    try:
                        msg = await sub.next_msg(timeout=stall_s)
                    except nats.errors.TimeoutError:
                        now = await self._info(name, missing_ok=True)
                        if now is None or now.nuid != info.nuid:
                            raise KeyError(f"{name} (deleted or replaced while it was read)") from None
                        raise BusTimeout(f"{what}: no chunk for {stall_s:.1f}s after "
                                         f"{got} of {info.size} bytes") from None
                    if max_bytes is not None:
                        if got + len(msg.data) > len(buf):
                            raise ObjectTooLarge(f"{what}: chunks past the {len(buf)} bytes "
                                                 "its info announces")
                        buf[got:got + len(msg.data)] = msg.data
                    else:
                        chunks.append(msg.data)
                    got += len(msg.data)
            finally:
                with contextlib.suppress(nats.errors.Error):
                    await sub.unsubscribe()
        data = buf if max_bytes is not None else b"".join(chunks)
        if not await asyncio.to_thread(_object_digest_ok, data, info.digest):
            raise BusError(f"{what}: the bytes read do not match the object's digest")
        return data

    async def _info(self, name: str, missing_ok: bool = False):
        try:
            return await self._obs.get_info(name)
        except nats.js.errors.NotFoundError:  # missing or deleted
            if missing_ok:
                return None
            raise KeyError(name) from None

    async def exists(self, name: str) -> bool:
        with translated(f"object info {self._bucket}/{name}"):
            return await self._info(name, missing_ok=True) is not None

    async def delete(self, name: str) -> None:
        with translated(f"object delete {self._bucket}/{name}"):
            try:
                await self._obs.delete(name)
            except nats.js.errors.NotFoundError:
                pass


def _object_digest_ok(data: bytes, digest: str | None) -> bool:
    """Whether ``data`` matches a nats object digest (``SHA-256=<base64url>``; none: yes)."""
    if not digest:
        return True
    kind, _, value = digest.partition("=")
    if kind.upper() != "SHA-256":
        return True  # a scheme this client does not know: nats-py would not check it either
    return hashlib.sha256(data).digest() == base64.urlsafe_b64decode(value + "=" * (-len(value) % 4))

"""The key-value and object stores of :class:`rollart.bus.memory.MemoryBus`.

A bucket keeps one revision counter and the last entry per key (no history: a watcher is
handed every change as it happens, so none is skipped); an object store keeps whole blobs.
What the stores use of the bus is the protocol :class:`Host`.
"""

from __future__ import annotations

import asyncio
import re
from collections.abc import AsyncIterator, Callable
from typing import Protocol

from rollart.bus.base import BusError, KeyValue, KVEntry, ObjectStore, ObjectTooLarge
from rollart.bus.subjects import check_subject, compile_matcher

_KV_KEY = re.compile(r"[-/_=.a-zA-Z0-9]+")
_KV_WATCH = re.compile(r"[-/_=.a-zA-Z0-9*>]+")


def as_bytes(data) -> bytes:
    return data if type(data) is bytes else bytes(data)


class Host(Protocol):
    """What the stores use of their bus."""

    def check_connected(self) -> None: ...


class MemoryKV(KeyValue):
    """A bucket: one revision counter, last entry per key, live watchers."""

    def __init__(self, bus: Host, bucket: str):
        self._bus = bus
        self.bucket = bucket
        self._entries: dict[str, KVEntry] = {}
        self._revision = 0
        self._watchers: list[tuple[Callable[[str], bool], asyncio.Queue]] = []

    @property
    def watchers(self) -> int:
        """How many watches of this bucket are open (closing a watch's iterator ends it)."""
        return len(self._watchers)

    def _check(self, key: str, pattern: re.Pattern = _KV_KEY) -> None:
        self._bus.check_connected()
        if not isinstance(key, str) or not pattern.fullmatch(key) or key[0] == "." or key[-1] == ".":
            raise BusError(f"invalid key {key!r} in bucket {self.bucket!r}")

    async def get(self, key: str) -> KVEntry | None:
        self._check(key)
        e = self._entries.get(key)
        return None if e is None or e.deleted else e

    def _set(self, entry: KVEntry) -> int:
        self._entries[entry.key] = entry
        for match, q in self._watchers:
            if match(entry.key):
                q.put_nowait(entry)
        return entry.revision

    async def put(self, key: str, value: bytes) -> int:
        self._check(key)
        self._revision += 1
        rev = self._set(KVEntry(key=key, value=as_bytes(value), revision=self._revision))
        await asyncio.sleep(0)
        return rev

    async def delete(self, key: str) -> None:
        self._check(key)
        self._revision += 1
        self._set(KVEntry(key=key, value=None, revision=self._revision, deleted=True))
        await asyncio.sleep(0)

    async def watch(self, key: str) -> AsyncIterator[KVEntry]:
        """Current entries of matching keys (oldest revision first), then every change.

        As in NATS, a key whose last operation was a delete starts with its delete
        marker. ``key`` may use ``*`` and ``>`` like a subject. Ends when the bus closes.
        """
        self._check(key, _KV_WATCH)
        check_subject(key, wildcards=True)
        match = compile_matcher(key)
        q: asyncio.Queue = asyncio.Queue()
        watcher = (match, q)
        # snapshot and registration happen with no await between: nothing is missed
        current = sorted(
            (e for k, e in self._entries.items() if match(k)),
            key=lambda e: e.revision,
        )
        self._watchers.append(watcher)
        try:
            for e in current:
                yield e
            while True:
                e = await q.get()
                if e is None:
                    return
                yield e
        finally:
            self._watchers.remove(watcher)

    def close(self) -> None:
        for _, q in self._watchers:
            q.put_nowait(None)


class MemoryObjects(ObjectStore):
    def __init__(self, bus: Host):
        self._bus = bus
        self._blobs: dict[str, bytes] = {}

    async def put(self, name: str, data: bytes) -> None:
        self._bus.check_connected()
        self._blobs[name] = as_bytes(data)

    async def get(self, name: str, *, max_bytes: int | None = None) -> bytes:
        self._bus.check_connected()
        try:
            blob = self._blobs[name]
        except KeyError:
            raise KeyError(name) from None
        if max_bytes is not None and len(blob) > max_bytes:
            raise ObjectTooLarge(f"object {name}: {len(blob)} bytes, larger than the "
                                 f"{max_bytes} asked for")
        return blob

    async def exists(self, name: str) -> bool:
        self._bus.check_connected()
        return name in self._blobs

    async def delete(self, name: str) -> None:
        """Deleting a missing object is a no-op."""
        self._bus.check_connected()
        self._blobs.pop(name, None)


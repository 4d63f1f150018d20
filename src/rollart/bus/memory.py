"""An in-process bus with the semantics of NATS JetStream.

:class:`MemoryBus` is a product feature, not a test double: it lets every actor run
in one asyncio process with no server, and it passes the same contract suite as
:class:`rollart.bus.nats.NatsBus`. This module holds the bus itself, core
publish/subscribe and request/reply; the pieces below it (none imports this one):
streams in :mod:`rollart.bus.memory_stream`, durable consumers in
:mod:`rollart.bus.memory_consumer`, the key-value and object stores in
:mod:`rollart.bus.memory_state`, subject rules in :mod:`rollart.bus.subjects`.

Everything runs on the event loop that called :meth:`MemoryBus.connect`: timers are
``loop.call_later`` handles and handlers are tasks, all cancelled by :meth:`close`.
State (streams, consumers, buckets) outlives :meth:`close`, like a server outlives a
client; deliveries still un-acked at close become due for redelivery.
"""

from __future__ import annotations

import asyncio
import functools
import itertools
import logging
import re
import secrets
from collections.abc import Awaitable, Callable

from rollart.bus.base import (
    Bus,
    BusError,
    BusTimeout,
    ConsumerSpec,
    DuplicateConflict,
    KeyValue,
    NoResponders,
    ObjectStore,
    PullConsumer,
    Request,
    StreamSpec,
    Subscription,
)
from rollart.bus.memory_consumer import MemoryPullConsumer
from rollart.bus.memory_state import MemoryKV, MemoryObjects, as_bytes
from rollart.bus.memory_stream import Stream
from rollart.bus.subjects import check_name, check_subject, compile_matcher, subjects_overlap

log = logging.getLogger(__name__)

_BUCKET = re.compile(r"[-_a-zA-Z0-9]+")
_OWNER_CACHE_MAX = 4096
MAX_PAYLOAD = 1024 * 1024
"""nats-server's default ``max_payload``: larger messages (data and headers) are refused;
the object store chunks bigger blobs."""


class MemoryBus(Bus):
    """The whole bus protocol in one process. ``MemoryBus()``, then ``connect()``."""

    def __init__(self, name: str = "memory", *, drain_timeout: float = 10.0,
                 max_payload: int = MAX_PAYLOAD) -> None:
        self.url = f"memory://{name}"
        self.drain_timeout = drain_timeout
        self.max_payload = max_payload
        self.loop: asyncio.AbstractEventLoop | None = None
        self._connected = False
        self._streams: dict[str, Stream] = {}
        self._owner: dict[str, Stream | None] = {}  # subject -> owning stream (cache)
        self._subs: list[_Sub] = []
        self._rr: dict[tuple[str, str], int] = {}  # queue group -> round-robin counter
        self._tasks: set[asyncio.Task] = set()
        self._replies: dict[str, asyncio.Future] = {}
        self._inbox = f"_INBOX.{secrets.token_hex(8)}."
        self._inbox_ids = itertools.count(1)
        self._kv: dict[str, MemoryKV] = {}
        self._objects: dict[str, MemoryObjects] = {}

    # -- lifecycle ----------------------------------------------------------------------
    async def connect(self) -> None:
        self.loop = asyncio.get_running_loop()
        self._connected = True

    async def close(self) -> None:
        """Stop subscriptions, let running handlers finish (up to ``drain_timeout``),
        then cancel what is left: handlers, timers, parked fetches, watches, requests."""
        if not self._connected:
            return
        self._subs.clear()
        if self._tasks:
            _, late = await asyncio.wait(set(self._tasks), timeout=self.drain_timeout)
            if late:
                log.warning("%s: %d handlers still running after %.1fs; cancelling them",
                            self.url, len(late), self.drain_timeout)
        self._connected = False
        for stream in self._streams.values():
            stream.close(delete=False)
        for fut in self._replies.values():
            if not fut.done():
                fut.set_exception(BusError("bus closed"))
        for kv in self._kv.values():
            kv.close()
        tasks = list(self._tasks)
        for t in tasks:
            t.cancel()
        if tasks:
            await asyncio.gather(*tasks, return_exceptions=True)

    @property
    def connected(self) -> bool:
        return self._connected

    @property
    def outage_s(self) -> float:
        return 0.0  # in-process: there is no server to lose

    def check_connected(self) -> None:
        if not self._connected:
            raise BusError(f"{self.url} is not connected")

    def _check_payload(self, what: str, subject: str, data: bytes,
                       headers: dict[str, str] | None) -> None:
        """As a NATS client does: refuse a message larger than the server's ``max_payload``."""
        limit = self.max_payload
        size = len(data)
        if headers:
            for k, v in headers.items():
                size += len(k) + len(v) + 4
        if 0 < limit < size:
            raise BusError(f"{what} {subject}: MaxPayloadError: {size} bytes exceed max_payload "
                           f"{limit} (put large blobs in the object store)")

    # -- durable ------------------------------------------------------------------------
    replicas: int = 1
    """As :attr:`rollart.bus.nats.NatsBus.replicas`, for the same code paths; ignored (one
    copy in this process), as is :attr:`StreamSpec.replicas`."""

    async def ensure_stream(self, spec: StreamSpec, *, update: bool = True) -> bool:
        self.check_connected()
        if spec.replicas < 1:
            raise BusError(f"stream {spec.name!r}: replicas must be at least 1 (it is {spec.replicas})")
        check_name(spec.name, "stream")
        if not spec.subjects:
            raise BusError(f"stream {spec.name!r} needs at least one subject")
        for s in spec.subjects:
            check_subject(s, wildcards=True)
        for other in self._streams.values():
            if other.spec.name == spec.name:
                continue
            for a in spec.subjects:
                for b in other.spec.subjects:
                    if subjects_overlap(a, b):
                        raise BusError(
                            f"subject {a!r} of stream {spec.name!r} overlaps {b!r} of "
                            f"stream {other.spec.name!r}"
                        )
        have = self._streams.get(spec.name)
        if have is None:
            self._streams[spec.name] = Stream(self, spec)
        elif have.spec != spec:
            if not update:
                return False
            if have.spec.retention != spec.retention:
                raise BusError(f"stream {spec.name!r}: retention cannot change")
            have.update(spec)
        self._owner.clear()
        return True

    def _stream(self, name: str) -> Stream:
        st = self._streams.get(name)
        if st is None:
            raise BusError(f"stream {name!r} not found")
        return st

    def _owner_of(self, subject: str) -> Stream | None:
        try:
            return self._owner[subject]
        except KeyError:
            pass
        owner = next((s for s in self._streams.values() if s.owns(subject)), None)
        if len(self._owner) >= _OWNER_CACHE_MAX:
            self._owner.clear()
        self._owner[subject] = owner
        return owner

    async def publish(
        self,
        subject: str,
        data: bytes,
        *,
        headers: dict[str, str] | None = None,
        msg_id: str | None = None,
        timeout: float = 5.0,
    ) -> int:
        self.check_connected()
        stream = self._owner_of(subject)
        if stream is None:
            check_subject(subject)
            raise NoResponders(f"no stream owns subject {subject!r}")
        stored = dict(headers) if headers else {}
        if msg_id is not None:
            stored["Nats-Msg-Id"] = msg_id
        data = as_bytes(data)
        self._check_payload("publish to", subject, data, stored)
        seq = stream.store(subject, data, stored, msg_id)
        if self._subs:  # as in NATS, a stored message is also a core message
            self.route_core(subject, data, stored)
        await asyncio.sleep(0)  # a real publish yields while awaiting its ack
        return seq

    async def publish_once(self, subject: str, data: bytes, *, msg_id: str,
                           headers: dict[str, str] | None = None, timeout: float = 5.0) -> int:
        data = as_bytes(data)
        seq = await self.publish(subject, data, headers=headers, msg_id=msg_id, timeout=timeout)
        stored = self._owner_of(subject).messages.get(seq)
        if stored is not None and stored.data != data:
            raise DuplicateConflict(f"publish to {subject}: msg id {msg_id!r} already holds "
                                    f"other data (stream sequence {seq})", seq)
        return seq

    async def pull_consumer(self, stream: str, spec: ConsumerSpec) -> PullConsumer:
        self.check_connected()
        return MemoryPullConsumer(self._stream(stream).add_consumer(spec))

    async def stream_info(self, stream: str) -> dict:
        self.check_connected()
        return self._stream(stream).info()

    def stream_spec(self, stream: str) -> StreamSpec:
        """The spec the stream holds now (as made or last updated); BusError if it is missing."""
        return self._stream(stream).spec

    async def consumers_info(self, stream: str) -> list[dict]:
        self.check_connected()
        st = self._stream(stream)
        st.expire()
        return [c.info() for c in st.consumers.values()]

    async def delete_stream(self, stream: str) -> None:
        """Delete ``stream`` and its consumers; a missing stream is a no-op."""
        self.check_connected()
        st = self._streams.pop(stream, None)
        if st is None:
            return
        self._owner.clear()
        st.close(delete=True)

    # -- core ---------------------------------------------------------------------------
    def route_core(
        self, subject: str, data: bytes, headers: dict[str, str] | None = None,
        reply: str | None = None,
    ) -> int:
        """Hand a message to matching subscribers; return how many got it."""
        plain: list[_Sub] = []
        groups: dict[tuple[str, str], list[_Sub]] = {}
        for s in self._subs:
            if s.match(subject):
                if s.queue is None:
                    plain.append(s)
                else:
                    groups.setdefault((s.subject, s.queue), []).append(s)
        for key, members in groups.items():
            n = self._rr.get(key, 0)
            self._rr[key] = n + 1
            plain.append(members[n % len(members)])
        for s in plain:
            respond = functools.partial(self._respond, reply) if reply else None
            req = Request(subject, data, dict(headers) if headers else {}, reply, respond)
            task = self.loop.create_task(self._run_handler(s, req))
            self._tasks.add(task)
            task.add_done_callback(self._tasks.discard)
        return len(plain)

    @staticmethod
    async def _run_handler(sub: _Sub, req: Request) -> None:
        try:
            await sub.handler(req)
        except Exception:
            log.exception("handler for %r failed on %r", sub.subject, req.subject)

    async def _respond(self, reply: str, data: bytes, headers: dict[str, str] | None) -> None:
        self.check_connected()
        fut = self._replies.get(reply)
        if fut is None:  # not one of our requests: route it like any core message
            self.route_core(reply, as_bytes(data), headers)
        elif not fut.done():
            fut.set_result(Request(reply, as_bytes(data), dict(headers) if headers else {}))

    async def publish_core(
        self, subject: str, data: bytes, *, headers: dict[str, str] | None = None
    ) -> None:
        """To live subscribers; also stored (without an ack) if a stream owns ``subject``."""
        self.check_connected()
        check_subject(subject)
        data = as_bytes(data)
        self._check_payload("publish to", subject, data, headers)
        self.route_core(subject, data, headers)
        stream = self._owner_of(subject)
        if stream is not None:  # as in NATS, a stream stores what lands on its subjects
            stored = dict(headers) if headers else {}
            stream.store(subject, data, stored, stored.get("Nats-Msg-Id"))
        await asyncio.sleep(0)

    async def subscribe(
        self,
        subject: str,
        handler: Callable[[Request], Awaitable[None]],
        *,
        queue: str | None = None,
    ) -> Subscription:
        self.check_connected()
        check_subject(subject, wildcards=True)
        if queue is not None:
            check_name(queue, "queue group")
        sub = _Sub(self, subject, handler, queue)
        self._subs.append(sub)
        return sub

    async def request(
        self,
        subject: str,
        data: bytes,
        *,
        headers: dict[str, str] | None = None,
        timeout: float = 5.0,
    ) -> Request:
        self.check_connected()
        check_subject(subject)
        self._check_payload("request to", subject, as_bytes(data), headers)
        inbox = f"{self._inbox}{next(self._inbox_ids)}"
        fut = self.loop.create_future()
        self._replies[inbox] = fut
        try:
            if not self.route_core(subject, as_bytes(data), headers, reply=inbox):
                raise NoResponders(f"no responders on {subject!r}")
            timer = self.loop.call_later(timeout, _time_out, fut, subject, timeout)
            try:
                return await fut
            finally:
                timer.cancel()
        finally:
            del self._replies[inbox]

    # -- state --------------------------------------------------------------------------
    async def key_value(self, bucket: str) -> KeyValue:
        self.check_connected()
        if not _BUCKET.fullmatch(bucket or ""):
            raise BusError(f"invalid bucket name {bucket!r}")
        kv = self._kv.get(bucket)
        if kv is None:
            kv = self._kv[bucket] = MemoryKV(self, bucket)
        return kv

    async def object_store(self, bucket: str, *, ttl: float = 0.0,
                           max_bytes: int = 0) -> ObjectStore:
        self.check_connected()
        if not _BUCKET.fullmatch(bucket or ""):
            raise BusError(f"invalid bucket name {bucket!r}")
        store = self._objects.get(bucket)
        if store is None:
            store = self._objects[bucket] = MemoryObjects(self)
        return store


def _time_out(fut: asyncio.Future, subject: str, timeout: float) -> None:
    if not fut.done():
        fut.set_exception(BusTimeout(f"no reply on {subject!r} within {timeout}s"))


class _Sub(Subscription):
    def __init__(self, bus: MemoryBus, subject: str, handler, queue: str | None):
        self._bus = bus
        self.subject = subject
        self.match = compile_matcher(subject)
        self.handler = handler
        self.queue = queue

    async def unsubscribe(self) -> None:
        """Stop new deliveries; handlers already running finish."""
        if self in self._bus._subs:
            self._bus._subs.remove(self)


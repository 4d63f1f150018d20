"""Durable pull consumers of the in-memory bus: deliveries, acks and redelivery.

The state machine mirrors JetStream's as measured (see ``NOTES.md``): explicit acks,
``nak(delay)``, ``term``, ``in_progress``, ``ack_wait`` redelivery, ``max_deliver`` and
``max_ack_pending``. Timers are ``loop.call_later`` handles; waiting fetches park on
futures that a publish, an ack or a due redelivery resolves. Nothing here polls.

This module sits below :mod:`rollart.bus.memory_stream` (which creates a
:class:`ConsumerState` per durable) and :mod:`rollart.bus.memory`; what it needs of them
is spelled out as the protocols :class:`Host` and :class:`StreamView`, so neither is
imported here.
"""

from __future__ import annotations

import asyncio
import heapq
import itertools
import json
import logging
import time
from typing import Protocol

from rollart.bus.base import BusError, ConsumerSpec, Delivery, PullConsumer, Retention, StreamSpec
from rollart.bus.subjects import compile_matcher

log = logging.getLogger(__name__)

MAX_DELIVERIES_ADVISORY = "$JS.EVENT.ADVISORY.CONSUMER.MAX_DELIVERIES"


class Host(Protocol):
    """What streams and consumers use of their bus (:class:`rollart.bus.memory.MemoryBus`)."""

    loop: asyncio.AbstractEventLoop

    @property
    def connected(self) -> bool: ...

    def check_connected(self) -> None: ...

    def route_core(self, subject: str, data: bytes, headers: dict[str, str] | None = None,
                   reply: str | None = None) -> int: ...


class StoredMsg:
    """A message as a stream keeps it (and a delivery hands it out)."""

    __slots__ = ("subject", "data", "headers", "seq", "time", "wall")

    def __init__(self, subject: str, data: bytes, headers: dict[str, str], seq: int, t: float):
        self.subject, self.data, self.headers, self.seq, self.time = subject, data, headers, seq, t
        self.wall = time.time()  # ``time`` is the loop's clock (for max_age); this, the wall's


class StreamView(Protocol):
    """What a consumer uses of its stream (:class:`rollart.bus.memory_stream.Stream`)."""

    bus: Host
    spec: StreamSpec
    messages: dict[int, StoredMsg]
    last_seq: int
    deleted: bool

    def expire(self) -> None: ...

    def remove(self, seq: int) -> bool: ...


_tokens = itertools.count(1)


class _Pending:
    """A delivered, not yet acked message of one consumer."""

    __slots__ = ("num_delivered", "token", "timer", "due", "since")

    def __init__(self) -> None:
        self.num_delivered = 0
        self.token = 0  # identifies the latest delivery; nak/in_progress need it to match
        self.timer = None
        self.due = False  # queued for redelivery
        self.since = None  # loop time of the delivery (or progress) its ack_wait timer runs from


class ConsumerState:
    """One durable's state, shared by every binding of it."""

    def __init__(self, stream: StreamView, spec: ConsumerSpec):
        self.stream = stream
        self.spec = spec
        self.matches = compile_matcher(spec.filter_subject)
        self.cursor = 0 if spec.deliver_all else stream.last_seq  # last stream seq looked at
        self.last_delivered = self.cursor  # stream seq of the last message delivered first
        self.pending: dict[int, _Pending] = {}
        self._due: list[int] = []  # heap of stream seqs to redeliver
        self.waiters: list = []  # futures of parked fetches
        self.last_active = stream.bus.loop.time()  # last fetch (inactive_threshold)
        self.deleted = False

    def update(self, spec: ConsumerSpec) -> None:
        """New updatable settings (see :func:`rollart.bus.base.consumer_changes`). As in NATS, a new
        ``ack_wait`` also applies to deliveries outstanding now, counted from when each was
        delivered (or last reported progress); a pending nak delay is kept."""
        old, self.spec = self.spec, spec
        if spec.ack_wait != old.ack_wait:
            loop = self.stream.bus.loop
            now = loop.time()
            for seq, p in self.pending.items():
                if p.timer is None or p.due or p.since is None:
                    continue
                p.timer.cancel()
                p.timer = loop.call_later(max(0.0, p.since + spec.ack_wait - now),
                                          self._timeout, seq, p.token)
        self.wake()  # a larger max_ack_pending may let parked fetches take more

    # -- waking fetches
    def wake(self) -> None:
        ws = self.waiters
        if ws:
            self.waiters = []
            for f in ws:
                if not f.done():
                    f.set_result(None)

    def _has_room(self) -> bool:
        limit = self.spec.max_ack_pending
        return limit <= 0 or len(self.pending) < limit

    def on_new_message(self) -> None:
        if self.waiters and self._has_room():
            self.wake()

    def _released(self) -> None:
        """A pending slot was freed: parked fetches may now take new messages."""
        if self.waiters and self.cursor < self.stream.last_seq:
            self.wake()

    # -- delivering
    def take(self, batch: int) -> list[MemoryDelivery]:
        stream = self.stream
        self.last_active = stream.bus.loop.time()
        stream.expire()
        msgs, pending, out = stream.messages, self.pending, []
        due = self._due
        while due and len(out) < batch:
            seq = heapq.heappop(due)
            p = pending.get(seq)
            if p is None or not p.due:
                continue
            msg = msgs.get(seq)
            if msg is None:  # removed meanwhile (age)
                del pending[seq]
                continue
            self._deliver(msg, p, out)
        limit = self.spec.max_ack_pending
        last = stream.last_seq
        while len(out) < batch and self.cursor < last and (limit <= 0 or len(pending) < limit):
            self.cursor = seq = self.cursor + 1
            msg = msgs.get(seq)
            if msg is None or not self.matches(msg.subject):
                continue
            p = pending[seq] = _Pending()
            self.last_delivered = seq
            self._deliver(msg, p, out)
        return out

    def _deliver(self, msg: StoredMsg, p: _Pending, out: list) -> None:
        p.num_delivered += 1
        p.token = tok = next(_tokens)
        p.due = False
        loop = self.stream.bus.loop
        p.since = loop.time()
        p.timer = loop.call_later(self.spec.ack_wait, self._timeout, msg.seq, tok)
        out.append(MemoryDelivery(self, msg, p.num_delivered, tok))

    def _timeout(self, seq: int, tok: int) -> None:
        p = self.pending.get(seq)
        if p is not None and p.token == tok and not p.due:
            p.timer = None
            self._redeliver_or_drop(seq, p)

    def _redeliver_or_drop(self, seq: int, p: _Pending, *, wake: bool = True) -> None:
        md = self.spec.max_deliver
        if md > 0 and p.num_delivered >= md:
            del self.pending[seq]
            log.debug("%s/%s: seq %d reached max_deliver=%d", self.stream.spec.name,
                      self.spec.durable, seq, md)
            self._advise_max_deliveries(seq, p.num_delivered)
            if wake:
                self._released()
            return
        p.due = True
        heapq.heappush(self._due, seq)
        if wake:
            self.wake()

    def _advise_max_deliveries(self, seq: int, deliveries: int) -> None:
        bus, sname, cname = self.stream.bus, self.stream.spec.name, self.spec.durable
        if not bus.connected:
            return
        payload = {
            "type": "io.nats.jetstream.advisory.v1.max_deliver",
            "stream": sname,
            "consumer": cname,
            "stream_seq": seq,
            "deliveries": deliveries,
        }
        bus.route_core(f"{MAX_DELIVERIES_ADVISORY}.{sname}.{cname}", json.dumps(payload).encode())

    # -- acknowledgements (from MemoryDelivery)
    def _finish(self, seq: int) -> None:
        """Ack or term: done for good, whichever delivery of the message sent it."""
        p = self.pending.pop(seq, None)
        if p is None:
            return
        if p.timer is not None:
            p.timer.cancel()
        if self.stream.spec.retention is Retention.WORKQUEUE:
            self.stream.remove(seq)
        self._released()

    ack = term = _finish

    def nak(self, seq: int, tok: int, delay: float | None) -> None:
        p = self.pending.get(seq)
        if p is None or p.token != tok or p.due:
            return
        if p.timer is not None:
            p.timer.cancel()
            p.timer = None
        p.token = tok = next(_tokens)  # this delivery may still ack, but not nak again
        if delay is not None and delay > 0:
            p.since = None  # a nak delay, not an ack_wait: a new ack_wait leaves it alone
            p.timer = self.stream.bus.loop.call_later(delay, self._timeout, seq, tok)
        else:
            self._redeliver_or_drop(seq, p)

    def in_progress(self, seq: int, tok: int) -> None:
        p = self.pending.get(seq)
        if p is None or p.token != tok or p.due:
            return
        if p.timer is not None:
            p.timer.cancel()
        loop = self.stream.bus.loop
        p.since = loop.time()
        p.timer = loop.call_later(self.spec.ack_wait, self._timeout, seq, tok)

    def forget(self, seq: int) -> None:
        """The stream dropped ``seq`` (max_age): it is no longer pending here."""
        p = self.pending.pop(seq, None)
        if p is not None:
            if p.timer is not None:
                p.timer.cancel()
            self._released()

    def delete(self) -> None:
        """The durable was deleted (idle past its ``inactive_threshold``): its bindings'
        fetches fail from now on."""
        self.deleted = True
        for p in self.pending.values():
            if p.timer is not None:
                p.timer.cancel()
        self.pending.clear()
        self.wake()

    def suspend(self) -> None:
        """Bus closing or stream deleted: cancel timers, wake parked fetches.

        Outstanding deliveries become due, as if their ack_wait had passed while the
        bus was down, so a reconnected bus redelivers them.
        """
        for seq, p in list(self.pending.items()):
            if p.timer is not None:
                p.timer.cancel()
                p.timer = None
            if not p.due:
                self._redeliver_or_drop(seq, p, wake=False)
        self.wake()

    def num_pending(self) -> int:
        msgs, match = self.stream.messages, self.matches
        return sum(
            1
            for seq in range(self.cursor + 1, self.stream.last_seq + 1)
            if (m := msgs.get(seq)) is not None and match(m.subject)
        )

    def info(self) -> dict:
        """What :meth:`rollart.bus.base.Bus.consumers_info` reports of this durable. The ack
        floor is the message before the oldest un-acked one (JetStream's own, with a filter
        that skips messages, may stand a little lower: at the last acked message)."""
        pending = self.pending
        return {
            "name": self.spec.durable,
            "filter_subject": self.spec.filter_subject,
            "num_pending": self.num_pending(),
            "num_ack_pending": len(pending),
            "num_redelivered": sum(1 for p in pending.values() if p.num_delivered > 1),
            "num_waiting": sum(1 for f in self.waiters if not f.done()),
            "delivered_stream_seq": self.last_delivered,
            "ack_floor_stream_seq": min(pending) - 1 if pending else self.last_delivered,
        }

    def check(self) -> None:
        if self.stream.deleted:
            raise BusError(f"stream {self.stream.spec.name!r} was deleted")
        if self.deleted:
            raise BusError(f"consumer {self.stream.spec.name}/{self.spec.durable} was deleted "
                           f"(idle past its inactive_threshold)")
        self.stream.bus.check_connected()


class MemoryDelivery(Delivery):
    __slots__ = ("subject", "data", "headers", "stream_seq", "num_delivered", "stored_at", "_state",
                 "_tok")

    def __init__(self, state: ConsumerState, msg: StoredMsg, num_delivered: int, tok: int):
        self.subject = msg.subject
        self.data = msg.data
        self.headers = dict(msg.headers)
        self.stream_seq = msg.seq
        self.num_delivered = num_delivered
        self.stored_at = msg.wall
        self._state = state
        self._tok = tok

    def __repr__(self) -> str:
        return (f"MemoryDelivery({self.subject!r}, seq={self.stream_seq}, "
                f"num_delivered={self.num_delivered})")

    async def ack(self) -> None:
        self._state.stream.bus.check_connected()
        self._state.ack(self.stream_seq)

    async def nak(self, delay: float | None = None) -> None:
        self._state.stream.bus.check_connected()
        self._state.nak(self.stream_seq, self._tok, delay)

    async def term(self) -> None:
        self._state.stream.bus.check_connected()
        self._state.term(self.stream_seq)

    async def in_progress(self) -> None:
        self._state.stream.bus.check_connected()
        self._state.in_progress(self.stream_seq, self._tok)


def _wake_one(fut) -> None:
    if not fut.done():
        fut.set_result(None)


class MemoryPullConsumer(PullConsumer):
    """One binding of a durable; every binding shares the same :class:`ConsumerState`."""

    def __init__(self, state: ConsumerState):
        self._state = state

    async def fetch(self, batch: int, timeout: float) -> list[Delivery]:
        batch = max(1, batch)  # as NatsBus does
        st = self._state
        st.check()
        out = st.take(batch)
        if out:
            return out
        loop = st.stream.bus.loop
        deadline = loop.time() + timeout
        while True:
            remaining = deadline - loop.time()
            if remaining <= 0:
                await asyncio.sleep(0)  # never a busy loop, even with timeout=0
                return []
            fut = loop.create_future()
            st.waiters.append(fut)
            timer = loop.call_later(remaining, _wake_one, fut)
            try:
                await fut
            finally:
                timer.cancel()
                if fut in st.waiters:
                    st.waiters.remove(fut)
            st.check()
            out = st.take(batch)
            if out:
                return out

    async def info(self) -> dict:
        st = self._state
        st.check()
        st.stream.expire()
        info = st.info()
        return {k: info[k] for k in ("num_pending", "num_ack_pending", "num_redelivered", "num_waiting")}

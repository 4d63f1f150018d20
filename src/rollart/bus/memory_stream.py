"""Streams and durable pull consumers of :class:`rollart.bus.memory.MemoryBus`.

The state machine mirrors JetStream's as measured (see ``NOTES.md``): per-stream
sequences from 1, ``msg_id`` dedupe, limits / work-queue retention, explicit acks,
``nak(delay)``, ``term``, ``in_progress``, ``ack_wait`` redelivery, ``max_deliver`` and
``max_ack_pending``. Timers are ``loop.call_later`` handles; waiting fetches park on
futures that a publish, an ack or a due redelivery resolves. Nothing here polls.
"""

from __future__ import annotations

import asyncio
import heapq
import itertools
import json
import logging
import time
from collections import deque
from collections.abc import Callable
from typing import TYPE_CHECKING

from rollart.bus.base import (
    BusError, ConsumerSpec, Delivery, PullConsumer, Retention, StreamSpec, consumer_changes,
)

if TYPE_CHECKING:
    from rollart.bus.memory import MemoryBus

log = logging.getLogger(__name__)

MAX_DELIVERIES_ADVISORY = "$JS.EVENT.ADVISORY.CONSUMER.MAX_DELIVERIES"


# -- subjects -------------------------------------------------------------------------
def _tokens_ok(subject: str, wildcards: bool) -> bool:
    if not subject or any(c.isspace() for c in subject):
        return False
    toks = subject.split(".")
    for i, t in enumerate(toks):
        if not t:
            return False
        if t in ("*", ">"):
            if not wildcards or (t == ">" and i != len(toks) - 1):
                return False
    return True


def check_subject(subject: str, *, wildcards: bool = False) -> None:
    """Raise :class:`BusError` unless ``subject`` is a valid NATS subject (or pattern)."""
    if not isinstance(subject, str) or not _tokens_ok(subject, wildcards):
        kind = "subject pattern" if wildcards else "subject"
        raise BusError(f"invalid {kind} {subject!r}")


def check_name(name: str, what: str) -> None:
    """Stream and durable names: no dots, wildcards, separators or whitespace."""
    if (
        not isinstance(name, str)
        or not name
        or any(c in ".*>/\\" or c.isspace() for c in name)
    ):
        raise BusError(f"invalid {what} name {name!r}")


def compile_matcher(pattern: str) -> Callable[[str], bool]:
    """A predicate for NATS matching: ``*`` is one token, ``>`` one or more trailing ones.

    The empty pattern matches everything (an unfiltered consumer).
    """
    if pattern in ("", ">"):
        return bool
    toks = pattern.split(".")
    if "*" not in toks and ">" not in toks:
        return pattern.__eq__
    if toks[-1] == ">" and "*" not in toks:
        prefix = pattern[:-1]  # keeps the trailing dot
        n = len(prefix)
        return lambda s: len(s) > n and s.startswith(prefix)
    last = len(toks) - 1

    def match(subject: str) -> bool:
        st = subject.split(".")
        for i, t in enumerate(toks):
            if t == ">":
                return len(st) > i
            if i >= len(st) or (t != "*" and t != st[i]):
                return False
        return len(st) == last + 1

    return match


def subjects_overlap(a: str, b: str) -> bool:
    """Whether some subject matches both patterns (``""`` stands for everything)."""
    ta, tb = (a or ">").split("."), (b or ">").split(".")
    for i in range(max(len(ta), len(tb))):
        x = ta[i] if i < len(ta) else None
        y = tb[i] if i < len(tb) else None
        if x is None or y is None:
            return False
        if x == ">" or y == ">":
            return True
        if x != "*" and y != "*" and x != y:
            return False
    return True


# -- stream ---------------------------------------------------------------------------
def _stored_size(subject: str, data: bytes, headers: dict[str, str]) -> int:
    """What a message counts against ``max_bytes``: subject, headers and data (JetStream
    adds a few dozen bytes of record overhead per message on top)."""
    return len(subject) + len(data) + sum(len(k) + len(v) for k, v in headers.items())


class StoredMsg:
    __slots__ = ("subject", "data", "headers", "seq", "time", "wall")

    def __init__(self, subject: str, data: bytes, headers: dict[str, str], seq: int, t: float):
        self.subject, self.data, self.headers, self.seq, self.time = subject, data, headers, seq, t
        self.wall = time.time()  # ``time`` is the loop's clock (for max_age); this, the wall's


class Stream:
    """One stream: its stored messages and its durable consumers."""

    def __init__(self, bus: MemoryBus, spec: StreamSpec):
        self.bus = bus
        self.messages: dict[int, StoredMsg] = {}
        self.last_seq = 0
        self.bytes = 0
        self._first = 1
        self._aging: deque[tuple[float, int]] = deque()  # (stored at, seq) when max_age > 0
        self._dedupe: dict[str, tuple[int, float]] = {}  # msg_id -> (seq, expires at)
        self._dedupe_q: deque[tuple[float, str]] = deque()
        self.consumers: dict[str, ConsumerState] = {}
        self.deleted = False
        self._idle_limits = False  # some durable has an inactive_threshold
        self.update(spec)

    def update(self, spec: StreamSpec) -> None:
        self.spec = spec
        self._matchers = [compile_matcher(s) for s in spec.subjects]
        if spec.max_age > 0 and not self._aging:  # max_age newly set: age what is stored
            self._aging.extend((m.time, seq) for seq, m in self.messages.items())
        self._trim()  # max_bytes newly set or lowered

    def _trim(self) -> None:
        """Discard the oldest messages while the stream holds more than ``max_bytes`` (as
        JetStream's discard-old policy does: a message larger than the limit goes too)."""
        limit = self.spec.max_bytes
        while limit > 0 and self.bytes > limit and self.messages:
            seq = next(iter(self.messages))  # stored in sequence order: the oldest
            self.remove(seq)
            for c in self.consumers.values():
                c.forget(seq)

    def owns(self, subject: str) -> bool:
        return any(m(subject) for m in self._matchers)

    def expire(self) -> None:
        """Forget dedupe ids past the window, messages past ``max_age`` and durables idle past
        their ``inactive_threshold``."""
        if self._idle_limits:
            self._reap_idle()
        if not (self._dedupe_q or self._aging):
            return
        now = self.bus.loop.time()
        dq = self._dedupe_q
        while dq and dq[0][0] <= now:
            _, msg_id = dq.popleft()
            hit = self._dedupe.get(msg_id)
            if hit is not None and hit[1] <= now:
                del self._dedupe[msg_id]
        aging, max_age = self._aging, self.spec.max_age
        if max_age <= 0:
            aging.clear()
        while aging and aging[0][0] + max_age <= now:
            _, seq = aging.popleft()
            if self.remove(seq):
                for c in self.consumers.values():
                    c.forget(seq)

    def _reap_idle(self) -> None:
        now = self.bus.loop.time()
        for name, c in list(self.consumers.items()):
            limit = c.spec.inactive_threshold
            if limit is not None and not c.waiters and now - c.last_active >= limit:
                del self.consumers[name]
                c.delete()
        self._idle_limits = any(c.spec.inactive_threshold is not None
                                for c in self.consumers.values())

    def store(self, subject: str, data: bytes, headers: dict[str, str], msg_id: str | None) -> int:
        self.expire()
        if msg_id is not None:
            hit = self._dedupe.get(msg_id)
            if hit is not None:
                return hit[0]
        now = self.bus.loop.time()
        self.last_seq = seq = self.last_seq + 1
        self.messages[seq] = StoredMsg(subject, data, headers, seq, now)
        self.bytes += _stored_size(subject, data, headers)
        if msg_id is not None:
            window = self.spec.duplicate_window
            until = now + (window if window > 0 else 120.0)  # NATS: 0 means the 2 min default
            self._dedupe[msg_id] = (seq, until)
            self._dedupe_q.append((until, msg_id))
        if self.spec.max_age > 0:
            self._aging.append((now, seq))
        if self.spec.max_bytes > 0:
            self._trim()
        for c in self.consumers.values():
            if c.matches(subject):
                c.on_new_message()
        return seq

    def remove(self, seq: int) -> bool:
        msg = self.messages.pop(seq, None)
        if msg is None:
            return False
        self.bytes -= _stored_size(msg.subject, msg.data, msg.headers)
        return True

    def info(self) -> dict:
        self.expire()
        while self._first <= self.last_seq and self._first not in self.messages:
            self._first += 1
        empty = not self.messages
        return {
            "name": self.spec.name,
            "subjects": list(self.spec.subjects),
            "retention": self.spec.retention.value,
            "messages": len(self.messages),
            "first_seq": (self.last_seq + 1 if self.last_seq else 0) if empty else self._first,
            "last_seq": self.last_seq,
            "bytes": self.bytes,
            "consumers": len(self.consumers),
        }

    def add_consumer(self, spec: ConsumerSpec) -> ConsumerState:
        check_name(spec.durable, "durable")
        if spec.filter_subject:
            check_subject(spec.filter_subject, wildcards=True)
            if not any(subjects_overlap(spec.filter_subject, s) for s in self.spec.subjects):
                raise BusError(
                    f"filter {spec.filter_subject!r} is outside stream {self.spec.name!r} subjects"
                )
        have = self.consumers.get(spec.durable)
        if have is not None:  # as in NATS: updatable settings change, fixed ones must match
            changes = consumer_changes(self.spec.name, have.spec, spec)
            if changes:
                log.info("consumer %s/%s: updating %s", self.spec.name, spec.durable,
                         ", ".join(f"{k} {old} -> {new}" for k, (old, new) in changes.items()))
                have.update(spec)
            return have
        if self.spec.retention is Retention.WORKQUEUE:
            if not spec.deliver_all:
                raise BusError("a work-queue stream's consumers must deliver all messages")
            for other in self.consumers.values():
                if subjects_overlap(other.spec.filter_subject, spec.filter_subject):
                    raise BusError(
                        f"work-queue stream {self.spec.name!r} already has consumer "
                        f"{other.spec.durable!r} overlapping filter {spec.filter_subject!r}"
                    )
        state = self.consumers[spec.durable] = ConsumerState(self, spec)
        self._idle_limits = self._idle_limits or spec.inactive_threshold is not None
        return state

    def close(self, *, delete: bool) -> None:
        """Bus closing (keep state, make outstanding deliveries due) or stream deleted."""
        self.deleted = self.deleted or delete
        for c in self.consumers.values():
            c.suspend()


# -- consumers ------------------------------------------------------------------------
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

    def __init__(self, stream: Stream, spec: ConsumerSpec):
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
        """New updatable settings (see :func:`consumer_changes`). As in NATS, a new
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

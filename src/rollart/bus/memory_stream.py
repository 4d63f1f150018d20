"""Streams of :class:`rollart.bus.memory.MemoryBus`: stored messages and their durables.

The stream side of JetStream as measured (see ``NOTES.md``): per-stream sequences from 1,
``msg_id`` dedupe within ``duplicate_window``, limits / work-queue retention, ``max_age``,
``max_bytes`` (discard old) and ``inactive_threshold`` on durables. The consumers' state
machine is :mod:`rollart.bus.memory_consumer`.
"""

from __future__ import annotations

import logging
from collections import deque

from rollart.bus.base import BusError, ConsumerSpec, Retention, StreamSpec, consumer_changes
from rollart.bus.memory_consumer import ConsumerState, Host, StoredMsg
from rollart.bus.subjects import check_name, check_subject, compile_matcher, subjects_overlap

log = logging.getLogger(__name__)


def _stored_size(subject: str, data: bytes, headers: dict[str, str]) -> int:
    """What a message counts against ``max_bytes``: subject, headers and data (JetStream
    adds a few dozen bytes of record overhead per message on top)."""
    return len(subject) + len(data) + sum(len(k) + len(v) for k, v in headers.items())


class Stream:
    """One stream: its stored messages and its durable consumers."""

    def __init__(self, bus: Host, spec: StreamSpec):
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


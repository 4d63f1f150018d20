"""Delivery machinery behind actor handlers: fetch loops, outcomes, dead letters (the
request/reply services are in :mod:`rollart.actors.kernel.service`)."""

from __future__ import annotations

import asyncio
import logging
import time

from rollart import messages as m
from rollart.actors.kernel import payloads
from rollart.actors.kernel.base import Actor, BoundHandler, Reject, Retry
from rollart.aio import backoff, retry
from rollart.bus import Bus, BusError, BusTimeout, ConsumerSpec, Delivery, NoResponders, PullConsumer
from rollart.bus.codec import DecodeError, decode, encode
from rollart.telemetry import otel_metrics

log = logging.getLogger(__name__)

BIND_PATIENCE_S = 120.0
"""Seconds binding a consumer retries a JetStream API that does not answer (a nats-server
cluster has no stream leader for a few seconds after one of its servers dies)."""


class Stats:
    """Counters per handler, read by heartbeats and the monitor."""

    def __init__(self) -> None:
        self.acked = self.naked = self.dead = self.errors = self.inflight = 0

    def as_dict(self, prefix: str) -> dict[str, float]:
        return {f"{prefix}.{k}": float(v) for k, v in vars(self).items()}


async def dead_letter(bus: Bus, actor: Actor, *, subject: str, payload: bytes, reason: str,
                      num_delivered: int = 1, stream_seq: int = 0,
                      headers: dict[str, str] | None = None, kind: str = "permanent") -> None:
    """Store a dead letter on ``rollart.<run>.dead``; deduplicated per original message.
    ``kind``: ``permanent`` (never retried) or ``exhausted`` (retried up to max_deliver)."""
    dl = m.DeadLetter(subject=subject, payload=payload, reason=reason,
                      num_delivered=num_delivered, stream_seq=stream_seq,
                      actor=actor.name, headers=dict(headers or {}), kind=kind)
    msg_id = f"dead:{subject}:{stream_seq}" if stream_seq else None
    await bus.publish(m.subject(actor.run, "dead"), encode(dl), msg_id=msg_id)
    otel_metrics.dead_letter(reason, kind)
    log.warning("dead letter from %s on %s seq=%s deliveries=%s: %s",
                actor.name, subject, stream_seq, num_delivered, reason)


class CoreJunk:
    """Junk on core subjects (``rollout.cancel``, ``node.heartbeat``, ``service.progress``):
    there is no stream message to terminate and dead-letter, so it is counted per subject
    and dropped, with at most one log line per subject every ``every`` seconds."""

    def __init__(self, every: float = 60.0) -> None:
        self.every = every
        self.counts: dict[str, int] = {}
        """Subject -> messages dropped so far."""
        self._logged: dict[str, tuple[float, int]] = {}

    def drop(self, subject: str, reason: str) -> None:
        n = self.counts[subject] = self.counts.get(subject, 0) + 1
        at, before = self._logged.get(subject, (float("-inf"), 0))
        now = time.monotonic()
        if now - at >= self.every:
            self._logged[subject] = (now, n)
            log.warning("dropped %d bad message(s) on %s (%d in all; at most one line per %.0fs);"
                        " last: %s", n - before, subject, n, self.every, reason[:300])


CORE_JUNK = CoreJunk()
"""The process's count of dropped core-subject junk."""


def decode_core(msg_type: type, req, junk: CoreJunk | None = None):
    """The decoded and validated message of a core delivery ``req`` (a subscription
    callback's argument), or None when it is junk: counted and dropped, never raised."""
    try:
        msg = decode(msg_type, req.data)
        m.validate(msg)
        return msg
    except DecodeError as e:
        why = f"malformed payload: {e}"
    except m.Invalid as e:
        why = f"invalid: {e}"
    (junk or CORE_JUNK).drop(req.subject, why)
    return None


class ConsumerLoop:
    """Fetch deliveries of one durable handler and run them, at most ``max_inflight`` at once."""

    def __init__(self, bus: Bus, actor: Actor, h: BoundHandler, stream: str):
        self.bus, self.actor, self.h, self.stream = bus, actor, h, stream
        self.stats = Stats()
        self.consumer: PullConsumer | None = None
        self._stopping = asyncio.Event()
        self._inflight: set[asyncio.Task] = set()

    async def bind(self) -> None:
        s = self.h.settings
        spec = ConsumerSpec(
            durable=s.durable or self.h.name,
            filter_subject=self.h.subject,
            ack_wait=s.ack_wait,
            # one delivery beyond max_deliver is reserved to dead-letter messages whose
            # handler never returned (the process died): see _handle
            max_deliver=s.max_deliver + 1 if s.max_deliver > 0 else -1,
            max_ack_pending=s.max_ack_pending or max(s.max_inflight * 4, 64),
            inactive_threshold=s.inactive_threshold,
            deliver_all=not s.deliver_new,
        )
        # transient: e.g. a cluster electing a leader
        self.consumer = await retry(
            lambda: self.bus.pull_consumer(self.stream, spec), retry_on=(BusTimeout, NoResponders),
            what=f"{self.actor.name}: binding {spec.durable}", deadline=BIND_PATIENCE_S,
            base=0.2, cap=2.0, logger=log)

    def stop(self) -> None:
        self._stopping.set()

    async def run(self, grace: float) -> None:
        """Fetch until stopped, then let in-flight handlers finish within ``grace`` seconds."""
        assert self.consumer is not None, "bind() first"
        s = self.h.settings
        failures = 0
        self._free = s.max_inflight
        self._room = asyncio.Event()
        async with asyncio.TaskGroup() as tg:
            while not self._stopping.is_set():
                if self._free <= 0:  # every slot busy: wait for a handler to finish
                    self._room.clear()
                    await _sleep_or_stop(self._room, 0.5)
                    continue
                try:
                    batch = await self.consumer.fetch(self._free, timeout=0.5)
                    failures = 0
                except BusError as e:
                    failures += 1
                    delay = backoff(failures, cap=5.0)
                    log.warning("%s fetch on %s failed (%s); retry in %.2fs",
                                self.actor.name, self.h.subject, e, delay)
                    await _sleep_or_stop(self._stopping, delay)
                    continue
                self._free -= len(batch)
                for d in batch:
                    t = tg.create_task(self._guarded(d))
                    self._inflight.add(t)
                    t.add_done_callback(self._inflight.discard)
            await self._finish_inflight(grace)

    async def _finish_inflight(self, grace: float) -> None:
        if not self._inflight:
            return
        _, pending = await asyncio.wait(set(self._inflight), timeout=grace)
        for t in pending:
            t.cancel()  # the handler's delivery is nak'ed by _handle

    async def _guarded(self, d: Delivery) -> None:
        self.stats.inflight += 1
        try:
            await self._handle(d)
        except BusError as e:  # the connection went away mid-outcome: redelivery covers it
            log.warning("%s lost the outcome of seq=%s: %s", self.actor.name, d.stream_seq, e)
        finally:
            self.stats.inflight -= 1
            self._free += 1
            self._room.set()

    async def _handle(self, d: Delivery) -> None:
        s, h = self.h.settings, self.h
        ctx = dict(actor=self.actor.name, subject=d.subject, seq=d.stream_seq,
                   delivered=d.num_delivered)
        if d.num_delivered > 1:
            otel_metrics.redelivery(s.durable or h.name, h.subject)
        if s.max_deliver > 0 and d.num_delivered > s.max_deliver:
            await self._dead(d, f"max_deliver ({s.max_deliver}) reached without an outcome",
                             kind="exhausted")
            return
        data, ref = d.data, None
        if payloads.reference(d.headers) is not None:  # the payload is in the object store
            got = await self._fetch_payload(d, ctx)
            if got is None:
                return
            data, ref = got
        try:
            msg = decode(h.msg_type, data)
            m.validate(msg)
            if ref is not None:
                payloads.check_matches(msg, ref)
        except DecodeError as e:
            await self._dead(d, f"malformed payload: {e}")
            return
        except m.Invalid as e:
            await self._dead(d, f"invalid: {e}")
            return
        except payloads.PayloadError as e:
            await self._dead(d, e.reason)
            return
        ctx["traj_id"] = getattr(msg, "traj_id", None)
        beat = self._beat(d)
        try:
            await h.fn(msg, d)
        except asyncio.CancelledError:  # not finished within the grace period
            if self.bus.connected:  # a lost bus cannot take the nak: ack_wait redelivers it
                await _quiet(d.nak())
                self.stats.naked += 1
            raise
        except Retry as r:
            log.info("retry %s in %s: %s", ctx, r.delay, r)
            await d.nak(r.delay)
            self.stats.naked += 1
        except Reject as r:
            await self._dead(d, r.reason)
        except Exception as e:  # noqa: BLE001 - any handler failure is retried then dead-lettered
            reason = f"{type(e).__name__}: {e}"
            await self._retry_or_dead(d, reason, "handler error %s: %s", ctx, reason,
                                      exc_info=log.isEnabledFor(logging.DEBUG))
        else:
            await d.ack()
            self.stats.acked += 1
            log.debug("acked %s", ctx)
        finally:
            beat.cancel()

    async def _fetch_payload(self, d: Delivery, ctx: dict):
        """``(payload, reference)`` of a message whose payload is in the object store
        (:mod:`rollart.actors.kernel.payloads`); None once the delivery has its outcome: dead-lettered
        (a reference that never resolves) or nak'ed (a bus error: redelivered later)."""
        beat = self._beat(d)
        try:
            return await payloads.fetch_payload(self.bus, self.actor.run, self.h.msg_type,
                                                d.headers, d.data)
        except payloads.PayloadError as e:
            await self._dead(d, e.reason)
        except BusError as e:
            reason = f"payload unreadable: {type(e).__name__}: {e}"
            await self._retry_or_dead(d, reason, "%s %s: retried", ctx, reason)
        finally:
            beat.cancel()
        return None

    def _beat(self, d: Delivery) -> "_Beat":
        """``in_progress`` signals for ``d`` while it is worked on (cancel it when done)."""
        s = self.h.settings
        return _Beat(d, s.heartbeat or max(0.05, s.ack_wait / 3))

    async def _retry_or_dead(self, d: Delivery, reason: str, *log_args, **log_kw) -> None:
        """A failure that may pass: nak ``d`` with backoff (logging ``log_args``), or dead-letter
        it as ``exhausted`` once it reached ``max_deliver``."""
        s = self.h.settings
        self.stats.errors += 1
        if s.max_deliver > 0 and d.num_delivered >= s.max_deliver:
            await self._dead(d, f"failed {d.num_delivered} times; last error {reason}",
                             kind="exhausted")
        else:
            log.warning(*log_args, **log_kw)
            await d.nak(backoff(d.num_delivered))
            self.stats.naked += 1

    async def _dead(self, d: Delivery, reason: str, kind: str = "permanent") -> None:
        await dead_letter(self.bus, self.actor, subject=d.subject, payload=d.data, reason=reason,
                          num_delivered=d.num_delivered, stream_seq=d.stream_seq,
                          headers=d.headers, kind=kind)
        await d.term()
        self.stats.dead += 1


class _Beat:
    """``in_progress`` for a delivery every ``every`` seconds while it is worked on, until
    :meth:`cancel`: a timer, and a task only while a signal is out (most handlers are done
    before the first; a task per delivery was 2 of the 3 tasks a delivery cost)."""

    def __init__(self, d: Delivery, every: float) -> None:
        self._d, self._every = d, every
        self._loop = asyncio.get_running_loop()
        self._task: asyncio.Task | None = None
        self._timer: asyncio.TimerHandle | None = self._loop.call_later(every, self._fire)

    def _fire(self) -> None:
        if self._task is None or self._task.done():  # one signal at a time
            self._task = self._loop.create_task(self._send())
        self._timer = self._loop.call_later(self._every, self._fire)

    async def _send(self) -> None:
        try:
            await self._d.in_progress()
        except BusError as e:
            log.debug("in_progress failed: %s", e)

    def cancel(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        if self._task is not None and not self._task.done():
            self._task.cancel()


async def _sleep_or_stop(stop: asyncio.Event, delay: float) -> None:
    try:
        await asyncio.wait_for(stop.wait(), delay)
    except TimeoutError:
        pass


async def _quiet(aw) -> None:
    try:
        await asyncio.shield(aw)
    except (BusError, asyncio.CancelledError):
        pass

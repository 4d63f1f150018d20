"""Delivery machinery behind actor handlers: fetch loops, outcomes, dead letters."""

from __future__ import annotations

import asyncio
import logging
import random
import time

from rollart import messages as m
from rollart.actors.base import ERROR_HEADER, Actor, BoundHandler, Reject, Retry
from rollart.bus import Bus, BusError, ConsumerSpec, Delivery, PullConsumer
from rollart.bus.codec import DecodeError, decode, encode

log = logging.getLogger(__name__)


def backoff(attempt: int, base: float = 0.2, cap: float = 10.0) -> float:
    """Jittered exponential backoff for attempt 1, 2, ..."""
    return min(cap, base * 2 ** max(0, attempt - 1)) * (0.5 + random.random() / 2)


class Stats:
    """Counters per handler, read by heartbeats and the monitor."""

    def __init__(self) -> None:
        self.acked = self.naked = self.dead = self.errors = self.inflight = 0

    def as_dict(self, prefix: str) -> dict[str, float]:
        return {f"{prefix}.{k}": float(v) for k, v in vars(self).items()}


async def dead_letter(bus: Bus, actor: Actor, *, subject: str, payload: bytes, reason: str,
                      num_delivered: int = 1, stream_seq: int = 0,
                      headers: dict[str, str] | None = None) -> None:
    """Store a dead letter on ``rollart.<run>.dead``; deduplicated per original message."""
    dl = m.DeadLetter(subject=subject, payload=payload, reason=reason,
                      num_delivered=num_delivered, stream_seq=stream_seq,
                      actor=actor.name, headers=dict(headers or {}))
    msg_id = f"dead:{subject}:{stream_seq}" if stream_seq else None
    await bus.publish(m.subject(actor.run, "dead"), encode(dl), msg_id=msg_id)
    log.warning("dead letter from %s on %s seq=%s deliveries=%s: %s",
                actor.name, subject, stream_seq, num_delivered, reason)


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
        )
        self.consumer = await self.bus.pull_consumer(self.stream, spec)

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
        if s.max_deliver > 0 and d.num_delivered > s.max_deliver:
            await self._dead(d, f"max_deliver ({s.max_deliver}) reached without an outcome")
            return
        try:
            msg = decode(h.msg_type, d.data)
        except DecodeError as e:
            await self._dead(d, f"malformed payload: {e}")
            return
        ctx["traj_id"] = getattr(msg, "traj_id", None)
        beat = asyncio.ensure_future(_heartbeat(d, s.heartbeat or max(0.05, s.ack_wait / 3)))
        try:
            await h.fn(msg, d)
        except asyncio.CancelledError:
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
            self.stats.errors += 1
            reason = f"{type(e).__name__}: {e}"
            if s.max_deliver > 0 and d.num_delivered >= s.max_deliver:
                await self._dead(d, f"failed {d.num_delivered} times; last error {reason}")
            else:
                log.warning("handler error %s: %s", ctx, reason, exc_info=log.isEnabledFor(logging.DEBUG))
                await d.nak(backoff(d.num_delivered))
                self.stats.naked += 1
        else:
            await d.ack()
            self.stats.acked += 1
            log.debug("acked %s", ctx)
        finally:
            beat.cancel()

    async def _dead(self, d: Delivery, reason: str) -> None:
        await dead_letter(self.bus, self.actor, subject=d.subject, payload=d.data, reason=reason,
                          num_delivered=d.num_delivered, stream_seq=d.stream_seq,
                          headers=d.headers)
        await d.term()
        self.stats.dead += 1


async def _heartbeat(d: Delivery, every: float) -> None:
    while True:
        await asyncio.sleep(every)
        try:
            await d.in_progress()
        except BusError as e:
            log.debug("in_progress failed: %s", e)


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


class Service:
    """A request/reply handler subscribed in a queue group."""

    def __init__(self, bus: Bus, actor: Actor, h: BoundHandler):
        self.bus, self.actor, self.h = bus, actor, h
        self.stats = Stats()
        self._slots = asyncio.Semaphore(h.settings.max_inflight)
        self._sub = None
        self._inflight: set[asyncio.Task] = set()

    async def bind(self) -> None:
        queue = self.h.settings.queue or f"{self.actor.role}-{self.h.name}"
        self._sub = await self.bus.subscribe(self.h.subject, self._on_request, queue=queue)

    async def stop(self, grace: float) -> None:
        if self._sub is not None:
            await self._sub.unsubscribe()
            self._sub = None
        if self._inflight:
            await asyncio.wait(set(self._inflight), timeout=grace)

    async def _on_request(self, req) -> None:
        task = asyncio.current_task()
        if task is not None:
            self._inflight.add(task)
        try:
            async with self._slots:
                self.stats.inflight += 1
                try:
                    await self._answer(req)
                finally:
                    self.stats.inflight -= 1
        finally:
            if task is not None:
                self._inflight.discard(task)

    async def _answer(self, req) -> None:
        t0 = time.perf_counter()
        try:
            msg = decode(self.h.msg_type, req.data)
        except DecodeError as e:
            await dead_letter(self.bus, self.actor, subject=req.subject, payload=req.data,
                              reason=f"malformed payload: {e}", headers=req.headers)
            self.stats.dead += 1
            await _respond_error(req, f"malformed payload: {e}")
            return
        try:
            reply = await self.h.fn(msg)
        except Exception as e:  # noqa: BLE001 - reported to the requester
            self.stats.errors += 1
            log.warning("%s failed on %s: %s", self.actor.name, req.subject, e)
            await _respond_error(req, f"{type(e).__name__}: {e}")
            return
        if req.reply:
            await req.respond(encode(reply))
        self.stats.acked += 1
        log.debug("%s answered in %.1f ms", self.h.subject, 1e3 * (time.perf_counter() - t0))


async def _respond_error(req, text: str) -> None:
    if req.reply:
        try:
            await req.respond(b"", headers={ERROR_HEADER: text[:2000]})
        except BusError as e:
            log.warning("could not send error reply: %s", e)

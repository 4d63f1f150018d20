"""Delivery machinery behind actor handlers: fetch loops, outcomes, dead letters."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time

import msgspec

from rollart import messages as m
from rollart.actors import payloads
from rollart.actors.base import ERROR_HEADER, Actor, BoundHandler, Reject, Retry
from rollart.aio import backoff, first_of, retry
from rollart.bus import Bus, BusError, BusTimeout, ConsumerSpec, Delivery, NoResponders, PullConsumer
from rollart.bus.codec import DecodeError, decode, encode
from rollart.telemetry import otel_metrics, tracing

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
        (:mod:`rollart.actors.payloads`); None once the delivery has its outcome: dead-lettered
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

    def _beat(self, d: Delivery) -> asyncio.Future:
        """``in_progress`` signals for ``d`` while it is worked on (cancel it when done)."""
        s = self.h.settings
        return asyncio.ensure_future(_heartbeat(d, s.heartbeat or max(0.05, s.ack_wait / 3)))

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


ERROR_KIND_HEADER = "Rollart-Error-Kind"
"""On an error reply: ``unavailable`` means "this replica cannot take it now, ask another"."""
REPLICA_HEADER = "Rollart-Replica"
"""On the replies of a service with a per-replica subject: the replica's id in its progress
reports (:class:`rollart.actors.service_client.ProgressReporter`), so that the requester
can send the next request of the same trajectory to it."""


class ServiceUnavailable(Exception):
    """Raise from a service handler when this replica cannot serve the request now (it is
    stopping): the requester sends it elsewhere at once instead of counting an error."""


_LOCAL: dict[tuple[int, str], list["Service"]] = {}
"""(id of the bus, queue-group subject) -> the bound services of this process on it."""


def local_services(bus: Bus | None, subject: str) -> list["Service"]:
    """The services bound in this process to ``subject`` on ``bus`` that are not stopping
    (what :class:`rollart.actors.service_client.ServiceClient` may call without the bus)."""
    return [s for s in _LOCAL.get((id(bus), subject), ()) if not s.draining]


class LocalAnswer(msgspec.Struct, frozen=True):
    """What :meth:`Service.call_local` returns: the encoded reply, or the error text the
    bus path would have put in its headers (``unavailable``: ask another replica)."""

    data: bytes = b""
    error: str | None = None
    unavailable: bool = False


class Service:
    """A request/reply handler subscribed in a queue group.

    With ``direct`` in its settings (and a progress reporter for its subject) it also
    answers the per-replica subject ``<direct>.<pool>.<token>`` with no queue group,
    announces the token in its progress reports and names itself in the
    ``Rollart-Replica`` header of its replies: a requester may then send the next turn of a
    trajectory to this replica (:class:`rollart.actors.service_client.ServiceClient`).

    Stopping (drain) answers every request that has not started yet (waiting for a slot)
    with an ``unavailable`` error, so its requester retries elsewhere at once; requests
    already running get ``grace`` seconds to finish.
    """

    def __init__(self, bus: Bus, actor: Actor, h: BoundHandler):
        self.bus, self.actor, self.h = bus, actor, h
        self.stats = Stats()
        self._slots = asyncio.Semaphore(h.settings.max_inflight)
        self._sub = None
        self._direct_sub = None
        self._reply_headers: dict[str, str] | None = None
        self._inflight: set[asyncio.Task] = set()
        self._draining = asyncio.Event()
        self._local_calls = 0
        self._local_idle = asyncio.Event()

    @property
    def draining(self) -> bool:
        return self._draining.is_set()

    @property
    def replica(self) -> str:
        """Its id in progress reports (empty: it sends none)."""
        rep = self.actor.progress
        return rep.replica if rep is not None and rep.service == self.h.settings.subject else ""

    async def bind(self) -> None:
        queue = self.h.settings.queue or f"{self.actor.role}-{self.h.name}"
        self._sub = await self.bus.subscribe(self.h.subject, self._on_request, queue=queue)
        _LOCAL.setdefault((id(self.bus), self.h.subject), []).append(self)
        rep, direct = self.actor.progress, self.h.settings.direct
        if direct and rep is not None and rep.service == self.h.settings.subject:
            pool = self.h.settings.pool or self.actor.pool
            self._direct_sub = await self.bus.subscribe(
                m.subject(self.actor.run, direct, pool, rep.token), self._on_request)
            rep.direct = rep.token  # announced from the next report on
            self._reply_headers = {REPLICA_HEADER: rep.replica}

    def _unregister(self) -> None:
        key = (id(self.bus), self.h.subject)
        peers = [s for s in _LOCAL.get(key, ()) if s is not self]
        if peers:
            _LOCAL[key] = peers
        else:
            _LOCAL.pop(key, None)

    async def stop(self, grace: float) -> None:
        self._draining.set()  # before unsubscribing, which may wait for running handlers
        self._unregister()
        end = time.monotonic() + grace
        if self._direct_sub is not None and self.actor.progress is not None:
            self.actor.progress.direct = ""  # no longer announced
        subs = [sub for sub in (self._direct_sub, self._sub) if sub is not None]
        self._sub = self._direct_sub = None
        if subs:
            try:  # a bus may wait here for running handlers: within the grace period only
                await asyncio.wait_for(asyncio.gather(*(sub.unsubscribe() for sub in subs)),
                                       max(0.1, grace))
            except TimeoutError:
                log.warning("%s: requests on %s still running after %.1fs of grace",
                            self.actor.name, self.h.subject, grace)
        if self._inflight and end > time.monotonic():
            await asyncio.wait(set(self._inflight), timeout=end - time.monotonic())
        if self._local_calls and end > time.monotonic():  # calls from this process: the same grace
            self._local_idle.clear()
            try:
                await asyncio.wait_for(self._local_idle.wait(), end - time.monotonic())
            except TimeoutError:
                pass

    async def _on_request(self, req) -> None:
        task = asyncio.current_task()
        if task is not None:
            self._inflight.add(task)
        try:
            try:
                msg = decode(self.h.msg_type, req.data)
                m.validate(msg)
            except (DecodeError, m.Invalid) as e:
                why = f"{'invalid' if isinstance(e, m.Invalid) else 'malformed payload'}: {e}"
                await _respond_error(req, why)  # first: the requester must not wait on the bus
                self.stats.dead += 1
                try:
                    await dead_letter(self.bus, self.actor, subject=req.subject, payload=req.data,
                                      reason=why, headers=req.headers)
                except BusError as err:
                    CORE_JUNK.drop(req.subject, f"{why} (dead letter not stored: {err})")
                return
            await self._serve(msg, req.headers, lambda ans: self._send(req, ans))
        finally:
            if task is not None:
                self._inflight.discard(task)

    async def _serve(self, msg, headers, answer) -> None:
        """One decoded request, from the bus or from this process: listed in the progress
        reports, a slot (``unavailable`` once stopping), the handler (in the requester's
        span), its reply or error handed to ``answer`` (an ``async fn(LocalAnswer)``) while
        the request is still listed and holds its slot."""
        with self._hold(msg):
            if not await self._acquire():
                self.stats.naked += 1
                await answer(LocalAnswer(error=f"{self.actor.name} is stopping", unavailable=True))
                return
            try:
                self.stats.inflight += 1
                ans = await self._answer(msg, headers)
                await answer(ans)
                if ans.error is None:
                    self.stats.acked += 1
            finally:
                self.stats.inflight -= 1
                self._slots.release()

    async def call_local(self, data: bytes) -> LocalAnswer:
        """A request from this process, without the bus: what :meth:`_on_request` does
        for one from the bus (:meth:`_serve`), with the request and the reply encoded and
        decoded as on the bus, so that neither side shares a mutable object with the other.
        A request that does not decode is the caller's bug: it raises."""
        msg = decode(self.h.msg_type, data)
        m.validate(msg)
        out: list[LocalAnswer] = []

        async def keep(ans: LocalAnswer) -> None:
            out.append(ans)

        self._local_calls += 1
        try:
            await self._serve(msg, None, keep)
        finally:
            self._local_calls -= 1
            if not self._local_calls:
                self._local_idle.set()
        return out[0]

    def _hold(self, msg):
        """List the request in the actor's progress reports from arrival (queued included)
        to reply: an actor whose ``progress`` reporter is for this subject (see
        :class:`rollart.actors.service_client.ProgressReporter`)."""
        rep = self.actor.progress
        rid = getattr(msg, "request_id", "")
        if rid and rep is not None and rep.service == self.h.settings.subject:
            return rep.hold(rid)
        return contextlib.nullcontext()

    async def _acquire(self) -> bool:
        """A slot, or False once the service is stopping (then no slot is held)."""
        if self._draining.is_set():
            return False
        if not self._slots.locked():
            await self._slots.acquire()
            return True
        slot = asyncio.ensure_future(self._slots.acquire())
        await first_of(slot, self._draining.wait())
        got = slot.done() and not slot.cancelled()
        if got and self._draining.is_set():
            self._slots.release()
            return False
        return got

    @staticmethod
    async def _respond_unavailable(req, text: str) -> None:
        if req.reply:
            try:
                await req.respond(b"", headers={ERROR_HEADER: text[:2000],
                                                ERROR_KIND_HEADER: "unavailable"})
            except BusError as e:
                log.warning("could not send error reply: %s", e)

    async def _answer(self, msg, headers) -> LocalAnswer:
        """The handler's reply to ``msg``, encoded, or the error to answer instead."""
        t0 = time.perf_counter()
        try:
            with tracing.attached(headers):  # the requester's span (tracing on) is the parent
                reply = await self.h.fn(msg)
        except ServiceUnavailable as e:
            self.stats.naked += 1
            log.info("%s passes on a request on %s: %s", self.actor.name, self.h.subject, e)
            return LocalAnswer(error=str(e) or f"{self.actor.name} is unavailable", unavailable=True)
        except Exception as e:  # noqa: BLE001 - reported to the requester
            self.stats.errors += 1
            log.warning("%s failed on %s: %s", self.actor.name, self.h.subject, e)
            return LocalAnswer(error=f"{type(e).__name__}: {e}")
        log.debug("%s answered in %.1f ms", self.h.subject, 1e3 * (time.perf_counter() - t0))
        return LocalAnswer(data=encode(reply))

    async def _send(self, req, ans: LocalAnswer) -> None:
        """``ans`` as the reply on the bus: the data, or the error in the headers."""
        if ans.unavailable:
            await self._respond_unavailable(req, ans.error or "")
        elif ans.error is not None:
            await _respond_error(req, ans.error)
        elif req.reply:
            await req.respond(ans.data, self._reply_headers)


async def _respond_error(req, text: str) -> None:
    if req.reply:
        try:
            await req.respond(b"", headers={ERROR_HEADER: text[:2000]})
        except BusError as e:
            log.warning("could not send error reply: %s", e)

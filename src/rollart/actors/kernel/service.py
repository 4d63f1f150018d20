"""Request/reply services behind actor handlers (:class:`Service`): a queue group per pool
and a per-replica subject, slots, progress listing, error and ``unavailable`` replies, and
calls from the same process that skip the bus (:meth:`Service.call_local`,
``rollout.local_calls``). The durable consumers are in :mod:`rollart.actors.kernel.runtime`."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time

import msgspec

from rollart import messages as m
from rollart.actors.kernel.base import ERROR_HEADER, Actor, BoundHandler
from rollart.actors.kernel.runtime import CORE_JUNK, Stats, dead_letter
from rollart.aio import first_of
from rollart.bus import Bus, BusError
from rollart.bus.codec import DecodeError, decode, encode
from rollart.telemetry import tracing

log = logging.getLogger(__name__)


ERROR_KIND_HEADER = "Rollart-Error-Kind"
"""On an error reply: ``unavailable`` means "this replica cannot take it now, ask another"."""
REPLICA_HEADER = "Rollart-Replica"
"""On the replies of a service with a per-replica subject: the replica's id in its progress
reports (:class:`rollart.actors.kernel.progress.ProgressReporter`), so that the requester
can send the next request of the same trajectory to it."""


class ServiceUnavailable(Exception):
    """Raise from a service handler when this replica cannot serve the request now (it is
    stopping): the requester sends it elsewhere at once instead of counting an error."""


_LOCAL: dict[tuple[int, str], list["Service"]] = {}
"""(id of the bus, queue-group subject) -> the bound services of this process on it."""


def local_services(bus: Bus | None, subject: str) -> list["Service"]:
    """The services bound in this process to ``subject`` on ``bus`` that are not stopping
    (what :class:`rollart.actors.kernel.service_client.ServiceClient` may call without the bus)."""
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
    trajectory to this replica (:class:`rollart.actors.kernel.service_client.ServiceClient`).

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
        :class:`rollart.actors.kernel.progress.ProgressReporter`)."""
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

"""Calling stateless services (generate, reward) so that a run never stalls on one.

Requester side, :class:`ServiceClient` (one per EnvManager):

- Nobody answers (no responders, a timeout, a lost connection, a replica that dies or
  stops): *transient*. The request is sent again, with jittered backoff capped at 2 s,
  until ``wait`` seconds have passed; then the trajectory fails with
  ``Reject("service_unavailable: ...")`` and is dead-lettered at once. A pool without
  replicas is waited for: its waiters wake as soon as a replica of the pool reports, and
  one rate-limited log line per pool (not one per retry) says what waits for what.
- A replica answers with an error: retried ``retries`` times, then
  ``Reject("service_error: ...")``. An error marked ``unavailable`` (the replica is
  stopping) is transient and is sent elsewhere at once. A reply that does not decode is
  ``Reject("decode: ...")`` at once.
- Every attempt carries a fresh ``request_id``. Replicas list the ids they hold on
  ``service.progress`` about once a second (:mod:`~rollart.actors.kernel.progress`); a
  request held by a replica that went silent for ``replica_timeout`` seconds, or claimed by
  no replica while the pool's replicas report, is sent again at once instead of waiting out
  its timeout.
- Affinity (``call(..., affinity=traj_id)``, generate only): the turns of one trajectory go
  to the replica that answered its last turn (named in the reply's ``Rollart-Replica``
  header), on that replica's own subject ``generate.direct.<pool>.<token>`` (its progress
  reports announce the token), so that its engine's per-trajectory KV cache is hit, while
  that replica is live and not saturated (:mod:`~rollart.actors.kernel.replica_pins` says
  which replica a key goes to). An attempt there that gets no answer or an error forgets the
  pin and goes to the pool's queue group at once, with the usual retries from there. No
  replica known (no reports yet, or ``replica_timeout`` 0): the queue group.
  :meth:`ServiceClient.forget` drops a trajectory's pin when it ends.

Replica side: :class:`rollart.actors.kernel.progress.ProgressReporter`.

Kept whole (~460 lines): the request's attempts, the replica table and the progress reports
are one state machine, read request by request; the pins' bookkeeping is
:mod:`rollart.actors.kernel.replica_pins` and the waits' log lines
:mod:`rollart.actors.kernel.outages`.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import msgspec

from rollart import messages as m
from rollart.actors.kernel.base import ERROR_HEADER, Actor, Reject
from rollart.actors.kernel.outages import Outages, service_of
from rollart.actors.kernel.replica_pins import AFFINITY_MAX, ReplicaPins
from rollart.actors.kernel.runtime import decode_core
from rollart.actors.kernel.service import ERROR_KIND_HEADER, REPLICA_HEADER, local_services
from rollart.aio import any_done, backoff, first_of
from rollart.bus import BusError, BusTimeout, NoResponders
from rollart.bus.codec import DecodeError, decode, encode
from rollart.telemetry import tracing

log = logging.getLogger(__name__)

FORGET_AFTER = 120.0
"""Seconds after which a silent replica is forgotten."""


def _retrieve(fut: asyncio.Future) -> None:
    if not fut.cancelled():
        fut.exception()


@dataclass(eq=False)
class _Pending:
    service: str
    pool: str
    sent: float
    lost: asyncio.Future
    claimed_by: str = ""


@dataclass(eq=False)
class _Replica:
    service: str
    pool: str
    last: float
    every: float
    silent: bool = False
    name: str = ""
    """Its id in progress reports (``<actor name>@<suffix>``)."""
    held: int = 0
    """Requests it held at its last report."""
    others: int = 0
    """Of those, the requests of other clients."""
    direct: str = ""
    """Its token on the service's per-replica subject; empty: none."""


class ServiceClient:
    """Request/reply to generate and reward pools that waits out missing replicas.

    Args:
        actor: the requesting actor (its bus, run, pool and name).
        timeout: seconds one attempt may take on a live replica.
        wait: seconds a request keeps trying while no replica answers.
        retries: error answers retried before the request fails.
        replica_timeout: seconds of silence after which a held request is sent again;
            0 turns progress tracking off.
        count: ``count(key)`` is called for each notable event (stats).
        local: a request whose pool has one replica, bound in this process on the same
            bus, and no other live replica in its progress reports, is a call of that
            replica's handler (:meth:`rollart.actors.kernel.service.Service.call_local`) instead of
            a round trip through the bus (``rollout.local_calls``). Unavailable, an error or
            no answer within ``timeout``: the bus path takes over, as for any attempt.
    """

    def __init__(self, actor: Actor, *, timeout: float = 60.0, wait: float = 300.0,
                 retries: int = 3, replica_timeout: float = 3.0,
                 count: Callable[[str], None] | None = None, local: bool = False) -> None:
        self.actor = actor
        self.local = local
        self.timeout, self.wait, self.retries = timeout, wait, retries
        self.replica_timeout = replica_timeout
        self._count = count or (lambda key: None)
        self._prefix = uuid.uuid4().hex[:8]
        self._ids = itertools.count(1)
        self._pending: dict[str, _Pending] = {}
        self._replicas: dict[tuple[str, str], _Replica] = {}
        self._outages = Outages(actor.name, wait, self._count)
        self._appeared: dict[tuple[str, str], asyncio.Event] = {}
        self._unclaimed_logged = 0.0
        self._sub: Any = None
        self._pins = ReplicaPins(AFFINITY_MAX, self._count)

    # -- lifecycle -----------------------------------------------------------------
    async def start(self) -> None:
        """Listen to replicas' progress reports (call once the actor has a bus)."""
        if self.replica_timeout > 0 and self._sub is None:
            assert self.actor.bus is not None
            self._sub = await self.actor.bus.subscribe(self.actor.subject("service.progress"),
                                                       self._on_progress)

    async def stop(self) -> None:
        if self._sub is not None:
            sub, self._sub = self._sub, None
            await sub.unsubscribe()

    async def run(self) -> None:
        """Watch held requests and report waits; run it in the actor's ``main``."""
        period = min(0.5, max(0.05, self.replica_timeout / 4)) if self.replica_timeout > 0 else 0.5
        last = time.monotonic()
        while True:
            await asyncio.sleep(period)
            now = time.monotonic()
            # after a stall of this event loop, reports may still sit unread: judge next time
            self.sweep(now, judge=now - last < period + 1.0)
            last = now

    def replicas(self) -> list[tuple[str, str]]:
        """(service, replica) of every replica that reported progress and is not forgotten."""
        return list(self._replicas)

    def waits(self) -> dict[tuple[str, str], tuple[int, float]]:
        """(service, pool) -> (requests waiting, seconds since the first began)."""
        return self._outages.waits(time.monotonic())

    # -- affinity --------------------------------------------------------------------
    def pinned(self, key: str, name: str = "generate.request") -> str | None:
        """The replica id ``key``'s next request of ``name`` goes to first, or None."""
        return self._pins.get(name, key)

    def pins(self) -> int:
        """Keys pinned to a replica now."""
        return len(self._pins)

    @property
    def affinity_max(self) -> int:
        """Keys whose replica this client remembers at most (default ``AFFINITY_MAX``)."""
        return self._pins.max_keys

    @affinity_max.setter
    def affinity_max(self, n: int) -> None:
        self._pins.max_keys = n

    def forget(self, key: str) -> None:
        """Drop the pin of ``key`` (its trajectory ended)."""
        for name in m.DIRECT_SUBJECTS:
            self._pins.unpin(name, key)

    def _target(self, name: str, pool: str, key: str) -> _Replica | None:
        """The replica to send ``key``'s request to on its own subject (the pinned one while
        it is live and not saturated, see :class:`ReplicaPins`); None when no live replica
        of the pool has its own subject."""
        now = time.monotonic()
        live = [r for r in self._replicas.values()
                if r.service == name and r.pool == pool and r.direct and not r.silent
                and now - r.last <= self._limit(r.every)]
        return self._pins.place(name, key, live)

    # -- requests ----------------------------------------------------------------------
    async def call(self, name: str, msg: Any, *, pool: str | None = None, what: str = "",
                   affinity: str | None = None) -> Any:
        """Send ``msg`` (a request with a ``request_id`` field) to service ``name``; return the
        decoded reply. Raises :class:`Reject` with a ``service_unavailable``,
        ``service_error`` or ``decode`` reason when it gives up.

        One attempt is active at a time. An attempt given up as lost keeps listening for its
        reply until its own timeout (a stalled replica may still answer); the first good
        reply of any attempt wins. ``affinity`` (a trajectory id; a service with a
        per-replica subject): the first attempt goes to the replica that answered this
        key's last request, within the pool (see the module's docstring).
        """
        pool = pool or self.actor.pool
        key = (name, pool)
        subject = self.actor.subject(name, pool)
        direct = m.DIRECT_SUBJECTS.get(name) if self._sub is not None else None
        if not affinity:
            direct = None
        target = self._target(name, pool, affinity) if direct else None
        lingering: dict[asyncio.Future, _Pending] = {}
        active: asyncio.Future | None = None
        started = 0.0
        errors = tries = 0
        ok = False
        delay = 0.0
        wake = True
        kw = {"headers": h} if (h := tracing.headers()) else {}  # the caller's span, if traced
        svc = self._local_replica(name, pool, subject) if self.local else None
        if svc is not None:
            ans = await self._call_local(svc, msg, name)
            if ans is not None and ans.error is None:
                return self._decode(name, ans, what)
            if ans is not None and not ans.unavailable:
                errors = self._error_answer(name, what, ans.error, errors)
                delay, wake = backoff(errors), False
        try:
            while True:
                if delay > 0:
                    await self._pause(key, delay, lingering, wake)
                    if (rep := self._harvest(lingering)) is not None:
                        out = self._reply(name, rep, what, affinity if direct else None)
                        ok = True
                        return out
                rid = f"{self._prefix}-{next(self._ids)}"
                p = _Pending(service=name, pool=pool, sent=time.monotonic(),
                             lost=asyncio.get_running_loop().create_future())
                self._pending[rid] = p
                assert self.actor.bus is not None
                to = subject if target is None else m.subject(self.actor.run, direct, pool,
                                                               target.direct)
                active = asyncio.ensure_future(self.actor.bus.request(
                    to, encode(msgspec.structs.replace(msg, request_id=rid)),
                    timeout=self.timeout, **kw))
                if target is not None:
                    self._pins.sent(name, target.name, active)
                while not (active.done() or p.lost.done()):
                    # the first to end wakes this loop, none of them is cancelled
                    await any_done(active, p.lost, *lingering)
                    if (rep := self._harvest(lingering)) is not None:
                        out = self._reply(name, rep, what, affinity if direct else None)
                        ok = True
                        return out
                del self._pending[rid]
                if not active.done():  # lost: keep listening, send again at once
                    self._count("requests_resent")
                    lingering[active] = p
                    active = None
                    why, at_once = p.lost.result(), True
                else:
                    fut, active = active, None
                    p.lost.cancel()
                    try:
                        rep = fut.result()
                    except NoResponders:
                        why, at_once = "no responders", False
                    except BusTimeout:
                        why, at_once = f"no reply within {self.timeout:g}s", True
                    except BusError as e:
                        why, at_once = f"{type(e).__name__}: {e}", False
                    else:
                        err = rep.headers.get(ERROR_HEADER)
                        if err is None:
                            out = self._reply(name, rep, what, affinity if direct else None)
                            ok = True
                            return out
                        if rep.headers.get(ERROR_KIND_HEADER) != "unavailable":
                            if target is not None:  # retried in the pool's queue group
                                self._pins.unpin(name, affinity)
                                target = None
                            errors = self._error_answer(name, what, err, errors)
                            delay, wake = backoff(errors), False
                            continue
                        why, at_once = f"replica unavailable ({err})", True
                if target is not None:  # its replica did not answer: the pool's queue group
                    log.debug("%s: %s replica %s did not answer%s (%s); asking pool %r",
                              self.actor.name, service_of(name), target.name, what, why, pool)
                    self._count("affinity_fallbacks")
                    self._pins.unpin(name, affinity)
                    target, delay = None, 0.0
                    continue
                now = time.monotonic()
                if not started:
                    started = now
                    self._outages.begin(key, now)
                self._outages.note(key, why)
                tries += 1
                left = started + self.wait - now
                if left <= 0:
                    raise Reject(f"service_unavailable: no {service_of(name)} replica in pool {pool!r} "
                                 f"answered{what} for {now - started:.0f}s (rollout.service_wait);"
                                 f" last: {why}")
                delay = 0.0 if at_once and tries == 1 else min(left, backoff(tries, base=0.1, cap=2.0))
                wake = True
        finally:
            for fut in [*lingering, *([active] if active is not None else [])]:
                if not fut.done():
                    fut.cancel()
                fut.add_done_callback(_retrieve)
            for p in lingering.values():
                p.lost.cancel()
            if started:
                self._outages.end(key, ok=ok)

    def _error_answer(self, name: str, what: str, err: str | None, errors: int) -> int:
        """One more error answer: the count of them, or ``Reject`` past ``retries``."""
        errors += 1
        self._count("service_errors")
        if errors > self.retries:
            raise Reject(f"service_error: {name}{what} failed {errors} times; last error: {err}")
        log.warning("%s: %s%s answered an error (%s); retry %d of %d",
                    self.actor.name, name, what, err, errors, self.retries)
        return errors

    def _local_replica(self, name: str, pool: str, subject: str) -> Any:
        """The one replica of ``subject`` bound in this process on this client's bus, when
        no other live replica of the pool reported progress (else the bus balances and
        pins); None otherwise."""
        svcs = local_services(self.actor.bus, subject)
        if len(svcs) != 1:
            return None
        svc = svcs[0]
        now = time.monotonic()
        for r in self._replicas.values():
            if (r.service == name and r.pool == pool and not r.silent and r.name != svc.replica
                    and now - r.last <= self._limit(r.every)):
                return None
        return svc

    async def _call_local(self, svc: Any, msg: Any, name: str) -> Any:
        """One attempt on the local replica: its answer, or None when it gave none within
        ``timeout`` (the bus path tries again)."""
        rid = f"{self._prefix}-{next(self._ids)}"
        data = encode(msgspec.structs.replace(msg, request_id=rid))
        self._count("local_calls")
        try:
            async with asyncio.timeout(self.timeout):
                return await svc.call_local(data)
        except TimeoutError:
            log.warning("%s: the local %s replica gave no answer within %gs; asking the bus",
                        self.actor.name, service_of(name), self.timeout)
            return None

    def _decode(self, name: str, rep: Any, what: str) -> Any:
        try:
            out = decode(m.REPLY_TYPES[name], rep.data)
            m.validate(out)
            return out
        except (DecodeError, m.Invalid) as e:
            raise Reject(f"decode: reply to {name}{what}: {e}") from e

    def _reply(self, name: str, rep: Any, what: str, affinity: str | None) -> Any:
        """The decoded good reply ``rep``; with ``affinity``, pins the key to the replica
        that answered."""
        out = self._decode(name, rep, what)
        replica = rep.headers.get(REPLICA_HEADER) if affinity else None
        if replica:
            self._pins.pin(name, affinity, replica)
        return out

    def _harvest(self, lingering: dict[asyncio.Future, _Pending]) -> Any:
        """The good reply of a lost attempt that answered after all, or None."""
        for fut in [f for f in lingering if f.done()]:
            del lingering[fut]
            if fut.cancelled() or fut.exception() is not None:
                continue
            rep = fut.result()
            if ERROR_HEADER not in rep.headers:
                return rep
        return None

    async def _pause(self, key: tuple[str, str], delay: float,
                     lingering: dict[asyncio.Future, _Pending], wake: bool) -> None:
        """Sleep ``delay`` seconds, or until a lost attempt answers, or (``wake``) until a
        replica of the pool reports."""
        waits = [asyncio.sleep(delay), any_done(*lingering)]  # lingering: kept running
        if wake:
            waits.append(self._appeared.setdefault(key, asyncio.Event()).wait())
        await first_of(*waits)

    # -- progress ------------------------------------------------------------------
    async def _on_progress(self, req) -> None:
        pr = decode_core(m.ServiceProgress, req)
        if pr is None:  # junk on a core subject: counted and dropped
            return
        now = time.monotonic()
        r = self._replicas.get((pr.service, pr.replica))
        if r is None:
            r = self._replicas[(pr.service, pr.replica)] = _Replica(
                service=pr.service, pool=pr.pool, last=now, every=pr.every, name=pr.replica)
        elif r.silent:
            log.info("%s: %s replica %s reports again", self.actor.name, service_of(pr.service),
                     pr.replica)
        r.last, r.every, r.pool, r.silent = now, pr.every, pr.pool, False
        mine, own = 0, f"{self._prefix}-"
        for rid in pr.request_ids:
            if rid.startswith(own):  # this client's (its request ids carry its prefix)
                mine += 1
                p = self._pending.get(rid)
                if p is not None:
                    p.claimed_by = pr.replica
        r.held, r.others, r.direct = len(pr.request_ids), len(pr.request_ids) - mine, pr.direct
        ev = self._appeared.pop((pr.service, pr.pool), None)
        if ev is not None:
            ev.set()

    def _limit(self, every: float) -> float:
        return max(self.replica_timeout, 2.0 * every)

    def sweep(self, now: float, judge: bool = True) -> None:
        """Send again requests held by silent replicas or claimed by none (``judge``); log
        waits."""
        if self.replica_timeout > 0 and judge:
            live: dict[tuple[str, str], float] = {}  # (service, pool) -> silence limit
            for r in self._replicas.values():
                if now - r.last <= self._limit(r.every):
                    k = (r.service, r.pool)
                    live[k] = max(live.get(k, 0.0), self._limit(r.every))
            silent: dict[tuple[str, str], int] = {}
            unclaimed = 0
            for p in self._pending.values():
                if p.lost.done():
                    continue
                if p.claimed_by:
                    r = self._replicas.get((p.service, p.claimed_by))
                    if r is not None and now - r.last > self._limit(r.every):
                        p.lost.set_result(f"replica {p.claimed_by} went silent")
                        silent[(p.service, p.claimed_by)] = silent.get((p.service, p.claimed_by), 0) + 1
                elif (p.service, p.pool) in live and now - p.sent > live[(p.service, p.pool)]:
                    p.lost.set_result(f"no replica claimed it within {now - p.sent:.1f}s")
                    unclaimed += 1
            for (service, name), n in silent.items():
                r = self._replicas[(service, name)]
                self._count("replicas_lost")
                if not r.silent:
                    r.silent = True
                    log.warning("%s: %s replica %s (pool %r) silent for %.1fs: sending the %d "
                                "request(s) it held elsewhere", self.actor.name, service_of(service),
                                name, r.pool, now - r.last, n)
            if unclaimed and now - self._unclaimed_logged > 10.0:
                self._unclaimed_logged = now
                log.warning("%s: %d request(s) claimed by no live replica; sending them again",
                            self.actor.name, unclaimed)
            for k in [k for k, r in self._replicas.items() if now - r.last > FORGET_AFTER]:
                del self._replicas[k]
        self._outages.announce(now)

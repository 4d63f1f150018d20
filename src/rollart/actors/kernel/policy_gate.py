"""Which announced policy versions a holder accepts: the gate a generation replica, the
scheduler and an EnvManager put between the KV ``policy.version`` record and their own
version (defence in depth, DESIGN.md §6). Reading the record and the weights is
:mod:`rollart.actors.kernel.policy`."""

from __future__ import annotations

import asyncio
import logging
import time

from rollart import messages as m
from rollart.actors.kernel.records import decode_entry, watch_revisions
from rollart.aio import retry
from rollart.bus import BusError
from rollart.bus.codec import decode, encode
from rollart.telemetry import otel_metrics

log = logging.getLogger(__name__)

# -- which announced versions a holder accepts -----------------------------------------


class PolicyGate:
    """Which KV ``policy.version`` records a holder of a policy version (a generation
    replica, the scheduler, an EnvManager) accepts: defence in depth against forged records
    on a bus without permission checks (DESIGN.md §6). The digest check of the weights
    (:func:`fetch_weights`) is separate: it proves the bytes are the announced ones, this
    proves the announcement is plausibly the trainer's.

    The rule. Let ``L`` and ``S`` be the ``version`` and ``steps_total`` of the latest trainer
    ledger summary (KV ``trainer.ledger``: the trainer writes it right after it announces a
    version, so it is a second, independent record of how far training got), and ``h`` the
    highest version this holder accepted (``None``: a fresh holder that found a record
    already there when it started; ``0``: one that watched the run from before its first
    announcement). The latest record ``p`` (version ``v'``, digest ``d``, ``uri``) is

    1. **refused** when ``0 < S < v'``: beyond any version of the run;
    2. **waiting** while ``v' > L``: the trainer's own ledger does not report that version
       yet (re-judged when a summary or record arrives; reported once it waited
       ``report_s``). A forged record with no forged summary never gets past this;
    3. **accepted** at once when ``h`` is None (a fresh holder joining mid-run has nothing
       else to go by than 1 and 2), or when all of
       a. ``v' <= h + max_jump`` (the trainer announces versions one by one and a KV watch
          sees every put in order, so a correct holder sees each next version: ``max_jump``
          = 1);
       b. with ``digests`` (generation replicas): ``d`` is the digest of the weights this
          holder loaded for ``v'``, if it loaded any (:meth:`loaded`: no silent replacement
          of the weights of a version; a record whose weights were refused may be corrected);
       c. with announcements followed (``follow_policy(announcements=True)``, as every
          holder does: a core subscription to ``policy.published``, which the role
          permissions of :mod:`rollart.security.permissions` grant generate, env and
          scheduler; a holder that has seen no announcement at all, e.g. one whose
          credential lacks it, skips the rule): a ``policy.published`` message with
          ``(v', d, uri)`` was seen (the trainer publishes it before the KV record; a record seen
          first is judged again when its announcement arrives, and one whose announcement was
          missed, say in a reconnect, settles in ``settle_s``);
    4. otherwise **settling**: accepted only once the latest records have stayed
       doubtful-but-confirmed (2 holds, versions non-decreasing) for ``settle_s``. A real
       jump (a holder whose connection was down while the trainer stepped) settles; a
       forged one does not, because the trainer puts its own record back as soon as it sees
       another (:class:`rollart.actors.trainer.publish.KvGuard`), which resets the clock.

    Rules 2 and 3c need a trainer ledger (3c also an announcement seen at all): a run that
    has none (no trainer: tests, fixed-policy rollouts) is judged by 1 (vacuous), 3a-b and 4
    only. Every refused, waiting or settling record is reported (a log line and a dead
    letter, see :func:`follow_policy`).

    What it cannot stop: a forger who writes the record and the ledger summary consistently
    (and the ``policy.published`` message, with 3c on) for exactly ``h + 1`` is accepted at
    once (the trainer puts both records back within milliseconds, and its next version
    replaces the forged one: after ``settle_s``, as it replaces a digest, or at once as
    ``h + 2``); a fresh holder takes any record that agrees with the summary.
    """

    def __init__(self, *, digests: bool = False, max_jump: int = 1, settle_s: float = 10.0,
                 report_s: float = 10.0):
        self.digests = digests
        self.max_jump = max_jump
        self.settle_s = settle_s
        self.report_s = report_s
        self.held: int | None = None
        self.digest_of: dict[int, str] = {}
        """Version -> digest of the weights loaded (recent versions; :meth:`loaded`)."""
        self.ledger: m.LedgerSummary | None = None
        self.announced: dict[tuple[int, str, str], None] = {}
        """``(version, digest, uri)`` of the ``policy.published`` messages seen (the newest):
        a record is the trainer's only with the URI the trainer published for it (another
        URI with the same digest would send holders to a forger's weight server)."""
        self._doubt: tuple[float, int] | None = None
        """``(since, version)`` of the latest run of doubtful records (rule 4)."""
        self.reports: dict[str, int] = {}
        """Records reported (not accepted, or not yet) by verdict: ``refuse``, ``wait``,
        ``settle`` (:func:`follow_policy`)."""

    def watched_from_start(self) -> None:
        """No record existed when this holder started watching: it has seen every one."""
        if self.held is None:
            self.held = 0

    def see_ledger(self, summary: m.LedgerSummary) -> None:
        self.ledger = summary

    def see_announcement(self, pub: m.PolicyPublished) -> None:
        self.announced[(pub.version, pub.digest, pub.uri)] = None
        while len(self.announced) > 256:
            del self.announced[next(iter(self.announced))]

    def refusal(self, pub: m.PolicyPublished) -> str | None:
        """Why ``pub`` is refused whatever comes after it (rule 1), or None."""
        s = self.ledger
        if s is not None and 0 < s.steps_total < pub.version:
            return (f"policy v{pub.version} is beyond any version of this run (the trainer's "
                    f"ledger: trainer.steps = {s.steps_total})")
        return None

    def judge(self, pub: m.PolicyPublished, now: float) -> tuple[str, str, float | None]:
        """``(verdict, why, judge again at)``: ``accept``, ``settle``, ``wait`` or ``refuse``."""
        v, s = pub.version, self.ledger
        why = self.refusal(pub)
        if why:
            return "refuse", why, None
        if s is not None and v > s.version:
            return "wait", f"the trainer's ledger reports v{s.version}, not v{v}", None
        doubts = []
        if self.held is not None:
            if v > self.held + self.max_jump:
                doubts.append(f"a jump from v{self.held} (at most +{self.max_jump} at once)")
            if self.digests and self.digest_of.get(v, pub.digest) != pub.digest:
                doubts.append(f"it replaces the loaded weights of v{v} ({self.digest_of[v]})")
            if s is not None and self.announced and (v, pub.digest, pub.uri) not in self.announced:
                doubts.append("no policy.published announcement of it (version, digest and "
                              "uri) was seen")
        if not doubts:
            self._doubt = None
            return "accept", "", None
        if self._doubt is None or v < self._doubt[1]:
            self._doubt = (now, v)
        else:
            self._doubt = (self._doubt[0], v)
        due = self._doubt[0] + self.settle_s
        if now >= due:
            return "accept", f"settled after {self.settle_s:.0f}s: " + "; ".join(doubts), None
        return "settle", "; ".join(doubts) + f" (accepted if it stays {self.settle_s:.0f}s)", due

    def accept(self, pub: m.PolicyPublished) -> None:
        self._doubt = None
        self.held = pub.version if self.held is None else max(self.held, pub.version)

    def reported(self, verdict: str) -> None:
        """Count a record reported with ``verdict`` (:attr:`reports`)."""
        self.reports[verdict] = self.reports.get(verdict, 0) + 1

    def loaded(self, pub: m.PolicyPublished) -> None:
        """The holder loaded the weights of ``pub`` (rule 3b)."""
        self.digest_of[pub.version] = pub.digest
        while len(self.digest_of) > 64:
            del self.digest_of[min(self.digest_of)]


async def follow_policy(actor, gate: PolicyGate, on_accept, *, announcements: bool = False) -> None:
    """Follow KV ``policy.version`` through ``gate`` for ``actor``: ``await on_accept(pub)``
    for each new record (KV revision) the gate accepts; report the others once each (a log
    line and a dead letter, :func:`report_policy`). With ``announcements``, also subscribe
    to ``policy.published`` (rule 3c; the role needs subscribe permission on it). Runs until
    cancelled."""
    bus, run = actor.bus, actor.run
    changed = asyncio.Event()
    latest: list = []  # [(revision, record, first seen)]
    accepted: set[int] = set()  # revisions accepted
    reported: set[int] = set()  # revisions reported (they may still be accepted later)

    async def on_announcement(req) -> None:
        try:
            pub = decode(m.PolicyPublished, req.data)
            m.validate(pub)
        except (ValueError, m.Invalid):  # DecodeError is a ValueError
            return
        gate.see_announcement(pub)
        changed.set()

    sub = None
    if announcements:
        sub = await bus.subscribe(m.subject(run, "policy.published"), on_announcement)
    try:
        kv = await bus.key_value(m.kv_bucket(run))
        summary = decode_entry(await _get_patiently(kv, m.LEDGER_KEY, actor.name), m.LedgerSummary)
        if summary is not None:
            gate.see_ledger(summary)
        if decode_entry(await _get_patiently(kv, m.POLICY_KEY, actor.name), m.PolicyPublished) is None:
            gate.watched_from_start()

        async def records() -> None:
            async for rev, pub in watch_revisions(bus, run, m.POLICY_KEY, m.PolicyPublished,
                                                  what="policy record", validate=True):
                latest[:] = [(rev, pub, time.monotonic())]
                changed.set()
                why = gate.refusal(pub)  # reported even if the next record supersedes it
                if why and rev not in reported:
                    reported.add(rev)
                    gate.reported("refuse")
                    await report_policy(actor, pub, "refuse", why)

        async def summaries() -> None:
            async for _, s in watch_revisions(bus, run, m.LEDGER_KEY, m.LedgerSummary,
                                              what="ledger summary"):
                gate.see_ledger(s)
                changed.set()

        async def judge() -> None:
            while True:
                changed.clear()
                due = None
                if latest and latest[0][0] not in accepted:
                    rev, pub, seen = latest[0]
                    now = time.monotonic()
                    verdict, why, due = gate.judge(pub, now)
                    if verdict == "accept":
                        accepted.add(rev)
                        gate.accept(pub)
                        if why:
                            log.warning("%s accepts policy v%d: %s", actor.name, pub.version, why)
                        await on_accept(pub)
                    elif verdict == "wait" and now < seen + gate.report_s:
                        due = seen + gate.report_s
                    elif rev not in reported:
                        reported.add(rev)
                        gate.reported(verdict)
                        await report_policy(actor, pub, verdict, why)
                    for done in (accepted, reported):
                        while len(done) > 1024:
                            done.discard(min(done))
                timeout = None if due is None else max(0.0, due - time.monotonic())
                try:
                    await asyncio.wait_for(changed.wait(), timeout)
                except TimeoutError:
                    pass

        async with asyncio.TaskGroup() as tg:
            tg.create_task(records())
            tg.create_task(summaries())
            tg.create_task(judge())
    finally:
        if sub is not None:
            await sub.unsubscribe()


async def _get_patiently(kv, key: str, who: str, deadline: float = 120.0):
    """``kv.get(key)``, retrying bus errors with backoff for up to ``deadline`` seconds: a
    bucket just made on a nats-server cluster answers "no responders" until its stream has a
    leader, which must not stop the node."""
    return await retry(lambda: kv.get(key), retry_on=BusError, what=f"{who}: reading KV {key}",
                       deadline=deadline, base=0.1, cap=2.0, logger=log)


async def report_policy(actor, pub: m.PolicyPublished, verdict: str, why: str) -> None:
    """A policy record the gate did not accept: a log line and a dead letter on the run's
    ``dead`` subject (reason ``not_admitted: ...``; one per record and role). Never raises."""
    reason = f"not_admitted: policy v{pub.version} ({pub.digest[:40]}) {verdict}: {why}"
    (log.error if verdict == "refuse" else log.warning)(
        "%s: KV policy record %s%s", actor.name, reason,
        "" if verdict == "refuse" else " (kept the current policy meanwhile)")
    dl = m.DeadLetter(subject=m.subject(actor.run, "policy.published"), payload=encode(pub),
                      reason=reason, actor=actor.name, kind="permanent")
    tag = f"{pub.version}:{pub.digest.rsplit(':', 1)[-1][:16]}:{verdict}:{actor.role}"
    try:
        await actor.publish("dead", dl, msg_id=f"dead:policy:{actor.run}:{tag}")
        otel_metrics.dead_letter(reason)
    except (BusError, TimeoutError) as e:
        log.warning("%s: dead letter for policy v%d not stored: %s", actor.name, pub.version, e)

"""The group ledger: the one owner of every training group's life.

What a group is, its states and who may move it from which to which:
:mod:`rollart.actors.groups.group`. The trainer owns the ledger, closes its groups and
persists it with its checkpoint; admission reads its summary (``lost``, ``version``) from
KV (:data:`rollart.messages.LEDGER_KEY`). The scheduler keeps, of the same groups, only
what the ledger cannot know (the ids it issued, moved copies included, and where it sent
them), and the ledger takes only groups the scheduler issued (KV
:func:`rollart.actors.groups.admission.issued_key`).

**The α guarantee** (DESIGN.md §4), stated once. Let ``B = batch_groups``. Admission lets a
group in at policy version ``a`` only while ``live + 1 <= (a + α + 1) * B``, where
``live = admitted - lost`` counts the groups that were admitted and are not failed or
dropped (:func:`admissible`). Under ``stale: wait`` the group's turns use versions
``>= a`` and the trainer takes live groups strictly in admission order, ``B`` per step, so
the group with live ordinal ``n`` (1-based) is trained by the step that starts from
version ``s = ceil(n / B) - 1 <= a + α``, i.e. ``a >= s - α``: never stale. A group lost
*after* another was admitted only moves that one earlier (smaller ``n``), so losses never
break the bound; they free headroom, and admission fills it with a fresh group (a new
task seed), which is how a lost group is replaced. Under ``drop``/``restart`` the trainer
checks ``min_version >= s - α`` per group instead and drops the rest (counted, and freed).
A group skipped for uniform rewards (``trainer.skip_uniform``) is lost the same way.

**What the trainer takes** (defence in depth, DESIGN.md §6, even under ``rollart secure``
permissions). Only a trajectory that admission issued: :class:`rollart.actors.groups.admission.Admission` says why
another is ``not_admitted`` (dead-lettered, never trained, never holding a member's place).
Two *different* completions of one trajectory id are a conflict (:meth:`GroupLedger.add_completed`):
neither is trained and both are dead-lettered, so a forged copy that arrives first cannot
silently push the real one out as a "duplicate".

Kept whole (~460 lines, a fifth of them this statement of its guarantees): selection,
closing and the summary read and change one table of groups under one set of rules.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import Counter, OrderedDict
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

from rollart import messages as m
from rollart.actors.groups.admission import CONFLICTS_REMEMBERED, fingerprint
from rollart.actors.groups.group import LOST, Group, GroupState
from rollart.actors.kernel.records import put_record, watch_record
from rollart.bus import BusError
from rollart.telemetry.otel_metrics import reason_kind

__all__ = ["GroupLedger", "HeldGroup", "IndexSet", "Selection", "admissible", "put_summary",
           "reason_kind", "watch_summary"]

log = logging.getLogger(__name__)


def admissible(admitted: int, lost: int, version: int, alpha: int | None,
               batch_groups: int) -> bool:
    """May one more group be admitted at ``version``? (the bound above, in groups)"""
    if alpha is None:
        return True
    return (admitted - lost) + 1 <= (version + alpha + 1) * batch_groups


def uniform(members: list[m.RolloutCompleted], which: str = "all") -> bool:
    """Every reward of ``members`` is the same (all advantages 0); with ``which="failed"``,
    and no member succeeded (``trainer.skip_uniform`` / ``skip_which``)."""
    rewards = [t.reward for t in members]
    if max(rewards) - min(rewards) > 1e-9:
        return False
    return which == "all" or not any(t.success for t in members)


class IndexSet:
    """A set of non-negative ints kept small: everything below ``low`` plus ``above``."""

    def __init__(self, low: int = 0, above: set[int] | None = None):
        self.low = low
        self.above = set(above or ())

    def add(self, i: int) -> None:
        if i < self.low:
            return
        self.above.add(i)
        while self.low in self.above:
            self.above.remove(self.low)
            self.low += 1

    def __contains__(self, i: int) -> bool:
        return i < self.low or i in self.above

    def __len__(self) -> int:
        return self.low + len(self.above)

    def state(self) -> dict:
        return {"low": self.low, "above": sorted(self.above)}

    @classmethod
    def from_state(cls, s: dict) -> "IndexSet":
        return cls(s.get("low", 0), set(s.get("above", ())))


@dataclass(eq=False, kw_only=True)
class HeldGroup(Group):
    """An open group of the ledger: the outcomes received so far, each holding its
    delivery's future (resolved, i.e. acked, once a checkpoint covers the group's fate)."""

    members: list[tuple[m.RolloutCompleted, asyncio.Future]] = field(default_factory=list)
    """The completions held, in arrival order (the first ``need`` are trained)."""
    dead: list[tuple[str, str]] = field(default_factory=list)
    """``(traj_id, reason)`` of dead-lettered members."""
    cancelled: list[str] = field(default_factory=list)
    held: list[asyncio.Future] = field(default_factory=list)
    """Futures of the dead-letter and cancel deliveries."""

    def completed_ids(self) -> list[str]:
        return [t.traj_id for t, _ in self.members]

    def dead_ids(self) -> list[str]:
        return [t for t, _ in self.dead]

    def cancelled_ids(self) -> list[str]:
        return self.cancelled

    @property
    def min_version(self) -> int:
        return min(t.min_version for t, _ in self.members)

    def futures(self) -> list[asyncio.Future]:
        return [f for _, f in self.members] + self.held


@dataclass
class Selection:
    batch: list[HeldGroup]
    stale: list[HeldGroup]
    failed: list[HeldGroup]
    skipped: list[HeldGroup] = field(default_factory=list)
    """Ready groups whose rewards are all equal, skipped (``trainer.skip_uniform``)."""


class GroupLedger:
    """Per-group state of a training run; see the module docstring for the rules."""

    def __init__(self, *, group_size: int, redundancy: int, batch_groups: int, alpha: int,
                 stale: str, breaker: int):
        self.need = group_size
        self.size = group_size + redundancy
        self.batch_groups = batch_groups
        self.alpha = alpha
        self.stale = stale
        self.breaker = breaker
        """Failed groups in a row that stop the run (0: never)."""
        self.open: dict[int, HeldGroup] = {}
        self.closed = IndexSet()
        self.next_index = 0
        self.lost = 0
        self.trained = 0
        self.streak = 0
        self.streak_reasons: Counter[str] = Counter()
        self.failure_kinds: Counter[str] = Counter()
        """Dead letters by reason kind, over the run."""
        self.counts = dict.fromkeys(("groups_failed", "stale_dropped", "stale_restarted",
                                     "uniform_skipped", "extra", "late", "duplicates",
                                     "conflicts", "reruns", "not_admitted"), 0)
        self.verdicts: dict[asyncio.Future, str] = {}
        """Held deliveries to dead-letter (not ack) once a checkpoint covers their group:
        both copies of a conflict. The handler pops its future's verdict when it resolves."""
        self.restarted: dict[int, tuple[str, int]] = {}
        """Group index -> ``(group id, seed)`` of the groups the trainer re-admitted."""
        self.trained_fp: OrderedDict[str, tuple[bytes, int]] = OrderedDict()
        """Fingerprint and attempt of the latest trained trajectories (a later different copy
        is a conflict to report, or a rerun when its attempt is later)."""

    # -- outcomes ----------------------------------------------------------------
    def _group(self, index: int) -> HeldGroup | None:
        """The open group ``index`` (opened on first sight), None when it is closed."""
        if index in self.closed or (self.stale == "wait" and index < self.next_index):
            return None
        g = self.open.get(index)
        if g is None:
            g = self.open[index] = HeldGroup(index=index, need=self.need, size=self.size)
        return g

    def add_completed(self, msg: m.RolloutCompleted, fut: asyncio.Future) -> str | None:
        """Record a completion; returns None if held, else why it is not (a count key:
        ``late``, ``duplicates``, ``extra``, ``reruns`` (a later attempt's different copy of
        a held one), or ``conflicts``, a copy that differs from one
        already trained or from the outcome already recorded for its trajectory).

        A completion whose trajectory already has a *different* completion held in its
        group is a conflict: the held one leaves the members, the trajectory's place counts
        as a dead outcome (``conflict: ...``), and both deliveries are held and then
        dead-lettered (their :attr:`verdicts`), so a restart sees the same conflict again.
        The ledger cannot tell which copy is real; it can only refuse to train on either
        and to let the first one silently win."""
        g = self._group(msg.group_index)
        key = None
        if g is None:
            fp, attempt = self.trained_fp.get(msg.traj_id, (None, 0))
            key = ("late" if fp is None or fp == fingerprint(msg)
                   else "reruns" if msg.attempt > attempt else "conflicts")
        else:
            same = next(((t, f) for t, f in g.members if t.traj_id == msg.traj_id), None)
            conflicted = next((r for t, r in g.dead
                               if t == msg.traj_id and r.startswith("conflict:")), None)
            if same is not None and same[0] != msg and msg.attempt > same[0].attempt:
                # A later delivery's run of a trajectory whose first copy is held: its env
                # node was killed between publishing that copy and acking the request. The
                # held copy stands; this one is acked (a forger gains nothing by claiming a
                # later attempt, and a claimed earlier one is a conflict below).
                key = "reruns"
            elif same is not None and same[0] != msg:
                reason = (f"conflict: two different completions of trajectory {msg.traj_id} "
                          f"(group {g.index}); neither is trained")
                g.members.remove(same)
                g.dead.append((msg.traj_id, reason))
                for f in (same[1], fut):
                    g.held.append(f)
                    self.verdicts[f] = reason
                self.counts["conflicts"] += 2
                return None
            elif conflicted is not None:  # a third copy: dead-lettered with the others
                g.held.append(fut)
                self.verdicts[fut] = conflicted
                self.counts["conflicts"] += 1
                return None
            elif same is not None:
                key = "duplicates"
            elif g.seen(msg.traj_id):
                key = "conflicts"  # completed after it was reported dead or cancelled
            elif len(g.members) >= self.need:
                key = "extra"
        if key:
            self.counts[key] += 1
            return key
        g.members.append((msg, fut))
        if len(g.members) >= min(2, self.need):
            self._reset_streak()
        return None

    def add_dead(self, traj_id: str, group_index: int, reason: str,
                 fut: asyncio.Future) -> bool:
        """Record a dead-lettered member; True if held (its ack waits for a checkpoint)."""
        self.failure_kinds[reason_kind(reason)] += 1
        g = self._group(group_index)
        if g is None or g.seen(traj_id):
            return False
        g.dead.append((traj_id, reason))
        g.held.append(fut)
        return True

    def add_cancelled(self, traj_id: str, group_index: int, fut: asyncio.Future) -> bool:
        g = self._group(group_index)
        if g is None or g.seen(traj_id):
            return False
        g.cancelled.append(traj_id)
        g.held.append(fut)
        return True

    def not_admitted(self) -> None:
        """Count a completion that admission did not issue (it is dead-lettered)."""
        self.counts["not_admitted"] += 1

    def take_verdict(self, fut: asyncio.Future) -> str | None:
        """The dead-letter reason of a held delivery once its future resolved (both copies
        of a conflict), None: ack it; forgotten once taken."""
        return self.verdicts.pop(fut, None)

    def readmitted(self, index: int, group_id: str, seed: int) -> None:
        """The trainer re-admitted a stale group's task as group ``index`` (``stale:
        restart``): its completions are admitted under ``group_id`` and ``seed``."""
        self.restarted[index] = (group_id, seed)

    def hand_back(self) -> list[asyncio.Future]:
        """Forget every open group (the trainer stops): returns the futures of their held
        deliveries, to be handed back for redelivery. Verdicts are forgotten too: those
        deliveries come back, and conflict again."""
        futs = [f for g in self.open.values() for f in g.futures()]
        self.open.clear()
        self.verdicts.clear()
        return futs

    def _reset_streak(self) -> None:
        self.streak = 0
        self.streak_reasons.clear()

    # -- selection ---------------------------------------------------------------
    def uniform(self, g: HeldGroup, which: str = "all") -> bool:
        """:func:`uniform` over the group's trained members."""
        return uniform([t for t, _ in g.members[: self.need]], which)

    def select(self, version: int, skip: int = 0, which: str = "all") -> Selection:
        """The groups of the next step (empty batch: not ready), plus stale, failed and
        skipped ones to close now: up to ``skip`` ready groups that are :meth:`uniform`
        (``which``) are passed over (oldest first; the rest are trained as any other). Pure:
        nothing changes until :meth:`close`."""
        failed = [g for g in self.open.values() if g.failed]
        dead = {g.index for g in failed}
        live = {i: g for i, g in self.open.items() if i not in dead}
        skipped: list[HeldGroup] = []

        def take(g: HeldGroup, batch: list[HeldGroup]) -> None:
            (skipped if len(skipped) < skip and self.uniform(g, which) else batch).append(g)

        if self.stale == "wait":
            batch: list[HeldGroup] = []
            i = self.next_index
            while len(batch) < self.batch_groups:
                if i in self.closed or i in dead:
                    i += 1
                    continue
                g = live.get(i)
                if g is None or not g.ready:
                    return Selection([], [], failed, skipped)
                take(g, batch)
                i += 1
            return Selection(batch, [], failed, skipped)
        in_bound, stale = [], []
        for i in sorted(live):
            g = live[i]
            if g.ready:
                if g.min_version >= version - self.alpha:
                    take(g, in_bound)
                else:
                    stale.append(g)
        if len(in_bound) < self.batch_groups:
            return Selection([], stale, failed, skipped)
        return Selection(in_bound[: self.batch_groups], stale, failed, skipped)

    def skim(self, version: int, skip: int = 0, which: str = "all") -> list[HeldGroup]:
        """Ready :meth:`uniform` groups that :meth:`select` is sure to skip on its way to the
        batch of the step from ``version``, whatever the groups not ready yet turn out to be:
        skipped now, their replacements are admitted now rather than when the groups before
        them are in (``stale: wait`` takes groups in index order), or, while a step trains,
        rather than after it. Pure, like :meth:`select`.

        ``stale: wait``: group ``j`` is sure to be skipped when, with ``p`` groups before it
        still open and not ready, ``skipped + p < skip`` (the budget lasts even if all of
        them are uniform) and ``batched + p < batch_groups`` (the batch is not full before
        ``j`` even if none of them is). Other modes: the groups :meth:`select` skips now
        (it takes ready groups in index order, the groups not ready are not waited for)."""
        if skip <= 0:
            return []
        if self.stale != "wait":
            return self.select(version, skip, which).skipped
        out: list[HeldGroup] = []
        batched = pending = 0  # before the next group: sure to be trained / either way
        i, last = self.next_index, max(self.open, default=-1)
        while i <= last and len(out) + pending < skip and batched + pending < self.batch_groups:
            g = self.open.get(i)
            i += 1
            if g is None:
                pending += (i - 1) not in self.closed  # nothing received yet
            elif not g.ready:
                pending += 1
            elif g.failed:
                continue  # closed as failed: neither trained nor skipped
            elif self.uniform(g, which):
                out.append(g)
            else:
                batched += 1
        return out

    def close(self, g: HeldGroup, state: GroupState | str) -> list[asyncio.Future]:
        """Close ``g`` as ``trained``, ``failed``, ``dropped``, ``restarted`` or ``skipped``
        (uniform rewards: lost, so admission replaces it; the moves a group may make:
        :data:`rollart.actors.groups.group.MOVES`); returns the futures of its deliveries
        (to be resolved once a checkpoint holds this)."""
        state = g.close(state)
        self.open.pop(g.index, None)
        self.closed.add(g.index)
        self.lost += state in LOST
        if state == "trained":
            self.trained += 1
            for t, _ in g.members:
                self.trained_fp[t.traj_id] = (fingerprint(t), t.attempt)
            while len(self.trained_fp) > CONFLICTS_REMEMBERED:
                self.trained_fp.popitem(last=False)
        elif state == "failed":
            self.counts["groups_failed"] += 1
            self.streak += 1
            self.streak_reasons.update(reason_kind(r) for _, r in g.dead)
            if not g.dead:
                self.streak_reasons["cancelled"] += 1
        elif state == "skipped":
            self.counts["uniform_skipped"] += 1
        else:  # dropped or restarted (re-admitted under a new index: not lost)
            self.counts["stale_dropped" if state == "dropped" else "stale_restarted"] += 1
        if self.stale == "wait":
            while self.next_index in self.closed:
                self.next_index += 1
        return g.futures()

    # -- health ------------------------------------------------------------------
    def tripped(self) -> str | None:
        """Why the run must stop, when the last ``breaker`` settled groups all failed."""
        if self.breaker <= 0 or self.streak < self.breaker:
            return None
        top = ", ".join(f"{k} x{n}" for k, n in self.streak_reasons.most_common(3))
        return (f"the last {self.streak} groups all failed (rollout.fail_after_groups = "
                f"{self.breaker}); reasons: {top or 'unknown'}")

    def describe_wait(self, version: int) -> str:
        """What selection is waiting for, in one line."""
        if self.stale == "wait":
            i = self.next_index
            while i in self.closed:
                i += 1
            want = [i + k for k in range(self.batch_groups)]
        else:
            want = sorted(self.open)[: self.batch_groups]
        parts = []
        for i in want:
            g = self.open.get(i)
            if g is None:
                parts.append(f"group {i}: nothing received")
            else:
                parts.append(f"group {i}: {len(g.members)}/{self.need} completed, "
                             f"{len(g.dead)} dead, {len(g.cancelled)} cancelled")
        ready = sum(g.ready and not g.failed for g in self.open.values())
        return (f"step to v{version + 1} needs {self.batch_groups} ready groups "
                f"({ready} ready, {len(self.open)} open); " + "; ".join(parts[:4]))

    def summary(self, **extra: Any) -> m.LedgerSummary:
        return m.LedgerSummary(lost=self.lost, trained=self.trained, next_index=self.next_index,
                               failed_streak=self.streak, ts=time.time(), **extra)

    # -- persistence -------------------------------------------------------------
    def state(self) -> dict:
        """What a checkpoint keeps: closed groups and counters (open groups are not kept:
        their deliveries are un-acked, so they come back after a restart)."""
        return {"closed": self.closed.state(), "next_index": self.next_index, "lost": self.lost,
                "trained": self.trained, "streak": self.streak,
                "streak_reasons": dict(self.streak_reasons),
                "failure_kinds": dict(self.failure_kinds), "counts": dict(self.counts),
                "restarted": {str(k): list(v) for k, v in self.restarted.items()}}

    def load(self, s: dict) -> None:
        self.closed = IndexSet.from_state(s["closed"])
        self.next_index = s["next_index"]
        self.lost, self.trained, self.streak = s["lost"], s["trained"], s["streak"]
        self.streak_reasons = Counter(s.get("streak_reasons", {}))
        self.failure_kinds = Counter(s.get("failure_kinds", {}))
        self.counts.update(s.get("counts", {}))
        self.restarted = {int(k): (v[0], int(v[1])) for k, v in s.get("restarted", {}).items()}


# -- the summary in KV -------------------------------------------------------------


async def put_summary(bus: Any, run: str, summary: m.LedgerSummary) -> bool:
    """Store the ledger summary; a failed put is logged, never raised (status, not state:
    the next change writes it again)."""
    try:
        await put_record(bus, run, m.LEDGER_KEY, summary, what="storing the ledger summary",
                         attempts=1, logger=log)
        return True
    except BusError as e:
        log.warning("could not store the ledger summary: %s", e)
        return False


async def watch_summary(bus: Any, run: str) -> AsyncIterator[m.LedgerSummary]:
    """The current ledger summary (if any), then each new one."""
    async for summary in watch_record(bus, run, m.LEDGER_KEY, m.LedgerSummary,
                                      what="ledger summary"):
        yield summary

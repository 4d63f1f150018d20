"""RolloutScheduler: admission control for α, groups and redundancy.

Groups of ``group_size + redundancy`` trajectories share a task seed. A group is
delivered by its first ``group_size`` completions; the rest are cancelled (a command
that EnvManagers honour; they report ``rollout.cancelled``). Admission never lets
more than ``(v + alpha + 1) * batch_groups`` live groups in, where ``v`` is the policy
version in KV and a group stops being live when the trainer's ledger counts it lost
(failed, dropped or skipped): its headroom goes to a fresh group (see
:mod:`rollart.actors.groups.ledger`). The ledger owns a group's life; the scheduler keeps of
the same groups (:class:`IssuedGroup`, :mod:`rollart.actors.groups.group`) only what the
ledger cannot know, or not soon enough: the ids it issued (moved copies included) and their
outcomes, to cancel the redundant members at once and to start the next wave, and where each
open trajectory went (:class:`rollart.actors.scheduler.pools.EnvPools`).

Neither KV record is taken on trust (nothing on the bus is authenticated): ``v`` is the
newest version the policy gate accepted (:class:`rollart.actors.kernel.policy_gate.PolicyGate`:
one version at a time), and never more than the latest trainer ledger summary says; ``lost``
is at most the number of groups that are done here (a group can only be lost once its
outcomes are in), so a forged record cannot open the α bound. In ``batch`` mode groups are
admitted in waves of ``batch_groups`` whose trajectories advance in lock step, and a wave
starts only when the previous one is done.

Several env pools (``mapping.env: [a, b]``): requests are spread over the live ones, and the
open trajectories of a pool that lost every node are moved to another
(:class:`rollart.actors.scheduler.pools.EnvPools`). Should the old pool come back and finish
an original too, the trainer takes it as one more member of its group or counts it extra or
late (it is another sample of the same task); nothing is trained twice.
"""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass, field
from typing import Any

from rollart import messages as m
from rollart.actors.groups.admission import group_id, issued_key, member_seed
from rollart.actors.groups.ledger import admissible, watch_summary
from rollart.actors.kernel.base import Actor, consume
from rollart.actors.kernel.policy_gate import PolicyGate, follow_policy
from rollart.actors.kernel.pool_watch import PoolWatch, make_watch, run_watch
from rollart.actors.kernel.records import put_record
from rollart.actors.kernel.run_end import wait_run_end
from rollart.actors.scheduler.issued import IssuedGroup
from rollart.actors.scheduler.pools import EnvPools
from rollart.bus import BusError
from rollart.bus.codec import encode
from rollart.config import ActorConfig, RolloutConfig, RunConfig
from rollart.config.placement import mapped_pools

log = logging.getLogger(__name__)


@dataclass(kw_only=True, eq=False)
class RolloutScheduler(Actor):
    role = "scheduler"
    rollout: RolloutConfig
    total_groups: int | None = None
    """Stop admitting after this many groups (None: until stopped); ``all_done`` is set
    once every member of every group has an outcome."""
    bounded: bool = True
    """Apply the α bound (False for evaluation runs with no trainer)."""
    env: str | None = None
    eval: bool = False
    greedy: bool = False
    prefix: str = "g"
    seed_offset: int = 0
    """Added to task seeds (evaluation uses held-out seeds)."""
    min_policy: int = 0
    """Unbounded (evaluation) admission only: the oldest policy version any turn may use
    (the final evaluation of version v sets v, so a replica that has not loaded it yet waits)."""
    max_live_groups: int | None = None
    """At most this many groups admitted and not yet settled at once (None: no limit): an
    evaluation beside training paces itself with it (``trainer.eval_share``)."""
    resume: bool = False
    """Continue the admission count stored in KV by an earlier process of this run."""
    keep_results: bool = False
    """Keep every completed trajectory in ``results`` (for ``rollart rollout``)."""
    results: list[m.RolloutCompleted] = field(default_factory=list)
    groups: dict[str, IssuedGroup] = field(default_factory=dict)
    """Group id -> this scheduler's view of it."""
    env_pool: str | None = None
    """Pool of the EnvManagers its requests go to (``mapping.env``); None: its own pool."""
    env_pools: list[str] = field(default_factory=list)
    """Every pool of ``mapping.env``, when it names more than one: requests are spread over
    them and moved off a pool that lost its nodes (see the module docstring)."""
    run_cfg: RunConfig | None = field(default=None, repr=False)
    """The RunConfig (``from_config``): with ``pools`` declared, its pools without a live node
    are logged (:mod:`rollart.actors.kernel.pool_watch`)."""

    # -- state made by setup() and the handlers ------------------------------------
    version: int = field(default=0, init=False)
    """The policy version admission counts from (:meth:`_set_version`)."""
    _policy_v: int = field(default=0, init=False)
    """The newest policy version the gate accepted."""
    _ledger_v: int | None = field(default=None, init=False)
    """The trainer ledger summary's version (None: no summary seen)."""
    lost: int = field(default=0, init=False)
    """Groups the trainer's ledger counts lost (failed, dropped or skipped)."""
    failed_groups: int = field(default=0, init=False)
    """Groups settled here with fewer than 2 completions."""
    failed_streak: int = field(default=0, init=False)
    """Groups failed in a row (a fixed-size rollout stops at ``rollout.fail_after_groups``)."""
    failure: str | None = field(default=None, init=False)
    """Set when a fixed-size rollout stopped because every recent group failed."""
    admitted: int = field(default=0, init=False)
    """Groups admitted (their requests published; KV :attr:`_kv_key` after them)."""
    issued: int = field(default=0, init=False)
    """Groups whose requests may have been published (KV :func:`issued_key`, stored before
    them: the trainer takes completions only of issued groups)."""
    gate: PolicyGate = field(default_factory=PolicyGate, init=False, repr=False)
    groups_done: int = field(default=0, init=False)
    """Groups that became ready (their first ``group_size`` completions, or every outcome)."""
    groups_settled: int = field(default=0, init=False)
    """Groups with an outcome for every member."""
    max_admitted_ahead: int = field(default=0, init=False)
    """The most groups admitted beyond ``(v + 1) * batch_groups`` (how far α was used)."""
    peak_live_groups: int = field(default=0, init=False)
    """The most groups admitted and not yet settled at once (``max_live_groups`` bounds it)."""
    changed: asyncio.Condition = field(default_factory=asyncio.Condition, init=False, repr=False)
    """Notified when anything admission looks at changes."""
    all_done: asyncio.Event = field(default_factory=asyncio.Event, init=False, repr=False)
    """Set once every admitted group settled and no more will be admitted."""
    extra_completions: int = field(default=0, init=False)
    """Completions of groups already ready (finished before they saw the cancel)."""
    moved: int = field(default=0, init=False)
    """Trajectories re-issued to another env pool (theirs lost every node)."""
    pools: EnvPools = field(default=None, init=False, repr=False)
    """Where each open trajectory was sent (:class:`EnvPools`)."""
    pool_watch: PoolWatch | None = field(default=None, init=False, repr=False)
    """Which pools have a live node (with ``pools`` declared)."""
    kv: Any = field(default=None, init=False, repr=False)
    """The run's KV bucket (admission and issued counts)."""

    @classmethod
    def from_config(cls, run_cfg: RunConfig, actor_cfg: ActorConfig, *, pool: str,
                    index: int = 0) -> "RolloutScheduler":
        envs = mapped_pools(run_cfg.mapping, "env") if run_cfg.pools else []
        placed = {"env_pool": envs[0], "env_pools": envs} if envs else {}
        # actors.scheduler.args (and the builder's per-run arguments) win over the config's
        return cls.configured(actor_cfg, {"run": run_cfg.run, "pool": pool,
                                          "rollout": run_cfg.rollout, "run_cfg": run_cfg, **placed})

    async def setup(self) -> None:
        self.pools = EnvPools(self.env_pool, self.env_pools, self.run_cfg)
        self.kv = await self.bus.key_value(m.kv_bucket(self.run))
        if self.resume:
            e = await self.kv.get(self._kv_key)
            if e and e.value:
                self.admitted = self.groups_done = self.groups_settled = int(e.value)
                self.issued = self.admitted
            e = await self.kv.get(issued_key(self.prefix))
            if e and e.value and e.value.isdigit():
                self.issued = max(self.issued, int(e.value))
                log.info("%s resumes after %d admitted groups", self.name, self.admitted)

    @property
    def _kv_key(self) -> str:
        return f"scheduler.{self.prefix.strip('-') or 'g'}.admitted"

    async def main(self) -> None:
        async with asyncio.TaskGroup() as tg:
            tg.create_task(self._watch_version())
            if self.run_cfg is not None and self.run_cfg.pools:  # logs pools with no live node
                try:
                    self.pool_watch = make_watch(self.bus, self.run_cfg, name=self.name)
                except Exception:  # noqa: BLE001 - the scheduler goes on without the watch
                    log.exception("%s: the pool watch did not start", self.name)
                if self.pool_watch is not None:
                    self.pools.watch = self.pool_watch
                    tg.create_task(run_watch(self.pool_watch))
                    if self.pools.several:
                        tg.create_task(self._failover_loop())
            if self.bounded:
                tg.create_task(self._watch_ledger())
                tg.create_task(self._watch_run_end())
            await self._admit_loop()

    async def _watch_version(self) -> None:
        async def accepted(pub: m.PolicyPublished) -> None:
            async with self.changed:
                self._policy_v = max(self._policy_v, pub.version)
                self._set_version()

        await follow_policy(self, self.gate, accepted, announcements=True)

    def _set_version(self) -> None:
        """``v`` = the newest accepted policy version, but never more than the latest trainer
        ledger summary says (the trainer puts back a forged summary within milliseconds, so
        a forged record that got past the gate with a forged summary lasts no longer).
        Called with ``self.changed`` held."""
        v = self._policy_v
        if self._ledger_v is not None:
            v = min(v, self._ledger_v)
        if v != self.version:
            self.version = v
            self.changed.notify_all()

    async def _watch_ledger(self) -> None:
        async for summary in watch_summary(self.bus, self.run):
            async with self.changed:
                if summary.lost > self.lost:
                    log.info("%s: %d group(s) lost so far; their headroom goes to fresh groups",
                             self.name, summary.lost)
                self.lost = max(self.lost, summary.lost)
                self._ledger_v = summary.version
                self._set_version()
                self.changed.notify_all()

    @property
    def live_lost(self) -> int:
        """The lost groups admission credits: the ledger's count, but never more than the
        groups done here (a lost group has all its outcomes in, or enough to be judged)."""
        return min(self.lost, self.groups_done)

    async def _watch_run_end(self) -> None:
        """Training is over (the trainer's last step, or its circuit breaker): admit nothing more."""
        rec = await wait_run_end(self.bus, self.run, stages=("trained", "ended"))
        async with self.changed:
            if self.total_groups is None or self.total_groups > self.admitted:
                log.info("%s: training ended at v%d; no more groups after %d", self.name,
                         rec.version, self.admitted)
                self.total_groups = self.admitted
            self.changed.notify_all()

    def _min_version(self) -> int:
        """Oldest policy the trajectory's turns may use. With ``stale: wait`` it is the
        version at admission, so that the trainer, taking groups in admission order, never
        sees a group older than its bound; otherwise ``v - alpha``."""
        if not self.bounded:
            return self.min_policy
        if self.rollout.stale == "wait":
            return self.version
        return max(0, self.version - self.rollout.alpha)

    def _may_admit(self) -> bool:
        r = self.rollout
        if self.total_groups is not None and self.admitted >= self.total_groups:
            return False
        if not admissible(self.admitted, self.live_lost, self.version,
                          r.alpha if self.bounded else None, r.batch_groups):
            return False
        if self.max_live_groups is not None and \
                self.admitted - self.groups_settled >= self.max_live_groups:
            return False
        if r.mode == "batch" and self.admitted % r.batch_groups == 0:
            return self.groups_done >= self.admitted  # a new wave waits for the last one
        return True

    def _settled(self) -> bool:
        return (self.total_groups is not None and self.admitted >= self.total_groups
                and self.groups_settled >= self.admitted)

    def _admissible_now(self, cap: int) -> int:
        """How many groups (at most ``cap``) :meth:`_may_admit` lets in one after the other
        now."""
        start, n = self.admitted, 0
        try:
            while n < cap and self._may_admit():
                n += 1
                self.admitted += 1
        finally:
            self.admitted = start
        return n

    async def _admit_loop(self) -> None:
        cap = max(1, self.rollout.batch_groups)
        while True:  # a fixed-size rollout may grow while it settles (replaced groups)
            async with self.changed:
                await self.changed.wait_for(lambda: self._may_admit() or self._settled())
                if self._settled():
                    break
                n = self._admissible_now(cap)
            await self._admit_groups(self.admitted, n)
        self.all_done.set()

    async def _admit_groups(self, first: int, n: int) -> None:
        """Admit groups ``first .. first + n - 1``: the issued count goes to KV before any of
        their requests exists, then the requests are published together (a step's groups
        all start within a few ms, not one group per JetStream round trips), then the
        admission count."""
        r = self.rollout
        if first + n > self.issued:  # stored before any request of the groups exists
            self.issued = first + n
            await self._put_issued()
        out: list[tuple[m.RolloutRequested, str | None]] = []
        size = r.group_size + r.redundancy
        for g in range(first, first + n):
            gid = group_id(g, self.prefix)
            members = [f"{gid}-{i}" for i in range(size)]
            self.groups[gid] = IssuedGroup(index=g, need=r.group_size, size=size,
                                           traj_ids=members)
            wave = g // r.batch_groups if r.mode == "batch" else -1
            wave_size = size * min(r.batch_groups,
                                   (self.total_groups or 1 << 30) - wave * r.batch_groups) \
                if wave >= 0 else 0
            self.admitted += 1
            self.peak_live_groups = max(self.peak_live_groups, self.admitted - self.groups_settled)
            self.max_admitted_ahead = max(self.max_admitted_ahead,
                                          self.admitted - (self.version + 1) * r.batch_groups)
            for i, tid in enumerate(members):
                seed = member_seed(r, g, i, self.seed_offset)
                req = m.RolloutRequested(
                    traj_id=tid, group_id=gid, env=self.env or r.env, seed=seed, index_in_group=i,
                    admitted_version=self.version,
                    min_version=self._min_version(),
                    group_index=g,
                    eval=self.eval, greedy=self.greedy, created_at=time.time(),
                    wave=wave, wave_size=wave_size, wave_id=f"{self.run}:{self.prefix}{wave}")
                pool = self.pools.pick()
                self.pools.opened(tid, pool, req)
                out.append((req, pool))
        results = await asyncio.gather(*(
            self.publish_patiently("rollout.requested", req, msg_id=f"req:{self.run}:{req.traj_id}",
                                   pool=pool) for req, pool in out), return_exceptions=True)
        failed = next((e for e in results if isinstance(e, BaseException)), None)
        if failed is not None:  # every publish has ended (each within its own deadline)
            raise failed
        await self._put_admitted()

    # -- env pools -----------------------------------------------------------------
    async def _failover_loop(self) -> None:
        """On every change of the pools' liveness, move the open trajectories of the env
        pools without a live node to live ones."""
        watch = self.pool_watch
        assert watch is not None
        while True:
            await watch.changed.wait()
            watch.changed.clear()
            for pool in sorted(watch.missing & set(self.pools.pools)):
                try:
                    await self._move_from(pool, watch.missing)
                except BusError as e:  # retried at the next change
                    log.warning("%s: moving the work of env pool %s failed: %s", self.name, pool, e)

    async def _move_from(self, pool: str, missing: set[str]) -> int:
        """Re-issue the open trajectories sent to ``pool`` to live pools; returns how many."""
        if self.rollout.mode == "batch":
            log.warning("%s: env pool %s has no live node; its trajectories stay there (batch "
                        "mode advances waves in lock step, so they are not moved)", self.name, pool)
            return 0
        moved = 0
        for copy, to in self.pools.moves(pool, missing, self.groups, name=self.name):
            self.moved += 1
            moved += 1
            await self.publish_patiently("rollout.requested", copy,
                                         msg_id=f"req:{self.run}:{copy.traj_id}", pool=to)
        return moved

    async def _put_issued(self, deadline: float = 300.0) -> None:
        """Store the issued count, retrying bus errors up to ``deadline`` seconds (the trainer
        refuses completions of groups not issued, so no request goes out before it)."""
        await put_record(self.kv, self.run, issued_key(self.prefix), str(self.issued).encode(),
                         what=f"{self.name}: storing the issued count", deadline=deadline,
                         base=0.2, cap=5.0, logger=log)

    async def _put_admitted(self) -> None:
        try:
            await put_record(self.kv, self.run, self._kv_key, str(self.admitted).encode(),
                             what=f"{self.name}: storing the admission count", attempts=7,
                             base=0.2, cap=10.0, logger=log)
        except BusError:
            log.error("%s: admission count not stored; a resume may re-admit a few groups", self.name)

    # -- outcomes ------------------------------------------------------------------
    async def _record(self, traj_id: str, group_id: str, outcome: str) -> None:
        g = self.groups.get(group_id)
        if g is None or not g.waits_for(traj_id):
            return  # not a trajectory this scheduler admitted (or moved), or already counted
        self.pools.closed(traj_id)
        was_ready = g.ready
        if outcome == "completed" and g.completions >= g.need:
            self.extra_completions += 1  # finished before it saw the cancel
        getattr(g, outcome).append(traj_id)
        if g.ready and not was_ready:
            g.done_at = time.monotonic()
            if not g.settled:
                await self._send_cancel(m.CancelGroup(group_id=group_id, keep=list(g.completed)))
            async with self.changed:
                self.groups_done += 1
                self.changed.notify_all()
        if g.settled:
            async with self.changed:
                self.groups_settled += 1
                if g.failed:
                    self._group_failed(group_id)
                elif g.completed:
                    self.failed_streak = 0
                self.changed.notify_all()

    def _group_failed(self, group_id: str) -> None:
        """A fixed-size rollout replaces a failed group (``rollout.on_failed_group``) and
        stops when ``fail_after_groups`` fail in a row; training leaves it to the ledger."""
        self.failed_groups += 1
        self.failed_streak += 1
        if self.total_groups is None:
            return
        r = self.rollout
        limit = r.fail_after_groups if r.fail_after_groups is not None else 2 * r.batch_groups
        if limit and self.failed_streak >= limit:
            self.failure = (f"the last {self.failed_streak} groups all failed "
                            f"(rollout.fail_after_groups = {limit}); last: {group_id}")
            log.error("%s: %s", self.name, self.failure)
            self.total_groups = self.admitted  # admit nothing more; settle and stop
        elif r.on_failed_group == "replace" and not self.bounded and r.mode != "batch":
            self.total_groups += 1

    async def _send_cancel(self, cmd: m.CancelGroup) -> None:
        """Best effort (redundant members that are not cancelled just finish): a bus error
        is logged, never raised, since the outcome that triggered it is already recorded."""
        try:
            await self.bus.publish_core(self.subject("rollout.cancel"), encode(cmd))
        except BusError as e:
            log.warning("%s: cancel of %s not sent: %s", self.name, cmd.group_id, e)

    @consume("rollout.completed", max_inflight=64)
    async def on_completed(self, msg: m.RolloutCompleted, delivery) -> None:
        g = self.groups.get(msg.group_id)
        if self.keep_results and g is not None and g.waits_for(msg.traj_id):
            self.results.append(msg)
        await self._record(msg.traj_id, msg.group_id, "completed")

    @consume("rollout.cancelled", max_inflight=64)
    async def on_cancelled(self, msg: m.RolloutCancelled, delivery) -> None:
        await self._record(msg.traj_id, msg.group_id, "cancelled")

    @consume("dead", max_inflight=64)
    async def on_dead(self, msg: m.DeadLetter, delivery) -> None:
        req = m.dead_request(msg)
        if req is not None:
            await self._record(req.traj_id, req.group_id, "dead")

    def summary(self) -> dict[str, float]:
        done = [g for g in self.groups.values() if g.ready]
        return {
            "groups_admitted": self.admitted, "groups_done": len(done),
            "completed": sum(len(g.completed) for g in self.groups.values()),
            "cancelled": sum(len(g.cancelled) for g in self.groups.values()),
            "dead": sum(len(g.dead) for g in self.groups.values()),
            "extra_completions": self.extra_completions, "moved": self.moved,
        }

"""The trainer's step loop: take a batch of groups from the ledger, train on it, checkpoint
(journal the step, :mod:`rollart.actors.trainer.checkpoint`), announce the new weights and the
ledger summary (:class:`StepLoop`).

Groups are taken oldest first. The α rule (DESIGN.md §4): the step producing ``v+1`` uses
only groups whose ``min_version >= v - alpha``; ``rollout.stale`` decides what happens to a
group beyond it (see :class:`rollart.config.RolloutConfig`).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections import deque
from typing import Any

from rollart import messages as m
from rollart.actors.groups.admission import RESTART_BASE
from rollart.actors.groups.ledger import GroupLedger, HeldGroup, put_summary
from rollart.actors.kernel.run_end import put_run_end
from rollart.actors.trainer.checkpoint import Checkpoints, rng_state
from rollart.actors.trainer.files import RunFiles
from rollart.actors.trainer.publish import KvGuard, WeightPublisher
from rollart.config import RunConfig
from rollart.config.placement import mapped_pools
from rollart.errors import TrainStepFailed
from rollart.telemetry import otel_metrics, tracing
from rollart.telemetry import sandboxes as sandbox_stats

log = logging.getLogger(__name__)


class StepLoop:
    """The step loop of :class:`rollart.actors.trainer.actor.Trainer` (a mixin: the state it works
    on is declared, and set up, by the Trainer; the names below say which)."""

    name: str
    run: str
    bus: Any
    cfg: RunConfig
    version: int
    backend: Any
    ledger: GroupLedger
    files: RunFiles
    ckpt: Checkpoints
    weights: WeightPublisher
    kv_guard: KvGuard
    counts: dict[str, int]
    unacked: list[asyncio.Future]
    changed: asyncio.Condition
    stepped: asyncio.Condition
    failure: str | None
    waiting: str
    history: deque[dict]
    wall_s: float
    started_at: float
    nodes: dict[str, m.NodeHeartbeat]
    lost_max: int
    end_published: bool
    skipped: list[HeldGroup]
    trace_heads: dict[str, dict[str, str]]
    on_step: Any
    before_training: Any
    publish_patiently: Any
    _publish: Any
    _checkpoint: Any
    loggers: Any

    async def _train(self) -> None:
        if self.version >= self.cfg.trainer.steps:
            log.info("%s: version %d already reached trainer.steps = %d", self.name, self.version,
                     self.cfg.trainer.steps)
            return
        if self.before_training is not None:
            await self.before_training()
        self.started_at = time.time() - self.wall_s  # for `rollart top`: step, ETA, totals
        if self.version > 0:
            await self._publish()  # a resumed run re-announces its weights
        await self._publish_ledger()
        t_start = time.perf_counter() - self.wall_s
        while self.version < self.cfg.trainer.steps:
            with tracing.span("trainer.step", {"version": self.version}) as sp:
                t0 = time.perf_counter()
                with tracing.span("get_batch"):
                    batch = await self._next_batch()
                if batch is None:
                    return
                if sp is not None:  # links (not parents) to the trajectories it trains
                    tracing.add_links(sp, self._trace_links(batch))
                    sp.set_attribute("staleness", self._staleness_counts(batch))
                metrics = await self._step(batch, wait_s=time.perf_counter() - t0, t_start=t_start)
            if metrics is None:  # the step could not be taken: the run stops (self.failure)
                return
            otel_metrics.trainer_step(time.perf_counter() - t0)
            if self.on_step is not None:
                self.on_step(metrics)
            async with self.stepped:  # trainer.eval_every's evaluator waits on it
                self.stepped.notify_all()

    def _staleness_counts(self, batch: list[HeldGroup]) -> list[int]:
        """``counts[k]``: the samples of ``batch`` that are ``k`` versions stale now."""
        k = self.cfg.rollout.group_size
        stale = [max(0, self.version - t.min_version) for g in batch for t, _ in g.members[:k]]
        counts = [0] * (max(stale, default=-1) + 1)
        for s in stale:
            counts[s] += 1
        return counts

    def _keep_trace(self, traj_id: str, headers: dict[str, str]) -> None:
        """Tracing on: remember a trajectory's ``traceparent`` for the step that trains it."""
        heads = self.trace_heads
        heads[traj_id] = {tracing.TRACEPARENT: headers[tracing.TRACEPARENT]}
        while len(heads) > 100_000:  # bounded: groups dropped or failed never claim theirs
            del heads[next(iter(heads))]

    def _trace_links(self, batch: list[HeldGroup]) -> list[dict[str, str]]:
        heads = self.trace_heads
        k = self.cfg.rollout.group_size
        return [h for g in batch for t, _ in g.members[:k]
                if (h := heads.pop(t.traj_id, None)) is not None]

    def _release_unacked(self) -> None:
        """A checkpoint holds the fate of the held deliveries: ack them."""
        for fut in self.unacked:
            fut.done() or fut.set_result(None)
        self.unacked = []

    async def _next_batch(self) -> list[HeldGroup] | None:
        """The next step's groups, or None when the circuit breaker stopped the run."""
        r = self.cfg.rollout
        t0 = time.monotonic()
        next_report = t0 + self.cfg.trainer.stall_after
        async with self.changed:
            while True:
                skimmed = self._skim(self.version)
                left_to_skip = self.cfg.trainer.skip_uniform - len(self.skipped)
                sel = self.ledger.select(self.version, skip=max(0, left_to_skip),
                                         which=self.cfg.trainer.skip_which)
                changed = bool(skimmed or sel.failed or sel.stale or sel.skipped)
                self._close_skipped(sel.skipped)  # admission replaces them (lost)
                for g in sel.failed:
                    self.unacked += self.ledger.close(g, "failed")
                    log.warning("group %d failed: %s", g.index,
                                "; ".join(sorted({x for _, x in g.dead})) or "every member cancelled")
                for g in sel.stale:
                    self.unacked += self.ledger.close(g, "restarted" if r.stale == "restart" else "dropped")
                    if r.stale == "restart":
                        await self._restart(g)
                if changed:
                    await self._publish_ledger()
                reason = self.ledger.tripped()
                if reason:
                    await self._stop_run(reason)
                    return None
                if sel.batch:
                    for g in sel.batch:
                        self.unacked += self.ledger.close(g, "trained")
                    if self.waiting:
                        log.info("trainer: no longer waiting after %.0fs", time.monotonic() - t0)
                        self.waiting = ""
                    return sel.batch
                left = next_report - time.monotonic()
                if left <= 0:
                    await self._report_wait(time.monotonic() - t0)
                    next_report = time.monotonic() + max(60.0, self.cfg.trainer.stall_after)
                    continue
                try:
                    await asyncio.wait_for(self.changed.wait(), left)
                except TimeoutError:
                    pass

    def _skim(self, version: int) -> bool:
        """Skip now the ready uniform groups that the selection of the step from ``version``
        is sure to skip (:meth:`GroupLedger.skim`), so that admission replaces them now;
        True when any was. The caller publishes the ledger summary."""
        t = self.cfg.trainer
        groups = self.ledger.skim(version, skip=t.skip_uniform - len(self.skipped),
                                  which=t.skip_which)
        self._close_skipped(groups)
        return bool(groups)

    def _close_skipped(self, groups: list[HeldGroup]) -> None:
        """Close ``groups`` as skipped (lost: admission replaces them), counted in this step."""
        for g in groups:
            self.unacked += self.ledger.close(g, "skipped")
            self.skipped.append(g)

    @contextlib.asynccontextmanager
    async def _skimming(self):
        """``trainer.skip_while_training``: while the body runs (a step trains, its loop
        free), the next step's groups that are sure to be skipped are skipped as they come in
        and the ledger summary goes out, so that admission replaces them while the step
        trains, not after it (with α >= 1 the next step's groups are out already). Stops
        before the body's checkpoint: every group closed here is in the state that
        checkpoint writes."""
        if self.cfg.trainer.skip_uniform <= 0 or not self.cfg.trainer.skip_while_training:
            yield
            return
        on = True

        async def loop() -> None:
            async with self.changed:
                while on:
                    n = len(self.skipped)
                    if self._skim(self.version + 1):
                        self.counts["skipped_while_training"] += len(self.skipped) - n
                        await self._publish_ledger()
                    await self.changed.wait()

        task = asyncio.create_task(loop(), name=f"{self.name}: skim while training")
        try:
            yield
        finally:
            async with self.changed:
                on = False
                self.changed.notify_all()
            await task

    async def _stop_run(self, reason: str) -> None:
        self.failure = reason
        await self._checkpoint()  # the ledger knows the failed groups
        self._release_unacked()
        kinds = ", ".join(f"{k}: {n}" for k, n in self.ledger.failure_kinds.most_common())
        log.error("run stopped: %s (dead letters by kind: %s)", reason, kinds or "none")
        await self._publish_ledger(stopped=reason)

    async def _report_wait(self, waited: float) -> None:
        """Say what the trainer waits for: groups, queued work, pools without a live node."""
        parts = [f"trainer waited {waited:.0f}s: {self.ledger.describe_wait(self.version)}"]
        try:
            info = await self.bus.stream_info(m.stream_name(self.run, "work"))
            parts.append(f"work queue holds {info.get('messages', '?')} requests")
        except Exception as e:  # noqa: BLE001 - a report must not stop training
            parts.append(f"work queue unknown ({type(e).__name__})")
        alive = self._live_nodes()
        missing = [role for role in ("env", "generate") if not any(role in hb.roles for hb in alive)]
        if self.nodes:
            parts.append("live nodes: " + (", ".join(
                f"{hb.pool}[{','.join(hb.roles)}]" for hb in alive) or "none"))
            if missing:
                parts.append("no live node serves " + " or ".join(missing))
        self.waiting = "; ".join(parts)
        log.warning("%s", self.waiting)
        await self._publish_ledger(waiting=self.waiting)

    def _live_nodes(self) -> list[m.NodeHeartbeat]:
        """The last heartbeat of each node heard within three heartbeat intervals."""
        horizon = 3 * max(1.0, self.cfg.node.heartbeat_every)
        return [hb for hb in self.nodes.values() if time.time() - hb.ts < horizon]

    async def _publish_ledger(self, **extra: Any) -> None:
        """The ledger summary in KV (admission frees lost groups' headroom from it), with the
        run's progress (`rollart top`); once the steps are taken or the circuit breaker
        stopped the run, the end of training (:mod:`rollart.actors.kernel.run_end`)."""
        hist = list(self.history)[-10:]
        step_s = last_s = 0.0
        if hist:
            last_s = hist[-1]["wall_s"] - (hist[-2]["wall_s"] if len(hist) > 1 else self.wall_s)
            n = hist[-1]["step"] - (hist[0]["step"] if len(hist) > 1 else self.version - 1)
            span = hist[-1]["wall_s"] - (hist[0]["wall_s"] if len(hist) > 1 else self.wall_s)
            step_s = span / max(1, n)
        steps = self.cfg.trainer.steps
        summary = self.ledger.summary(
            version=self.version, steps_total=steps, started_at=self.started_at,
            last_step_s=max(0.0, last_s), step_s=max(0.0, step_s),
            trajectories=self.ledger.trained * self.cfg.rollout.group_size,
            dead=sum(self.ledger.failure_kinds.values()), **extra)
        self.lost_max = max(self.lost_max, self.ledger.lost)
        self.kv_guard.wrote(m.LEDGER_KEY, summary)
        await put_summary(self.bus, self.run, summary)
        stopped = extra.get("stopped", "")
        if (stopped or self.version >= steps) and not self.end_published:
            self.end_published = True
            await put_run_end(self.bus, self.run, m.RunEnd(
                stage="trained", version=self.version, steps=steps, stopped=stopped, ts=time.time()))

    async def _restart(self, g: HeldGroup) -> None:
        """Roll a stale group's task out again under a fresh group index."""
        t = g.members[0][0]
        n = self.cfg.rollout.group_size + self.cfg.rollout.redundancy
        idx = RESTART_BASE + g.index * 100 + t.attempt
        gid = f"{t.group_id}-r{t.attempt}"
        self.ledger.readmitted(idx, gid, t.seed)
        pool = self._env_pool(g.index)
        for i in range(n):
            await self.publish_patiently("rollout.requested", m.RolloutRequested(
                traj_id=f"{gid}-{i}", group_id=gid, env=t.env, seed=t.seed, index_in_group=i,
                admitted_version=self.version, min_version=self.version, group_index=idx,
                created_at=time.time()), msg_id=f"req:{self.run}:{gid}-{i}", pool=pool)

    def _env_pool(self, index: int) -> str | None:
        """The pool of the EnvManagers for restarted group ``index`` (``mapping.env``;
        several: taken in turn by group index), None: this actor's own pool."""
        if not self.cfg.pools:
            return None
        pools = mapped_pools(self.cfg.mapping, "env")
        return pools[index % len(pools)]

    async def _step(self, batch: list[HeldGroup], *, wait_s: float, t_start: float) -> dict | None:
        # optional dependency: train_batch imports torch (a trainer process has it)
        from rollart.actors.trainer.batch import (advances_schedule, build_samples, loss_config,
                                                next_entropy_coef, trajectory_stats)

        k = self.cfg.rollout.group_size
        trajs = [t for g in batch for t, _ in g.members[:k]]
        settled = trajs + [t for g in self.skipped for t, _ in g.members[:k]]
        n_skipped, self.skipped = len(self.skipped), []
        v = self.version
        samples = build_samples(trajs, [g.index for g in batch for _ in g.members[:k]],
                                self.cfg.trainer.advantage)
        otel_metrics.staleness(v - t.min_version for t in trajs)
        rng = rng_state(self.backend)  # the journal's replay starts the step from the same draws
        coef = self.entropy_coef
        advance = advances_schedule(self.cfg.trainer, trajs, samples)
        t0 = time.perf_counter()
        try:
            with tracing.span("train", {"samples": len(samples)}):
                async with self._skimming():
                    tm = await asyncio.to_thread(self.backend.train_step, samples,
                                                 loss_cfg=loss_config(self.cfg.trainer, coef,
                                                                      advance))
        except TrainStepFailed as e:  # e.g. a trainer rank died: nothing of the step applied, no
            # checkpoint taken; its groups (and every later one) are handed back un-acked
            self.failure = f"training step {v + 1} failed: {e}"
            log.error("%s: run stopped: %s", self.name, self.failure)
            return None
        train_s = time.perf_counter() - t0
        self.ckpt.record(v, [g.index for g in batch for _ in g.members[:k]], trajs, rng,
                         coef if self.cfg.trainer.entropy_target is not None else None)
        self.entropy_coef = next_entropy_coef(self.cfg.trainer, coef, tm.get("entropy"))
        if not advance:
            self.counts["schedule_held"] += 1
        counts = {**self.ledger.counts, **self.counts}
        out = {"step": self.version, "version": self.version, "train_s": train_s, "wait_s": wait_s,
               **trajectory_stats(trajs, v),
               # sampled success and reward of every group settled, the skipped ones too
               "reward": sum(t.reward for t in settled) / len(settled),
               "success": sum(t.success for t in settled) / len(settled),
               "groups_skipped": n_skipped,
               "entropy_coef": coef,
               "schedule_held": float(not advance),
               **{k: float(x) for k, x in tm.items() if isinstance(x, (int, float))},
               **{f"count_{k}": x for k, x in counts.items()},
               # failed or dropped; skipped groups free admission places the same way, but
               # are counted apart (count_uniform_skipped)
               "groups_lost": self.ledger.lost - self.ledger.counts["uniform_skipped"],
               "traj_ids": [t.traj_id for t in trajs],
               "traj_min_versions": [t.min_version for t in trajs],
               # a full checkpoint finished in the background since the previous row
               **self.ckpt.take_done(),
               # how the version this step trained from reached the generators
               **self.weights.sync_row(v),
               # the env hosts' sandbox pools as top shows them (none in a run without)
               **sandbox_stats.summary(hb.stats for hb in self._live_nodes())}
        t1 = time.perf_counter()
        out["wall_s"] = t1 - t_start
        self.history.append(out)
        final = self.version >= self.cfg.trainer.steps
        checkpointed = self.version % self.cfg.trainer.checkpoint_every == 0 or final
        # the record first: a resume keeps exactly the rows of the steps its checkpoint holds
        try:
            with tracing.span("checkpoint", {"saved": checkpointed}):
                await asyncio.to_thread(self.files.write_metrics, out)
                if self.loggers is not None:  # never raises: a failing logger turns itself off
                    await asyncio.to_thread(self.loggers.log, out)
                if checkpointed:  # seconds of the state, and waited for a full checkpoint
                    out.update(await self._checkpoint(final=final))
            with tracing.span("publish"):
                await self._publish()
                await self._publish_ledger()
        except TrainStepFailed as e:  # sharded ranks gather for a full checkpoint and a
            # version (trainer.shard: fsdp2): a rank died there. As a crash at this point:
            # nothing acked; a resume replays the journaled step or trains its groups again
            self.failure = f"after training step {v + 1}: {e}"
            log.error("%s: run stopped: %s", self.name, self.failure)
            return None
        out["publish_s"] = time.perf_counter() - t1
        if checkpointed:
            self._release_unacked()
        return out


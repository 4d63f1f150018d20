"""Trainer: completed trajectories become gradient steps; new weights go out as messages.

Each ``rollout.completed`` delivery stays un-acked (held by heartbeats) until the step
that used it has been checkpointed, so a killed trainer loses nothing: what it had
buffered is redelivered, and what it had trained is skipped by id on resume.

Groups are taken oldest first. The α rule (DESIGN.md §4): the step producing ``v+1``
uses only groups whose ``min_version >= v - alpha``; ``rollout.stale`` decides what
happens to a group beyond it (see :class:`rollart.config.RolloutConfig`).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import deque
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from rollart import messages as m
from rollart.actors.admission import RESTART_BASE, Admission, issued_key
from rollart.actors.base import Actor, Reject, Retry, consume
from rollart.actors.ledger import Group, GroupLedger
from rollart.actors.policy import set_policy
from rollart.telemetry import otel_metrics, tracing

log = logging.getLogger(__name__)


class RunFailed(RuntimeError):
    """The circuit breaker stopped the run: failures are systematic, not transient."""


@dataclass(kw_only=True, eq=False)
class Trainer(Actor):
    role = "trainer"
    cfg: Any
    """The whole :class:`rollart.config.RunConfig`."""
    model_dir: str
    run_path: str
    """``<run_dir>/<run>``: weights, checkpoints, metrics."""
    resume: bool = False
    on_step: Any = None
    """Optional callback ``fn(metrics: dict)`` after each step (progress display)."""

    @classmethod
    def from_config(cls, run_cfg: Any, actor_cfg: Any, *, pool: str, index: int = 0) -> "Trainer":
        from rollart.config.schema import (
            trainer_buffer,  # RunConfig checks checkpoint_every against it
        )
        from rollart.engines.provision import model_dir

        buf = trainer_buffer(run_cfg.rollout)
        held = {"max_inflight": buf, "max_ack_pending": 2 * buf}
        settings = {"on_completed": dict(held), "on_dead": dict(held), "on_cancelled": dict(held)}
        for h, hc in actor_cfg.handlers.items():
            settings.setdefault(h, {}).update(hc.overrides())
        return cls(run=run_cfg.run, pool=pool, settings=settings, cfg=run_cfg,
                   model_dir=str(model_dir(run_cfg)),
                   run_path=str(Path(run_cfg.run_dir) / run_cfg.run), **actor_cfg.args)

    # -- state -------------------------------------------------------------------
    async def setup(self) -> None:
        from rollart.engines.torch_trainer import TorchTrainBackend

        t, r = self.cfg.trainer, self.cfg.rollout
        self.backend = await asyncio.to_thread(
            TorchTrainBackend, self.model_dir, lr=t.lr, weight_decay=t.weight_decay,
            grad_clip=t.grad_clip, warmup_steps=t.warmup_steps, total_steps=t.steps,
            schedule=t.schedule, threads=self.cfg.model.threads, seed=t.seed,
            micro_batch_tokens=t.micro_batch_tokens)
        breaker = r.fail_after_groups if r.fail_after_groups is not None else 2 * r.batch_groups
        self.ledger = GroupLedger(group_size=r.group_size, redundancy=r.redundancy,
                                  batch_groups=r.batch_groups, alpha=r.alpha, stale=r.stale,
                                  breaker=breaker)
        self.admission = Admission(r, dict(self.cfg.envs))
        self.issued: int | None = None
        """The highest issued-group count of the training scheduler seen in KV."""
        self.counts = {"eval_skipped": 0, "kv_restored": 0}
        self._own_kv: dict[str, deque[bytes]] = {m.POLICY_KEY: deque(maxlen=256),
                                                 m.LEDGER_KEY: deque(maxlen=256)}
        """The latest records this process wrote per KV key (others are put back)."""
        self._announced: dict[int, str] = {}
        """Version -> digest of what this process announced."""
        self._prune_store = True
        """Delete old versions from the object store (off after the first refusal)."""
        self.unacked: list[asyncio.Future] = []
        self.changed = asyncio.Condition()
        self.finished = asyncio.Event()
        """Set when the trainer is done: its steps taken, or stopped by :attr:`failure`."""
        self.failure: str | None = None
        self.waiting = ""
        self.history: deque[dict] = deque(maxlen=64)
        """The latest steps' metrics (the whole record is ``metrics.jsonl``)."""
        self.wall_s = 0.0
        """Training wall time before this process (a resumed run continues the clock)."""
        self.nodes: dict[str, m.NodeHeartbeat] = {}
        self.path = Path(self.run_path)
        (self.path / "weights").mkdir(parents=True, exist_ok=True)
        (self.path / "checkpoints").mkdir(parents=True, exist_ok=True)
        if self.resume:
            await asyncio.to_thread(self._load_checkpoint)
        self.announced_max = max([self.version] + [
            int(p.name[1:7]) for p in (self.path / "weights").glob("v*.safetensors")
            if p.name[1:7].isdigit()])
        """The newest version this run's trainer announced (a version file is written before
        its announcement, and the newest is never deleted)."""
        self.lost_max = self.ledger.lost
        """The most groups the trainer ever reported lost (a resume may restart below it)."""
        if self.resume:
            from rollart.actors.records import decode_entry

            kv = await self.bus.key_value(m.kv_bucket(self.run))
            prev = decode_entry(await kv.get(m.LEDGER_KEY), m.LedgerSummary)
            if prev is not None:
                self.lost_max = max(self.lost_max, prev.lost)
        self._hb_sub = await self.bus.subscribe(self.subject("node.heartbeat"), self._on_heartbeat)

    async def teardown(self) -> None:
        await self._hb_sub.unsubscribe()

    async def _on_heartbeat(self, req) -> None:
        from rollart.actors.runtime import decode_core

        hb = decode_core(m.NodeHeartbeat, req)
        if hb is None:  # junk on a core subject: counted and dropped
            return
        self.nodes[hb.node_id] = hb
        if len(self.nodes) > 1024:  # forget the longest silent
            del self.nodes[min(self.nodes, key=lambda k: self.nodes[k].ts)]

    @property
    def version(self) -> int:
        return self.backend.version

    def _load_checkpoint(self) -> None:
        import torch

        p = self.path / "checkpoints" / "latest.pt"
        if not p.exists():
            log.warning("no checkpoint at %s: starting from scratch", p)
            self._rewrite_metrics()  # rows of steps no checkpoint holds are trained again
            return
        state = torch.load(p, weights_only=False)
        self.backend.load_checkpoint_state(state["backend"])
        if "ledger" in state:
            self.ledger.load(state["ledger"])
        elif "next_index" in state:  # a checkpoint from before the ledger: groups below are done
            self.ledger.load({"closed": {"low": state["next_index"]}, "next_index": state["next_index"],
                              "lost": 0, "trained": state["next_index"], "streak": 0})
        self.counts.update(state.get("counts", {}))
        self.wall_s = state.get("wall_s", (state.get("history") or [{}])[-1].get("wall_s", 0.0))
        self._rewrite_metrics()
        log.info("resumed at version %d with %d trained groups", self.version, self.ledger.trained)

    def _save_checkpoint(self) -> None:
        import torch

        p = self.path / "checkpoints" / "latest.pt"
        tmp = p.with_suffix(".tmp")
        torch.save({"backend": self.backend.state_dict_for_checkpoint(),
                    "ledger": self.ledger.state(), "counts": dict(self.counts),
                    "wall_s": self.history[-1]["wall_s"] if self.history else self.wall_s}, tmp)
        tmp.replace(p)

    # -- input -------------------------------------------------------------------
    async def _hold(self, fut: asyncio.Future) -> None:
        async with self.changed:
            self.changed.notify_all()
        await fut  # resolved once a checkpoint covers the group's fate (or handed back)

    @consume("rollout.completed", durable="trainer", ack_wait=30.0, max_deliver=-1)
    async def on_completed(self, msg: m.RolloutCompleted, delivery) -> None:
        if msg.eval or msg.group_index < 0:
            self.counts["eval_skipped"] += 1
            return
        if self.finished.is_set():  # keep it for a later run that trains further
            raise Retry(30.0, "trainer finished its steps")
        why = await self._not_admitted(msg)
        if why:
            self.ledger.counts["not_admitted"] += 1
            raise Reject(f"not_admitted: {why}")
        if tracing.enabled() and tracing.TRACEPARENT in (delivery.headers or {}):
            self._keep_trace(msg.traj_id, delivery.headers)
        fut = asyncio.get_running_loop().create_future()
        key = self.ledger.add_completed(msg, fut)
        if key == "conflicts":
            log.error("%s: trajectory %s came again with other content after its group was "
                      "trained or it was reported dead or cancelled: a forged or replayed copy",
                      self.name, msg.traj_id)
            raise Reject(f"conflict: a different copy of trajectory {msg.traj_id} (group "
                         f"{msg.group_index}) came after its outcome was recorded")
        if key is None:
            await self._hold(fut)
            verdict = self.ledger.verdicts.pop(fut, None)
            if verdict:
                raise Reject(verdict)

    async def _not_admitted(self, msg: m.RolloutCompleted) -> str | None:
        """Why a training completion is not one admission issued (None: it is); see
        :class:`rollart.actors.admission.Admission`. The issued count is read from KV again
        before a refusal (the watch may lag); a KV that cannot be read is retried later."""
        from rollart.bus import BusError

        def check() -> str | None:
            lost = max(self.lost_max, self.ledger.lost)
            return self.admission.check(msg, ledger=self.ledger, version=self.announced_max,
                                        issued=self.issued, lost=lost)

        why = check()
        if why and msg.group_index < RESTART_BASE and (self.issued or 0) <= msg.group_index:
            try:
                await self._read_issued()
            except BusError as e:
                raise Retry(2.0, f"issued count unreadable: {e}") from None
            why = check()
        if why:
            log.warning("%s: completion %s (group %d) not admitted: %s", self.name,
                        msg.traj_id[:80], msg.group_index, why)
        return why

    async def _read_issued(self) -> None:
        kv = await self.bus.key_value(m.kv_bucket(self.run))
        self._see_issued(await kv.get(issued_key()))

    def _see_issued(self, e) -> None:
        if e is None or e.deleted or not e.value:
            return
        try:
            n = int(e.value)
        except ValueError:
            log.error("%s: ignoring a malformed issued count %r", self.name, e.value[:40])
            return
        self.issued = max(self.issued or 0, n)

    @consume("dead", durable="trainer-dead", max_deliver=-1)
    async def on_dead(self, msg: m.DeadLetter, delivery) -> None:
        req = m.dead_request(msg)
        if req is None or req.eval or req.group_index < 0:
            return
        if self.finished.is_set():
            raise Retry(30.0, "trainer finished its steps")
        fut = asyncio.get_running_loop().create_future()
        if self.ledger.add_dead(req.traj_id, req.group_index, msg.reason, fut):
            await self._hold(fut)

    @consume("rollout.cancelled", durable="trainer-cancelled", max_deliver=-1)
    async def on_cancelled(self, msg: m.RolloutCancelled, delivery) -> None:
        if msg.group_index < 0:
            return
        if self.finished.is_set():
            raise Retry(30.0, "trainer finished its steps")
        fut = asyncio.get_running_loop().create_future()
        if self.ledger.add_cancelled(msg.traj_id, msg.group_index, fut):
            await self._hold(fut)

    # Only the trainer announces policy versions (DESIGN.md §5b); nothing else consumes these
    # durably, so the trainer checks them: the runtime dead-letters what does not decode or
    # validate, and these handlers what no trainer of this run can have produced.
    @consume("policy.published", max_inflight=4)
    async def on_policy_published(self, msg: m.PolicyPublished, delivery) -> None:
        self._check_policy_version("policy.published", msg.version)
        own = self._announced.get(msg.version)
        if msg.version > self.announced_max or (own is not None and own != msg.digest):
            raise Reject(f"not_admitted: policy.published v{msg.version} ({msg.digest[:40]}) "
                         f"is not an announcement of this trainer (it announced up to "
                         f"v{self.announced_max}{f', v{msg.version} as {own}' if own else ''})")

    @consume("policy.loaded", max_inflight=4)
    async def on_policy_loaded(self, msg: m.PolicyLoaded, delivery) -> None:
        self._check_policy_version("policy.loaded", msg.version)

    def _check_policy_version(self, what: str, version: int) -> None:
        steps = self.cfg.trainer.steps
        if version > steps:
            raise Reject(f"invalid: {what} v{version} is beyond any version of this run "
                         f"(trainer.steps = {steps})")

    # -- the loop ----------------------------------------------------------------
    async def main(self) -> None:
        # KV watchers that live as long as training (each logs its own errors)
        watchers = asyncio.gather(self._guard_kv(m.POLICY_KEY), self._guard_kv(m.LEDGER_KEY),
                                  self._watch_issued(), return_exceptions=True)
        try:
            await self._train()
        finally:
            self._finish()
            watchers.cancel()
            await asyncio.wait([watchers])
            if not watchers.cancelled():
                watchers.exception()  # retrieved: the CancelledError of the cancel above

    async def _watch_issued(self) -> None:
        """Follow the training scheduler's issued-group count (admission of completions)."""
        from rollart.bus import BusError

        try:
            kv = await self.bus.key_value(m.kv_bucket(self.run))
            async for e in kv.watch(issued_key()):
                self._see_issued(e)
        except BusError as e:  # completions then read KV themselves
            log.warning("%s: cannot watch the issued count: %s", self.name, e)

    async def _guard_kv(self, key: str) -> None:
        """Put this trainer's record of ``key`` back when another client overwrote or deleted
        it (the trainer is the only writer of ``policy.version`` and ``trainer.ledger``): a
        forged record then lives milliseconds, and policy holders, which accept jumps and
        unannounced records only when they stay (:class:`rollart.actors.policy_gate.PolicyGate`),
        never take it. Only once this process wrote the key (before, it holds an earlier
        process's record). Never raises."""
        from rollart.bus import BusError

        own = self._own_kv[key]
        last_log = 0.0
        try:
            kv = await self.bus.key_value(m.kv_bucket(self.run))
            # Revisions up to the one there now are an earlier process's (a resumed run) or this
            # one's: the watch may deliver them after this process wrote its own, so they are
            # no sign of another client.
            start = await kv.get(key)
            start_rev = start.revision if start is not None else 0
            async for e in kv.watch(key):
                if not own or e.revision <= start_rev or (not e.deleted and e.value in own):
                    continue
                self.counts["kv_restored"] += 1
                if time.monotonic() - last_log > 10.0:
                    last_log = time.monotonic()
                    log.error("%s: KV %s was %s by another client (revision %d); the trainer "
                              "puts its own record back (%d times so far)", self.name, key,
                              "deleted" if e.deleted else "overwritten", e.revision,
                              self.counts["kv_restored"])
                try:
                    await kv.put(key, own[-1])
                    await self.publish("dead", m.DeadLetter(
                        subject=f"{m.PREFIX}.{self.run}.kv.{key}", payload=e.value or b"",
                        reason=f"not_admitted: KV {key} revision {e.revision} was "
                               f"{'deleted' if e.deleted else 'written'} by another client "
                               f"than the trainer; its record was put back",
                        actor=self.name, kind="permanent"),
                        msg_id=f"dead:kv:{self.run}:{key}:{e.revision}")
                    otel_metrics.dead_letter("not_admitted: KV record put back")
                except BusError as err:
                    log.warning("%s: restoring KV %s failed: %s", self.name, key, err)
        except BusError as e:
            log.warning("%s: cannot guard KV %s: %s", self.name, key, e)

    async def _train(self) -> None:
        if self.version >= self.cfg.trainer.steps:
            log.info("%s: version %d already reached trainer.steps = %d", self.name, self.version,
                     self.cfg.trainer.steps)
            return
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
            otel_metrics.trainer_step(time.perf_counter() - t0)
            if self.on_step is not None:
                self.on_step(metrics)

    def _staleness_counts(self, batch: list[Group]) -> list[int]:
        """``counts[k]``: the samples of ``batch`` that are ``k`` versions stale now."""
        k = self.cfg.rollout.group_size
        stale = [max(0, self.version - t.min_version) for g in batch for t, _ in g.members[:k]]
        counts = [0] * (max(stale, default=-1) + 1)
        for s in stale:
            counts[s] += 1
        return counts

    def _keep_trace(self, traj_id: str, headers: dict[str, str]) -> None:
        """Tracing on: remember a trajectory's ``traceparent`` for the step that trains it."""
        heads = self.__dict__.setdefault("_trace_heads", {})
        heads[traj_id] = {tracing.TRACEPARENT: headers[tracing.TRACEPARENT]}
        while len(heads) > 100_000:  # bounded: groups dropped or failed never claim theirs
            del heads[next(iter(heads))]

    def _trace_links(self, batch: list[Group]) -> list[dict[str, str]]:
        heads = self.__dict__.get("_trace_heads", {})
        k = self.cfg.rollout.group_size
        return [h for g in batch for t, _ in g.members[:k]
                if (h := heads.pop(t.traj_id, None)) is not None]

    def _finish(self) -> None:
        self.finished.set()
        self.draining()

    def draining(self) -> None:
        """Hand back what no checkpoint holds (redelivered to a later run: buffered groups,
        steps after the last checkpoint); the last checkpoint already acked the rest."""
        for fut in self.unacked:
            fut.done() or fut.set_exception(Retry(30.0, "trainer stopped before a checkpoint"))
        self.unacked = []
        for g in list(self.ledger.open.values()):
            for fut in g.futures():
                fut.done() or fut.set_exception(Retry(30.0, "trainer stopped"))
        self.ledger.open.clear()
        self.ledger.verdicts.clear()  # their deliveries come back, and conflict again

    async def _next_batch(self) -> list[Group] | None:
        """The next step's groups, or None when the circuit breaker stopped the run."""
        r = self.cfg.rollout
        t0 = time.monotonic()
        next_report = t0 + self.cfg.trainer.stall_after
        async with self.changed:
            while True:
                sel = self.ledger.select(self.version)
                changed = bool(sel.failed or sel.stale)
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

    async def _stop_run(self, reason: str) -> None:
        self.failure = reason
        await asyncio.to_thread(self._save_checkpoint)  # the ledger knows the failed groups
        for fut in self.unacked:
            fut.done() or fut.set_result(None)
        self.unacked = []
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
        horizon = 3 * max(1.0, self.cfg.node.heartbeat_every)
        alive = [hb for hb in self.nodes.values() if time.time() - hb.ts < horizon]
        missing = [role for role in ("env", "generate") if not any(role in hb.roles for hb in alive)]
        if self.nodes:
            parts.append("live nodes: " + (", ".join(
                f"{hb.pool}[{','.join(hb.roles)}]" for hb in alive) or "none"))
            if missing:
                parts.append("no live node serves " + " or ".join(missing))
        self.waiting = "; ".join(parts)
        log.warning("%s", self.waiting)
        await self._publish_ledger(waiting=self.waiting)

    async def _publish_ledger(self, **extra: Any) -> None:
        """The ledger summary in KV (admission frees lost groups' headroom from it), with the
        run's progress (`rollart top`); once the steps are taken or the circuit breaker
        stopped the run, the end of training (:mod:`rollart.actors.run_end`)."""
        from rollart.actors.ledger import put_summary
        from rollart.actors.run_end import put_run_end

        hist = list(self.history)[-10:]
        step_s = last_s = 0.0
        if hist:
            last_s = hist[-1]["wall_s"] - (hist[-2]["wall_s"] if len(hist) > 1 else self.wall_s)
            n = hist[-1]["step"] - (hist[0]["step"] if len(hist) > 1 else self.version - 1)
            span = hist[-1]["wall_s"] - (hist[0]["wall_s"] if len(hist) > 1 else self.wall_s)
            step_s = span / max(1, n)
        from rollart.bus.codec import encode

        steps = self.cfg.trainer.steps
        summary = self.ledger.summary(
            version=self.version, steps_total=steps, started_at=getattr(self, "started_at", 0.0),
            last_step_s=max(0.0, last_s), step_s=max(0.0, step_s),
            trajectories=self.ledger.trained * self.cfg.rollout.group_size,
            dead=sum(self.ledger.failure_kinds.values()), **extra)
        self.lost_max = max(self.lost_max, self.ledger.lost)
        self._own_kv[m.LEDGER_KEY].append(encode(summary))
        await put_summary(self.bus, self.run, summary)
        stopped = extra.get("stopped", "")
        if (stopped or self.version >= steps) and not getattr(self, "_end_published", False):
            self._end_published = True
            await put_run_end(self.bus, self.run, m.RunEnd(
                stage="trained", version=self.version, steps=steps, stopped=stopped, ts=time.time()))

    async def _restart(self, g: Group) -> None:
        """Roll a stale group's task out again under a fresh group index."""
        t = g.members[0][0]
        n = self.cfg.rollout.group_size + self.cfg.rollout.redundancy
        idx = RESTART_BASE + g.index * 100 + t.attempt
        gid = f"{t.group_id}-r{t.attempt}"
        self.ledger.restarted[idx] = (gid, t.seed)
        for i in range(n):
            await self.publish_patiently("rollout.requested", m.RolloutRequested(
                traj_id=f"{gid}-{i}", group_id=gid, env=t.env, seed=t.seed, index_in_group=i,
                admitted_version=self.version, min_version=self.version, group_index=idx,
                created_at=time.time()), msg_id=f"req:{self.run}:{gid}-{i}", pool=self._env_pool())

    def _env_pool(self) -> str | None:
        """The pool of the EnvManagers (``mapping.env``), None: this actor's own pool."""
        from rollart.config.placement import mapped_pools

        return mapped_pools(self.cfg.mapping, "env")[0] if self.cfg.pools else None

    async def _step(self, batch: list[Group], *, wait_s: float, t_start: float) -> dict:
        from rollart.actors.train_batch import (
            build_samples,
            loss_config,
            trajectory_stats,
        )

        k = self.cfg.rollout.group_size
        trajs = [t for g in batch for t, _ in g.members[:k]]
        v = self.version
        samples = build_samples(trajs, [g.index for g in batch for _ in g.members[:k]],
                                self.cfg.trainer.advantage)
        otel_metrics.staleness(v - t.min_version for t in trajs)
        t0 = time.perf_counter()
        with tracing.span("train", {"samples": len(samples)}):
            tm = await asyncio.to_thread(self.backend.train_step, samples, loss_cfg=loss_config(self.cfg.trainer))
        train_s = time.perf_counter() - t0
        counts = {**self.ledger.counts, **self.counts}
        out = {"step": self.version, "version": self.version, "train_s": train_s, "wait_s": wait_s,
               **trajectory_stats(trajs, v),
               **{k: float(x) for k, x in tm.items() if isinstance(x, (int, float))},
               **{f"count_{k}": x for k, x in counts.items()},
               "groups_lost": self.ledger.lost,
               "traj_ids": [t.traj_id for t in trajs],
               "traj_min_versions": [t.min_version for t in trajs]}
        t1 = time.perf_counter()
        out["wall_s"] = t1 - t_start
        self.history.append(out)
        checkpointed = (self.version % self.cfg.trainer.checkpoint_every == 0
                        or self.version >= self.cfg.trainer.steps)
        # the record first: a resume keeps exactly the rows of the steps its checkpoint holds
        with tracing.span("checkpoint", {"saved": checkpointed}):
            await asyncio.to_thread(self._write_metrics, out)
            if checkpointed:
                await asyncio.to_thread(self._save_checkpoint)
        with tracing.span("publish"):
            await self._publish()
            await self._publish_ledger()
        out["publish_s"] = time.perf_counter() - t1
        if checkpointed:
            for fut in self.unacked:
                fut.done() or fut.set_result(None)
            self.unacked = []
        return out

    async def _publish(self) -> None:
        """Announce the current weights: ``policy.published`` and KV ``policy.version``.

        Weights by content (DESIGN.md §5): the digest names the tensors, and a version's
        file is written once, never rewritten. A resume announces the existing file again
        (same content digest, so a replica that loaded it before keeps it). A file that holds
        other tensors than the model is left alone and the model goes to a new file name.
        """
        from rollart.actors.policy import content_digest, file_content_digest
        from rollart.bus import BusError

        v = self.version
        t = self.cfg.trainer
        wdir = self.path / "weights"

        def existing(p: Path) -> str | None:
            try:
                return file_content_digest(p) if p.exists() else None
            except (OSError, ValueError) as e:  # torn or foreign: never overwrite it either
                return f"unreadable ({e})"

        path = wdir / f"v{v:06d}.safetensors"
        digest = await asyncio.to_thread(existing, path)
        if digest is not None:
            current = await asyncio.to_thread(self.backend.weights_digest)
            n = 0
            while digest is not None and digest != current:
                retrained = v % max(1, t.checkpoint_every) != 0 and v < t.steps
                (log.warning if retrained and n == 0 else log.error)(
                    "%s: %s holds other tensors (%s) than version %d of the model (%s)%s; "
                    "it is left as it is and the model is published under a new name",
                    self.name, path.name, digest, v, current,
                    ": this version was trained again after a resume from an earlier checkpoint"
                    if retrained else "")
                n += 1
                path = wdir / f"v{v:06d}-{current.rsplit(':', 1)[-1][:16]}" \
                              f"{'' if n == 1 else f'-{n}'}.safetensors"
                digest = await asyncio.to_thread(existing, path)
        reused = digest is not None
        if reused:
            log.info("%s: announcing the existing %s again (%s)", self.name, path.name, digest)
        else:
            digest = await asyncio.to_thread(self.backend.save_weights, path)
        uri = path.resolve().as_uri()
        if t.weights == "object":
            name = path.name.removesuffix(".safetensors")
            store = await self.bus.object_store(m.object_bucket(self.run))
            same = False
            if reused:  # put only what the store does not hold yet: no rewrite under a reader
                try:
                    same = await asyncio.to_thread(content_digest, await store.get(name)) == digest
                except (KeyError, ValueError):
                    same = False
            if not same:
                await store.put(name, await asyncio.to_thread(path.read_bytes))
            uri = f"obj://{m.object_bucket(self.run)}/{name}"
        pub = m.PolicyPublished(version=v, uri=uri, digest=digest, created_at=time.time())
        from rollart.bus.codec import encode

        self._announced[v] = digest
        self.announced_max = max(self.announced_max, v)
        self._own_kv[m.POLICY_KEY].append(encode(pub))
        await self.publish_patiently("policy.published", pub,
                                     msg_id=f"policy:{self.run}:{v}:{digest.rsplit(':', 1)[-1][:16]}")
        for attempt in range(1, 1000):
            try:
                await set_policy(self.bus, self.run, pub)
                break
            except BusError as e:
                if attempt >= 60:
                    raise
                if attempt == 1:
                    log.warning("%s: setting policy v%d failed (%s); retrying", self.name, v, e)
                await asyncio.sleep(min(5.0, 0.1 * 2 ** attempt))
        keep = max(1, t.keep_weights)
        for old in wdir.glob("v*.safetensors"):  # by version, never what was just announced
            ver = old.name[1:7]
            if old != path and ver.isdigit() and int(ver) <= v - keep:
                old.unlink(missing_ok=True)
                if t.weights == "object" and self._prune_store:  # no more versions than the folder
                    try:
                        await store.delete(old.name.removesuffix(".safetensors"))
                    except BusError as e:  # left behind, not fatal: the stream's data only
                        self._prune_store = False  # one wait and one line, not one per step
                        log.warning("%s: deleting %s from the object store failed (%s): old weights "
                                    "stay in the store from now on (under `rollart secure` "
                                    "credentials made without --run the trainer may not purge)",
                                    self.name, old.name, e)

    def _rewrite_metrics(self) -> None:
        """After a resume: the record is the steps the checkpoint holds, nothing after."""
        import json

        p = self.path / "metrics.jsonl"
        if not p.exists():
            return
        keep = []
        for line in p.read_text().splitlines():
            try:
                row = json.loads(line)
            except ValueError:  # a line cut by the kill
                continue
            if row.get("step", 0) <= self.version:
                keep.append(line + "\n")
        tmp = p.with_suffix(".tmp")
        tmp.write_text("".join(keep))
        tmp.replace(p)

    def _write_metrics(self, metrics: dict) -> None:
        import json

        with (self.path / "metrics.jsonl").open("a") as f:
            f.write(json.dumps(metrics) + "\n")

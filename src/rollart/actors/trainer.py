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
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from rollart import messages as m
from rollart.actors.base import Actor, Retry, consume
from rollart.actors.policy import set_policy, sha256_digest

log = logging.getLogger(__name__)


@dataclass
class Group:
    index: int
    members: list[tuple[m.RolloutCompleted, asyncio.Future]] = field(default_factory=list)
    dead: int = 0

    @property
    def min_version(self) -> int:
        return min(t.min_version for t, _ in self.members)


def select_batch(groups: dict[int, Group], *, next_index: int, version: int, alpha: int,
                 stale: str, batch_groups: int, need: int, size: int
                 ) -> tuple[list[Group], list[Group], list[Group]]:
    """Pick the groups of the next step: ``(batch, stale, failed)``; batch is empty if not ready.

    ``need`` completions make a group ready; a group that settled (``size`` outcomes) with
    fewer than two completions is ``failed``. Under ``wait`` groups are taken strictly in
    admission order from ``next_index``; otherwise the oldest ready in-bound groups.
    """
    def ready(g: Group) -> bool:
        return len(g.members) >= need or len(g.members) + g.dead >= size

    failed = [g for g in groups.values() if ready(g) and len(g.members) < min(2, need)]
    live = {i: g for i, g in groups.items() if g not in failed}
    stale_groups: list[Group] = []
    if stale == "wait":
        batch, i = [], next_index
        while len(batch) < batch_groups:
            g = live.get(i)
            if g is None:
                if any(f.index == i for f in failed):
                    i += 1
                    continue
                return [], [], failed
            if not ready(g):
                return [], [], failed
            batch.append(g)
            i += 1
        return batch, [], failed
    in_bound = []
    for i in sorted(live):
        g = live[i]
        if not ready(g):
            continue
        (in_bound if g.min_version >= version - alpha else stale_groups).append(g)
    if len(in_bound) < batch_groups:
        return [], stale_groups, failed
    return in_bound[:batch_groups], stale_groups, failed


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
        from rollart.engines.provision import model_dir

        r = run_cfg.rollout
        buf = max(256, 4 * (r.alpha + 2) * r.batch_groups * (r.group_size + r.redundancy))
        settings = {"on_completed": {"max_inflight": buf, "max_ack_pending": 2 * buf},
                    "on_dead": {}}
        for h, hc in actor_cfg.handlers.items():
            settings.setdefault(h, {}).update(hc.overrides())
        return cls(run=run_cfg.run, pool=pool, settings=settings, cfg=run_cfg,
                   model_dir=str(model_dir(run_cfg)),
                   run_path=str(Path(run_cfg.run_dir) / run_cfg.run), **actor_cfg.args)

    # -- state -------------------------------------------------------------------
    async def setup(self) -> None:
        from rollart.engines.torch_trainer import TorchTrainBackend

        t = self.cfg.trainer
        self.backend = await asyncio.to_thread(
            TorchTrainBackend, self.model_dir, lr=t.lr, weight_decay=t.weight_decay,
            grad_clip=t.grad_clip, warmup_steps=t.warmup_steps, total_steps=t.steps,
            schedule=t.schedule, threads=self.cfg.model.threads, seed=t.seed,
            micro_batch_tokens=t.micro_batch_tokens)
        self.groups: dict[int, Group] = {}
        self.closed: set[int] = set()
        """Groups already trained on or released."""
        self.trained: set[str] = set()
        self.next_index = 0
        self.counts = dict.fromkeys(("extra", "stale_dropped", "stale_restarted",
                                     "groups_failed", "duplicates", "late", "eval_skipped"), 0)
        self.unacked: list[asyncio.Future] = []
        self.changed = asyncio.Condition()
        self.finished = asyncio.Event()
        self.history: list[dict] = []
        self.path = Path(self.run_path)
        (self.path / "weights").mkdir(parents=True, exist_ok=True)
        (self.path / "checkpoints").mkdir(parents=True, exist_ok=True)
        if self.resume:
            await asyncio.to_thread(self._load_checkpoint)

    @property
    def version(self) -> int:
        return self.backend.version

    def _load_checkpoint(self) -> None:
        import torch

        p = self.path / "checkpoints" / "latest.pt"
        if not p.exists():
            log.warning("no checkpoint at %s: starting from scratch", p)
            return
        state = torch.load(p, weights_only=False)
        self.backend.load_checkpoint_state(state["backend"])
        self.trained = set(state["trained"])
        self.next_index = state["next_index"]
        self.counts.update(state["counts"])
        self.history = list(state.get("history", []))
        self._rewrite_metrics()
        log.info("resumed at version %d with %d trained trajectories", self.version, len(self.trained))

    def _save_checkpoint(self) -> None:
        import torch

        p = self.path / "checkpoints" / "latest.pt"
        tmp = p.with_suffix(".tmp")
        torch.save({"backend": self.backend.state_dict_for_checkpoint(), "trained": sorted(self.trained),
                    "next_index": self.next_index, "counts": dict(self.counts),
                    "history": self.history}, tmp)
        tmp.replace(p)

    # -- input -------------------------------------------------------------------
    @consume("rollout.completed", durable="trainer", ack_wait=30.0, max_deliver=-1)
    async def on_completed(self, msg: m.RolloutCompleted, delivery) -> None:
        if self.finished.is_set():  # keep it for a later run that trains further
            raise Retry(30.0, "trainer finished its steps")
        if msg.eval or msg.group_index < 0:
            self.counts["eval_skipped"] += 1
            return
        if msg.traj_id in self.trained or msg.group_index in self.closed or \
                (self.cfg.rollout.stale == "wait" and msg.group_index < self.next_index):
            self.counts["late" if msg.traj_id not in self.trained else "duplicates"] += 1
            return
        g = self.groups.setdefault(msg.group_index, Group(msg.group_index))
        if any(t.traj_id == msg.traj_id for t, _ in g.members):
            self.counts["duplicates"] += 1  # redelivered while still buffered
            return
        if len(g.members) >= self.cfg.rollout.group_size:
            self.counts["extra"] += 1
            return
        fut = asyncio.get_running_loop().create_future()
        g.members.append((msg, fut))
        async with self.changed:
            self.changed.notify_all()
        await fut  # resolved once trained and checkpointed (or dropped)

    @consume("dead", durable="trainer-dead", max_deliver=-1)
    async def on_dead(self, msg: m.DeadLetter, delivery) -> None:
        req = m.dead_request(msg)
        if req is None:
            return
        if req.group_index >= self.next_index and req.group_index not in self.closed and not req.eval:
            self.groups.setdefault(req.group_index, Group(req.group_index)).dead += 1
            async with self.changed:
                self.changed.notify_all()

    # -- the loop ----------------------------------------------------------------
    async def main(self) -> None:
        if self.version > 0:
            await self._publish()  # a resumed run re-announces its weights
        t_start = time.perf_counter() - (self.history[-1]["wall_s"] if self.history else 0.0)
        while self.version < self.cfg.trainer.steps:
            t0 = time.perf_counter()
            batch = await self._next_batch()
            metrics = await self._step(batch, wait_s=time.perf_counter() - t0, t_start=t_start)
            if self.on_step is not None:
                self.on_step(metrics)
        for fut in self.unacked:
            fut.done() or fut.set_result(None)
        self.finished.set()
        for g in list(self.groups.values()):  # buffered, never trained: back to the stream
            for _, fut in g.members:
                fut.done() or fut.set_exception(Retry(30.0, "trainer finished its steps"))
        self.groups.clear()

    async def _next_batch(self) -> list[Group]:
        r = self.cfg.rollout
        async with self.changed:
            while True:
                batch, stale, failed = select_batch(
                    self.groups, next_index=self.next_index, version=self.version, alpha=r.alpha,
                    stale=r.stale, batch_groups=r.batch_groups, need=r.group_size,
                    size=r.group_size + r.redundancy)
                for g in failed:
                    self._release(g)
                    self.counts["groups_failed"] += 1
                for g in stale:
                    self._release(g)
                    await self._restart(g) if r.stale == "restart" else None
                    self.counts["stale_restarted" if r.stale == "restart" else "stale_dropped"] += 1
                if batch:
                    for g in batch:
                        del self.groups[g.index]
                        self.closed.add(g.index)
                    if r.stale == "wait":
                        self.next_index = batch[-1].index + 1
                    return batch
                await self.changed.wait()

    def _release(self, g: Group) -> None:
        self.groups.pop(g.index, None)
        self.closed.add(g.index)
        for _, fut in g.members:
            fut.done() or fut.set_result(None)

    async def _restart(self, g: Group) -> None:
        """Roll a stale group's task out again under a fresh group index."""
        t = g.members[0][0]
        n = self.cfg.rollout.group_size + self.cfg.rollout.redundancy
        idx = 10**9 + g.index * 100 + t.attempt
        gid = f"{t.group_id}-r{t.attempt}"
        for i in range(n):
            await self.publish("rollout.requested", m.RolloutRequested(
                traj_id=f"{gid}-{i}", group_id=gid, env=t.env, seed=t.seed, index_in_group=i,
                admitted_version=self.version, min_version=self.version, group_index=idx,
                created_at=time.time()), msg_id=f"req:{self.run}:{gid}-{i}")

    async def _step(self, batch: list[Group], *, wait_s: float, t_start: float) -> dict:
        from rollart.actors.train_batch import build_samples, loss_config, trajectory_stats

        trajs = [t for g in batch for t, _ in g.members[: self.cfg.rollout.group_size]]
        v = self.version
        samples = build_samples(trajs, [g.index for g in batch for _ in g.members[: self.cfg.rollout.group_size]],
                                self.cfg.trainer.advantage)
        t0 = time.perf_counter()
        tm = await asyncio.to_thread(self.backend.train_step, samples, loss_cfg=loss_config(self.cfg.trainer))
        train_s = time.perf_counter() - t0
        for t in trajs:
            self.trained.add(t.traj_id)
        out = {"step": self.version, "version": self.version, "train_s": train_s, "wait_s": wait_s,
               **trajectory_stats(trajs, v),
               **{k: float(x) for k, x in tm.items() if isinstance(x, (int, float))},
               **{f"count_{k}": x for k, x in self.counts.items()},
               "traj_ids": [t.traj_id for t in trajs],
               "traj_min_versions": [t.min_version for t in trajs]}
        t1 = time.perf_counter()
        out["wall_s"] = t1 - t_start
        self.history.append(out)
        checkpointed = (self.version % self.cfg.trainer.checkpoint_every == 0
                        or self.version >= self.cfg.trainer.steps)
        if checkpointed:  # the checkpoint holds the metrics, so the record matches the model
            await asyncio.to_thread(self._save_checkpoint)
        self._write_metrics(out)
        await self._publish()
        out["publish_s"] = time.perf_counter() - t1
        self.unacked += [f for g in batch for _, f in g.members]
        if checkpointed:
            for fut in self.unacked:
                fut.done() or fut.set_result(None)
            self.unacked = []
        return out

    async def _publish(self) -> None:
        v = self.version
        t = self.cfg.trainer
        path = self.path / "weights" / f"v{v:06d}.safetensors"
        digest = await asyncio.to_thread(self.backend.save_weights, path)
        uri = path.resolve().as_uri()
        if t.weights == "object":
            data = path.read_bytes()
            store = await self.bus.object_store(m.object_bucket(self.run))
            await store.put(f"v{v:06d}", data)
            uri, digest = f"obj://{m.object_bucket(self.run)}/v{v:06d}", sha256_digest(data)
        pub = m.PolicyPublished(version=v, uri=uri, digest=digest, created_at=time.time())
        await self.publish("policy.published", pub, msg_id=f"policy:{self.run}:{v}:{digest[7:23]}")
        await set_policy(self.bus, self.run, pub)
        for old in sorted((self.path / "weights").glob("v*.safetensors"))[: -max(1, t.keep_weights)]:
            old.unlink(missing_ok=True)

    def _rewrite_metrics(self) -> None:
        """After a resume: the record is what the checkpoint holds, nothing after it."""
        import json

        p = self.path / "metrics.jsonl"
        tmp = p.with_suffix(".tmp")
        tmp.write_text("".join(json.dumps(r) + "\n" for r in self.history))
        tmp.replace(p)

    def _write_metrics(self, metrics: dict) -> None:
        import json

        with (self.path / "metrics.jsonl").open("a") as f:
            f.write(json.dumps(metrics) + "\n")

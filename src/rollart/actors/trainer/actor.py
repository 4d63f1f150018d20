"""Trainer: completed trajectories become gradient steps; new weights go out as messages.

Each ``rollout.completed`` delivery stays un-acked (held by heartbeats) until the step
that used it has been checkpointed, so a killed trainer loses nothing: what it had
buffered is redelivered, and what it had trained is skipped by id on resume. A checkpoint is
small (the ledger and a journal of the steps since the last full checkpoint); the full one,
model and optimizer, is written every few steps in the background, and a resume trains the
journaled steps again (:mod:`rollart.actors.trainer.checkpoint`).

This module is the actor: its state, set-up and resume, and the handlers of what comes in
(which completions it takes: :class:`rollart.actors.groups.admission.Admission`; where each group
stands: :class:`rollart.actors.groups.ledger.GroupLedger`). The step loop is
:mod:`rollart.actors.trainer.steps`, the announcements of weights and KV records
:mod:`rollart.actors.trainer.publish`, the run's files :mod:`rollart.actors.trainer.files`.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import deque
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from rollart import messages as m
from rollart.actors.groups.admission import RESTART_BASE, Admission, issued_key
from rollart.actors.kernel.base import Actor, Reject, Retry, consume
from rollart.actors.groups.ledger import GroupLedger, HeldGroup
from rollart.actors.kernel.records import decode_entry
from rollart.actors.kernel.runtime import decode_core
from rollart.actors.trainer.checkpoint import Checkpoints, replay
from rollart.actors.trainer.files import RunFiles
from rollart.actors.trainer.publish import GUARDED_KEYS, KvGuard, WeightPublisher
from rollart.actors.trainer.steps import StepLoop
from rollart.bus import BusError, Subscription
from rollart.config import ActorConfig, RunConfig
from rollart.config.schema import trainer_buffer  # RunConfig checks checkpoint_every against it
from rollart.engines.provision import model_dir
from rollart.telemetry import tracing

log = logging.getLogger(__name__)

HAND_BACK_S = 2.0
"""Redelivery delay of what a finished or stopping trainer hands back (groups admitted ahead
within alpha, steps after the last checkpoint): short, because the next process of the run (a
``--resume``, a restarted head) takes them at once (a 30 s delay made a prompt resume's first
step wait 15-25 s); not zero, so that a finished trainer whose node still runs its final
evaluation fetches them only every few seconds."""


class RunFailed(RuntimeError):
    """The circuit breaker stopped the run: failures are systematic, not transient."""


@dataclass(kw_only=True, eq=False)
class Trainer(StepLoop, Actor):
    role = "trainer"
    cfg: RunConfig
    """The whole :class:`rollart.config.RunConfig`."""
    model_dir: str
    run_path: str
    """``<run_dir>/<run>``: weights, checkpoints, metrics."""
    resume: bool = False
    on_step: Any = None
    """Optional callback ``fn(metrics: dict)`` after each step (progress display)."""
    before_training: Any = None
    """Optional ``async fn()`` awaited once before the first step's clock starts: ``rollart
    run`` waits there for its node processes to start (set-up, not a step's time)."""

    # -- state made by setup() -----------------------------------------------------
    loggers: Any = field(default=None, init=False, repr=False)
    """The open metric loggers (``telemetry.loggers``, :mod:`rollart.telemetry.loggers`)."""
    backend: Any = field(default=None, init=False, repr=False)
    """The training backend (:class:`rollart.engines.torch_trainer.TorchTrainBackend`)."""
    ledger: GroupLedger = field(default=None, init=False, repr=False)
    """Every training group's state; persisted with the checkpoint."""
    admission: Admission = field(default=None, init=False, repr=False)
    files: RunFiles = field(default=None, init=False, repr=False)
    ckpt: Checkpoints = field(default=None, init=False, repr=False)
    """The durable state, the journal and the full checkpoint in the background."""
    kv_guard: KvGuard = field(default=None, init=False, repr=False)
    weights: WeightPublisher = field(default=None, init=False, repr=False)
    issued: int | None = field(default=None, init=False)
    """The highest issued-group count of the training scheduler seen in KV."""
    counts: dict[str, int] = field(
        default_factory=lambda: {"eval_skipped": 0, "kv_restored": 0, "schedule_held": 0,
                                 "skipped_while_training": 0},
        init=False)
    unacked: list[asyncio.Future] = field(default_factory=list, init=False, repr=False)
    """Futures of the deliveries of closed groups: resolved (acked) by the next checkpoint."""
    changed: asyncio.Condition = field(default_factory=asyncio.Condition, init=False, repr=False)
    """Notified when a delivery is held (the step loop looks at the ledger again)."""
    stepped: asyncio.Condition = field(default_factory=asyncio.Condition, init=False, repr=False)
    """Notified after each step (:attr:`version` is the new one)."""
    finished: asyncio.Event = field(default_factory=asyncio.Event, init=False, repr=False)
    """Set when the trainer is done: its steps taken, or stopped by :attr:`failure`."""
    failure: str | None = field(default=None, init=False)
    waiting: str = field(default="", init=False)
    """What the trainer waits for, when it has waited ``trainer.stall_after`` for a batch."""
    history: deque[dict] = field(default_factory=lambda: deque(maxlen=64), init=False, repr=False)
    """The latest steps' metrics (the whole record is ``metrics.jsonl``)."""
    wall_s: float = field(default=0.0, init=False)
    """Training wall time before this process (a resumed run continues the clock)."""
    entropy_coef: float = field(default=0.0, init=False)
    """The next step's entropy coefficient (``trainer.entropy_target`` adapts it; kept in
    the durable state)."""
    started_at: float = field(default=0.0, init=False)
    """Wall-clock start of training, earlier by :attr:`wall_s` (for `rollart top`)."""
    nodes: dict[str, m.NodeHeartbeat] = field(default_factory=dict, init=False, repr=False)
    """The latest heartbeat of each node (who serves what, for the wait report)."""
    lost_max: int = field(default=0, init=False)
    """The most groups the trainer ever reported lost (a resume may restart below it)."""
    end_published: bool = field(default=False, init=False)
    """The end of training was stored (:mod:`rollart.actors.kernel.run_end`)."""
    skipped: list[HeldGroup] = field(default_factory=list, init=False, repr=False)
    """Groups skipped for uniform rewards since the last step (``trainer.skip_uniform``)."""
    trace_heads: dict[str, dict[str, str]] = field(default_factory=dict, init=False, repr=False)
    """Tracing on: traj_id -> its ``traceparent``, for the step that trains it."""
    _hb_sub: Subscription | None = field(default=None, init=False, repr=False)

    @classmethod
    def from_config(cls, run_cfg: RunConfig, actor_cfg: ActorConfig, *, pool: str,
                    index: int = 0) -> "Trainer":
        buf = trainer_buffer(run_cfg.rollout, run_cfg.trainer.skip_uniform)
        held = {"max_inflight": buf, "max_ack_pending": 2 * buf}
        return cls.configured(
            actor_cfg, {"run": run_cfg.run, "pool": pool, "cfg": run_cfg,
                        "model_dir": str(model_dir(run_cfg)),
                        "run_path": str(Path(run_cfg.run_dir) / run_cfg.run)},
            handlers={h: held for h in ("on_completed", "on_dead", "on_cancelled")})

    # -- state -------------------------------------------------------------------
    async def setup(self) -> None:
        t, r = self.cfg.trainer, self.cfg.rollout
        self.backend = await asyncio.to_thread(self.build_backend)
        self.entropy_coef = t.entropy_coef
        if self.cfg.telemetry.loggers:  # TensorBoard, wandb, MLflow: metrics.jsonl's rows too
            from rollart.telemetry.loggers import open_loggers

            self.loggers = await asyncio.to_thread(open_loggers, self.cfg, self.run_path)
        breaker = r.fail_after_groups if r.fail_after_groups is not None else 2 * r.batch_groups
        self.ledger = GroupLedger(group_size=r.group_size, redundancy=r.redundancy,
                                  batch_groups=r.batch_groups, alpha=r.alpha, stale=r.stale,
                                  breaker=breaker)
        self.admission = Admission(r, dict(self.cfg.envs))
        self.files = RunFiles(self.run_path)
        self.files.make()
        self.ckpt = Checkpoints(self.files, t, bus=self.bus, run=self.run, name=self.name,
                                object_store=t.checkpoint_store == "object")
        if self.resume:
            await asyncio.to_thread(self._load_checkpoint)
        self.kv_guard = KvGuard(self, self.counts)
        self.weights = WeightPublisher(
            self, t, self.files.weights, self.backend, self.kv_guard,
            announced_max=max([self.version] + self.files.weight_versions()))
        self.lost_max = self.ledger.lost
        if self.resume:
            kv = await self.bus.key_value(m.kv_bucket(self.run))
            prev = decode_entry(await kv.get(m.LEDGER_KEY), m.LedgerSummary)
            if prev is not None:
                self.lost_max = max(self.lost_max, prev.lost)
        self._hb_sub = await self.bus.subscribe(self.subject("node.heartbeat"), self._on_heartbeat)

    def build_backend(self) -> Any:
        """The training backend (blocking, run in a thread): ``trainer.backend`` of the config.
        A subclass (``actors.trainer.type``) may build another, e.g. the emulated one of
        :mod:`rollart.emulate.trainer`."""
        # optional dependency: the backend imports torch (a trainer process has it)
        from rollart.engines.train_backends import make_backend

        return make_backend(self.cfg, self.model_dir)

    async def teardown(self) -> None:
        await self._hb_sub.unsubscribe()
        if self.weights is not None:
            await self.weights.close()
        try:  # a full checkpoint being written is finished (its thread would be anyway)
            if self.ckpt is not None:
                await self.ckpt.wait()
        except Exception:  # the durable state holds the run without it
            log.exception("%s: the last full checkpoint failed", self.name)
        if self.loggers is not None:
            await asyncio.to_thread(self.loggers.close)
        # trainer ranks (trainer.world_size > 1) stop with the actor, not at the process's
        # exit: a process that embeds the trainer (tests, a service) may start another, and a
        # sharded trainer's default process group must be left for it
        shutdown = getattr(getattr(self, "backend", None), "shutdown", None)
        if shutdown is not None:
            await asyncio.to_thread(shutdown)

    async def _on_heartbeat(self, req) -> None:
        hb = decode_core(m.NodeHeartbeat, req)
        if hb is None:  # junk on a core subject: counted and dropped
            return
        self.nodes[hb.node_id] = hb
        if len(self.nodes) > 1024:  # forget the longest silent
            del self.nodes[min(self.nodes, key=lambda k: self.nodes[k].ts)]

    @property
    def version(self) -> int:
        return self.backend.version

    @property
    def path(self) -> Path:
        """``<run_dir>/<run>``, the run's folder (:class:`RunFiles`)."""
        return self.files.path

    def _load_checkpoint(self) -> None:
        """Resume: the last full checkpoint, then the journal's steps after it trained again
        (:func:`rollart.actors.trainer.checkpoint.replay`), the durable state's ledger."""
        state = self.files.load_checkpoint()
        durable = self.files.load_state()
        if state is None and durable is None:
            log.warning("no checkpoint at %s: starting from scratch", self.files.folder)
            self.files.rewrite_metrics(self.version)  # rows of steps no checkpoint holds are trained again
            return
        if state is not None:
            self.backend.load_checkpoint_state(state["backend"])
        held = state.get("journal_seq") if state is not None else 0
        if durable is not None and held is not None and durable["seq"] >= held:
            from rollart.actors.trainer.batch import loss_config  # optional: imports torch

            full_version = self.version
            took = replay(self.files, self.backend, after=held, upto=durable["seq"],
                          advantage=self.cfg.trainer.advantage, loss_cfg=loss_config(self.cfg.trainer),
                          trainer_cfg=self.cfg.trainer)
            if self.version != durable["version"]:
                raise ValueError(
                    f"{self.files.state}: the journal's steps {held + 1}..{durable['seq']} trained "
                    f"again reach version {self.version}, the state says {durable['version']}")
            self.ledger.load(durable["ledger"])
            self.counts.update(durable.get("counts", {}))
            self.wall_s = durable.get("wall_s", 0.0)
            self.entropy_coef = durable.get("entropy_coef", self.entropy_coef)
            self.ckpt.resumed(seq=durable["seq"], full_seq=held, full_version=full_version)
            self.files.rewrite_metrics(self.version)
            log.info("resumed at version %d with %d trained groups: the full checkpoint of "
                     "version %d and %d journaled steps trained again in %.2fs", self.version,
                     self.ledger.trained, full_version, len(took), sum(took))
            return
        self.ckpt.resumed(seq=self.version, full_seq=self.version, full_version=self.version)
        if "ledger" in state:
            self.ledger.load(state["ledger"])
        elif "next_index" in state:  # a checkpoint from before the ledger: groups below are done
            self.ledger.load({"closed": {"low": state["next_index"]}, "next_index": state["next_index"],
                              "lost": 0, "trained": state["next_index"], "streak": 0})
        self.counts.update(state.get("counts", {}))
        self.wall_s = state.get("wall_s", (state.get("history") or [{}])[-1].get("wall_s", 0.0))
        self.entropy_coef = state.get("entropy_coef", self.entropy_coef)
        self.files.rewrite_metrics(self.version)
        log.info("resumed at version %d with %d trained groups", self.version, self.ledger.trained)

    def _durable_state(self) -> dict[str, Any]:
        return {"version": self.version, "ledger": self.ledger.state(), "counts": dict(self.counts),
                "wall_s": self.history[-1]["wall_s"] if self.history else self.wall_s,
                "entropy_coef": self.entropy_coef}

    def _full_state(self) -> dict[str, Any]:
        """What a full checkpoint holds (live tensors: :class:`Checkpoints` copies them)."""
        return {"backend": self.backend.state_dict_for_checkpoint(), **self._durable_state()}

    async def _checkpoint(self, *, final: bool = False) -> dict[str, float]:
        """Make the steps so far durable (journal, then state; with ``trainer.checkpoint_store:
        object`` in the run's object store too, :mod:`rollart.actors.trainer.checkpoint_store`), before
        the deliveries they cover are acked; a full checkpoint when one is due (``final``: the
        last step's, waited for). Returns the seconds of the durable state and the seconds
        the step waited for a full checkpoint."""
        out = {"state_s": await self.ckpt.commit(self._durable_state())}
        if self.ckpt.full_due(self.version, final=final):
            t0, gathered = time.perf_counter(), None
            if getattr(self.backend, "gathers_state", False):  # sharded ranks: collectives that
                # gather every shard, off the event loop (see Fsdp2TrainBackend.gathers_state)
                gathered = await asyncio.to_thread(self.backend.state_dict_for_checkpoint)
            gather_s = time.perf_counter() - t0
            out["full_block_s"] = gather_s + await self.ckpt.start_full(
                self._full_state if gathered is None else self._durable_state, self.version,
                final=final, fresh=None if gathered is None else {"backend": gathered})
            del gathered
            if final:
                t0 = time.perf_counter()
                await self.ckpt.wait()
                out["full_block_s"] += time.perf_counter() - t0
        return out

    async def _publish(self) -> None:
        """Announce the current weights: ``policy.published`` and KV ``policy.version``
        (:class:`rollart.actors.trainer.publish.WeightPublisher`)."""
        await self.weights.publish()

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
            raise Retry(HAND_BACK_S, "trainer finished its steps")
        why = await self._not_admitted(msg)
        if why:
            self.ledger.not_admitted()
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
            verdict = self.ledger.take_verdict(fut)
            if verdict:
                raise Reject(verdict)

    async def _not_admitted(self, msg: m.RolloutCompleted) -> str | None:
        """Why a training completion is not one admission issued (None: it is); see
        :class:`rollart.actors.groups.admission.Admission`. The issued count is read from KV again
        before a refusal (the watch may lag); a KV that cannot be read is retried later."""
        def check() -> str | None:
            lost = max(self.lost_max, self.ledger.lost)
            return self.admission.check(msg, ledger=self.ledger, version=self.weights.announced_max,
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
            raise Retry(HAND_BACK_S, "trainer finished its steps")
        fut = asyncio.get_running_loop().create_future()
        if self.ledger.add_dead(req.traj_id, req.group_index, msg.reason, fut):
            await self._hold(fut)

    @consume("rollout.cancelled", durable="trainer-cancelled", max_deliver=-1)
    async def on_cancelled(self, msg: m.RolloutCancelled, delivery) -> None:
        if msg.group_index < 0:
            return
        if self.finished.is_set():
            raise Retry(HAND_BACK_S, "trainer finished its steps")
        fut = asyncio.get_running_loop().create_future()
        if self.ledger.add_cancelled(msg.traj_id, msg.group_index, fut):
            await self._hold(fut)

    # Only the trainer announces policy versions (DESIGN.md §5b); nothing else consumes these
    # durably, so the trainer checks them: the runtime dead-letters what does not decode or
    # validate, and these handlers what no trainer of this run can have produced.
    @consume("policy.published", max_inflight=4)
    async def on_policy_published(self, msg: m.PolicyPublished, delivery) -> None:
        self._check_policy_version("policy.published", msg.version)
        own = self.weights.announced.get(msg.version)
        top = self.weights.announced_max
        if msg.version > top or (own is not None and own != msg.digest):
            raise Reject(f"not_admitted: policy.published v{msg.version} ({msg.digest[:40]}) "
                         f"is not an announcement of this trainer (it announced up to "
                         f"v{top}{f', v{msg.version} as {own}' if own else ''})")

    @consume("policy.loaded", max_inflight=4)
    async def on_policy_loaded(self, msg: m.PolicyLoaded, delivery) -> None:
        self._check_policy_version("policy.loaded", msg.version)
        self.weights.loaded(msg)  # the generation pauses of a version, for the metrics row

    def _check_policy_version(self, what: str, version: int) -> None:
        steps = self.cfg.trainer.steps
        if version > steps:
            raise Reject(f"invalid: {what} v{version} is beyond any version of this run "
                         f"(trainer.steps = {steps})")

    # -- the loop ----------------------------------------------------------------
    async def main(self) -> None:
        # KV watchers that live as long as training (each logs its own errors)
        watchers = asyncio.gather(*(self.kv_guard.guard(k) for k in GUARDED_KEYS),
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
        try:
            kv = await self.bus.key_value(m.kv_bucket(self.run))
            async for e in kv.watch(issued_key()):
                self._see_issued(e)
        except BusError as e:  # completions then read KV themselves
            log.warning("%s: cannot watch the issued count: %s", self.name, e)

    def _finish(self) -> None:
        self.finished.set()
        self.draining()

    def draining(self) -> None:
        """Hand back what no checkpoint holds (redelivered to a later run: buffered groups,
        steps after the last checkpoint); the last checkpoint already acked the rest."""
        for fut in self.unacked:
            fut.done() or fut.set_exception(
                Retry(HAND_BACK_S, "trainer stopped before a checkpoint"))
        self.unacked = []
        for fut in self.ledger.hand_back():
            fut.done() or fut.set_exception(Retry(HAND_BACK_S, "trainer stopped"))

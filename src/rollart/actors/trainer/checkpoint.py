"""The trainer's checkpoints: a small durable state at every checkpoint, the full one (model
and optimizer) every few steps in the background, and the replay that joins them on resume.

A full checkpoint of a real model is large (model + AdamW moments in fp32: 16 bytes a
parameter, ~24 GB at 1.5B) and the trainer acks a trajectory only once a checkpoint holds
it, so writing one per step would cost the run its step time. What makes a crash lose
nothing is cheaper: the ledger (which groups are settled), the counters, and for every step
since the last full checkpoint the trajectories it trained on, in the order it used them, and
the RNG state it started from (a :class:`StepRecord`, the *journal*). Given the last full
checkpoint, retraining those steps in order gives the same weights (same batches, same loss
settings, same RNG draws; bit for bit on CPU, where the kernels are deterministic), so:

- every ``trainer.checkpoint_every`` steps the trainer writes the new records, then the
  durable state (``state.json``, atomically: temp file, fsync, rename; it records each
  record's SHA-256, so a record changed or swapped later is refused before it is decoded),
  and only then acks the deliveries it covers (:meth:`Checkpoints.commit`);
- every ``trainer.full_checkpoint_every`` steps (or ``trainer.full_checkpoint_s`` seconds)
  it copies model, optimizer, scheduler and RNG to CPU memory (the only part the step waits
  for) and a thread writes them while the next steps train (:meth:`Checkpoints.start_full`);
  one write at a time: the next full checkpoint waits for the previous one. It is a new
  file (safetensors and a msgspec record, :mod:`rollart.engines.checkpoint_codec`: never a
  pickle); once it is durable the durable state is written again naming it with its SHA-256,
  and only then are the previous one and the records it holds deleted: a crash at any point
  leaves a state whose full checkpoint and records are there;
- on resume the trainer loads the last full checkpoint and retrains the journal's steps after
  it (:func:`replay`), then continues. Nothing is trained twice (the ledger of the durable
  state closed those groups; the replay is the same steps, not new ones) and nothing is lost
  (the journal holds every trajectory that was acked but is not in the full checkpoint).

Why a journal and not the events stream: the trajectories are acked once the durable state
holds them, and the stream that carries ``rollout.completed`` keeps them only within its
LIMITS (age, bytes, messages: :data:`rollart.messages.STREAM_RETENTION`), which a long gap
between full checkpoints, or a busy run, can exceed; a payload offloaded to the trajectory
store is deleted once acked. The journal is written by the trainer itself and deleted only
when a full checkpoint made it useless, whatever the stream's limits.

Replicated ranks (``trainer.world_size``, ``trainer.shard: none``) hold the whole model and
optimizer, bit-identical after every step (:mod:`rollart.engines.trainer_ranks`), so rank 0's
full checkpoint is every rank's, and per-rank files would be N copies of it. Sharded ranks
(``trainer.shard: fsdp2``, :mod:`rollart.engines.fsdp2_ranks`) gather their shards to rank 0
in the same layout when :meth:`state_dict_for_checkpoint` is asked (every rank takes part),
so the file, its SHA-256 and a resume at any world size are the same.
"""

from __future__ import annotations

import asyncio
import copy
import dataclasses
import hashlib
import logging
import time
from collections.abc import Callable
from typing import Any

import msgspec

from rollart import messages as m
from rollart.actors.trainer.files import FullRef, RunFiles, check_record, unchecked_warning
from rollart.config import TrainerConfig

log = logging.getLogger(__name__)


class StepRecord(msgspec.Struct, kw_only=True):
    """One journaled step: what replaying it needs."""

    seq: int
    """The step's sequence number (1, 2, ...; a step whose update was skipped for a
    non-finite gradient has one too, without changing the version)."""
    version: int
    """The policy version the step started from."""
    groups: list[int]
    """The group index of each trajectory (the advantage baseline's groups)."""
    trajectories: list[m.RolloutCompleted]
    """The trajectories the step trained on, in the order it used them."""
    rng: dict[str, bytes] = {}
    """The RNG states the step started from (``torch``; ``cuda`` on a GPU)."""
    entropy_coef: float | None = None
    """The step's entropy coefficient (``trainer.entropy_target`` adapts it; None: the
    config's)."""


_encoder = msgspec.msgpack.Encoder()
_decoder = msgspec.msgpack.Decoder(StepRecord)


def rng_state(backend: Any) -> dict[str, bytes]:
    """The torch RNG states of ``backend``'s process and device (LoRA dropout draws from
    them; the rollout engine has a generator of its own)."""
    import torch  # optional dependency: a trainer process has it

    out = {"torch": torch.get_rng_state().numpy().tobytes()}
    dev = getattr(backend, "device", None)
    if dev is not None and dev.type == "cuda":
        out["cuda"] = torch.cuda.get_rng_state(dev).numpy().tobytes()
    return out


def set_rng_state(backend: Any, rng: dict[str, bytes]) -> None:
    import torch  # optional dependency: a trainer process has it

    if "torch" in rng:
        torch.set_rng_state(torch.frombuffer(bytearray(rng["torch"]), dtype=torch.uint8))
    dev = getattr(backend, "device", None)
    if "cuda" in rng and dev is not None and dev.type == "cuda":
        torch.cuda.set_rng_state(torch.frombuffer(bytearray(rng["cuda"]), dtype=torch.uint8), dev)


def snapshot(obj: Any, *, copy_tensors: bool = True) -> Any:
    """A copy of ``obj`` on CPU that the next step cannot change: every tensor copied (views
    of one storage, such as tied embeddings, stay one copy), containers rebuilt, the rest
    deep-copied. ``copy_tensors=False`` (the last step's checkpoint: no step follows to
    change them): tensors already on the CPU are kept as they are, which saves the copy's 16
    bytes a parameter (fp32 weights and AdamW state) at the run's peak."""
    import torch  # optional dependency: a trainer process has it

    seen: dict[tuple, torch.Tensor] = {}

    def copy_of(x: Any) -> Any:
        if isinstance(x, torch.Tensor):
            t = x.detach()
            key = (t.untyped_storage().data_ptr(), t.storage_offset(), tuple(t.shape),
                   t.stride(), t.dtype, t.device)
            if key not in seen:
                seen[key] = t.to("cpu", copy=copy_tensors or t.device.type != "cpu")
            return seen[key]
        if isinstance(x, dict):
            return {k: copy_of(v) for k, v in x.items()}
        if isinstance(x, list):
            return [copy_of(v) for v in x]
        if isinstance(x, tuple):
            return tuple(copy_of(v) for v in x)
        if x is None or isinstance(x, (bool, int, float, str, bytes)):
            return x
        return copy.deepcopy(x)

    return copy_of(obj)


def replay(files: RunFiles, backend: Any, *, after: int, upto: int, advantage: str,
           loss_cfg: Any, trainer_cfg: Any = None) -> list[float]:
    """Train the journal's steps ``after + 1 .. upto`` again, in order, on ``backend`` (loaded
    from the full checkpoint that holds step ``after``); returns each step's seconds.
    ``trainer_cfg`` (``schedule_clock``): whether each step moved the LR schedule (None:
    every step did). Blocking. A missing or unreadable record, one whose bytes are not the
    ones whose SHA-256 the durable state records (:class:`CheckpointRefused`, checked before
    it is decoded), or a step that does not start from the version it started from before,
    raises ``ValueError`` naming it: continuing would train on other weights than the run
    published."""
    from rollart.actors.trainer.batch import advances_schedule, build_samples  # imports torch

    loaded = files.load_state_head()
    head = loaded[1] if loaded is not None else None
    if head is not None and upto > after:
        unchecked_warning(head, str(files.state))
    took = []
    for seq in range(after + 1, upto + 1):
        try:
            data = files.read_journal(seq)
        except FileNotFoundError:
            raise ValueError(f"{files.journal_path(seq)} is missing: the durable state "
                             f"({files.state}) counts step {seq} and the full checkpoint holds "
                             f"steps up to {after} only") from None
        if head is not None:
            check_record(head, seq, data, str(files.journal_path(seq)))
        try:
            rec = _decoder.decode(data)
        except (msgspec.DecodeError, msgspec.ValidationError) as e:
            raise ValueError(f"{files.journal_path(seq)} does not decode: {e}") from None
        if rec.seq != seq or rec.version != backend.version:
            raise ValueError(f"{files.journal_path(seq)}: step {rec.seq} started from version "
                             f"{rec.version}, the trainer is at version {backend.version} after "
                             f"the steps before it")
        t0 = time.perf_counter()
        set_rng_state(backend, rec.rng)
        samples = build_samples(rec.trajectories, rec.groups, advantage)
        # the schedule moved (or held) as it did the first time: decided by the same rule
        cfg = dataclasses.replace(
            loss_cfg, entropy_coef=loss_cfg.entropy_coef if rec.entropy_coef is None
            else rec.entropy_coef,
            advance_schedule=advances_schedule(trainer_cfg, rec.trajectories, samples))
        backend.train_step(samples, loss_cfg=cfg)
        took.append(time.perf_counter() - t0)
    return took


class Checkpoints:
    """The trainer's checkpoints (see the module docstring): the journal's records waiting
    for the next durable state, and the one full checkpoint written in the background."""

    def __init__(self, files: RunFiles, cfg: TrainerConfig, *, bus: Any = None, run: str = "",
                 name: str = "trainer", object_store: bool = False):
        self.files = files
        self.cfg = cfg
        self.bus, self.run, self.name = bus, run, name
        self.object_store = object_store
        """``trainer.checkpoint_store: object``: records, state and full checkpoint are put in
        the run's object store too (:mod:`rollart.actors.trainer.checkpoint_store`)."""
        self.seq = 0
        """The last step recorded."""
        self.full_seq = 0
        """The last step the latest durable full checkpoint holds (0: none, the initial model)."""
        self.full_version = 0
        self.full: FullRef | None = None
        """The durable full checkpoint the durable state names (None: the initial model)."""
        self.durable_seq = 0
        """The last step the durable state counts."""
        self.last_state: dict[str, Any] | None = None
        """The state of the last commit (written again naming a new full checkpoint)."""
        self.journal_sha256: dict[int, str] = {}
        """Step -> the SHA-256 of its durable record, for the steps the journal holds (the
        durable state records them: ``journal_sha256``)."""
        self.state_lock = asyncio.Lock()
        """One durable state write (and its put in the object store) at a time: a commit and
        a finished full checkpoint never write the state over each other."""
        self.started = (0, 0)
        """``(seq, version)`` of the latest full checkpoint started (written or being written):
        the next one is due counting from it."""
        self.full_at = time.monotonic()
        """When the latest full checkpoint was started (``trainer.full_checkpoint_s``)."""
        self.pending: list[StepRecord] = []
        """Steps recorded since the last durable state."""
        self.task: asyncio.Task | None = None
        """The full checkpoint being written."""
        self.done: list[dict[str, float]] = []
        """Full checkpoints finished since :meth:`take_done` (for the metrics row)."""

    def resumed(self, *, seq: int, full_seq: int, full_version: int) -> None:
        """Continue after step ``seq``, the full checkpoint holding step ``full_seq`` (the
        one the durable state names)."""
        self.seq, self.full_seq, self.full_version = seq, full_seq, full_version
        loaded = self.files.load_state_head()
        self.full = loaded[1].full if loaded is not None else None
        self.durable_seq = seq
        if loaded is not None:
            self.last_state = {k: v for k, v in loaded[0].items()
                               if k not in ("format", "seq", "journal_from", "full",
                                            "journal_sha256")}
            digests = loaded[1].journal_sha256
            if digests is None:  # a format 2 state: the records just replayed, as they are
                digests = self.files.journal_digests(full_seq + 1, seq)
            self.journal_sha256 = {int(k): v for k, v in digests.items() if int(k) > full_seq}
        self.started = (full_seq, full_version)

    def record(self, version: int, groups: list[int], trajectories: list[m.RolloutCompleted],
               rng: dict[str, bytes], entropy_coef: float | None = None) -> None:
        """A step from ``version`` trained on ``trajectories``: journal it at the next commit."""
        self.seq += 1
        self.pending.append(StepRecord(seq=self.seq, version=version, groups=list(groups),
                                       trajectories=list(trajectories), rng=rng,
                                       entropy_coef=entropy_coef))

    async def commit(self, state: dict[str, Any]) -> float:
        """Make the recorded steps and ``state`` (ledger, counters, version) durable: the
        records, then ``state.json`` (and with the object store, their objects): after it
        returns the deliveries they cover may be acked. Returns its seconds."""
        t0 = time.perf_counter()
        async with self.state_lock:
            pending, self.pending = self.pending, []
            try:
                await self._write_state(state, pending, self.seq)
            except BaseException:
                self.pending = pending + self.pending  # written again by the next commit
                raise
        return time.perf_counter() - t0

    async def _write_state(self, state: dict[str, Any], pending: list[StepRecord],
                           seq: int) -> None:
        """The records ``pending``, then ``state`` counting steps up to ``seq`` and naming the
        current full checkpoint (and with the object store, their objects). Under
        :attr:`state_lock`."""
        start = self.full_seq + 1
        durable = {**state, "seq": seq, "journal_from": start,
                   "full": msgspec.to_builtins(self.full) if self.full is not None else None}

        def write() -> dict[int, str]:
            known = dict(self.journal_sha256)
            for rec in pending:
                data = _encoder.encode(rec)
                self.files.write_journal(rec.seq, data)
                known[rec.seq] = hashlib.sha256(data).hexdigest()
            self.files.save_state({**durable, "journal_sha256": {
                str(s): known[s] for s in range(start, seq + 1)}})
            return {s: d for s, d in known.items() if s >= start}

        self.journal_sha256 = await asyncio.to_thread(write)
        self.last_state, self.durable_seq = state, seq
        if self.object_store:
            # deferred: trainer.checkpoint_store: object only
            from rollart.actors.trainer.checkpoint_store import put_state

            await put_state(self.bus, self.run, self.files, [r.seq for r in pending],
                            what=self.name)

    def full_due(self, version: int, *, final: bool = False) -> bool:
        """Whether this checkpoint is a full one: the last step, ``trainer.full_checkpoint_every``
        versions since the previous one, or ``trainer.full_checkpoint_s`` seconds."""
        seq, last = self.started
        if self.seq <= seq:  # nothing trained since: the full checkpoint is current
            return False
        if final or version - last >= self.cfg.full_checkpoint_every:
            return True
        budget = self.cfg.full_checkpoint_s
        return budget is not None and time.monotonic() - self.full_at >= budget

    async def start_full(self, make_state: Callable[[], dict[str, Any]], version: int, *,
                         final: bool = False, fresh: dict[str, Any] | None = None) -> float:
        """Take a full checkpoint of the state ``make_state()`` returns (called on the event
        loop, where the handlers change the ledger; its tensors are copied in a thread, before
        the next step changes them) and write it in the background; waits for the previous
        one first. ``final``: the last step's, which no step follows, so CPU tensors are
        written as they are (the caller waits for the write). ``fresh``: more of the state,
        already a copy nothing else changes (sharded ranks' gathered tensors), added without a
        second copy. Returns the seconds the step
        waited (previous write, then the copy to CPU memory)."""
        t0 = time.perf_counter()
        await self.wait()
        if self.pending:
            raise RuntimeError("a full checkpoint is taken after the commit of the steps it "
                               "holds (their records would be missing from the durable state)")
        seq = self.seq
        live = {**make_state(), "journal_seq": seq}
        state = await asyncio.to_thread(snapshot, live, copy_tensors=not final)
        del live
        state.update(fresh or {})
        blocked = time.perf_counter() - t0
        self.full_at = time.monotonic()
        self.started = (seq, version)
        self.task = asyncio.create_task(self._write_full(state, seq, version, blocked),
                                        name=f"{self.name}-full-checkpoint")
        return blocked

    async def _write_full(self, state: dict[str, Any], seq: int, version: int,
                          blocked: float) -> None:
        t0 = time.perf_counter()
        ref = await asyncio.to_thread(self.files.save_checkpoint, state)
        size = ref.bytes
        del state  # the CPU copy: freed before the object store reads the file
        write_s = time.perf_counter() - t0
        if self.object_store:
            # deferred: trainer.checkpoint_store: object only
            from rollart.actors.trainer.checkpoint_store import put_full

            await put_full(self.bus, self.run, self.files, ref, what=self.name)
        prev, prev_ref = self.full_seq, self.full
        async with self.state_lock:  # the state names the new one: the old one may go
            self.full_seq, self.full_version, self.full = seq, version, ref
            if self.last_state is not None:
                await self._write_state(self.last_state, [], self.durable_seq)
        took = time.perf_counter() - t0
        gone = await asyncio.to_thread(self.files.prune_journal, seq)
        await asyncio.to_thread(self.files.prune_full, seq)
        if self.object_store:
            # deferred: trainer.checkpoint_store: object only
            from rollart.actors.trainer.checkpoint_store import delete_full, delete_journal

            await delete_journal(self.bus, self.run, sorted(set(gone) | set(range(prev + 1, seq + 1))))
            if prev_ref is not None and prev_ref.seq != seq:
                await delete_full(self.bus, self.run, prev_ref.seq)
        log.info("%s: full checkpoint at version %d: %d bytes in %.2fs (written %.2fs, the step "
                 "waited %.2fs for the copy); %d journaled steps dropped", self.name, version,
                 size, took, write_s, blocked, len(gone))
        self.done.append({"full_checkpoint_version": version, "full_checkpoint_s": took,
                          "full_checkpoint_bytes": size, "full_checkpoint_block_s": blocked})

    async def wait(self) -> None:
        """Wait for the full checkpoint being written; its failure is raised here (a full
        checkpoint that cannot be written stops the trainer: the journal would grow forever)."""
        task, self.task = self.task, None
        if task is not None:  # shielded: a cancelled waiter never stops a write half way
            await asyncio.shield(task)

    def take_done(self) -> dict[str, float]:
        """The latest full checkpoint finished since the last call (metrics row fields)."""
        out = self.done[-1] if self.done else {}
        self.done = []
        return out

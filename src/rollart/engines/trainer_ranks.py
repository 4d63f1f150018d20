"""Trainer ranks: one training step computed by ``trainer.world_size`` processes.

Rank 0 is the trainer on the bus (:class:`rollart.actors.trainer.actor.Trainer`): it takes the
batches, acks, checkpoints and publishes versions, and its backend is a
:class:`RankedTrainBackend`. Ranks 1..N-1 never touch the bus: each holds a replica of the
model and optimizer and, per step, receives the step's samples and loss settings from rank 0
(:meth:`RankedTrainBackend.serve`).

A step (every rank runs the same code on the same samples):

1. rank 0 broadcasts the samples (msgpack, no pickle) over the process group: their size
   first, which the other ranks check against a cap (:attr:`RankedTrainBackend.command_cap`,
   4 × the model's fp32 state + :data:`COMMAND_MARGIN_BYTES`) before they allocate for it;
2. each rank sorts them longest first and takes every N-th one from its rank on (balanced
   shares), and back-propagates its micro-batches with the weight ``units_k / units_total``
   where ``units_total`` is the aggregation denominator of the *whole* batch (token count,
   or sequence count: :func:`rollart.algos.reduce.agg_units`): every rank sees every
   sample, so the global counts are known before the loss is scaled and no per-rank mean is
   ever averaged; token-mean, seq-mean-token-sum and seq-mean-token-mean give the update of
   world size 1;
3. the gradients (one flat buffer) and the metric sums are all-reduced (sum), so every rank
   holds the full gradient: the clip uses the global norm and the optimizer steps are the
   same on every rank; the replicas stay bit-identical (checked every step: a fingerprint of
   the parameters, compared across ranks), so a version's weights and digest are rank 0's.

Rendezvous (:mod:`rollart.engines.rank_launch`): rank 0 opens a ``TCPStore`` (``trainer.master``, or 127.0.0.1 on a free port)
and writes what the others need into it (backend arguments, the model folder); without
``trainer.master`` it starts ranks 1..N-1 itself (``python -m rollart.app.trainer_rank``,
log ``<run>/logs/trainer-rank<R>.log``). Every collective has ``trainer.dist_timeout``; rank
0 pings idle ranks so they never time out between steps. A rank that dies fails the step
with :class:`RankFailed` naming it; the backend is then unusable (the trainer stops the run,
nothing of the step applied) and the other ranks are stopped.
"""

from __future__ import annotations

import datetime
import logging
import os
import subprocess
import threading
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import msgspec
import torch
import torch.distributed as dist

from rollart.algos.losses import LossConfig
from rollart.engines import checkpoint_codec
from rollart.engines.torch_trainer import TorchTrainBackend, as_loss_config
from rollart.engines.train_samples import TrainSample
from rollart.procs import describe_exit
from rollart.errors import TrainStepFailed

log = logging.getLogger(__name__)


COMMAND_MARGIN_BYTES = 1 << 30
"""Bytes a command may have beyond 4 × the model's fp32 state (:attr:`RankedTrainBackend.command_cap`):
a step's samples (~20 bytes a token: millions of tokens)."""
COMMAND_KINDS = ("step", "load", "ping", "stop")


class RankFailed(TrainStepFailed):
    """A trainer rank died, hung past ``trainer.dist_timeout``, or diverged."""


class CommandRefused(ValueError):
    """A command over the cap (rank 0: refused before it is sent; the other ranks: before
    anything is allocated for it), or bytes that are not a command."""


def checked_size(size: int, cap: int, *, rank: int) -> int:
    """``size``, the bytes rank 0 announced, if a buffer of that size may be allocated."""
    if not 0 <= size <= cap:
        raise CommandRefused(f"trainer rank {rank}: rank 0 announced a command of {size} bytes, "
                             f"more than the cap of {cap} bytes (4 × the model's fp32 state + "
                             f"{COMMAND_MARGIN_BYTES} for a step's samples)")
    return size


def decode_command(data: bytes, *, rank: int, kinds: tuple[str, ...] = COMMAND_KINDS) -> "_Command":
    """The command in ``data`` (msgpack, never a pickle), one of ``kinds``."""
    try:
        cmd = _command_decoder.decode(data)
    except (msgspec.DecodeError, msgspec.ValidationError) as e:
        raise CommandRefused(f"trainer rank {rank}: rank 0's command does not decode "
                             f"({len(data)} bytes: {str(e)[:200]})") from None
    if cmd.kind not in kinds:
        raise CommandRefused(f"trainer rank {rank}: rank 0's command {cmd.kind[:40]!r} is not "
                             f"one of {kinds}")
    return cmd


class _Command(msgspec.Struct, array_like=True):
    kind: str
    """``step``, ``load`` (a checkpoint's state, :func:`rollart.engines.checkpoint_codec.dumps`
    bytes), ``ping`` or ``stop``."""
    samples: list[TrainSample] = []
    loss: LossConfig | None = None
    state: bytes = b""
    name: str = ""
    """What a sharded backend's own commands name (a tensor, a folder:
    :mod:`rollart.engines.fsdp2_ranks`)."""


_command_decoder = msgspec.msgpack.Decoder(_Command)


class RankedTrainBackend(TorchTrainBackend):
    """A :class:`TorchTrainBackend` that is one rank of a process group (see the module
    docstring). Build rank 0 with :func:`start_ranks`, the others with :func:`serve_rank`."""

    kinds: tuple[str, ...] = COMMAND_KINDS
    """The commands ranks 1..N-1 take from rank 0."""
    own_kinds: tuple[str, ...] = ()
    """Those a subclass serves itself (:meth:`_serve_other`)."""

    def __init__(self, model_dir: str | os.PathLike, *, rank: int, world_size: int,
                 dist_timeout: float, **kwargs: Any) -> None:
        super().__init__(model_dir, **kwargs)
        self.rank, self.world_size, self.dist_timeout = rank, world_size, float(dist_timeout)
        self.pg: Any = None
        self.failed: str | None = None
        """Why this group is unusable (rank 0: every later step raises it)."""
        self.procs: dict[int, subprocess.Popen] = {}
        """Rank 0: the ranks it started, by rank."""
        self.logs: dict[int, Path] = {}
        state_bytes = sum(4 * t.numel() for t in self.model.parameters()) + sum(
            t.numel() * t.element_size() for t in self.model.buffers())
        self.command_cap = 4 * state_bytes + COMMAND_MARGIN_BYTES
        """Bytes a command may have: 4 × the model's fp32 state (a checkpoint's model, AdamW
        moments and scheduler: ~3 ×) + :data:`COMMAND_MARGIN_BYTES` (a step's samples). The
        other ranks never allocate more for what rank 0 announces."""
        self._lock = threading.Lock()
        self._sharding = False
        self._last_op = time.monotonic()
        self._stop = threading.Event()

    # -- the process group ----------------------------------------------------------
    def join(self, store: Any, *, address: str) -> None:
        """Create the process group over ``store`` (every rank calls it; ``address``: this
        host's address the other ranks reach) and give every rank rank 0's parameters."""
        self._make_group(store, address=address)
        with torch.no_grad():  # the trained parameters (LoRA: the adapters; the frozen base
            for t in self._params + list(self.model.buffers()):  # is every rank's own load)
                self._wait(self.pg.broadcast(t.data, 0))
        self._joined()

    def _joined(self) -> None:
        """After :meth:`join`: every rank holds rank 0's parameters (a sharded backend shards
        them here)."""

    def _make_group(self, store: Any, *, address: str) -> None:
        timeout = datetime.timedelta(seconds=self.dist_timeout)
        pg_store = dist.PrefixStore("pg", store)
        if self.device.type == "cuda":
            opts = dist.ProcessGroupNCCL.Options()
            opts._timeout = timeout
            self.pg = dist.ProcessGroupNCCL(pg_store, self.rank, self.world_size, opts)
        else:
            opts = dist.ProcessGroupGloo._Options()
            opts._timeout = timeout
            ifname = os.environ.get("GLOO_SOCKET_IFNAME")
            opts._devices = [dist.ProcessGroupGloo.create_device(interface=ifname) if ifname
                             else dist.ProcessGroupGloo.create_device(hostname=address)]
            self.pg = dist.ProcessGroupGloo(pg_store, self.rank, self.world_size, opts)

    def _wait(self, work: Any) -> None:
        work.wait()
        self._last_op = time.monotonic()

    def _allreduce(self, t: torch.Tensor, op: Any = None) -> None:
        if op is None:
            self._wait(self.pg.allreduce([t]))
        else:
            opts = dist.AllreduceOptions()
            opts.reduceOp = op
            self._wait(self.pg.allreduce([t], opts))

    def _broadcast_command(self, cmd: _Command | None) -> _Command:
        """Rank 0 sends ``cmd``; every other rank receives it. :class:`CommandRefused` over
        :attr:`command_cap` (rank 0 before any collective; the others before allocating)."""
        if self.rank == 0:
            raw = msgspec.msgpack.encode(cmd)
            if len(raw) > self.command_cap:
                raise CommandRefused(f"trainer rank 0: a {cmd.kind} command of {len(raw)} bytes, "
                                     f"more than the cap of {self.command_cap} bytes (4 × the "
                                     f"model's fp32 state + {COMMAND_MARGIN_BYTES} for a step's "
                                     f"samples): take smaller batches")
            size = torch.tensor([len(raw)], dtype=torch.int64)
        else:
            size = torch.zeros(1, dtype=torch.int64)
        self._wait(self.pg.broadcast(size, 0))
        buf = (torch.frombuffer(bytearray(raw), dtype=torch.uint8) if self.rank == 0
               else torch.empty(checked_size(int(size.item()), self.command_cap, rank=self.rank),
                                dtype=torch.uint8))
        if buf.numel():
            self._wait(self.pg.broadcast(buf, 0))
        return cmd if self.rank == 0 else decode_command(buf.numpy().tobytes(), rank=self.rank,
                                                         kinds=self.kinds)

    # -- the step (every rank) ------------------------------------------------------
    def micro_batches(self, samples: Sequence[TrainSample]) -> list[list[TrainSample]]:
        if not self._sharding:
            return super().micro_batches(samples)
        ordered = sorted(samples, key=lambda s: -len(s.token_ids))  # stable: the same everywhere
        return super().micro_batches(ordered[self.rank::self.world_size])

    def accumulate_gradients(self, samples: Sequence[TrainSample], *, loss_cfg: object = None) -> dict:
        """This rank's share of the micro-batches, weighted by the whole batch's aggregation
        units, then the gradients and metric sums all-reduced: every rank holds the gradient
        and the metrics of the whole batch."""
        self._sharding = True
        try:
            metrics = super().accumulate_gradients(samples, loss_cfg=loss_cfg)
        finally:
            self._sharding = False
        self._reduce_gradients()
        keys = [k for k in metrics if k not in ("tokens", "samples")]
        sums = torch.tensor([float(metrics[k]) for k in keys], dtype=torch.float64)
        self._allreduce(sums)
        metrics.update(zip(keys, sums.tolist()))
        return metrics

    def _reduce_gradients(self) -> None:
        """Every rank's gradients summed into every rank's (one flat all-reduce)."""
        grads = []
        for p in self._params:
            if p.grad is None:
                p.grad = torch.zeros_like(p)
            grads.append(p.grad)
        flat = torch.cat([g.reshape(-1) for g in grads])
        self._allreduce(flat)
        off = 0
        for g in grads:
            g.copy_(flat[off:off + g.numel()].view_as(g))
            off += g.numel()

    def _check_replicas(self) -> None:
        """Every rank's parameters are the same (a fingerprint, compared across ranks)."""
        with torch.no_grad():
            fp = torch.zeros(2, dtype=torch.float64)
            for i, p in enumerate(self._params):
                fp[0] += p.double().sum() * (1 + i % 7)
                fp[1] += p.double().abs().sum()
        both = torch.cat([fp, -fp])
        self._allreduce(both, dist.ReduceOp.MAX)
        if not torch.equal(both[:2], -both[2:]):
            raise RankFailed(f"trainer rank {self.rank}: the ranks' parameters differ after step "
                             f"{self.version} (fingerprints {both[:2].tolist()} vs "
                             f"{(-both[2:]).tolist()}): the replicas diverged")

    def _ranked_step(self, samples: Sequence[TrainSample], loss_cfg: object) -> dict:
        metrics = super().train_step(samples, loss_cfg=loss_cfg)
        self._check_replicas()
        metrics["world_size"] = self.world_size
        return metrics

    # -- rank 0 ---------------------------------------------------------------------
    def train_step(self, samples: Sequence[TrainSample], *, loss_cfg: object = None) -> dict:
        if self.rank != 0:
            raise RuntimeError("only rank 0 takes steps; the other ranks serve()")
        with self._lock:
            self._usable()
            cmd = _Command("step", list(samples), as_loss_config(loss_cfg))
            try:
                self._broadcast_command(cmd)
                return self._ranked_step(cmd.samples, cmd.loss)
            except ValueError:  # the batch's fault (no response tokens): the same on every
                raise           # rank, raised before any collective; the group stays usable
            except RankFailed as e:
                raise self._fail(str(e)) from None
            except Exception as e:  # noqa: BLE001 - a collective failed: dead or hung rank
                raise self._fail(self._why(e, f"step {self.version + 1}")) from None

    def load_checkpoint_state(self, state: Any) -> None:
        super().load_checkpoint_state(state)
        if self.rank != 0:
            return
        data = checkpoint_codec.dumps({k: state[k] for k in ("model", "optimizer", "scheduler",
                                                             "version", "lora") if k in state})
        with self._lock:
            self._usable()
            try:
                self._broadcast_command(_Command("load", state=data))
            except Exception as e:  # noqa: BLE001
                raise self._fail(self._why(e, "loading the checkpoint")) from None

    def _command(self, cmd: _Command, during: str, then: Any = None) -> Any:
        """Rank 0: send ``cmd`` to the other ranks and run ``then()`` (what every rank does
        for it), under the group's lock; a failure makes the group unusable (:class:`RankFailed`)."""
        with self._lock:
            self._usable()
            try:
                self._broadcast_command(cmd)
                return then() if then is not None else None
            except RankFailed as e:
                raise self._fail(str(e)) from None
            except Exception as e:  # noqa: BLE001 - a collective failed: dead or hung rank
                raise self._fail(self._why(e, during)) from None

    def _usable(self) -> None:
        if self.failed is not None:
            raise RankFailed(self.failed)

    def _dead(self, wait: float = 2.0) -> list[int]:
        """The ranks this process started that have exited (waiting up to ``wait`` s for a
        kill to be seen: the collective may fail before the process is reaped)."""
        deadline = time.monotonic() + wait
        while True:
            dead = [r for r, p in self.procs.items() if p.poll() is not None]
            if dead or time.monotonic() > deadline or not self.procs:
                return dead
            time.sleep(0.05)

    def _why(self, e: BaseException, during: str) -> str:
        dead = self._dead()
        err = str(e).strip().splitlines()[0][:300] if str(e).strip() else type(e).__name__
        if dead:
            return "; ".join(
                f"trainer rank {r} (pid {self.procs[r].pid}) died ({describe_exit(self.procs[r].returncode)}) "
                f"during {during}; see its log {self.logs.get(r)}" for r in dead)
        return (f"trainer ranks: a collective failed during {during} within trainer.dist_timeout "
                f"= {self.dist_timeout:g} s: a rank died or hangs ({type(e).__name__}: {err})")

    def _fail(self, why: str) -> RankFailed:
        if self.failed is None:
            self.failed = why
            log.error("%s; the trainer ranks are stopped", why)
        self.shutdown(kill=True)
        return RankFailed(self.failed)

    def _keepalive(self) -> None:
        """Ping idle ranks so their wait for the next command never reaches the timeout; a
        ping that fails marks the group failed (the next step says which rank)."""
        every = max(0.2, min(30.0, self.dist_timeout / 4))
        while not self._stop.wait(every / 2):
            if self.failed is not None:
                return
            if time.monotonic() - self._last_op < every or not self._lock.acquire(timeout=0):
                continue
            try:
                if self.failed is None and not self._stop.is_set():
                    self._broadcast_command(_Command("ping"))
            except Exception as e:  # noqa: BLE001
                self._fail(self._why(e, "an idle ping"))
            finally:
                self._lock.release()

    def shutdown(self, *, kill: bool = False, timeout: float = 10.0) -> None:
        """Rank 0: stop the other ranks (a ``stop`` command, then SIGKILL of those it started
        that did not exit). Idempotent."""
        if self.rank != 0 or self._stop.is_set():
            return
        self._stop.set()
        if not kill and self.failed is None and self.pg is not None:
            got = self._lock.acquire(timeout=timeout)
            try:
                if got and self.failed is None:
                    self._broadcast_command(_Command("stop"))
            except Exception:  # noqa: BLE001 - they are killed below
                kill = True
            finally:
                if got:
                    self._lock.release()
        deadline = time.monotonic() + (0 if kill else timeout)
        for p in self.procs.values():
            try:
                p.wait(max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                pass
            if p.poll() is None:
                p.kill()
                p.wait(5)

    # -- ranks 1..N-1 ---------------------------------------------------------------
    def serve(self) -> int:
        """Take rank 0's commands until ``stop`` (0) or a failure (non-zero)."""
        while True:
            try:
                cmd = self._broadcast_command(None)
            except CommandRefused as e:  # nothing allocated for it: this rank stops here
                log.error("%s; rank %d exits", e, self.rank)
                return 2
            except Exception as e:  # noqa: BLE001 - rank 0 died or stopped pinging
                log.error("rank %d: lost rank 0 (%s: %s)", self.rank, type(e).__name__, e)
                return 1
            if cmd.kind == "stop":
                log.info("rank %d: stopped by rank 0 at version %d", self.rank, self.version)
                return 0
            if cmd.kind == "ping":
                continue
            if cmd.kind in self.own_kinds:
                try:
                    self._serve_other(cmd)
                except Exception:
                    log.exception("rank %d: command %s failed", self.rank, cmd.kind)
                    return 1
                continue
            if cmd.kind == "load":
                try:  # safetensors and msgspec: nothing in it is unpickled
                    state = checkpoint_codec.loads(cmd.state, what="rank 0's checkpoint state")
                except checkpoint_codec.CheckpointRefused as e:
                    log.error("rank %d: %s", self.rank, e)
                    return 1
                state["rng"] = {"torch": torch.get_rng_state(), "python": _py_rng()}
                TorchTrainBackend.load_checkpoint_state(self, state)
                log.info("rank %d: loaded rank 0's checkpoint state (version %d)", self.rank, self.version)
                continue
            try:
                m = self._ranked_step(cmd.samples, cmd.loss)
            except ValueError as e:  # the batch's fault: rank 0 raised the same before any collective
                log.warning("rank %d: step refused: %s", self.rank, e)
                continue
            except Exception:
                log.exception("rank %d: step %d failed", self.rank, self.version + 1)
                return 1
            log.info("rank %d: step -> version %d (%.2fs, %d samples)", self.rank, self.version,
                     m["seconds"], len(cmd.samples))

    def _serve_other(self, cmd: _Command) -> None:
        """Ranks 1..N-1: a command of :attr:`kinds` beyond the replicated ranks' own."""
        raise CommandRefused(f"trainer rank {self.rank}: no handler for command {cmd.kind!r}")


def _py_rng() -> Any:
    import random

    return random.getstate()



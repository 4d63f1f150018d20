"""Sharded trainer ranks (``trainer.shard: fsdp2``): torch's ``fully_shard`` over the ranks of
:mod:`rollart.engines.trainer_ranks`.

The rank protocol is the replicated ranks' (rendezvous, rank 0's commands, pings, timeouts,
:class:`~rollart.engines.trainer_ranks.RankFailed`); what differs is what each rank holds:

- every decoder layer and the root module are ``fully_shard``-ed over the group (gloo on CPU,
  NCCL on GPU), so each rank holds ``1 / world_size`` of every parameter (dim 0), of its
  gradient and of its AdamW moments (DTensors: the optimizer is built over the sharded
  parameters); a layer's full parameters exist only while it computes;
- a step: each rank takes the same share of the samples as a replicated rank (longest first,
  every N-th), weighted by the *whole* batch's aggregation units, so the three aggregation
  modes give the update of one rank. Every rank runs the same number of forward/backward
  passes (FSDP's all-gathers and reduce-scatters are collectives): a rank with fewer
  micro-batches back-propagates blank ones (no response token: weight 0). FSDP averages the
  gradient over the ranks by default; the divide factor is set to 1, so the reduce-scatter
  *sums* the ranks' gradients, as the replicated all-reduce does. ``clip_grad_norm_`` on the
  DTensor gradients takes the global norm;
- publishing: :meth:`Fsdp2TrainBackend.weight_tensors` is a lazy mapping: reading a tensor
  gathers it (``full_tensor``, one command of rank 0's per tensor), so the stream encoder
  (:class:`rollart.engines.weight_encode.TorchTensors`) and :meth:`save_weights` hold one
  full tensor at a time, never the whole model;
- checkpoints: :meth:`state_dict_for_checkpoint` gathers the model and AdamW state to rank 0
  in the world-size-1 layout (the trainer's full checkpoint file, resumable at any world size
  and sharding); :meth:`save_sharded` / :meth:`load_sharded` write and read a
  ``torch.distributed.checkpoint`` folder, each rank its own shard, loadable at another
  world size (DCP reshards); :meth:`export_hf` writes the weights as an HF model folder.

Refused: ``trainer.lora`` (see :class:`rollart.config.trainer.ComputeKeys`), and
:meth:`token_logprobs` on rank 0 alone (a forward of a sharded model is a collective).

Kept whole (over 450 lines): the group, the sharded step, the per-tensor gathers and the
checkpoints all answer rank 0's commands in one ``_serve_other``; apart, each piece would
reach into the others' state.
"""

from __future__ import annotations

import datetime
import json
import logging
import os
import random
import weakref
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from rollart.engines import checkpoint_codec
from rollart.engines.torch_trainer import TorchTrainBackend
from rollart.engines.train_samples import TrainSample
from rollart.engines.trainer_ranks import COMMAND_KINDS, RankedTrainBackend, _Command

__all__ = ["Fsdp2TrainBackend", "decoder_layers"]

log = logging.getLogger(__name__)
_OWNER: weakref.ref | None = None
"""The sharded trainer that made this process's default process group (a live one refuses
another; a stopped or collected one's group is left for the next)."""


def decoder_layers(model: torch.nn.Module) -> list[torch.nn.Module]:
    """The model's repeated blocks (HF: ``model.layers``; else every module whose class name
    ends in ``DecoderLayer``)."""
    inner = getattr(model, "model", None)
    layers = getattr(inner, "layers", None)
    if isinstance(layers, torch.nn.ModuleList) and len(layers):
        return list(layers)
    return [m for m in model.modules() if type(m).__name__.endswith("DecoderLayer")]


def _blank(s: TrainSample) -> TrainSample:
    """``s`` with no response token (weight 0 in the loss)."""
    n = len(s.token_ids)
    return TrainSample(list(s.token_ids), [0] * n, [0.0] * n, 0.0)


class _Gathered(Mapping):
    """Rank 0's view of the sharded weights by name: a tensor is gathered when it is read."""

    def __init__(self, backend: "Fsdp2TrainBackend") -> None:
        self._b = backend
        self._names = list(backend._weights())

    def __getitem__(self, name: str) -> torch.Tensor:
        if name not in self._names:
            raise KeyError(name)
        return self._b._gather(name)

    def __iter__(self) -> Iterator[str]:
        return iter(self._names)

    def __len__(self) -> int:
        return len(self._names)

    def meta(self, name: str) -> torch.Tensor:
        """A tensor on the meta device with ``name``'s global shape and dtype (nothing
        gathered)."""
        t = self._b._weights()[name]
        return torch.empty(tuple(t.shape), dtype=t.dtype, device="meta")


class Fsdp2TrainBackend(RankedTrainBackend):
    """One rank of a sharded trainer (see the module docstring). Build rank 0 with
    :func:`rollart.engines.rank_launch.start_ranks` (``shard="fsdp2"``)."""

    kinds = COMMAND_KINDS + ("gather", "state", "save", "restore")
    own_kinds = ("load", "gather", "state", "save", "restore")
    gathers_state = True
    """:meth:`state_dict_for_checkpoint` runs collectives (and copies every tensor): the
    trainer calls it in a thread, not on its event loop."""

    def __init__(self, model_dir: str | os.PathLike, *, rank: int, world_size: int,
                 dist_timeout: float, **kwargs: Any) -> None:
        if kwargs.get("lora") is not None:
            raise ValueError("trainer.shard: fsdp2 does not train trainer.lora adapters "
                             "(trainer.shard: none trains them on replicated ranks)")
        super().__init__(model_dir, rank=rank, world_size=world_size, dist_timeout=dist_timeout,
                         **kwargs)
        self._factor = self.scheduler.lr_lambdas[0]
        self._sd: tuple[int, dict[str, torch.Tensor]] | None = None
        self.gathers = 0
        """Full tensors gathered so far (rank 0)."""
        self.mesh: Any = None

    # -- the group and the sharding ---------------------------------------------------
    def _make_group(self, store: Any, *, address: str) -> None:
        # fully_shard needs a registered group (a DeviceMesh over the default group); gloo
        # finds its interface from the host name (other hosts: GLOO_SOCKET_IFNAME)
        global _OWNER
        owner = _OWNER() if _OWNER is not None else None
        if dist.is_initialized():
            if owner is not None and not owner._stop.is_set():
                raise RuntimeError("trainer.shard: fsdp2: this process already has a default "
                                   "process group (one sharded trainer per process)")
            log.warning("leaving the default process group a stopped sharded trainer left")
            dist.destroy_process_group()  # its ranks failed before it could leave it
        _OWNER = weakref.ref(self)
        if self.device.type == "cuda":
            torch.cuda.set_device(self.device)
        dist.init_process_group("nccl" if self.device.type == "cuda" else "gloo",
                                store=dist.PrefixStore("pg", store), rank=self.rank,
                                world_size=self.world_size,
                                timeout=datetime.timedelta(seconds=self.dist_timeout))
        self.pg = dist.distributed_c10d._get_default_group()

    def _joined(self) -> None:
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard

        self.mesh = init_device_mesh(self.device.type, (self.world_size,))
        units = decoder_layers(self.model)
        for layer in units:
            fully_shard(layer, mesh=self.mesh)
        fully_shard(self.model, mesh=self.mesh)
        for mod in [*units, self.model]:
            mod.set_gradient_divide_factor(1.0)  # sum the ranks' gradients, as world size 1 has them
            mod.set_force_sum_reduction_for_comms(True)  # gloo has no PREMUL_SUM
        d = self.optimizer.defaults
        self._params = [p for p in self.model.parameters() if p.requires_grad]
        self.optimizer = torch.optim.AdamW(self._params, lr=d["lr"], betas=d["betas"],
                                           weight_decay=d["weight_decay"])
        self.scheduler = torch.optim.lr_scheduler.LambdaLR(self.optimizer, self._factor)
        log.info("trainer rank %d: %d decoder layers and the root sharded over %d ranks "
                 "(%d of %d parameter elements here)", self.rank, len(units), self.world_size,
                 self.local_elements(), sum(p.numel() for p in self._params))

    def local_elements(self, what: str = "params") -> int:
        """Elements this rank holds: of the parameters (``params``) or of the AdamW state
        (``optimizer``: the moments' local shards)."""
        if what == "params":
            return sum(_local(p).numel() for p in self._params)
        return sum(_local(v).numel() for st in self.optimizer.state.values()
                   for v in st.values() if isinstance(v, torch.Tensor) and v.dim() > 0)

    # -- the step (every rank) ----------------------------------------------------------
    def _accumulate(self, samples: Sequence[TrainSample], cfg: Any, units_total: float,
                    tokens_total: int, sums: dict) -> None:
        ordered = sorted(samples, key=lambda s: -len(s.token_ids))  # stable: the same everywhere
        shares = [TorchTrainBackend.micro_batches(self, ordered[r::self.world_size])
                  for r in range(self.world_size)]
        mine = shares[self.rank]
        for i in range(max(len(s) for s in shares)):
            if i < len(mine):
                self._micro_batch(mine[i], cfg, units_total, tokens_total, sums, always_backward=True)
            else:  # the same collectives as the ranks with more micro-batches, weight 0
                self._micro_batch([_blank(ordered[-1])], cfg, units_total, tokens_total,
                                  dict.fromkeys(sums, 0.0), always_backward=True)

    def _reduce_gradients(self) -> None:
        """Nothing: FSDP's reduce-scatter summed them (divide factor 1) into each rank's shard."""

    def _check_replicas(self) -> None:
        """Nothing: the ranks hold different shards by design."""

    def token_logprobs(self, batch: Any) -> list[torch.Tensor]:
        raise NotImplementedError("trainer.shard: fsdp2: a forward pass is a collective of every "
                                  "rank; token_logprobs runs on one rank only (shard: none)")

    # -- weights: one full tensor at a time -----------------------------------------------
    def _weights(self) -> dict[str, torch.Tensor]:
        """The model's state dict (DTensors: local shards), cached per version."""
        if self._sd is None or self._sd[0] != self.version:
            self._sd = (self.version, self.model.state_dict())
        return self._sd[1]

    def _full(self, name: str) -> torch.Tensor:
        """Every rank: the full tensor ``name`` (an all-gather for a sharded one)."""
        t = self._weights()[name]
        full = t.full_tensor() if _is_dtensor(t) else t
        return full.detach().to("cpu").contiguous()

    def _gather(self, name: str) -> torch.Tensor:
        if self.rank != 0:
            raise RuntimeError("only rank 0 gathers weights")
        self.gathers += 1
        return self._command(_Command("gather", name=name), f"gathering {name}",
                             lambda: self._full(name))

    def weight_tensors(self) -> Mapping[str, torch.Tensor]:  # type: ignore[override]
        """The version's tensors by name, each gathered when read (rank 0; see the module
        docstring): a consumer that reads one at a time holds one full tensor at a time."""
        return _Gathered(self)

    def save_weights(self, path: str | os.PathLike) -> str:
        """The version as one safetensors file, written front to back a tensor at a time
        (temp file, fsync, rename); its content digest."""
        from rollart.engines.digest import file_content_digest
        from rollart.engines.weight_encode import TorchTensors
        from rollart.engines.weight_staging import StagedFile

        tensors = self.weight_tensors()
        source = TorchTensors(tensors, str(self.dtype).removeprefix("torch."))
        total = sum(spec.nbytes for spec in source.specs)
        writer = StagedFile(path, source.specs, [total] if total else [])
        try:
            for i, spec in enumerate(source.specs):
                data = source.read(i, 0, spec.nbytes)
                writer.write(data.copy())  # the hasher reads it one piece behind
            writer.commit()  # whole, renamed into place (its bucket-tree digest unused here)
        except BaseException:
            writer.abort()
            raise
        with open(path, "rb") as f:
            os.fsync(f.fileno())
        # a file version's digest is its tensors' (tensors-sha256, as every backend's file)
        return file_content_digest(path)

    def export_hf(self, out: str | os.PathLike) -> str:
        """Rank 0: the current weights as a complete HF model folder at ``out`` (the model's
        ``config.json``, ``model.safetensors`` written a tensor at a time, and the model
        folder's other files: tokenizer, generation config), atomically (a temporary sibling
        renamed); the weights' content digest."""
        import shutil

        out = Path(out)
        tmp = out.with_name(f".{out.name}.tmp{os.getpid()}")
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(parents=True)
        self.model.config.to_json_file(tmp / "config.json")
        digest = self.save_weights(tmp / "model.safetensors")
        for f in sorted(Path(self.model_dir).iterdir()):
            if f.is_file() and not f.name.endswith(_WEIGHT_SUFFIXES) and f.name not in _WRITTEN:
                shutil.copy2(f, tmp / f.name)
        shutil.rmtree(out, ignore_errors=True)
        os.replace(tmp, out)
        return digest

    # -- checkpoints ----------------------------------------------------------------------
    def _full_state(self) -> tuple[dict, dict]:
        """Every rank: the model's and the optimizer's state, every sharded tensor gathered
        (rank 0 keeps them; the others drop each as it is made)."""
        keep = self.rank == 0
        model = {}
        for name in list(self._weights()):
            t = self._full(name)
            if keep:
                model[name] = t
        sd = self.optimizer.state_dict()
        state = {}
        for i, st in sd["state"].items():
            entry = {}
            for k, v in st.items():
                v = v.full_tensor() if _is_dtensor(v) else v
                entry[k] = v.detach().to("cpu") if isinstance(v, torch.Tensor) else v
            if keep:
                state[i] = entry
        return model, {"state": state, "param_groups": sd["param_groups"]}

    def state_dict_for_checkpoint(self) -> dict:
        """Model, optimizer, scheduler, RNG and version in the layout of world size 1 (every
        tensor whole, gathered to rank 0): a checkpoint any world size or sharding resumes
        from. Rank 0 holds the full state for as long as the caller keeps it."""
        model, optim = self._command(_Command("state"), "gathering the checkpoint state",
                                     self._full_state)
        return {"model": model, "optimizer": optim, "scheduler": self.scheduler.state_dict(),
                "rng": {"torch": torch.get_rng_state(), "python": random.getstate()},
                "version": self.version}

    def load_checkpoint_state(self, state: Any) -> None:
        """Rank 0: restore a checkpoint of the world-size-1 layout (whole tensors): each
        tensor is scattered to the ranks' shards (``distribute_tensor`` from rank 0)."""
        if self.rank != 0:
            raise RuntimeError("only rank 0 loads checkpoints; the other ranks serve()")
        own = self._weights()  # checked before any rank is asked: a refusal leaves them usable
        if set(state["model"]) != set(own):
            missing, unknown = sorted(set(own) - set(state["model"])), sorted(set(state["model"]) - set(own))
            raise ValueError(f"the checkpoint is of another model: missing {missing[:3]}, "
                             f"unknown {unknown[:3]}")
        for name, t in own.items():
            if tuple(state["model"][name].shape) != tuple(t.shape):
                raise ValueError(f"the checkpoint's {name} is {tuple(state['model'][name].shape)}, "
                                 f"the model's {tuple(t.shape)}")
        small = {"scheduler": state["scheduler"], "version": int(state["version"]),
                 "param_groups": state["optimizer"]["param_groups"],
                 "steps": {str(i): float(st["step"]) for i, st in state["optimizer"]["state"].items()
                           if "step" in st}}
        data = checkpoint_codec.dumps(small)
        self._command(_Command("load", state=data), "loading the checkpoint",
                      lambda: self._scatter(state, small))
        rng = state["rng"]
        torch.set_rng_state(rng["torch"])
        py = rng["python"]
        random.setstate((py[0], tuple(py[1]), py[2]))

    def _scatter(self, state: Mapping | None, small: Mapping) -> None:
        """Every rank: its shards of the whole tensors rank 0 holds (``state``; None on the
        others), then the optimizer's state built over them."""
        from torch.distributed.tensor import distribute_tensor

        def spread(full: torch.Tensor | None, like: torch.Tensor) -> torch.Tensor:
            if self.rank == 0:
                if tuple(full.shape) != tuple(like.shape):
                    raise ValueError(f"the checkpoint's tensor is {tuple(full.shape)}, the model's "
                                     f"{tuple(like.shape)}")
                src = full.to(device=self.device, dtype=like.dtype).contiguous()
            else:
                src = torch.empty(tuple(like.shape), dtype=like.dtype, device=self.device)
            if not _is_dtensor(like):
                self._wait(self.pg.broadcast(src, 0))
                return src
            return distribute_tensor(src, like.device_mesh, like.placements, src_data_rank=0)

        own = self._weights()
        saved = {int(k): v for k, v in state["optimizer"]["state"].items()} if self.rank == 0 else {}
        if self.rank == 0 and set(state["model"]) != set(own):
            missing = sorted(set(own) - set(state["model"]))
            raise ValueError(f"the checkpoint's model does not match: missing {missing[:3]}")
        with torch.no_grad():
            for name, t in own.items():
                got = spread(state["model"][name] if self.rank == 0 else None, t)
                _local(t).copy_(_local(got))
        optim_state = {}
        for i, p in enumerate(self._params):
            if str(i) not in small["steps"]:
                continue
            ent = saved[i] if self.rank == 0 else {}
            optim_state[i] = {"step": torch.tensor(small["steps"][str(i)]),
                              **{k: spread(ent.get(k), p) for k in ("exp_avg", "exp_avg_sq")}}
        self.optimizer.load_state_dict({"state": optim_state,
                                        "param_groups": _groups(small["param_groups"])})
        self._restore_schedule(small["scheduler"])
        self.version = int(small["version"])

    def save_sharded(self, path: str | os.PathLike) -> None:
        """Rank 0: every rank writes its shards of the model and AdamW state into the
        ``torch.distributed.checkpoint`` folder ``path`` (rank 0 the metadata, and the
        scheduler and version in ``rollart.json``)."""
        self._command(_Command("save", name=os.fspath(path)), f"saving {path}",
                      lambda: self._dcp_save(os.fspath(path)))
        Path(path, "rollart.json").write_text(json.dumps(
            {"version": self.version, "scheduler": self.scheduler.state_dict(),
             "world_size": self.world_size}))

    def load_sharded(self, path: str | os.PathLike) -> None:
        """Rank 0: every rank reads its shards from the folder :meth:`save_sharded` wrote,
        at this world size (DCP reshards a folder written at another one)."""
        meta = json.loads(Path(path, "rollart.json").read_text())
        self._command(_Command("restore", name=os.fspath(path),
                               state=checkpoint_codec.dumps(meta)), f"loading {path}",
                      lambda: self._dcp_load(os.fspath(path), meta))

    def _dcp_states(self) -> dict:
        from torch.distributed.checkpoint.state_dict import get_state_dict

        msd, osd = get_state_dict(self.model, self.optimizer)
        return {"model": msd, "optim": osd}

    def _dcp_save(self, path: str) -> None:
        import torch.distributed.checkpoint as dcp

        dcp.save(self._dcp_states(), checkpoint_id=path)

    def _dcp_load(self, path: str, meta: Mapping) -> None:
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint.state_dict import set_state_dict

        states = self._dcp_states()
        dcp.load(states, checkpoint_id=path)
        set_state_dict(self.model, self.optimizer, model_state_dict=states["model"],
                       optim_state_dict=states["optim"])
        self._restore_schedule(meta["scheduler"])
        self.version = int(meta["version"])
        self._sd = None

    def shutdown(self, *, kill: bool = False, timeout: float = 10.0) -> None:
        """Rank 0: stop the other ranks, then leave the default process group (another sharded
        trainer may start in this process)."""
        stopping = self.rank == 0 and not self._stop.is_set()
        super().shutdown(kill=kill, timeout=timeout)
        if stopping and dist.is_initialized():
            dist.destroy_process_group()

    # -- ranks 1..N-1 ---------------------------------------------------------------------
    def _serve_other(self, cmd: _Command) -> None:
        if cmd.kind == "gather":
            if cmd.name not in self._weights():
                raise ValueError(f"rank 0 asked for an unknown tensor {cmd.name[:80]!r}")
            self._full(cmd.name)
        elif cmd.kind == "state":
            self._full_state()
        elif cmd.kind == "load":  # safetensors and msgspec: nothing in it is unpickled
            small = checkpoint_codec.loads(cmd.state, what="rank 0's checkpoint state")
            self._scatter(None, small)
        elif cmd.kind == "save":
            self._dcp_save(cmd.name)
        elif cmd.kind == "restore":
            self._dcp_load(cmd.name, checkpoint_codec.loads(cmd.state, what="rank 0's DCP metadata"))
        (log.debug if cmd.kind == "gather" else log.info)("rank %d: %s done (version %d)",
                                                          self.rank, cmd.kind, self.version)


_WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".ckpt")
_WRITTEN = {"config.json", "model.safetensors.index.json", "pytorch_model.bin.index.json",
            "rollart_tiny.json"}
"""A model folder's files :meth:`Fsdp2TrainBackend.export_hf` writes itself or leaves out
(the weights, their index, the tiny model's build record)."""


def _groups(groups: Sequence[Mapping]) -> list[dict]:
    out = []
    for g in groups:
        g = dict(g)
        if "betas" in g:
            g["betas"] = tuple(g["betas"])
        g["params"] = [int(i) for i in g["params"]]
        out.append(g)
    return out


def _is_dtensor(t: Any) -> bool:
    from torch.distributed.tensor import DTensor

    return isinstance(t, DTensor)


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if _is_dtensor(t) else t

"""The trainer's compute backend, chosen by the run config (``trainer``): what
:class:`rollart.actors.trainer.actor.Trainer` calls ``train_step``, ``save_weights``,
``weights_digest`` and the checkpoint methods on. Imports torch (a trainer process has it)."""

from __future__ import annotations

import os
from typing import Any


def make_backend(cfg: Any, model_dir: str | os.PathLike) -> Any:
    """Build the training backend of a RunConfig ``cfg`` for the HF model folder
    ``model_dir`` (blocking: run it in a thread from async code)."""
    from rollart.engines.torch_trainer import TorchTrainBackend

    t = cfg.trainer
    kwargs = dict(lr=t.lr, weight_decay=t.weight_decay, betas=tuple(t.adam_betas), grad_clip=t.grad_clip,
                  warmup_steps=t.warmup_steps, total_steps=t.steps, schedule=t.schedule,
                  threads=cfg.model.threads, seed=t.seed, micro_batch_tokens=t.micro_batch_tokens)
    if getattr(t, "lora", None) is not None:  # adapters where the engine applies them
        from rollart.engines import applies_adapters, lora_engine_args

        lo = t.lora
        args = lora_engine_args(cfg.proxy.engine, cfg.proxy.engine_args, lo.rank)
        kwargs.update(lora={"rank": lo.rank, "alpha": lo.alpha, "dropout": lo.dropout,
                            "targets": list(lo.targets)},
                      publish="adapter" if applies_adapters(cfg.proxy.engine, args) else "merged")
    if getattr(t, "backend", "torch") == "megatron":
        from rollart.engines import megatron_trainer as mt

        if not mt.megatron_available():
            raise RuntimeError("trainer.backend: megatron needs megatron-core: "
                               "pip install 'rollart[megatron]'")
        return mt.MegatronTrainBackend(model_dir, tensor_parallel=t.megatron.tensor_parallel,
                                       pipeline_parallel=t.megatron.pipeline_parallel, **kwargs)
    shard = getattr(t, "shard", "none")
    if getattr(t, "world_size", 1) > 1 or shard != "none":  # trainer ranks over torch.distributed
        from pathlib import Path

        from rollart.engines.rank_launch import start_ranks

        return start_ranks(model_dir, world_size=t.world_size, dist_timeout=t.dist_timeout,
                           master=t.master, log_dir=Path(cfg.run_dir) / cfg.run / "logs",
                           shard=shard, **kwargs)
    return TorchTrainBackend(model_dir, **kwargs)

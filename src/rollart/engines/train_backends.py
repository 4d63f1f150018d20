"""The trainer's compute backend, chosen by the run config (``trainer``): what
:class:`rollart.actors.trainer.Trainer` calls ``train_step``, ``save_weights``,
``weights_digest`` and the checkpoint methods on. Imports torch (a trainer process has it)."""

from __future__ import annotations

import os
from typing import Any


def make_backend(cfg: Any, model_dir: str | os.PathLike) -> Any:
    """Build the training backend of a RunConfig ``cfg`` for the HF model folder
    ``model_dir`` (blocking: run it in a thread from async code)."""
    from rollart.engines.torch_trainer import TorchTrainBackend

    t = cfg.trainer
    return TorchTrainBackend(
        model_dir, lr=t.lr, weight_decay=t.weight_decay, grad_clip=t.grad_clip,
        warmup_steps=t.warmup_steps, total_steps=t.steps, schedule=t.schedule,
        threads=cfg.model.threads, seed=t.seed, micro_batch_tokens=t.micro_batch_tokens)

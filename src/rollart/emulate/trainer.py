"""An emulated training backend and the Trainer that uses it.

:class:`EmulatedTrainBackend` is what :class:`rollart.actors.trainer.actor.Trainer` calls
(``train_step``, ``save_weights``, ``weights_digest``, ``weight_tensors``, the checkpoint
methods) with no model at all:

- ``train_step`` sleeps ``step_base_s + step_per_token_s x tokens`` modelled seconds (tokens of
  the batch: prompt and response; the default 25 µs a token is ~40k tokens/s, about what 8
  H800s sustain for forward + backward of an 8B model at ~40% MFU: 6 x 8e9 FLOP per token /
  (8 x 989 TFLOPS x 0.4) = 15 µs, plus the reference and old-policy passes) and increments
  the version;
- ``save_weights`` sleeps ``model_gb / publish_gbps`` modelled seconds (gathering and writing
  the declared model size) and writes a tiny real safetensors file (one tensor holding the
  version), so digests, ``policy.published`` and the generators' digest check are the real
  ones.

All times are modelled, slept as ``x time_scale``; every step and publish is recorded in
:data:`rollart.emulate.records.RECORDS`. Use it with
``actors.trainer.type: rollart.emulate.trainer:EmulatedTrainer`` and
``actors.trainer.args: {emulate: {step_per_token_s: 2.5e-5, model_gb: 16, time_scale: 0.05}}``.
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass, field
from typing import Any

from rollart.actors.trainer.actor import Trainer
from rollart.emulate.profiles import time_scale as _time_scale
from rollart.emulate.records import RECORDS

__all__ = ["EmulatedTrainBackend", "EmulatedTrainer"]


class EmulatedTrainBackend:
    """Sleeps instead of training (module docstring)."""

    weights_kind = "full"
    device = None

    def __init__(self, *, step_base_s: float = 1.0, step_per_token_s: float = 2.5e-5,
                 model_gb: float = 16.0, publish_gbps: float = 4.0,
                 time_scale: float | None = None) -> None:
        if min(step_base_s, step_per_token_s, model_gb) < 0 or publish_gbps <= 0:
            raise ValueError("emulated trainer: times and sizes >= 0, publish_gbps > 0")
        self.step_base_s, self.step_per_token_s = float(step_base_s), float(step_per_token_s)
        self.model_gb, self.publish_gbps = float(model_gb), float(publish_gbps)
        self.scale = _time_scale(time_scale)
        self.version = 0

    def step_model_s(self, tokens: int) -> float:
        return self.step_base_s + self.step_per_token_s * tokens

    def train_step(self, samples: Any, *, loss_cfg: object = None) -> dict:
        t0 = time.perf_counter()
        tokens = sum(len(s.token_ids) for s in samples)
        resp = sum(sum(s.response_mask) for s in samples)
        s = self.step_model_s(tokens)
        time.sleep(s * self.scale)
        self.version += 1
        RECORDS.train.append({"model_s": s, "tokens": tokens, "samples": len(samples),
                              "version": self.version})
        return {"loss": 0.0, "pg_loss": 0.0, "grad_norm": 0.0, "lr": 0.0, "entropy": 0.0,
                "kl": 0.0, "tokens": float(resp), "samples": float(len(samples)),
                "seconds": time.perf_counter() - t0, "version": self.version, "skipped": 0.0,
                "emulated_train_model_s": s}

    def weight_tensors(self) -> dict:
        import torch  # optional dependency: a trainer process has it

        return {"emulated.version": torch.tensor([float(self.version)], dtype=torch.float32)}

    def weights_digest(self) -> str:
        # optional dependency: torch_trainer imports torch (a trainer process has it)
        from rollart.engines.torch_trainer import tensors_digest

        return tensors_digest(self.weight_tensors())

    def save_weights(self, path: str | os.PathLike) -> str:
        from safetensors.torch import save_file

        from rollart.engines.digest import file_content_digest

        s = self.model_gb / self.publish_gbps
        time.sleep(s * self.scale)
        RECORDS.publish.append({"model_s": s, "version": self.version})
        path = os.fspath(path)
        tmp = f"{path}.tmp{os.getpid()}"
        save_file(self.weight_tensors(), tmp, metadata={"format": "pt", "emulated": "1",
                                                       "rollart_version": str(self.version)})
        os.replace(tmp, path)
        return file_content_digest(path)

    def state_dict_for_checkpoint(self) -> dict:
        return {"version": self.version, "emulated": True}

    def load_checkpoint_state(self, state: Any) -> None:
        self.version = int(state["version"])


@dataclass(kw_only=True, eq=False)
class EmulatedTrainer(Trainer):
    """The real :class:`Trainer` on an :class:`EmulatedTrainBackend` built from ``emulate``
    (``actors.trainer.args.emulate``); named ``emulated`` in every table."""

    emulate: dict[str, Any] = field(default_factory=dict)

    def build_backend(self) -> EmulatedTrainBackend:
        return EmulatedTrainBackend(**self.emulate)

    async def _step(self, batch: list, **kw: Any) -> dict | None:
        k = self.cfg.rollout.group_size
        for g in batch:  # which trajectories the step trains, for the critical path
            for t, _ in g.members[:k]:
                RECORDS.trained[t.traj_id] = (t.seed, len(t.turns))
        return await super()._step(batch, **kw)

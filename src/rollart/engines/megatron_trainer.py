"""``trainer.backend: megatron``: the Qwen3 policy trained as megatron-core's ``GPTModel``.

:class:`MegatronTrainBackend` is :class:`rollart.engines.torch_trainer.TorchTrainBackend`
with another model inside: the step loop, micro-batching, losses (``rollart.algos.losses``),
AdamW, LR schedule, checkpoint state and version counting are the torch backend's own code;
what differs is that

- the model is a megatron ``GPTModel`` built from the HF folder's ``config.json`` and loaded
  with its weights converted (:mod:`rollart.engines.megatron_convert`), behind a small
  adapter that takes ``input_ids``/``attention_mask`` and returns ``.logits`` as an HF model
  does (causal mask plus key padding, positions ``0..T-1``);
- the weights it saves and digests are converted back to HF names and layout, so generators
  load a version unchanged and its digest is the one a torch backend would give the same
  weights (:func:`rollart.engines.torch_trainer.tensors_digest`).

The checkpoint (``state_dict_for_checkpoint``) holds the megatron-format model: it resumes a
megatron backend, not a torch one.

On CPU (what this machine has) megatron-core needs, besides its parallel state over a
one-process gloo group: ``torch.cuda.current_device`` answering ``"cpu"`` (its rope, linear
and attention layers ask for it), a no-op CUDA RNG tracker, every fused kernel off, and a
step loop of its own (its pipeline schedules hard-code ``device="cuda"``): the torch
backend's loop is that loop. Tensor and pipeline parallel sizes are 1: larger ones need one
process per rank, which this backend does not start.
"""

from __future__ import annotations

import os
import threading
import warnings
from types import SimpleNamespace
from typing import Any

import torch

from rollart.engines.megatron_convert import (
    Qwen3Layout,
    build_gpt_model,
    hf_to_megatron,
    megatron_to_hf,
    qwen3_layout,
)
from rollart.engines.torch_trainer import TorchTrainBackend

__all__ = ["GPTCausalLM", "MegatronTrainBackend", "check_parallel_sizes", "load_gpt_from_hf",
           "megatron_available", "setup_megatron"]

_setup_lock = threading.Lock()


def megatron_available() -> bool:
    """Whether megatron-core imports here (the ``megatron`` extra)."""
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            import megatron.core  # noqa: F401
    except ImportError:
        return False
    return True


def check_parallel_sizes(tensor_parallel: int, pipeline_parallel: int, device: str | torch.device) -> None:
    """Tensor and pipeline parallel sizes this backend runs: 1 each (errors name the key)."""
    for key, n in (("tensor_parallel", tensor_parallel), ("pipeline_parallel", pipeline_parallel)):
        if n != 1:
            why = ("the trainer runs on CPU, where megatron-core parallelism is not available"
                   if torch.device(device).type == "cpu" else
                   "sizes above 1 need one trainer process per rank, which this backend does not start")
            raise ValueError(f"trainer.megatron.{key} must be 1 (it is {n!r}): {why}")


def setup_megatron(device: str | torch.device = "cpu") -> None:
    """Make this process able to build and run a megatron ``GPTModel`` (idempotent): a
    one-process gloo group when torch.distributed is not set up, megatron's model-parallel
    state at sizes 1, a no-op RNG tracker, and on a machine without CUDA
    ``torch.cuda.current_device`` patched to answer ``"cpu"``."""
    with _setup_lock:
        if (torch.device(device).type == "cpu" and not torch.cuda.is_available()
                and not getattr(torch.cuda.current_device, "_rollart_cpu", False)):
            def current_device() -> str:
                return "cpu"
            current_device._rollart_cpu = True  # type: ignore[attr-defined]
            torch.cuda.current_device = current_device
        import torch.distributed as dist

        if not dist.is_initialized():
            dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
        with warnings.catch_warnings():  # "Transformer Engine and Apex are not installed"
            warnings.simplefilter("ignore")
            from megatron.core import parallel_state, tensor_parallel
        if not parallel_state.model_parallel_is_initialized():
            parallel_state.initialize_model_parallel(tensor_model_parallel_size=1,
                                                     pipeline_model_parallel_size=1)
            tensor_parallel.random.initialize_rng_tracker(inference_rng_tracker=True, force_reset=True)


class GPTCausalLM(torch.nn.Module):
    """A megatron ``GPTModel`` called as an HF causal LM: ``forward(input_ids,
    attention_mask)`` returns an object with ``.logits`` ``[B, T, vocab]``."""

    def __init__(self, gpt: torch.nn.Module, layout: Qwen3Layout) -> None:
        super().__init__()
        self.gpt = gpt
        self.layout = layout

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None) -> SimpleNamespace:
        B, T = input_ids.shape
        dev = input_ids.device
        position_ids = torch.arange(T, device=dev).unsqueeze(0).expand(B, T)
        # megatron's mask: True where attention is NOT allowed, [B, 1, T, T]
        mask = torch.ones(T, T, dtype=torch.bool, device=dev).triu(1)[None, None]
        if attention_mask is not None:
            mask = mask | (attention_mask == 0)[:, None, None, :]
        logits = self.gpt(input_ids=input_ids, position_ids=position_ids, attention_mask=mask)
        return SimpleNamespace(logits=logits)

    def hf_state_dict(self) -> dict[str, torch.Tensor]:
        """The weights as an HF Qwen3 state dict (copies on CPU)."""
        return megatron_to_hf(self.gpt.state_dict(), self.layout)

    @torch.no_grad()
    def load_hf_state_dict(self, hf: dict[str, torch.Tensor]) -> None:
        """Copy HF Qwen3 tensors into every parameter (``KeyError`` on any name left over or
        missing; ``ValueError`` on a shape that does not fit)."""
        mg = hf_to_megatron(hf, self.layout)
        params = dict(self.gpt.named_parameters())
        missing, extra = sorted(set(params) - set(mg)), sorted(set(mg) - set(params))
        if missing or extra:
            raise KeyError(f"megatron parameters without a converted tensor: {missing}; "
                           f"converted tensors without a parameter: {extra}")
        for name, p in params.items():
            src = mg[name]
            if tuple(src.shape) != tuple(p.shape):
                raise ValueError(f"{name}: converted shape {tuple(src.shape)}, parameter {tuple(p.shape)}")
            p.copy_(src)


def load_gpt_from_hf(model_dir: str | os.PathLike, *, dtype: torch.dtype = torch.float32,
                     device: str | torch.device = "cpu") -> GPTCausalLM:
    """The HF Qwen3 model in ``model_dir`` as a :class:`GPTCausalLM` (eval mode)."""
    from transformers import AutoModelForCausalLM  # optional dependency

    layout = qwen3_layout(model_dir)
    setup_megatron(device)
    hf = AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype, local_files_only=True)
    model = GPTCausalLM(build_gpt_model(layout, dtype=dtype), layout)
    model.load_hf_state_dict(hf.state_dict())
    del hf
    return model.to(device).eval()


class MegatronTrainBackend(TorchTrainBackend):
    """The torch backend's interface (``train_step``, ``token_logprobs``, ``save_weights``,
    ``weights_digest``, checkpoint state, ``version``) on a megatron-core ``GPTModel``."""

    def __init__(self, model_dir: str | os.PathLike, *, tensor_parallel: int = 1,
                 pipeline_parallel: int = 1, device: str = "cpu", **kwargs: Any) -> None:
        check_parallel_sizes(tensor_parallel, pipeline_parallel, device)
        self.layout = qwen3_layout(model_dir)
        self.tensor_parallel, self.pipeline_parallel = tensor_parallel, pipeline_parallel
        super().__init__(model_dir, device=device, **kwargs)

    def _load_model(self) -> torch.nn.Module:
        return load_gpt_from_hf(self.model_dir, dtype=self.dtype, device=self.device)

    def weight_tensors(self) -> dict[str, torch.Tensor]:
        """HF-named tensors (what generators load and the digest covers)."""
        return self.model.hf_state_dict()

"""LoRA (``trainer.lora``): the trainer's side on ``peft``, the generator's side in plain torch.

Trainer (:class:`rollart.engines.torch_trainer.TorchTrainBackend` with ``lora=``): the HF
model is wrapped once with ``peft.get_peft_model`` (the base frozen, only the adapters'
``lora_A``/``lora_B`` trainable). A version is published either as

- the **adapter** (:func:`adapter_tensors`): the tensors peft's ``save_pretrained`` writes
  to ``adapter_model.safetensors`` (``base_model.model.<module>.lora_A.weight`` and
  ``lora_B``), with the scale in the file's metadata (:func:`adapter_metadata`); the
  version's content digest is over these tensors; or
- the **merged** weights (:func:`merged_tensors`): HF names, ``W + alpha/r * B @ A`` by
  peft's own ``get_delta_weight``, for engines that load full weights only (vLLM, SGLang).

Generator (:class:`rollart.engines.torch_engine.TorchGenerationEngine`): :func:`adapter_deltas`
turns an adapter file into ``{HF weight name: alpha/r * B @ A}`` (the same float32 product
peft's merge computes), checked against the model before anything changes; the engine adds
each delta to its copy of the base weight, so a new version replaces the previous adapter
and never stacks on it. No ``peft`` is needed on the generator.
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping, Sequence
from typing import Any

import torch

from rollart.engines.lora_files import rank_and_alpha
from rollart.engines.weight_files import LORA_KIND, is_adapter_metadata

__all__ = ["LORA_KIND", "adapter_deltas", "adapter_metadata", "adapter_tensors",
           "is_adapter_metadata", "merged_tensors", "wrap_model"]

_NAME = re.compile(r"^base_model\.model\.(?P<module>.+)\.lora_(?P<ab>[AB])\.weight$")


def wrap_model(model: torch.nn.Module, *, rank: int, alpha: float, dropout: float = 0.0,
               targets: Sequence[str]) -> Any:
    """``model`` with LoRA adapters on the linear modules named ``targets`` (peft
    ``target_modules``), every other parameter frozen. Raises ``ValueError`` (peft's) when
    no module matches."""
    from peft import LoraConfig, get_peft_model  # the train extra

    tied = bool(getattr(getattr(model, "config", None), "tie_word_embeddings", False))
    if tied and "lm_head" in targets:  # merging B @ A into the head would change the embeddings
        raise ValueError("trainer.lora.targets: 'lm_head' is tied to the input embeddings in "
                         "this model (config.json tie_word_embeddings: true); adapt the "
                         "projections only, or use an untied model")
    cfg = LoraConfig(r=int(rank), lora_alpha=float(alpha), lora_dropout=float(dropout),
                     target_modules=list(targets), bias="none")
    return get_peft_model(model, cfg)


def adapter_tensors(model: Any) -> dict[str, torch.Tensor]:
    """The adapter's tensors under peft's file names (what ``save_pretrained`` writes), on
    CPU and contiguous."""
    from peft import get_peft_model_state_dict  # the train extra

    # adapters only: with ``lm_head`` among the targets peft would add the (frozen) base
    # head by default ("auto" saves embedding-like layers), which the version does not need
    return {k: v.detach().to("cpu").contiguous()
            for k, v in get_peft_model_state_dict(model, save_embedding_layers=False).items()}


def adapter_metadata(rank: int, alpha: float, targets: Sequence[str]) -> dict[str, str]:
    """The safetensors ``__metadata__`` that makes a file an adapter for the generators."""
    return {"rollart_kind": LORA_KIND, "lora_rank": str(int(rank)), "lora_alpha": repr(float(alpha)),
            "lora_targets": json.dumps(list(targets))}


@torch.no_grad()
def merged_tensors(model: Any) -> dict[str, torch.Tensor]:
    """The base model's state dict with every adapter merged in (HF names, new tensors; the
    model is not changed). Tensors that share storage (tied embeddings) still do."""
    from peft.tuners.lora import LoraLayer  # the train extra

    base = model.get_base_model()
    deltas = {name: mod.get_delta_weight(mod.active_adapters[0])
              for name, mod in base.named_modules() if isinstance(mod, LoraLayer)}
    out: dict[str, torch.Tensor] = {}
    for k, t in base.state_dict().items():
        if ".lora_" in k:
            continue
        name = k.replace(".base_layer.", ".")
        module = name.rpartition(".")[0]
        if name.endswith(".weight") and module in deltas:
            t = t + deltas[module].to(t.dtype)
        out[name] = t
    return out


def adapter_deltas(tensors: Mapping[str, torch.Tensor], metadata: Mapping[str, str] | None,
                   weights: Mapping[str, torch.Tensor], *, what: str = "adapter"
                   ) -> dict[str, torch.Tensor]:
    """``{HF weight name: alpha / r * B @ A}`` (float32) of an adapter file's ``tensors``,
    checked against the model's state dict ``weights``: every tensor named as peft names
    them, each module with both ``A`` ``[r, in]`` and ``B`` ``[out, r]``, the weight ``[out,
    in]`` in the model, ``r`` the metadata's ``lora_rank``. ``ValueError`` otherwise."""
    rank, alpha = rank_and_alpha(metadata, what)
    pairs: dict[str, dict[str, torch.Tensor]] = {}
    for k, t in tensors.items():
        m = _NAME.match(k)
        if m is None:
            raise ValueError(f"{what}: tensor {k!r} is not a LoRA adapter's "
                             f"(base_model.model.<module>.lora_A|lora_B.weight)")
        pairs.setdefault(m["module"], {})[m["ab"]] = t
    if not pairs:
        raise ValueError(f"{what}: no adapter tensors")
    problems, out = [], {}
    for module, ab in sorted(pairs.items()):
        name = f"{module}.weight"
        a, b, w = ab.get("A"), ab.get("B"), weights.get(name)
        if a is None or b is None:
            problems.append(f"{module}: lora_{'A' if a is None else 'B'} missing")
        elif w is None:
            problems.append(f"{module}: the model has no {name}")
        elif (a.dim() != 2 or b.dim() != 2 or a.shape[0] != rank or b.shape[1] != rank
              or (b.shape[0], a.shape[1]) != tuple(w.shape)):
            problems.append(f"{module}: A {tuple(a.shape)}, B {tuple(b.shape)} for rank {rank} "
                            f"and weight {tuple(w.shape)}")
        else:
            out[name] = (b.float() @ a.float()) * (alpha / rank)
    if problems:
        raise ValueError(f"{what} does not match the model: {'; '.join(problems[:5])}")
    return out

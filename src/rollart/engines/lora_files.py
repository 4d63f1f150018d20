"""A LoRA version (``trainer.lora``) as the peft adapter folder a server loads (no torch).

:func:`adapter_config` checks an adapter file's header against the model, name by name and
shape by shape, as :func:`rollart.engines.lora.adapter_deltas` does for the torch engine, and
returns the ``adapter_config.json`` peft (and vLLM's ``PEFTHelper``) read: ``r``,
``lora_alpha``, ``target_modules`` (the modules the file adapts), no bias, no DoRA.
:func:`write_adapter_folder` writes that folder (``adapter_config.json`` and
``adapter_model.safetensors``) in a folder of the engine's, made private (0700), the file
linked or written in one step.
"""

from __future__ import annotations

import json
import os
import re
from collections.abc import Mapping, Sequence
from pathlib import Path

from .weight_files import Source, Tensor, is_adapter_metadata, place_weights

__all__ = ["ADAPTER_CONFIG", "ADAPTER_FILE", "adapter_config", "rank_and_alpha",
           "write_adapter_folder"]

ADAPTER_CONFIG = "adapter_config.json"
ADAPTER_FILE = "adapter_model.safetensors"
_NAME = re.compile(r"^base_model\.model\.(?P<module>.+)\.lora_(?P<ab>[AB])\.weight$")
_FLOATS = {"F32", "F16", "BF16"}


def rank_and_alpha(metadata: Mapping[str, str] | None, what: str = "adapter"
                   ) -> tuple[int, float]:
    """The rank and alpha of an adapter file's metadata (rollart's: ``rollart_kind: lora``,
    ``lora_rank`` >= 1, ``lora_alpha`` > 0 and finite); ``ValueError`` naming ``what``."""
    meta = dict(metadata or {})
    if not is_adapter_metadata(meta):
        raise ValueError(f"{what}: no LoRA metadata (rollart_kind={meta.get('rollart_kind')!r})")
    try:
        rank, alpha = int(meta["lora_rank"]), float(meta["lora_alpha"])
    except (KeyError, ValueError) as e:
        raise ValueError(f"{what}: bad LoRA metadata ({e!r})") from None
    if rank < 1 or not alpha > 0 or alpha == float("inf"):
        raise ValueError(f"{what}: bad LoRA metadata (rank {rank}, alpha {alpha})")
    return rank, alpha


def adapter_config(header: Mapping[str, Tensor], metadata: Mapping[str, str] | None,
                   shapes: Mapping[str, Sequence[int]], *, max_rank: int | None = None,
                   what: str = "adapter") -> dict:
    """The peft ``adapter_config.json`` of an adapter file whose header is ``header`` and
    metadata ``metadata`` (rollart's: ``rollart_kind: lora``, ``lora_rank``,
    ``lora_alpha``), checked against the model's weight ``shapes``: every tensor named as
    peft names them, a float, each module with ``A`` ``[r, in]`` and ``B`` ``[out, r]`` of a
    weight ``[out, in]`` of the model, ``r`` at most ``max_rank``. ``ValueError`` otherwise."""
    rank, alpha = rank_and_alpha(metadata, what)
    if max_rank is not None and rank > max_rank:
        raise ValueError(f"{what}: LoRA rank {rank} is above the server's max_lora_rank "
                         f"{max_rank} (proxy.engine_args.max_lora_rank)")
    pairs: dict[str, dict[str, Tensor]] = {}
    for k, t in header.items():
        m = _NAME.match(k)
        if m is None:
            raise ValueError(f"{what}: tensor {k!r} is not a LoRA adapter's "
                             f"(base_model.model.<module>.lora_A|lora_B.weight)")
        if t.dtype not in _FLOATS:
            raise ValueError(f"{what}: tensor {k!r} is {t.dtype}, not a float")
        pairs.setdefault(m["module"], {})[m["ab"]] = t
    if not pairs:
        raise ValueError(f"{what}: no adapter tensors")
    problems = []
    for module, ab in sorted(pairs.items()):
        a, b, w = ab.get("A"), ab.get("B"), shapes.get(f"{module}.weight")
        if a is None or b is None:
            problems.append(f"{module}: lora_{'A' if a is None else 'B'} missing")
        elif w is None:
            problems.append(f"{module}: the model has no {module}.weight")
        elif (len(a.shape) != 2 or len(b.shape) != 2 or a.shape[0] != rank
              or b.shape[1] != rank or (b.shape[0], a.shape[1]) != tuple(w)):
            problems.append(f"{module}: A {list(a.shape)}, B {list(b.shape)} for rank {rank} "
                            f"and weight {list(w)}")
    if problems:
        raise ValueError(f"{what} does not match the model: {'; '.join(problems[:5])}")
    targets = sorted({m.rpartition(".")[2] for m in pairs})
    return {"peft_type": "LORA", "task_type": "CAUSAL_LM", "r": rank, "lora_alpha": alpha,
            "target_modules": targets, "lora_dropout": 0.0, "bias": "none",
            "use_rslora": False, "use_dora": False, "fan_in_fan_out": False,
            "modules_to_save": None, "base_model_name_or_path": None}


def write_adapter_folder(source: Source, config: Mapping, folder: Path) -> Path:
    """Write ``folder`` (created private, 0700; it must not exist) with the adapter file
    ``source`` (a checked file, hard-linked or copied, or bytes written) and ``config`` as
    ``adapter_config.json``; the config is written last."""
    os.mkdir(folder, 0o700)
    place_weights(source, folder / ADAPTER_FILE, hard_link=True)
    tmp = folder / f".{ADAPTER_CONFIG}.tmp"
    tmp.write_text(json.dumps(dict(config), indent=1))
    os.replace(tmp, folder / ADAPTER_CONFIG)
    return folder

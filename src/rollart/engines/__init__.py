"""Generation engines.

`rollart.engines.base` (the interface, no torch import) is re-exported here; the torch
engine and the tiny-model builder import torch, so they are imported lazily (importing this
package does not import torch; the batcher, the vLLM and the SGLang clients import what
needs torch or the engine lazily themselves).
"""

from __future__ import annotations

from importlib.util import find_spec
from typing import Any

from .base import (
    FINISH_CHOICE,
    FINISH_INTERRUPTED,
    AsyncEngine,
    EngineAborted,
    EngineUnavailable,
    FINISH_LENGTH,
    FINISH_STOP,
    GenerationEngine,
    GenInput,
    GenOutput,
    save_weights,
    validate_choices,
)
from .batched import BatchedEngine
from .sglang_engine import SglangEngine
from .vllm_engine import VllmEngine
from .vllm_server_engine import VllmServerEngine

__all__ = [
    "AsyncEngine",
    "EngineAborted",
    "EngineUnavailable",
    "FINISH_INTERRUPTED",
    "applies_adapters",
    "build_engine",
    "lora_engine_args",
    "FINISH_CHOICE",
    "FINISH_LENGTH",
    "FINISH_STOP",
    "GenerationEngine",
    "GenInput",
    "GenOutput",
    "save_weights",
    "validate_choices",
    "TorchGenerationEngine",
    "build_tiny_model",
]


def missing_for(name: str) -> str | None:
    """What ``proxy.engine: name`` needs that this Python lacks (an install hint), or None.
    Cheap (no import of the engine): for a clear error before a run starts."""
    if name == "vllm" and find_spec("vllm") is None:
        return ("proxy.engine 'vllm' needs vLLM, which is not installed here: pip install "
                "'rollart[vllm]' (GPU) or, on CPU, make setup-vllm (see README: Engines)")
    if name == "vllm-server" and find_spec("aiohttp") is None:
        return ("proxy.engine 'vllm-server' needs aiohttp to talk to the vLLM server: pip "
                "install 'rollart[sglang]' (vLLM itself may live in another environment: "
                "proxy.engine_args.python)")
    if name == "sglang" and find_spec("aiohttp") is None:
        return ("proxy.engine 'sglang' needs aiohttp to talk to the SGLang server: pip install "
                "'rollart[sglang]'")
    return None


VLLM_LORA_RANKS = (1, 8, 16, 32, 64, 128, 256, 320, 512)
"""The ``--max-lora-rank`` values vLLM (0.32) accepts."""


def lora_engine_args(name: str, engine_args: dict[str, Any] | None,
                     lora_rank: int | None) -> dict[str, Any]:
    """``proxy.engine_args`` as the replicas use them in a run with ``trainer.lora`` of rank
    ``lora_rank`` (None: no LoRA; the args unchanged): ``vllm-server`` serves the versions as
    adapters (``enable_lora: true`` unless the args say ``false``) with ``max_lora_rank`` the
    smallest rank vLLM accepts that holds ``lora_rank`` unless given."""
    args = {str(k).replace("-", "_"): v for k, v in dict(engine_args or {}).items()}
    if lora_rank is None or name != "vllm-server":
        return dict(engine_args or {})
    args.setdefault("enable_lora", True)
    if args["enable_lora"] and "max_lora_rank" not in args:
        args["max_lora_rank"] = next((r for r in VLLM_LORA_RANKS if r >= int(lora_rank)),
                                     int(lora_rank))
    return args


def applies_adapters(name: str, engine_args: dict[str, Any] | None) -> bool:
    """Whether ``proxy.engine`` ``name`` with ``engine_args`` (as :func:`lora_engine_args`
    gives them) loads a LoRA version (``kind: lora``) as an adapter over its base: the torch
    engine always, ``vllm-server`` with ``enable_lora``; the others load full weights only,
    so the trainer sends them merged weights (``kind: full``)."""
    if name == "torch":
        return True
    if name == "vllm-server":
        args = {str(k).replace("-", "_"): v for k, v in dict(engine_args or {}).items()}
        return bool(args.get("enable_lora"))
    return False


TORCH_ENGINE_ARGS = frozenset({"kv_cache_mb", "dtype", "attn_implementation", "gather_max_ms"})
"""The ``proxy.engine_args`` keys ``proxy.engine: torch`` takes."""


def build_engine(name: str, model_dir: str, *, seed: int = 0, threads: int | None = 1,
                 gather_s: float = 0.002, max_batch: int = 128,
                 engine_args: dict[str, Any] | None = None) -> AsyncEngine:
    """The :class:`AsyncEngine` ``proxy.engine`` names, not started yet (``await
    engine.start()`` loads it). ``torch``: a :class:`BatchedEngine` (gather window
    ``gather_s``, ``max_batch`` rows) around a ``TorchGenerationEngine``; ``vllm`` and
    ``sglang`` take ``engine_args`` (``proxy.engine_args``); so does ``torch``:
    ``kv_cache_mb`` (the multi-turn KV cache's cap, 0: off), ``dtype``,
    ``attn_implementation``, and ``gather_max_ms`` (the batch gather window; default: the
    last engine call's duration, at most 50 ms)."""
    args = dict(engine_args or {})
    if name == "torch":
        bad = sorted(set(args) - TORCH_ENGINE_ARGS)
        if bad:
            raise ValueError(f"proxy.engine_args.{bad[0]}: not an argument of the torch engine "
                             f"(it takes {', '.join(sorted(TORCH_ENGINE_ARGS))})")
        gmax = args.pop("gather_max_ms", None)
        eng = BatchedEngine.torch(model_dir, seed=seed, threads=threads, gather_s=gather_s,
                                  max_batch=max_batch, **args)
        if gmax is not None:
            if not isinstance(gmax, (int, float)) or gmax < 0:
                raise ValueError(f"proxy.engine_args.gather_max_ms must be a number >= 0, got "
                                 f"{gmax!r}")
            eng.gather_max_s = float(gmax) / 1e3
        return eng
    if name == "vllm":
        return VllmEngine(model_dir, seed=seed, threads=threads, engine_args=args)
    if name == "vllm-server":
        return VllmServerEngine(model_dir, seed=seed, engine_args=args)
    if name == "sglang":
        return SglangEngine(model_dir, seed=seed, engine_args=args)
    raise ValueError(f"proxy.engine {name!r} is not one of torch, vllm, vllm-server, sglang")


def __getattr__(name: str):
    if name == "TorchGenerationEngine":
        # optional dependency: this module imports torch
        from .torch_engine import TorchGenerationEngine

        return TorchGenerationEngine
    if name == "build_tiny_model":
        from .tiny import build_tiny_model  # optional dependency: this module imports torch

        return build_tiny_model
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")

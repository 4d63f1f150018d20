"""Generation engines.

`rollart.engines.base` (the interface, no torch import) is re-exported here; the torch
engine and the tiny-model builder are imported lazily so that importing this package does not
import torch.
"""

from __future__ import annotations

from .base import (
    FINISH_CHOICE,
    FINISH_LENGTH,
    FINISH_STOP,
    GenerationEngine,
    GenInput,
    GenOutput,
    save_weights,
    validate_choices,
)

__all__ = [
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


def __getattr__(name: str):
    if name == "TorchGenerationEngine":
        from .torch_engine import TorchGenerationEngine

        return TorchGenerationEngine
    if name == "build_tiny_model":
        from .tiny import build_tiny_model

        return build_tiny_model
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")

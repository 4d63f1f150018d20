"""Where a run's model lives: a local folder, or a tiny model built once and cached."""

from __future__ import annotations

import hashlib
from pathlib import Path

import msgspec

from rollart.config import RunConfig


def model_dir(run_cfg: RunConfig) -> Path:
    """The model folder of ``run_cfg``; builds the configured tiny model if no path is set."""
    mc = run_cfg.model
    if mc.path:
        p = Path(mc.path).expanduser()
        if not (p / "config.json").exists():
            raise ValueError(f"model.path {str(p)!r} holds no config.json (a local HF model folder)")
        return p
    t = mc.tiny
    from rollart.engines.tiny import build_tiny_model  # optional dependency: it imports torch

    tag = hashlib.sha256(msgspec.json.encode(t)).hexdigest()[:8]
    name = f"tiny-v{t.vocab_size}-h{t.hidden_size}-l{t.num_layers}-s{t.seed}-{tag}"
    return build_tiny_model(
        Path(run_cfg.run_dir) / "_models" / name, vocab_size=t.vocab_size,
        hidden_size=t.hidden_size, num_layers=t.num_layers, num_heads=t.num_heads,
        num_kv_heads=t.num_kv_heads, intermediate_size=t.intermediate_size, seed=t.seed)

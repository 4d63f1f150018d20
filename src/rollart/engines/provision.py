"""Where a run's model lives: the SFT model it starts from (``trainer.init_from``), a local
folder (``model.path``), or a tiny model built once and cached (``model.tiny``)."""

from __future__ import annotations

import hashlib
from pathlib import Path

import msgspec

from rollart.config import RunConfig
from rollart.errors import ConfigError

SFT_MODEL = "model"
"""The model folder inside an SFT run folder (``rollart sft`` writes ``runs/<run>/model``)."""


def init_from_dir(path: str) -> Path:
    """The model folder ``trainer.init_from`` names: ``<path>/model`` (an SFT run folder) or
    ``<path>`` itself (a model folder); a :class:`ConfigError` naming the key otherwise."""
    p = Path(path).expanduser()
    for folder in (p / SFT_MODEL, p):
        if (folder / "config.json").is_file():
            return folder
    what = "does not exist" if not p.exists() else "holds no model"
    raise ConfigError(f"trainer.init_from: {str(p)!r} {what}: expected an SFT run folder with "
                      f"{SFT_MODEL}/config.json (`rollart sft CONFIG --data FILE --out "
                      f"{p}` writes one) or a Hugging Face model folder with config.json")


def model_dir(run_cfg: RunConfig) -> Path:
    """The model folder of ``run_cfg``, the same for every role: ``trainer.init_from``'s when
    set, else ``model.path``, else the configured tiny model (built on first use)."""
    init = getattr(run_cfg.trainer, "init_from", None)
    if init:
        return init_from_dir(init)
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

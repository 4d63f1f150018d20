"""How long a context the run's engines can hold, and the check of ``envs.<name>.
max_context_tokens`` against it (no torch, no engine started: the model's ``config.json`` and
``proxy.engine_args`` say it)."""

from __future__ import annotations

import json
from pathlib import Path

from rollart.config import RunConfig
from rollart.messages import MAX_TOKENS

_POSITION_KEYS = ("max_position_embeddings", "n_positions", "max_sequence_length", "seq_length")
_SCALED = ("yarn", "linear", "dynamic")
"""RoPE scalings that stretch the positions by their ``factor`` (as vLLM derives its length)."""


def model_context(folder: str | Path) -> tuple[int | None, str]:
    """``(tokens, where it comes from)`` the model in ``folder`` holds: its ``config.json``'s
    ``max_position_embeddings`` (or ``n_positions``...; of ``text_config`` in a multimodal
    one), times the ``rope_scaling`` factor of a yarn, linear or dynamic scaling; ``(None,
    why)`` when the config does not say."""
    path = Path(folder) / "config.json"
    try:
        cfg = json.loads(path.read_text())
    except (OSError, ValueError) as e:
        return None, f"{path} unreadable: {e}"
    for c in (cfg, cfg.get("text_config") or {}):
        for key in _POSITION_KEYS:
            v = c.get(key)
            if isinstance(v, int) and v > 0:
                rope = c.get("rope_scaling") or {}
                kind = rope.get("rope_type") or rope.get("type")
                factor = rope.get("factor")
                if kind in _SCALED and isinstance(factor, (int, float)) and factor > 1:
                    return int(v * factor), f"{path}: {key} {v} x rope_scaling.factor {factor:g}"
                return v, f"{path}: {key}"
    return None, f"{path} names no context length"


def engine_context(cfg: RunConfig, folder: str | Path) -> tuple[int | None, str]:
    """``(tokens, where it comes from)`` one generation replica holds: the model's length,
    lowered by ``proxy.engine_args.max_model_len`` (vllm) or ``context_length`` (sglang)."""
    limit, where = model_context(folder)
    key = {"vllm": "max_model_len", "vllm-server": "max_model_len",
           "sglang": "context_length"}.get(cfg.proxy.engine)
    v = cfg.proxy.engine_args.get(key) if key else None
    if isinstance(v, int) and v > 0 and (limit is None or v < limit):
        limit, where = v, f"proxy.engine_args.{key}"
    return limit, where


def check_context(cfg: RunConfig, folder: str | Path) -> None:
    """``ValueError`` naming the key when an env's last turn cannot fit: a prompt of up to
    ``envs.<name>.max_context_tokens`` plus ``sampling.max_new_tokens`` must fit the engine's
    context (:func:`engine_context`) and a message's token list (``MAX_TOKENS``)."""
    limit, where = engine_context(cfg, folder)
    for name, env in cfg.envs.items():
        need = env.max_context_tokens + env.sampling.max_new_tokens
        for cap, what in ((limit, f"what the engine holds, {limit} tokens ({where})"),
                          (MAX_TOKENS, f"the longest token list a message carries ({MAX_TOKENS})")):
            if cap is not None and need > cap:
                raise ValueError(
                    f"envs.{name}.max_context_tokens = {env.max_context_tokens} plus "
                    f"envs.{name}.sampling.max_new_tokens = {env.sampling.max_new_tokens} "
                    f"exceeds {what}: lower envs.{name}.max_context_tokens, or use a model "
                    f"(or engine_args) with a longer context")

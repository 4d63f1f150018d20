"""Hugging Face Qwen3 <-> megatron-core ``GPTModel``: the model built from an HF
``config.json`` and the weights converted both ways (exactly: only copies, splits and
concatenations, no arithmetic).

Layout (per decoder layer ``i``; ``hpg = num_heads / num_kv_heads`` query heads per group):

==========================================  =====================================================
HF (``model.layers.i.``)                    megatron (``decoder.layers.i.``)
==========================================  =====================================================
``self_attn.{q,k,v}_proj.weight``           ``self_attention.linear_qkv.weight``: per query group
                                            ``[hpg q heads; 1 k head; 1 v head]``, groups stacked
``self_attn.o_proj.weight``                 ``self_attention.linear_proj.weight``
``self_attn.{q,k}_norm.weight``             ``self_attention.{q,k}_layernorm.weight``
``input_layernorm.weight``                  ``input_layernorm.weight``
``post_attention_layernorm.weight``         ``pre_mlp_layernorm.weight``
``mlp.{gate,up}_proj.weight``               ``mlp.linear_fc1.weight`` = ``[gate; up]``
``mlp.down_proj.weight``                    ``mlp.linear_fc2.weight``
==========================================  =====================================================

plus ``model.embed_tokens.weight`` <-> ``embedding.word_embeddings.weight``,
``model.norm.weight`` <-> ``decoder.final_layernorm.weight`` and ``lm_head.weight`` <->
``output_layer.weight`` (absent on the megatron side with tied embeddings, where HF's
``lm_head.weight`` is the embedding again). Megatron's ``_extra_state`` entries carry no
weights and are skipped. Imports torch; megatron-core only where a model is built.
"""

from __future__ import annotations

import json
import os
import warnings
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch

__all__ = ["Qwen3Layout", "build_gpt_model", "hf_to_megatron", "layer_spec", "megatron_to_hf",
           "qwen3_layout", "transformer_config"]


@dataclass(frozen=True)
class Qwen3Layout:
    """The shape of a Qwen3 causal LM, read from its HF ``config.json``."""

    num_layers: int
    hidden_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    vocab_size: int
    rms_norm_eps: float
    rope_theta: float
    max_position_embeddings: int
    tie_word_embeddings: bool

    @property
    def heads_per_group(self) -> int:
        return self.num_heads // self.num_kv_heads


def qwen3_layout(config: str | os.PathLike | Mapping[str, Any]) -> Qwen3Layout:
    """The layout of an HF Qwen3 model: ``config`` is its folder, its ``config.json`` or the
    parsed dict. Anything the megatron model here does not reproduce (biases, sliding
    window, scaled rope, another activation or model type) is an error naming the key."""
    if not isinstance(config, Mapping):
        path = os.fspath(config)
        if os.path.isdir(path):
            path = os.path.join(path, "config.json")
        with open(path) as f:
            config = json.load(f)
    c = dict(config)
    where = "megatron backend (Qwen3 GPTModel)"
    if c.get("model_type") != "qwen3":
        raise ValueError(f"{where}: model_type is {c.get('model_type')!r}; only 'qwen3' is converted")
    for key, ok in (("attention_bias", False), ("use_sliding_window", False), ("mlp_bias", False)):
        if bool(c.get(key, False)) != ok:
            raise ValueError(f"{where}: config {key}={c[key]!r} is not supported")
    if c.get("hidden_act", "silu") != "silu":
        raise ValueError(f"{where}: config hidden_act={c['hidden_act']!r} is not supported (silu only)")
    rope = c.get("rope_parameters") or c.get("rope_scaling") or {}
    if rope.get("rope_type", rope.get("type", "default")) != "default":
        raise ValueError(f"{where}: rope type {rope.get('rope_type', rope.get('type'))!r} is not "
                         "supported (default rope only)")
    theta = rope.get("rope_theta", c.get("rope_theta", 10000.0))
    heads = int(c["num_attention_heads"])
    kv = int(c.get("num_key_value_heads") or heads)
    if heads % kv:
        raise ValueError(f"{where}: num_attention_heads ({heads}) is not a multiple of "
                         f"num_key_value_heads ({kv})")
    return Qwen3Layout(
        num_layers=int(c["num_hidden_layers"]), hidden_size=int(c["hidden_size"]), num_heads=heads,
        num_kv_heads=kv, head_dim=int(c.get("head_dim") or int(c["hidden_size"]) // heads),
        intermediate_size=int(c["intermediate_size"]), vocab_size=int(c["vocab_size"]),
        rms_norm_eps=float(c.get("rms_norm_eps", 1e-6)), rope_theta=float(theta),
        max_position_embeddings=int(c.get("max_position_embeddings", 2048)),
        tie_word_embeddings=bool(c.get("tie_word_embeddings", False)))


def transformer_config(layout: Qwen3Layout, *, dtype: torch.dtype = torch.float32,
                       tensor_parallel: int = 1, pipeline_parallel: int = 1,
                       initialize: bool = False) -> Any:
    """megatron-core's ``TransformerConfig`` for ``layout``: RMSNorm, SwiGLU (gated fc1),
    q/k RMSNorm per head, no biases, no dropout, every fused kernel off (they are CUDA
    ones), weights created on CPU. ``initialize=False`` leaves them uninitialised (the
    caller loads converted weights into every one)."""
    from megatron.core.transformer.transformer_config import TransformerConfig

    return TransformerConfig(
        num_layers=layout.num_layers, hidden_size=layout.hidden_size,
        num_attention_heads=layout.num_heads, num_query_groups=layout.num_kv_heads,
        kv_channels=layout.head_dim, ffn_hidden_size=layout.intermediate_size,
        normalization="RMSNorm", layernorm_epsilon=layout.rms_norm_eps,
        gated_linear_unit=True, activation_func=torch.nn.functional.silu,
        add_bias_linear=False, add_qkv_bias=False, qk_layernorm=True,
        hidden_dropout=0.0, attention_dropout=0.0,
        bias_activation_fusion=False, bias_dropout_fusion=False, masked_softmax_fusion=False,
        apply_rope_fusion=False, gradient_accumulation_fusion=False, persist_layer_norm=False,
        tensor_model_parallel_size=tensor_parallel, pipeline_model_parallel_size=pipeline_parallel,
        use_cpu_initialization=True, perform_initialization=initialize,
        params_dtype=dtype, bf16=dtype == torch.bfloat16, fp16=dtype == torch.float16)


def layer_spec(layout: Qwen3Layout) -> Any:
    """The decoder layer spec: megatron-core's own modules (no Transformer Engine), RMSNorm,
    q/k layernorm."""
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec

    return get_gpt_layer_local_spec(qk_layernorm=True, normalization="RMSNorm")


def build_gpt_model(layout: Qwen3Layout, *, dtype: torch.dtype = torch.float32,
                    initialize: bool = False) -> Any:
    """A megatron-core ``GPTModel`` of ``layout`` (rope at ``rope_theta``, embeddings tied as
    in the HF config). Megatron's parallel state must be set up
    (:func:`rollart.engines.megatron_trainer.setup_megatron`)."""
    with warnings.catch_warnings():  # "Apex is not installed", deprecations of its own
        warnings.simplefilter("ignore")
        from megatron.core.models.gpt.gpt_model import GPTModel

        return GPTModel(
            transformer_config(layout, dtype=dtype, initialize=initialize), layer_spec(layout),
            vocab_size=layout.vocab_size, max_sequence_length=layout.max_position_embeddings,
            position_embedding_type="rope", rotary_base=layout.rope_theta,
            share_embeddings_and_output_weights=layout.tie_word_embeddings, parallel_output=True)


_LAYER_SAME = {  # HF name in model.layers.i -> megatron name in decoder.layers.i
    "self_attn.o_proj.weight": "self_attention.linear_proj.weight",
    "self_attn.q_norm.weight": "self_attention.q_layernorm.weight",
    "self_attn.k_norm.weight": "self_attention.k_layernorm.weight",
    "input_layernorm.weight": "input_layernorm.weight",
    "post_attention_layernorm.weight": "pre_mlp_layernorm.weight",
    "mlp.down_proj.weight": "mlp.linear_fc2.weight",
}
_TOP_SAME = {"model.embed_tokens.weight": "embedding.word_embeddings.weight",
             "model.norm.weight": "decoder.final_layernorm.weight"}


def _take(sd: Mapping[str, torch.Tensor], name: str, used: set[str]) -> torch.Tensor:
    if name not in sd:
        raise KeyError(f"state dict has no {name!r}")
    used.add(name)
    return sd[name]


def _check_all_used(sd: Mapping[str, Any], used: set[str], side: str) -> None:
    left = sorted(k for k in sd if k not in used and not k.endswith("_extra_state")
                  and not k.endswith("rotary_emb.inv_freq"))
    if left:
        raise KeyError(f"{side} tensors the Qwen3 conversion does not know: {left[:8]}"
                       + (f" and {len(left) - 8} more" if len(left) > 8 else ""))


def hf_to_megatron(hf: Mapping[str, torch.Tensor], layout: Qwen3Layout) -> dict[str, torch.Tensor]:
    """An HF Qwen3 state dict as megatron ``GPTModel`` tensors (new tensors where fused,
    the same tensors elsewhere). Every HF tensor must be used (else ``KeyError``)."""
    used: set[str] = set()
    out = {mg: _take(hf, name, used) for name, mg in _TOP_SAME.items()}
    if not layout.tie_word_embeddings:
        out["output_layer.weight"] = _take(hf, "lm_head.weight", used)
    elif "lm_head.weight" in hf:
        used.add("lm_head.weight")  # the embedding again
    g, hpg, d, H = layout.num_kv_heads, layout.heads_per_group, layout.head_dim, layout.hidden_size
    for i in range(layout.num_layers):
        p, m = f"model.layers.{i}.", f"decoder.layers.{i}."
        for name, mg in _LAYER_SAME.items():
            out[m + mg] = _take(hf, p + name, used)
        q = _take(hf, p + "self_attn.q_proj.weight", used).reshape(g, hpg * d, H)
        k = _take(hf, p + "self_attn.k_proj.weight", used).reshape(g, d, H)
        v = _take(hf, p + "self_attn.v_proj.weight", used).reshape(g, d, H)
        out[m + "self_attention.linear_qkv.weight"] = torch.cat([q, k, v], dim=1).reshape(-1, H)
        out[m + "mlp.linear_fc1.weight"] = torch.cat(
            [_take(hf, p + "mlp.gate_proj.weight", used), _take(hf, p + "mlp.up_proj.weight", used)], dim=0)
    _check_all_used(hf, used, "HF")
    return out


def megatron_to_hf(mg: Mapping[str, Any], layout: Qwen3Layout) -> dict[str, torch.Tensor]:
    """Megatron ``GPTModel`` tensors as an HF Qwen3 state dict (contiguous CPU tensors, each
    its own storage). With tied embeddings ``lm_head.weight`` is a copy of the embedding, as
    HF's ``state_dict()`` lists it, so names and digest match a torch-backend trainer."""
    used: set[str] = set()

    def t(x: torch.Tensor) -> torch.Tensor:
        return x.detach().to("cpu").clone().contiguous()

    out = {name: t(_take(mg, m, used)) for name, m in _TOP_SAME.items()}
    if not layout.tie_word_embeddings:
        out["lm_head.weight"] = t(_take(mg, "output_layer.weight", used))
    else:
        used.add("output_layer.weight")
        out["lm_head.weight"] = out["model.embed_tokens.weight"].clone()
    g, hpg, d, H = layout.num_kv_heads, layout.heads_per_group, layout.head_dim, layout.hidden_size
    for i in range(layout.num_layers):
        p, m = f"model.layers.{i}.", f"decoder.layers.{i}."
        for name, mgn in _LAYER_SAME.items():
            out[p + name] = t(_take(mg, m + mgn, used))
        qkv = _take(mg, m + "self_attention.linear_qkv.weight", used).reshape(g, (hpg + 2) * d, H)
        q, k, v = torch.split(qkv, [hpg * d, d, d], dim=1)
        out[p + "self_attn.q_proj.weight"] = t(q.reshape(-1, H))
        out[p + "self_attn.k_proj.weight"] = t(k.reshape(-1, H))
        out[p + "self_attn.v_proj.weight"] = t(v.reshape(-1, H))
        gate, up = torch.split(_take(mg, m + "mlp.linear_fc1.weight", used), layout.intermediate_size, dim=0)
        out[p + "mlp.gate_proj.weight"] = t(gate)
        out[p + "mlp.up_proj.weight"] = t(up)
    _check_all_used(mg, used, "megatron")
    return out

"""Advantages and losses: pure functions on tensors (no bus, no actors)."""

from rollart.algos.advantages import (
    broadcast_to_tokens,
    grpo_advantages,
    reinforce_pp_advantages,
    rloo_advantages,
)
from rollart.algos.losses import (
    LossConfig,
    entropy_from_logits,
    entropy_per_token,
    kl_k3,
    kl_k3_per_token,
    policy_loss,
)
from rollart.algos.reduce import AGG_MODES, agg_units, aggregate, masked_mean, masked_sum

__all__ = [
    "AGG_MODES", "LossConfig", "agg_units", "aggregate", "broadcast_to_tokens",
    "entropy_from_logits", "entropy_per_token", "grpo_advantages", "kl_k3", "kl_k3_per_token",
    "masked_mean", "masked_sum", "policy_loss", "reinforce_pp_advantages", "rloo_advantages",
]

"""Policy-gradient losses, KL and entropy, as pure functions on tensors.

Notation, per token ``t`` of sequence ``b`` (all ``[B, T]`` tensors, ``m`` the response mask):

- ``logp``        log pi_theta(y_t | y_<t)   the policy being trained (carries the gradient)
- ``old_logp``    log pi_old                 the proximal / old policy, recomputed by the
                                             trainer before the update (no gradient)
- ``behav_logp``  log mu                     the behaviour policy: what the rollout engine
                                             reported when it sampled the token
- ``A``           advantage (per token, or per sequence ``[B]`` broadcast over ``T``)

``r = exp(logp - old_logp)`` and ``clip(r) = clamp(r, 1 - clip_low, 1 + clip_high)``.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from rollart.algos.reduce import aggregate, check_agg, masked_mean

OLD_LOGP_SOURCES = ("recompute", "behav")


@dataclass(frozen=True)
class LossConfig:
    """Settings of one training step's loss (what ``TorchTrainBackend.train_step`` reads)."""

    clip_low: float = 0.2
    """Lower PPO clip: the ratio is clipped from below at ``1 - clip_low``."""
    clip_high: float = 0.2
    """Upper PPO clip: the ratio is clipped from above at ``1 + clip_high`` (DAPO uses 0.28)."""
    agg: str = "token-mean"
    """Loss aggregation: token-mean | seq-mean-token-mean | seq-mean-token-sum."""
    old_logp: str = "recompute"
    """Source of ``old_logp``: ``recompute`` (the trainer's policy before this step) or
    ``behav`` (the rollout engine's log-probs: classic PPO against the behaviour policy;
    no IS correction is then applied)."""
    is_cap: float | None = None
    """Cap C of the behaviour importance weight ``exp(old_logp - behav_logp)``; None = no
    cap. With ``old_logp=recompute`` and ``decoupled=False`` the correction is applied
    only when a cap is set (truncated IS)."""
    decoupled: bool = False
    """Decoupled PPO (AReaL): behaviour weight applied uncapped, tokens above the cap dropped."""
    entropy_coef: float = 0.0
    """Entropy bonus: ``loss -= entropy_coef * agg(entropy)``."""
    kl_coef: float = 0.0
    """k3 KL penalty to the frozen initial policy: ``loss += kl_coef * agg(k3)``."""
    advance_schedule: bool = True
    """Whether this step moves the LR schedule (``trainer.schedule_clock``); the step itself
    is taken either way."""

    def __post_init__(self) -> None:
        check_agg(self.agg)
        if self.old_logp not in OLD_LOGP_SOURCES:
            raise ValueError(f"unknown old_logp {self.old_logp!r}; allowed: {', '.join(OLD_LOGP_SOURCES)}")
        if self.decoupled and self.old_logp != "recompute":
            raise ValueError("decoupled=True needs old_logp='recompute' (the proximal policy)")
        if self.is_cap is not None and self.is_cap <= 0:
            raise ValueError(f"is_cap must be > 0 or None, got {self.is_cap}")

    @property
    def uses_behav(self) -> bool:
        """Whether the loss takes an importance weight against the behaviour log-probs."""
        return self.old_logp == "recompute" and (self.decoupled or self.is_cap is not None)


def policy_loss(logp: torch.Tensor, old_logp: torch.Tensor, advantages: torch.Tensor,
                mask: torch.Tensor, *, clip_low: float = 0.2, clip_high: float = 0.2,
                agg: str = "token-mean", behav_logp: torch.Tensor | None = None,
                is_cap: float | None = None, decoupled: bool = False
                ) -> tuple[torch.Tensor, dict[str, float]]:
    """PPO clipped surrogate with an optional behaviour-policy correction.

    Per token::

        s_t = min(r_t * A_t, clip(r_t) * A_t)          # PPO clipped surrogate
        l_t = -w_t * s_t
        loss = aggregate(l, m, agg)                     # see rollart.algos.reduce

    The weight ``w_t`` (always detached) depends on the mode, with
    ``rho_t = exp(old_logp_t - behav_logp_t)``:

    - ``behav_logp is None``: ``w_t = 1`` (on-policy PPO/GRPO; with one optimizer step
      per batch ``r_t == 1`` in value and this is the plain policy gradient).
    - ``decoupled=False`` (truncated IS, for rollout/trainer mismatch and staleness):
      ``w_t = min(rho_t, is_cap)``; ``is_cap=None`` means ``w_t = rho_t``.
    - ``decoupled=True`` (AReaL decoupled PPO: the ratio is taken against the proximal
      policy ``old_logp``, the behaviour correction is ``pi_prox / mu``):
      ``w_t = rho_t`` if ``rho_t <= is_cap`` else ``0`` (the token is dropped from the
      numerator; it still counts in the aggregation denominator). Requires ``behav_logp``.

    ``advantages`` may be ``[B]`` (broadcast over tokens) or the shape of ``logp``.

    Metrics (token means over ``m``, floats): ``clip_frac`` fraction of tokens where the
    clipped branch is selected (``clip(r)A < rA``: A>0 and r>1+clip_high, or A<0 and
    r<1-clip_low; those tokens get no gradient); ``ratio_mean`` mean r; ``is_weight_mean``
    mean w; ``is_capped_frac`` fraction with ``rho > is_cap`` (truncated or dropped);
    ``approx_kl`` k3 estimate of KL(pi_old || pi_theta): mean of ``r - 1 - log r``.
    """
    if decoupled and behav_logp is None:
        raise ValueError("decoupled PPO needs behav_logp")
    if advantages.dim() == 1 and logp.dim() == 2:
        advantages = advantages.unsqueeze(-1)
    advantages = advantages.to(logp.dtype)
    mask = mask.to(logp.dtype)
    log_ratio = logp - old_logp.detach()
    ratio = torch.exp(log_ratio)
    clipped = torch.clamp(ratio, 1.0 - clip_low, 1.0 + clip_high)
    surr = ratio * advantages
    surr_clip = clipped * advantages
    obj = torch.minimum(surr, surr_clip)

    capped = torch.zeros_like(mask)
    if behav_logp is None:
        weight = torch.ones_like(mask)
    else:
        rho = torch.exp(old_logp.detach() - behav_logp.detach())
        if is_cap is not None:
            capped = (rho > is_cap).to(logp.dtype)
        if decoupled:
            weight = rho if is_cap is None else torch.where(rho > is_cap, torch.zeros_like(rho), rho)
        else:
            weight = rho if is_cap is None else torch.clamp(rho, max=is_cap)
    loss = aggregate(-weight * obj, mask, agg)

    with torch.no_grad():
        metrics = {
            "clip_frac": masked_mean((surr_clip < surr).to(logp.dtype), mask).item(),
            "ratio_mean": masked_mean(ratio, mask).item(),
            "is_weight_mean": masked_mean(weight, mask).item(),
            "is_capped_frac": masked_mean(capped, mask).item(),
            "approx_kl": masked_mean(ratio - 1.0 - log_ratio, mask).item(),
        }
    return loss, metrics


def kl_k3_per_token(logp: torch.Tensor, ref_logp: torch.Tensor) -> torch.Tensor:
    """``k3 = exp(ref - logp) - (ref - logp) - 1`` (>= 0), an unbiased, low-variance estimate
    of KL(pi_theta || pi_ref) for tokens sampled from pi_theta."""
    d = ref_logp.detach() - logp
    return torch.exp(d) - d - 1.0


def kl_k3(logp: torch.Tensor, ref_logp: torch.Tensor, mask: torch.Tensor,
          agg: str = "token-mean") -> torch.Tensor:
    """k3 KL estimate per token (see ``kl_k3_per_token``), aggregated with ``agg``."""
    return aggregate(kl_k3_per_token(logp, ref_logp), mask.to(logp.dtype), agg)


def entropy_per_token(logits: torch.Tensor) -> torch.Tensor:
    """``H = -sum_v p_v log p_v`` over the last dim; ``-inf`` logits (disallowed tokens)
    contribute 0. Computed as ``logsumexp(z) - sum_v p_v z_v``."""
    logz = torch.logsumexp(logits, dim=-1)
    p = torch.softmax(logits, dim=-1)
    finite = torch.where(torch.isfinite(logits), logits, torch.zeros_like(logits))
    return logz - (p * finite).sum(dim=-1)


def entropy_from_logits(logits: torch.Tensor, mask: torch.Tensor,
                        agg: str = "token-mean") -> torch.Tensor:
    """Entropy of ``softmax(logits)`` (``[B, T, V]``) per token, aggregated over ``mask [B, T]``."""
    ent = entropy_per_token(logits)
    return aggregate(ent, mask.to(ent.dtype), agg)

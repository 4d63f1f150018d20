"""Per-trajectory advantages from scalar rewards and group membership.

Every function accepts either

- ``rewards`` of shape ``[N]`` with ``groups`` a length-``N`` sequence (or tensor) of
  group ids (any hashable: prompt ids, ints, strings), or
- ``rewards`` of shape ``[G, S]`` (one row per group) with ``groups=None``,

and returns advantages of the same shape as ``rewards``. Computation runs in float64
and the result is cast to the rewards' floating dtype (float32 for integer rewards).

Conventions: ``n_g`` is the size of the group of trajectory ``i``, ``mean_g`` its mean
reward, ``std_g`` its *unbiased* standard deviation (Bessel, divisor ``n_g - 1``).
A group of size 1 and a group whose rewards are all equal get advantage exactly 0.
"""

from __future__ import annotations

from collections.abc import Hashable, Sequence

import torch

GroupIds = Sequence[Hashable] | torch.Tensor | None


def _prepare(rewards, groups: GroupIds):
    r = torch.as_tensor(rewards)
    out_dtype = r.dtype if r.is_floating_point() else torch.float32
    shape = r.shape
    if groups is None:
        if r.dim() != 2:
            raise ValueError(f"without group ids rewards must be [num_groups, group_size], got {tuple(shape)}")
        idx = torch.arange(shape[0]).repeat_interleave(shape[1])
    else:
        if r.dim() != 1:
            raise ValueError(f"with group ids rewards must be 1-D, got {tuple(shape)}")
        ids = groups.tolist() if isinstance(groups, torch.Tensor) else list(groups)
        if len(ids) != r.shape[0]:
            raise ValueError(f"{len(ids)} group ids for {r.shape[0]} rewards")
        index: dict = {}
        idx = torch.tensor([index.setdefault(g, len(index)) for g in ids], dtype=torch.long)
    flat = r.reshape(-1).to(torch.float64)
    return flat, idx, shape, out_dtype


def _group_stats(r: torch.Tensor, idx: torch.Tensor):
    """Per-trajectory (n_g, mean_g, unbiased std_g, all-equal flag) of its group."""
    ng = int(idx.max().item()) + 1 if idx.numel() else 0
    cnt = torch.zeros(ng, dtype=r.dtype).index_add_(0, idx, torch.ones_like(r))
    tot = torch.zeros(ng, dtype=r.dtype).index_add_(0, idx, r)
    mean = tot / cnt
    dev2 = torch.zeros(ng, dtype=r.dtype).index_add_(0, idx, (r - mean[idx]) ** 2)
    std = (dev2 / (cnt - 1).clamp(min=1.0)).sqrt()
    hi = torch.full((ng,), -torch.inf, dtype=r.dtype).scatter_reduce(0, idx, r, reduce="amax")
    lo = torch.full((ng,), torch.inf, dtype=r.dtype).scatter_reduce(0, idx, r, reduce="amin")
    flat = (hi == lo) | (cnt < 2)
    return cnt[idx], tot[idx], mean[idx], std[idx], flat[idx]


def grpo_advantages(rewards, groups: GroupIds = None, *, std_normalize: bool = True,
                    eps: float = 1e-6) -> torch.Tensor:
    """GRPO group-normalised advantage.

    ``A_i = (r_i - mean_g) / (std_g + eps)`` with ``std_normalize=True``;
    ``A_i = r_i - mean_g`` with ``std_normalize=False`` (Dr. GRPO: no std division, which
    removes the bias toward low-variance groups).
    """
    r, idx, shape, dtype = _prepare(rewards, groups)
    if r.numel() == 0:
        return torch.zeros(shape, dtype=dtype)
    _, _, mean, std, flat = _group_stats(r, idx)
    adv = r - mean
    if std_normalize:
        adv = adv / (std + eps)
    adv = torch.where(flat, torch.zeros_like(adv), adv)
    return adv.reshape(shape).to(dtype)


def rloo_advantages(rewards, groups: GroupIds = None) -> torch.Tensor:
    """REINFORCE leave-one-out: the baseline is the mean of the *other* group members.

    ``A_i = r_i - (sum_g - r_i) / (n_g - 1)``  (equivalently ``n_g/(n_g-1) * (r_i - mean_g)``).
    With ``n_g = 2``: ``A_1 = r_1 - r_2`` and ``A_2 = r_2 - r_1``.
    """
    r, idx, shape, dtype = _prepare(rewards, groups)
    if r.numel() == 0:
        return torch.zeros(shape, dtype=dtype)
    cnt, tot, _, _, flat = _group_stats(r, idx)
    adv = r - (tot - r) / (cnt - 1).clamp(min=1.0)
    adv = torch.where(flat, torch.zeros_like(adv), adv)
    return adv.reshape(shape).to(dtype)


def reinforce_pp_advantages(rewards, groups: GroupIds = None, *, eps: float = 1e-6) -> torch.Tensor:
    """REINFORCE++ with a group baseline, whitened over the whole batch.

    ``a_i = r_i - mean_g`` then ``A_i = (a_i - mean(a)) / (std(a) + eps)`` where mean and
    (unbiased) std run over all ``N`` trajectories of the batch. If every ``a_i`` is equal
    (e.g. all groups have zero variance) or ``N < 2``, ``A_i = 0``.
    """
    r, idx, shape, dtype = _prepare(rewards, groups)
    if r.numel() == 0:
        return torch.zeros(shape, dtype=dtype)
    _, _, mean, _, flat = _group_stats(r, idx)
    a = torch.where(flat, torch.zeros_like(r), r - mean)
    if a.numel() < 2 or bool((a == a[0]).all()):
        return torch.zeros(shape, dtype=dtype)
    adv = (a - a.mean()) / (a.std() + eps)
    return adv.reshape(shape).to(dtype)


def broadcast_to_tokens(adv: torch.Tensor, response_mask: torch.Tensor) -> torch.Tensor:
    """Per-trajectory ``adv [B]`` to per-token ``[B, T]``: ``A[b, t] = adv[b] * mask[b, t]``."""
    adv = torch.as_tensor(adv)
    dtype = adv.dtype if adv.is_floating_point() else torch.float32
    m = response_mask.to(dtype)
    return adv.to(dtype=dtype, device=m.device).reshape(-1, *([1] * (m.dim() - 1))) * m

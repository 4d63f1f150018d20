"""Masked reductions and loss aggregation modes.

All functions take a value tensor ``x`` and a ``mask`` of the same shape (1 = the
position counts, 0 = padding / prompt / environment token). Sequences run along
the last dimension, so a batch is ``[B, T]``.

Aggregation modes (``agg``), for a per-token quantity ``x[b, t]`` and mask ``m[b, t]``:

- ``"token-mean"``:          ``sum_bt m*x / sum_bt m``
  (every response token in the batch weighs the same; long responses weigh more).
- ``"seq-mean-token-mean"``: ``mean_{b in S} ( sum_t m*x / sum_t m )``
  (every sequence weighs the same, whatever its length).
- ``"seq-mean-token-sum"``:  ``mean_{b in S} ( sum_t m*x )``
  (per-sequence sums, averaged over sequences; no length normalisation).

``S`` is the set of sequences with at least one masked-in token; a sequence with
no response tokens neither contributes nor counts. An empty mask gives 0, never NaN.
"""

from __future__ import annotations

import torch

AGG_MODES = ("token-mean", "seq-mean-token-mean", "seq-mean-token-sum")


def masked_sum(x: torch.Tensor, mask: torch.Tensor, dim: int | None = None) -> torch.Tensor:
    """``sum(x * mask)`` over ``dim`` (all dimensions when ``None``)."""
    prod = x * mask.to(x.dtype)
    return prod.sum() if dim is None else prod.sum(dim=dim)


def masked_mean(x: torch.Tensor, mask: torch.Tensor, dim: int | None = None) -> torch.Tensor:
    """``sum(x * mask) / sum(mask)`` over ``dim``; 0 where the mask is empty."""
    m = mask.to(x.dtype)
    count = m.sum() if dim is None else m.sum(dim=dim)
    return masked_sum(x, m, dim) / count.clamp(min=1.0)


def check_agg(agg: str) -> None:
    if agg not in AGG_MODES:
        raise ValueError(f"unknown loss aggregation {agg!r}; allowed: {', '.join(AGG_MODES)}")


def aggregate(x: torch.Tensor, mask: torch.Tensor, agg: str = "token-mean") -> torch.Tensor:
    """Reduce a per-token ``[B, T]`` tensor to a scalar with the mode ``agg`` (see module doc)."""
    check_agg(agg)
    if agg == "token-mean":
        return masked_mean(x, mask)
    if x.dim() < 2:
        x, mask = x.unsqueeze(0), mask.unsqueeze(0)
    m = mask.to(x.dtype)
    per_seq = masked_sum(x, m, dim=-1)
    if agg == "seq-mean-token-mean":
        per_seq = per_seq / m.sum(dim=-1).clamp(min=1.0)
    present = (m.sum(dim=-1) > 0).to(x.dtype)
    return (per_seq * present).sum() / present.sum().clamp(min=1.0)


def agg_units(mask: torch.Tensor, agg: str = "token-mean") -> int:
    """The denominator ``aggregate`` uses: masked-in tokens for ``token-mean``, non-empty
    sequences for the ``seq-mean-*`` modes.

    For gradient accumulation over micro-batches, ``sum_k aggregate(x_k, m_k) * units_k /
    units_total`` equals ``aggregate`` over the whole batch exactly.
    """
    check_agg(agg)
    if agg == "token-mean":
        return int(mask.sum().item())
    if mask.dim() < 2:
        mask = mask.unsqueeze(0)
    return int((mask.sum(dim=-1) > 0).sum().item())

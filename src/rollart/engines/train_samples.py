"""What a training step reads: one sample per trajectory (:class:`TrainSample`), padded into
micro-batches (:func:`collate`), and the per-token log-probs (and entropies) a model gives
them (:func:`sequence_logprobs`). Shared by every trainer backend and ``rollart sft``."""

from __future__ import annotations

import functools
import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from rollart.algos.losses import entropy_per_token

__all__ = ["Batch", "TrainSample", "collate", "sequence_logprobs"]


@dataclass
class TrainSample:
    """One trajectory as the trainer sees it. Lists are aligned with ``token_ids``:
    entry ``i`` describes token ``i`` (whose log-prob is conditioned on tokens ``< i``).

    - ``response_mask[i]``: 1 for tokens the policy generated (trained on), 0 for prompt and
      environment tokens. ``response_mask[0]`` must be 0 (token 0 has no log-prob).
    - ``behav_logprobs[i]``: the rollout engine's log-prob of token ``i`` (any value where
      the mask is 0).
    - ``advantage``: the trajectory's scalar advantage, applied to every response token.
    - ``allowed[i]``: when not None, token ``i`` was sampled under constrained decoding
      from these token ids, and its log-prob is ``log_softmax`` renormalised over them:
      ``z[tok] - logsumexp(z[allowed])``. The entropy at that position is taken over the
      allowed set as well.
    """

    token_ids: list[int]
    response_mask: list[int]
    behav_logprobs: list[float]
    advantage: float
    allowed: list[list[int] | None] | None = None

    def __post_init__(self) -> None:
        n = len(self.token_ids)
        if n < 2:
            raise ValueError("a TrainSample needs at least 2 tokens")
        for name in ("response_mask", "behav_logprobs") + (("allowed",) if self.allowed is not None else ()):
            if len(getattr(self, name)) != n:
                raise ValueError(f"{name} has {len(getattr(self, name))} entries for {n} tokens")
        if self.response_mask[0]:
            raise ValueError("response_mask[0] must be 0: the first token has no log-prob")
        for i, ids in enumerate(self.allowed or ()):
            if ids is not None and (i == 0 or self.token_ids[i] not in ids):
                raise ValueError(f"allowed[{i}] is set but token {self.token_ids[i]} is not in it (or i == 0)")


@dataclass
class Batch:
    """Samples padded into tensors on one device: what the loss and the SFT step read."""
    input_ids: torch.Tensor       # [B, T] long, right-padded with 0
    attention_mask: torch.Tensor  # [B, T] long
    response_mask: torch.Tensor   # [B, T] float
    behav: torch.Tensor           # [B, T] float
    adv: torch.Tensor             # [B] float
    c_rows: torch.Tensor          # [K] sequence index of each constrained token
    c_cols: torch.Tensor          # [K] token index (>= 1) of each constrained token
    c_ids: torch.Tensor           # [K, A] allowed ids, padded with 0
    c_valid: torch.Tensor         # [K, A] bool, False on padding


def collate(samples: Sequence[TrainSample], device: torch.device) -> Batch:
    """Right-pad ``samples`` into a :class:`Batch` on ``device`` (RL's steps and ``rollart sft``)."""
    B, T = len(samples), max(len(s.token_ids) for s in samples)
    ids = torch.zeros(B, T, dtype=torch.long)
    att = torch.zeros(B, T, dtype=torch.long)
    resp = torch.zeros(B, T)
    behav = torch.zeros(B, T)
    rows, cols, allowed = [], [], []
    for b, s in enumerate(samples):
        n = len(s.token_ids)
        ids[b, :n] = torch.tensor(s.token_ids)
        att[b, :n] = 1
        resp[b, :n] = torch.tensor(s.response_mask, dtype=torch.float32)
        behav[b, :n] = torch.tensor(s.behav_logprobs, dtype=torch.float32)
        for t, a in enumerate(s.allowed or ()):
            if a is not None:
                rows.append(b)
                cols.append(t)
                allowed.append(a)
    width = max((len(a) for a in allowed), default=1)
    c_ids = torch.zeros(len(allowed), width, dtype=torch.long)
    c_valid = torch.zeros(len(allowed), width, dtype=torch.bool)
    for k, a in enumerate(allowed):
        c_ids[k, : len(a)] = torch.tensor(a)
        c_valid[k, : len(a)] = True
    adv = torch.tensor([float(s.advantage) for s in samples])
    to = functools.partial(torch.Tensor.to, device=device)
    return Batch(to(ids), to(att), to(resp), to(behav), to(adv),
                  to(torch.tensor(rows, dtype=torch.long)), to(torch.tensor(cols, dtype=torch.long)),
                  to(c_ids), to(c_valid))


def sequence_logprobs(model: torch.nn.Module, batch: Batch, *, with_entropy: bool = False,
                      entropy_grad: bool = False) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Per-token log-probs ``[B, T]`` (column 0 is 0) and optionally per-token entropy.

    ``logp[b, t] = z[b, t-1, tok] - logsumexp(z[b, t-1, S])`` with ``z`` the float32 logits,
    ``S`` the whole vocabulary or, for a constrained token, its allowed ids.
    """
    logits = model(input_ids=batch.input_ids, attention_mask=batch.attention_mask).logits
    z = logits[:, :-1].float()
    tok = z.gather(-1, batch.input_ids[:, 1:].unsqueeze(-1)).squeeze(-1)
    logz = torch.logsumexp(z, dim=-1)
    ent = None
    if with_entropy:
        ent = entropy_per_token(z if entropy_grad else z.detach())
    if batch.c_rows.numel():
        rows, cols = batch.c_rows, batch.c_cols - 1
        sub = z[rows, cols].gather(-1, batch.c_ids).masked_fill(~batch.c_valid, -math.inf)
        logz = logz.index_put((rows, cols), torch.logsumexp(sub, dim=-1))
        if ent is not None:
            ent = ent.index_put((rows, cols), entropy_per_token(sub if entropy_grad else sub.detach()))
    pad = z.new_zeros(z.shape[0], 1)
    logp = torch.cat([pad, tok - logz], dim=1)
    return logp, (torch.cat([pad, ent], dim=1) if ent is not None else None)

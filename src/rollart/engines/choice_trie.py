"""The choice trie of a constrained row and its log-probs renormalised over the allowed
tokens, for engines that sample it under a mask (no torch, no vLLM: the vLLM engine imports it
everywhere, its logits processor in vLLM's worker), and the allowed tokens after a prefix
(:func:`allowed_after`), which the trainer uses to rebuild a constrained turn's masks without
importing a generation engine.

A trie maps a token id to the trie after it; a complete choice ends at an empty dict.
"""

from __future__ import annotations

import asyncio
import math
from collections.abc import Awaitable, Callable, Mapping, Sequence

from .base import validate_choices

__all__ = ["accepted_prefix", "allowed_after", "branch_ids", "build_choice_trie", "choice_trie",
           "logsumexp", "renormalised_logprobs"]

Trie = dict


def choice_trie(choices: Sequence[Sequence[int]]) -> Trie:
    """The prefix tree of ``choices`` (validated by the caller)."""
    root: Trie = {}
    for c in choices:
        node = root
        for t in c:
            node = node.setdefault(int(t), {})
    return root


def build_choice_trie(choices: list[list[int]]) -> Trie:
    """A prefix tree of the choices (validated: non-empty, prefix-free)."""
    validate_choices(choices)
    return choice_trie(choices)


def allowed_after(choices: list[list[int]], prefix: list[int]) -> list[int]:
    """Tokens allowed after `prefix` under `choices` (sorted). The trainer uses this to
    rebuild the per-step masks of a constrained turn when it recomputes log-probs."""
    node = build_choice_trie(choices)
    for t in prefix:
        node = node[int(t)]
    return sorted(node)


def branch_ids(trie: Trie) -> list[int]:
    """Tokens allowed at some step with at least two allowed tokens (the only steps whose
    renormalised log-prob is not 0), sorted."""
    out: set[int] = set()
    stack = [trie]
    while stack:
        node = stack.pop()
        if len(node) > 1:
            out.update(node)
        stack.extend(node.values())
    return sorted(out)


def accepted_prefix(trie: Trie, tokens: Sequence[int]) -> tuple[list[int], bool]:
    """The longest prefix of ``tokens`` the trie accepts, and whether it is a whole choice."""
    resp: list[int] = []
    node = trie
    for t in tokens:
        if t not in node:
            break
        resp.append(t)
        node = node[t]
    return resp, not node


def logsumexp(xs: Sequence[float]) -> float:
    m = max(xs)
    if m == -math.inf:
        return m
    return m + math.log(sum(math.exp(x - m) for x in xs))


async def renormalised_logprobs(
    trie: Trie, resp: Sequence[int], raw: Sequence[Mapping[int, float]] | None,
    score: Callable[[int, list[int]], Awaitable[Mapping[int, float]]],
) -> list[float]:
    """Log-probs of ``resp`` renormalised over the tokens the trie allows at each step (0 at a
    step with one allowed token). ``raw[k]``: the raw log-probs of step ``k``'s allowed tokens,
    when the engine returned them; without ``raw`` (None), ``score(k, allowed)`` gives them
    (awaited together for every branching step)."""
    out: list[float] = []
    todo: list[tuple[int, list[int]]] = []  # (step, allowed) scored afterwards
    node = trie
    for k, t in enumerate(resp):
        allowed = sorted(node)
        if len(allowed) == 1:
            out.append(0.0)
        elif raw is not None:
            d = raw[k]
            out.append(d[t] - logsumexp([d[a] for a in allowed]))
        else:
            out.append(math.nan)
            todo.append((k, allowed))
        node = node[t]
    if todo:
        scores = await asyncio.gather(*(score(k, allowed) for k, allowed in todo))
        for (k, allowed), lp in zip(todo, scores):
            out[k] = lp[resp[k]] - logsumexp([lp[a] for a in allowed])
    return out

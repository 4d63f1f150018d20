"""Per-session KV reuse for multi-turn rollouts.

In a multi-turn rollout a trajectory's next prompt is its previous prompt, plus the tokens
the policy generated, plus the new observation. Re-reading that whole prompt every turn makes
prefill cost grow with the square of the number of turns. `SessionKVCache` keeps, per session
(the trajectory id), the keys and values the model computed for the tokens it has seen, so
the next turn only prefills the tokens that are new.

An entry is only ever reused for the exact tokens it was computed for: `get` returns the
length of the common prefix of the stored tokens and the new prompt, and the engine keeps the
K/V of that prefix only. Entries hold tensors shaped ``[1, kv_heads, n, head_dim]`` per layer
(contiguous, no padding), computed at positions ``0..n-1``. They are valid for the weights
that computed them only: the engine clears the cache when it loads weights.

Memory is bounded by `max_bytes`: the least recently used entries are evicted first, and an
entry larger than the whole cap is not stored at all.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

import torch

__all__ = ["KVEntry", "SessionKVCache"]

Layers = list[tuple[torch.Tensor, torch.Tensor]]


@dataclass
class KVEntry:
    """The K/V of one session: ``layers[l] = (keys, values)`` for the tokens in `tokens`."""

    tokens: tuple[int, ...]
    layers: Layers
    nbytes: int


def _common_prefix(a: Sequence[int], b: Sequence[int]) -> int:
    n = min(len(a), len(b))
    for i in range(n):
        if a[i] != b[i]:
            return i
    return n


def _check_layers(tokens: tuple[int, ...], layers: Layers) -> int:
    """Validate shapes; return the entry's size in bytes."""
    if not layers:
        raise ValueError("layers must not be empty")
    nbytes = 0
    for i, (k, v) in enumerate(layers):
        if k.dim() != 4 or k.shape != v.shape or k.shape[0] != 1:
            raise ValueError(
                f"layer {i}: keys and values must both be [1, kv_heads, n, head_dim], "
                f"got {tuple(k.shape)} and {tuple(v.shape)}"
            )
        if k.shape[2] != len(tokens):
            raise ValueError(
                f"layer {i}: {k.shape[2]} cached positions for {len(tokens)} tokens"
            )
        nbytes += k.numel() * k.element_size() + v.numel() * v.element_size()
    return nbytes


class SessionKVCache:
    """An LRU map session -> :class:`KVEntry`, bounded to `max_bytes` of tensors.

    Counters: `hits` / `misses` (lookups that could / could not reuse anything),
    `reused_tokens` / `prefilled_tokens` (prompt tokens of those lookups whose K/V were
    reused / must be computed), `evictions` (entries dropped to stay under the cap) and
    `bytes` (the size of what is stored now).
    """

    def __init__(self, max_bytes: int) -> None:
        if max_bytes < 0:
            raise ValueError(f"max_bytes must be >= 0, got {max_bytes}")
        self.max_bytes = int(max_bytes)
        self._entries: OrderedDict[str, KVEntry] = OrderedDict()
        self.bytes = 0
        self.hits = 0
        self.misses = 0
        self.reused_tokens = 0
        self.prefilled_tokens = 0
        self.evictions = 0

    def __len__(self) -> int:
        return len(self._entries)

    def __contains__(self, session: str) -> bool:
        return session in self._entries

    def get(self, session: str, prompt_ids: Sequence[int]) -> tuple[KVEntry | None, int]:
        """The entry of `session` and how many leading positions of `prompt_ids` it covers.

        The count is the common prefix of the stored tokens and `prompt_ids`, capped at
        ``len(prompt_ids) - 1`` so that at least one token is left to feed (the model needs
        one to produce the next-token logits). 0 (with entry None) is a miss.
        """
        entry = self._entries.get(session)
        reuse = 0
        if entry is not None:
            reuse = min(_common_prefix(entry.tokens, prompt_ids), len(prompt_ids) - 1)
        if reuse <= 0:
            self.misses += 1
            self.prefilled_tokens += len(prompt_ids)
            return None, 0
        self._entries.move_to_end(session)
        self.hits += 1
        self.reused_tokens += reuse
        self.prefilled_tokens += len(prompt_ids) - reuse
        return entry, reuse

    def put(self, session: str, tokens: Sequence[int], layers: Layers) -> bool:
        """Store (replacing) the K/V of `tokens` for `session`; evict least recently used
        entries to stay within `max_bytes`. Returns False if the entry alone is larger than
        the cap (it is then not stored, and any older entry of the session is dropped)."""
        if not session:
            raise ValueError("session must be a non-empty string")
        tokens = tuple(int(t) for t in tokens)
        nbytes = _check_layers(tokens, layers)
        self.drop([session])
        if nbytes > self.max_bytes:
            return False
        while self._entries and self.bytes + nbytes > self.max_bytes:
            _, old = self._entries.popitem(last=False)
            self.bytes -= old.nbytes
            self.evictions += 1
        self._entries[session] = KVEntry(tokens, list(layers), nbytes)
        self.bytes += nbytes
        return True

    def drop(self, sessions: Iterable[str]) -> None:
        """Forget these sessions (unknown ones are ignored)."""
        for s in sessions:
            entry = self._entries.pop(s, None)
            if entry is not None:
                self.bytes -= entry.nbytes

    def clear(self) -> None:
        """Forget every session (the counters other than `bytes` are kept)."""
        self._entries.clear()
        self.bytes = 0

    def stats(self) -> dict[str, int]:
        return {
            "sessions": len(self._entries),
            "bytes": self.bytes,
            "max_bytes": self.max_bytes,
            "hits": self.hits,
            "misses": self.misses,
            "reused_tokens": self.reused_tokens,
            "prefilled_tokens": self.prefilled_tokens,
            "evictions": self.evictions,
        }

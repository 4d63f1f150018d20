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

The functions below are the engine's side (`torch_engine.py`): they build and read HF
`DynamicCache`s. In a prefill batch with hits, row r holds c_r cached and n_r new tokens: the
cached K/V are left-padded to C = max c_r, the new tokens to N = max n_r, the attention mask is
1 exactly on real positions (the pads in the middle are just masked keys) and the position ids
continue at c_r, so each row sees exactly what an uncached prefill would have given it (up to
float rounding). A row that finishes normally stores the K/V of its prompt and response (all
but the last token, which was never fed) under its session.
"""

from __future__ import annotations

import logging
from collections import OrderedDict
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass

import torch

__all__ = [
    "Hit",
    "KVEntry",
    "SessionKVCache",
    "cached_prefill_batch",
    "lookup",
    "row_kv",
    "session_cache",
]

log = logging.getLogger(__name__)

Layers = list[tuple[torch.Tensor, torch.Tensor]]


@dataclass
class KVEntry:
    """The K/V of one session: ``layers[l] = (keys, values)`` for the tokens in `tokens`."""

    tokens: tuple[int, ...]
    layers: Layers
    nbytes: int


Hit = tuple[KVEntry | None, int]
"""(entry, reused length) of one batch row; (None, 0) where nothing is reused."""


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

    def sessions(self) -> dict[str, tuple[int, ...]]:
        """The stored sessions and the tokens each covers, least recently used first."""
        return {session: entry.tokens for session, entry in self._entries.items()}

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

    def put_rows(self, pending: Iterable[tuple[str, Sequence[int], Layers | None]]) -> None:
        """Store the (session, tokens, layers) a `generate` call collected, once it succeeded.
        Rows whose K/V could not be read (None, see `row_kv`) or do not cover exactly their
        tokens are skipped: the cache is an optimisation, never an error."""
        for session, tokens, layers in pending:
            if layers is not None and layers[0][0].shape[2] == len(tokens):
                self.put(session, tokens, layers)

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


# ---------------------------------------------------------------------------- engine side
def session_cache(mb: float, new_cache: Callable[[], object]) -> SessionKVCache | None:
    """A `SessionKVCache` of `mb` MiB for the model whose HF caches `new_cache` builds; None
    (no reuse) if `mb` is 0 or those caches are not plain (logged)."""
    if mb <= 0:
        return None
    if not _plain_dynamic_cache(new_cache):
        log.warning("KV reuse is off: this model's cache layers are not plain "
                    "full-attention DynamicLayers")
        return None
    return SessionKVCache(int(mb * 2**20))


def _plain_dynamic_cache(new_cache: Callable[[], object]) -> bool:
    """Whether the caches `new_cache` builds keep one K/V per position in every layer (what
    the session cache stores and rebuilds); False for sliding windows, linear attention."""
    try:  # optional dependency
        from transformers.cache_utils import DynamicLayer

        cache = new_cache()
    except (ImportError, TypeError, ValueError):
        return False
    layers = getattr(cache, "layers", None)
    if layers is None or not hasattr(cache, "batch_select_indices"):
        return False
    return all(type(layer) is DynamicLayer for layer in layers)


def lookup(kv: SessionKVCache | None, rows: Sequence[tuple[str, Sequence[int]]]) -> list[Hit]:
    """One `Hit` per (session, prompt ids) row; rows without a session (or no cache) miss
    without being counted."""
    if kv is None:
        return [(None, 0)] * len(rows)
    return [kv.get(session, prompt) if session else (None, 0) for session, prompt in rows]


def cached_prefill_batch(prompts: Sequence[Sequence[int]], hits: Sequence[Hit], pad_id: int,
                         cache):
    """The prefill inputs of a batch with at least one hit (layout in the module docstring):
    (input ids [B, N], attention mask [B, C + N], position ids [B, N], `cache` filled with
    each row's reused K/V left-padded to C), all on the CPU but the cache."""
    cached = [reuse for _, reuse in hits]
    new = [p[c:] for p, c in zip(prompts, cached)]
    C, N = max(cached), max(len(x) for x in new)
    ids = torch.full((len(prompts), N), pad_id, dtype=torch.long)
    attn = torch.zeros((len(prompts), C + N), dtype=torch.long)
    pos = torch.zeros((len(prompts), N), dtype=torch.long)
    for r, (c, x) in enumerate(zip(cached, new)):
        k = len(x)
        ids[r, N - k :] = torch.tensor(x, dtype=torch.long)
        attn[r, C - c : C] = 1
        attn[r, C + N - k :] = 1
        pos[r, N - k :] = torch.arange(c, c + k)
    return ids, attn, pos, _padded_cache(hits, C, cache)


def _padded_cache(hits: Sequence[Hit], width: int, cache):
    """`cache` (a fresh HF cache) holding each row's reused K/V, left-padded with zeros to
    `width`."""
    entry0 = next(e for e, reuse in hits if reuse)
    for layer, (k0, _) in enumerate(entry0.layers):
        shape = (len(hits), k0.shape[1], width, k0.shape[3])
        keys = k0.new_zeros(shape)
        values = k0.new_zeros(shape)
        for r, (entry, c) in enumerate(hits):
            if c:
                k, v = entry.layers[layer]
                keys[r, :, width - c :] = k[0, :, :c]
                values[r, :, width - c :] = v[0, :, :c]
        cache.update(keys, values, layer)
    return cache


def row_kv(cache, attn: torch.Tensor, r: int) -> Layers | None:
    """Copies of batch row `r`'s K/V at its real (mask 1) positions, per layer; None if the
    cache's layout is not the one expected (then nothing is stored)."""
    idx = attn[r].nonzero().squeeze(1)
    layers = []
    for layer in cache.layers:
        keys, values = layer.keys, layer.values
        if keys is None or keys.shape[2] != attn.shape[1]:
            return None
        layers.append((keys[r : r + 1].index_select(2, idx).contiguous(),
                       values[r : r + 1].index_select(2, idx).contiguous()))
    return layers

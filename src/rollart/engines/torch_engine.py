"""A plain PyTorch generation engine for any HF causal LM in a local directory.

Batched sampling with a KV cache: prompts of different lengths are left-padded, with an
attention mask and explicit position ids (each row's positions start at 0 at its first real
token), so a row's tokens do not depend on what else is in the batch. Rows that finish are
dropped from the batch (and from the KV cache) at once; a finished row produces no more
tokens. Sampling uses one `torch.Generator` seeded at construction, so a given sequence of
`generate` calls is reproducible.

Multi-turn KV reuse: a multi-turn prompt is the previous prompt + response + new tokens, so
re-reading it each turn costs a prefill that grows with the conversation. Inputs that name a
`session` look up a `SessionKVCache`; a row that hits takes the stored K/V of the common prefix
and prefills only the rest, and a row that finishes normally stores its K/V (`kv_cache.py` has
the batch layout that keeps tokens unchanged). Without a hit the prefill is the plain one. The
cache holds K/V of the current weights only: loading weights clears it.

See `rollart.engines.base` for the log-prob, stopping and constrained-decoding contract.

Kept whole (~500 lines): prefill, the decode loop and constrained sampling share the
batch's tensors, and weight loading (the check, adapters over the base) its model; the KV
cache is :mod:`~rollart.engines.kv_cache`, the trie :mod:`~rollart.engines.choice_trie`,
reading a file into the parameters :mod:`~rollart.engines.torch_weights`.
"""

from __future__ import annotations

import inspect
import os
from collections.abc import Collection
from pathlib import Path

import torch

from .base import (
    FINISH_CHOICE,
    FINISH_INTERRUPTED,
    FINISH_LENGTH,
    FINISH_STOP,
    GenerationEngine,
    GenInput,
    GenOutput,
    save_weights,
    validate_choices,
)
from .choice_trie import Trie, allowed_after, build_choice_trie  # allowed_after: re-exported
from .kv_cache import Hit, SessionKVCache, cached_prefill_batch, lookup, row_kv, session_cache
from .torch_weights import read_file_into

__all__ = ["TorchGenerationEngine", "allowed_after", "build_choice_trie"]

_DTYPES = {
    "float32": torch.float32,
    "fp32": torch.float32,
    "bfloat16": torch.bfloat16,
    "bf16": torch.bfloat16,
    "float16": torch.float16,
    "fp16": torch.float16,
}


def _as_ids(x) -> list[int]:
    if x is None:
        return []
    if isinstance(x, int):
        return [x]
    return [int(t) for t in x]


class TorchGenerationEngine(GenerationEngine):
    """Generation with `transformers.AutoModelForCausalLM` in plain PyTorch.

    Args:
        model_dir: local directory with a saved HF causal LM (no network access is made).
        device: torch device string.
        threads: if not None, `torch.set_num_threads(threads)` (process-wide!). Use 1 when
            several processes share few cores.
        seed: seed of the sampling generator.
        dtype: "float32" | "bfloat16" | "float16" for the weights; sampling math is float32.
        attn_implementation: passed to `from_pretrained` ("sdpa" or "eager").
        version: the policy version of the weights in `model_dir`.
        kv_cache_mb: size cap of the per-session KV cache in MiB (0 disables it). It is also
            off for models whose HF cache is not a plain full-attention `DynamicCache`
            (sliding windows, linear attention), whose cached layers hold other than one K/V
            per position.
    """

    applies_adapters = True

    def __init__(
        self,
        model_dir: str | os.PathLike,
        *,
        device: str = "cpu",
        threads: int | None = 1,
        seed: int = 0,
        dtype: str = "float32",
        attn_implementation: str = "sdpa",
        version: int = 0,
        kv_cache_mb: float = 256,
    ) -> None:
        from transformers import AutoModelForCausalLM  # optional dependency

        if threads is not None:
            torch.set_num_threads(int(threads))
        if dtype not in _DTYPES:
            raise ValueError(f"dtype must be one of {sorted(_DTYPES)}, got {dtype!r}")
        if not kv_cache_mb >= 0:
            raise ValueError(f"kv_cache_mb must be >= 0, got {kv_cache_mb}")
        self.model_dir = Path(model_dir)
        self.device = torch.device(device)
        self.dtype = _DTYPES[dtype]
        self.model = AutoModelForCausalLM.from_pretrained(
            self.model_dir,
            dtype=self.dtype,
            attn_implementation=attn_implementation,
            local_files_only=True,
        )
        self.model.to(self.device)
        self.model.eval()
        self.model.requires_grad_(False)
        self.generator = torch.Generator(device=self.device)
        self.generator.manual_seed(int(seed))
        self.version = int(version)

        cfg = self.model.config
        gen_cfg = getattr(self.model, "generation_config", None)
        eos: list[int] = []
        for src in (getattr(gen_cfg, "eos_token_id", None), getattr(cfg, "eos_token_id", None)):
            for t in _as_ids(src):
                if t not in eos:
                    eos.append(t)
        self._eos = tuple(eos)
        pad = getattr(gen_cfg, "pad_token_id", None)
        if pad is None:
            pad = getattr(cfg, "pad_token_id", None)
        if pad is None:
            pad = eos[0] if eos else 0
        self.pad_token_id = int(pad)
        self.vocab_size = int(self.model.get_output_embeddings().weight.shape[0])
        self._tokenizer = None
        # transformers 5.x renamed `past_key_values` to `cache` (the old name warns).
        params = inspect.signature(type(self.model).forward).parameters
        self._cache_kw = "cache" if "cache" in params else "past_key_values"
        self._kv = session_cache(kv_cache_mb, self._new_cache)
        self._base: dict[str, torch.Tensor] = {}
        """Base values of the weights a LoRA adapter changed (see `load_weights`)."""

    def _new_cache(self):
        from transformers import DynamicCache  # optional dependency

        return DynamicCache(config=self.model.config)

    # ------------------------------------------------------------------ properties
    @property
    def eos_token_ids(self) -> tuple[int, ...]:
        return self._eos

    @property
    def tokenizer(self):
        """The tokenizer saved next to the model (loaded on first use)."""
        if self._tokenizer is None:
            from transformers import AutoTokenizer  # optional dependency

            self._tokenizer = AutoTokenizer.from_pretrained(self.model_dir, local_files_only=True)
        return self._tokenizer

    # ------------------------------------------------------------------ generation
    @torch.inference_mode()
    def generate(self, inputs: list[GenInput],
                 stop_rows: Collection[int] | None = None) -> list[GenOutput]:
        """See :meth:`GenerationEngine.generate`. ``stop_rows``: indices of ``inputs`` to stop
        early, which another thread may add to while this runs (e.g. a ``set``); read once
        per decode step: a row in it that has not finished ends with
        :data:`FINISH_INTERRUPTED` and the tokens and log-probs it has so far.

        An input with a ``session`` reuses that session's cached K/V and, once it finishes
        (not interrupted, and only if the whole call succeeds), replaces them with its own."""
        n = len(inputs)
        tries: list[Trie | None] = [None] * n
        for i, inp in enumerate(inputs):
            if not inp.prompt_ids:
                raise ValueError(f"input {i}: prompt_ids is empty")
            if inp.choices is not None:
                trie = build_choice_trie(inp.choices)
                bad = [t for c in inp.choices for t in c if not 0 <= int(t) < self.vocab_size]
                if bad:
                    raise ValueError(f"input {i}: choice token ids out of range: {bad[:5]}")
                tries[i] = trie
            elif not 0 < inp.top_p <= 1:
                raise ValueError(f"input {i}: top_p must be in (0, 1], got {inp.top_p}")

        out_tokens: list[list[int]] = [[] for _ in range(n)]
        out_lps: list[list[float]] = [[] for _ in range(n)]
        finish: list[str | None] = [None] * n
        stops = [frozenset(self._eos) | frozenset(int(t) for t in inp.stop_token_ids) for inp in inputs]

        # Rows with nothing to generate finish at once.
        rows = []
        for i, inp in enumerate(inputs):
            if tries[i] is None and inp.max_new_tokens <= 0:
                finish[i] = FINISH_LENGTH
            else:
                rows.append(i)
        if not rows:
            return [GenOutput([], [], finish[i]) for i in range(n)]

        dev = self.device
        hits = lookup(self._kv, [(inputs[i].session, inputs[i].prompt_ids) for i in rows])
        out, attn = self._prefill(inputs, rows, hits)
        next_pos = torch.tensor([len(inputs[i].prompt_ids) for i in rows], dtype=torch.long,
                                device=dev)
        cache = self._cache_of(out)
        logits = out.logits[:, -1, :]
        nodes: list[Trie | None] = [tries[i] for i in rows]
        to_store: list[tuple[str, list[int], list]] = []

        while True:
            tok, lp = self._pick([inputs[i] for i in rows], nodes, logits)
            tok_list = tok.tolist()
            lp_list = lp.tolist()
            keep: list[int] = []
            halt = bool(stop_rows)  # once per step: nothing more when no row is stopped
            for r, i in enumerate(rows):
                t = tok_list[r]
                out_tokens[i].append(t)
                out_lps[i].append(lp_list[r])
                node = nodes[r]
                if node is not None:
                    node = node[t]
                    nodes[r] = node
                    if not node:
                        finish[i] = FINISH_CHOICE
                elif t in stops[i]:
                    finish[i] = FINISH_STOP
                elif len(out_tokens[i]) >= inputs[i].max_new_tokens:
                    finish[i] = FINISH_LENGTH
                if finish[i] is None and halt and i in stop_rows:
                    finish[i] = FINISH_INTERRUPTED
                if finish[i] is None:
                    keep.append(r)
                elif finish[i] != FINISH_INTERRUPTED and self._kv is not None and inputs[i].session:
                    # Before the row leaves the batch cache: all it has seen but its last token.
                    seen = list(inputs[i].prompt_ids) + out_tokens[i][:-1]
                    to_store.append((inputs[i].session, seen, row_kv(cache, attn, r)))
            if not keep:
                break
            if len(keep) < len(rows):
                idx = torch.tensor(keep, dtype=torch.long, device=dev)
                if hasattr(cache, "batch_select_indices"):
                    cache.batch_select_indices(idx)
                else:  # older caches
                    cache.reorder_cache(idx)
                attn = attn.index_select(0, idx)
                next_pos = next_pos.index_select(0, idx)
                tok = tok.index_select(0, idx)
                rows = [rows[r] for r in keep]
                nodes = [nodes[r] for r in keep]
            attn = torch.cat([attn, attn.new_ones((len(rows), 1))], dim=1)
            out = self.model(
                input_ids=tok.unsqueeze(1),
                attention_mask=attn,
                position_ids=next_pos.unsqueeze(1),
                use_cache=True,
                **{self._cache_kw: cache},
            )
            cache = self._cache_of(out)
            logits = out.logits[:, -1, :]
            next_pos = next_pos + 1

        if to_store:  # only once the whole batch succeeded
            self._kv.put_rows(to_store)
        return [GenOutput(out_tokens[i], out_lps[i], finish[i]) for i in range(n)]

    def _prefill(self, inputs: list[GenInput], rows: list[int], hits: list[Hit]):
        """Read the prompts of `rows`, left-padded: only what follows each row's reused prefix
        if any row hits, else from scratch; return (model output, attention mask over all
        positions, cached ones included)."""
        prompts = [inputs[i].prompt_ids for i in rows]
        if any(reuse for _, reuse in hits):
            ids, attn, pos, cache = cached_prefill_batch(
                prompts, hits, self.pad_token_id, self._new_cache())
            return self._prefill_forward(ids, attn, pos, cache), attn.to(self.device)
        width = max(len(p) for p in prompts)
        ids = torch.full((len(rows), width), self.pad_token_id, dtype=torch.long)
        attn = torch.zeros((len(rows), width), dtype=torch.long)
        for r, p in enumerate(prompts):
            ids[r, width - len(p) :] = torch.tensor(p, dtype=torch.long)
            attn[r, width - len(p) :] = 1
        pos = (attn.cumsum(-1) - 1).clamp_(min=0)
        return self._prefill_forward(ids, attn, pos), attn.to(self.device)

    def _prefill_forward(self, ids, attn, pos, cache=None):
        """The prefill's forward pass (logits of the last position only), on the device."""
        dev = self.device
        kw = {} if cache is None else {self._cache_kw: cache}
        return self.model(input_ids=ids.to(dev), attention_mask=attn.to(dev),
                          position_ids=pos.to(dev), use_cache=True, logits_to_keep=1, **kw)

    @staticmethod
    def _cache_of(out):
        cache = getattr(out, "cache", None)
        return cache if cache is not None else out.past_key_values

    def _pick(
        self, inputs: list[GenInput], nodes: list[Trie | None], logits: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Choose one token per row; return (tokens, log-probs at temperature 1 over the
        allowed tokens)."""
        logits = logits.float()
        b, V = logits.shape
        dev = logits.device
        if any(node is not None for node in nodes):
            allowed = torch.ones((b, V), dtype=torch.bool, device=dev)
            for r, node in enumerate(nodes):
                if node is not None:
                    allowed[r] = False
                    allowed[r, torch.tensor(list(node), dtype=torch.long, device=dev)] = True
            logits = logits.masked_fill(~allowed, float("-inf"))
        logp = torch.log_softmax(logits, dim=-1)

        greedy = [
            inp.greedy or inp.temperature <= 0 or (node is not None and len(node) == 1)
            for inp, node in zip(inputs, nodes)
        ]
        tok = logits.argmax(dim=-1)
        sample_rows = [r for r in range(b) if not greedy[r]]
        if sample_rows:
            sr = torch.tensor(sample_rows, dtype=torch.long, device=dev)
            temp = torch.tensor(
                [inputs[r].temperature for r in sample_rows], dtype=torch.float32, device=dev
            )
            probs = torch.softmax(logits.index_select(0, sr) / temp.unsqueeze(1), dim=-1)
            top_p = [inputs[r].top_p for r in sample_rows]
            if any(p < 1.0 for p in top_p):
                tp = torch.tensor(top_p, dtype=torch.float32, device=dev).unsqueeze(1)
                sp, si = probs.sort(dim=-1, descending=True)
                before = sp.cumsum(dim=-1) - sp  # mass strictly above each token
                sp = sp.masked_fill(before >= tp, 0.0)  # the top token always stays
                probs = torch.zeros_like(probs).scatter_(-1, si, sp)
            sampled = torch.multinomial(probs, 1, generator=self.generator).squeeze(1)
            tok = tok.index_copy(0, sr, sampled)
        lp = logp.gather(1, tok.unsqueeze(1)).squeeze(1)
        return tok, lp

    # ------------------------------------------------------------------ weights
    def _tied_aliases(self) -> dict[str, str]:
        """name -> the first name sharing the same storage (for tied parameters)."""
        seen: dict[tuple[int, tuple, tuple], str] = {}
        alias: dict[str, str] = {}
        for k, v in self.model.state_dict(keep_vars=True).items():
            key = (v.data_ptr(), tuple(v.shape), tuple(v.stride()))
            if key in seen:
                alias[k] = seen[key]
            else:
                seen[key] = k
        return alias

    partial_loads = True
    """The file is read only inside :meth:`load_weights`; ``changed`` loads some tensors."""

    def load_weights(self, path: str | Path, version: int, *,
                     changed: Collection[str] | None = None) -> None:
        """Load a full state dict (safetensors) strictly and set `version`.

        ``changed``: only these tensors differ from the weights held (a streamed delta
        patched into the staged file in place, :mod:`rollart.engines.weight_decode`): the
        file is checked whole (names, shapes) but only they are read.

        Every parameter must be in the file with the model's shape, and the file must hold no
        unknown names; a tied parameter may be present under either name. Nothing is changed
        if the check fails. dtypes are converted to the engine's dtype.

        A LoRA adapter file (``trainer.lora``: ``rollart_kind: lora`` in its metadata, peft's
        tensor names) is applied instead over the base weights: each adapted weight becomes
        ``base + alpha / r * B @ A`` (:func:`rollart.engines.lora.adapter_deltas`); the base is
        the last full weights loaded (the model folder's at first), so a new adapter replaces
        the previous one and never stacks on it.
        """
        from safetensors import safe_open  # optional dependency

        from .lora import is_adapter_metadata
        from .weight_files import read_header, read_metadata

        path = Path(path)
        # names and shapes from the header first: nothing changes for a file that does not
        # fit; then one tensor at a time (the extra memory of a load is its largest tensor,
        # not a second copy of the model)
        header = read_header(path)
        meta = read_metadata(path)
        try:
            with safe_open(str(path), framework="pt", device="cpu") as f:
                if is_adapter_metadata(meta):  # adapters are small: as a dict, over the base
                    sd = {k: f.get_tensor(k) for k in f.keys()}  # noqa: SIM118 - not a dict
                    self.load_state_dict(sd, version, metadata=meta, what=str(path))
                    return
                self._check_names({k: t.shape for k, t in header.items()}, str(path))
                self.clear_kv()  # the stored K/V belong to the old weights
                read_file_into(self.model.state_dict(), path, changed)
        except ValueError:
            raise
        except Exception as e:  # safetensors raises several types for bad files
            raise ValueError(f"cannot read weights from {path}: {e}") from e
        self._base = {}  # these weights are the base of later adapters
        self.version = int(version)

    def load_state_dict(self, state_dict: dict[str, torch.Tensor], version: int, *,
                        metadata: dict[str, str] | None = None, what: str = "state dict") -> None:
        """Like `load_weights` but from tensors already in memory (``metadata``: the file's
        safetensors metadata, which says whether they are a LoRA adapter)."""
        from .lora import is_adapter_metadata

        if metadata and is_adapter_metadata(metadata):
            self._apply_adapter(state_dict, metadata, what)
        else:
            self._check_and_load(state_dict, what)
            self._base = {}  # these weights are the base of later adapters
        self.version = int(version)

    def _apply_adapter(self, sd: dict[str, torch.Tensor], metadata: dict[str, str], what: str) -> None:
        from .lora import adapter_deltas

        own = self.model.state_dict()
        deltas = adapter_deltas(sd, metadata, own, what=f"LoRA adapter in {what}")  # checks first
        base = self._base
        self.clear_kv()  # the stored K/V belong to the old weights
        with torch.no_grad():
            for name in [n for n in base if n not in deltas]:  # the previous adapter's only
                own[name].copy_(base.pop(name))
            for name, d in deltas.items():
                if name not in base:
                    base[name] = own[name].detach().clone()
                own[name].copy_((base[name].float() + d.to(base[name].device)).to(own[name].dtype))

    def _check_and_load(self, sd: dict[str, torch.Tensor], what: str) -> None:
        self._check_names({k: tuple(v.shape) for k, v in sd.items()}, what)
        own = self.model.state_dict()
        self.clear_kv()  # the stored K/V belong to the old weights
        with torch.no_grad():
            for k, v in sd.items():
                own[k].copy_(v.to(device=own[k].device, dtype=own[k].dtype))

    def _check_names(self, sd: dict[str, tuple[int, ...]], what: str) -> None:
        """``ValueError`` unless ``sd`` (name -> shape) holds every parameter with the model's
        shape (a tied one under either name) and no unknown name."""
        own = self.model.state_dict()
        alias = self._tied_aliases()
        unexpected = sorted(set(sd) - set(own))
        missing = []
        for k in own:
            if k in sd:
                continue
            partner = alias.get(k)
            partners = {partner} if partner else {a for a, b in alias.items() if b == k}
            if not any(p in sd for p in partners):
                missing.append(k)
        bad_shapes = [
            f"{k}: {tuple(v)} != {tuple(own[k].shape)}"
            for k, v in sd.items()
            if k in own and tuple(v) != tuple(own[k].shape)
        ]
        if unexpected or missing or bad_shapes:
            raise ValueError(
                f"weights in {what} do not match the model: missing={missing[:5]} "
                f"unexpected={unexpected[:5]} shape mismatches={bad_shapes[:5]}"
            )

    def state_dict_bytes(self) -> bytes:
        """The current weights as safetensors bytes (tied tensors written under each name)."""
        from safetensors.torch import save  # optional dependency

        tensors = {
            k: v.detach().to("cpu").contiguous().clone() for k, v in self.model.state_dict().items()
        }
        return save(tensors)

    def save_weights(self, path: str | Path) -> Path:
        """Write the current weights to a safetensors file (atomically)."""
        return save_weights(self.model.state_dict(), path)

    def forget(self, sessions) -> None:
        """Drop the cached K/V of these sessions (e.g. trajectories that ended)."""
        if self._kv is not None:
            self._kv.drop(sessions)

    def clear_kv(self) -> int:
        """Drop every session's cached K/V (loading weights does, since they belong to the old
        weights; benchmarks do, so that one run does not start from another's cache). Returns
        how many sessions were dropped (0 when the cache is off); the counters are kept."""
        if self._kv is None:
            return 0
        n = len(self._kv)
        self._kv.clear()
        return n

    def kv_sessions(self) -> dict[str, tuple[int, ...]]:
        """The sessions whose K/V are cached and the tokens each covers (empty when off)."""
        return self._kv.sessions() if self._kv is not None else {}

    def kv_stats(self) -> dict[str, int]:
        """Counters of the session KV cache (all 0 when it is off); see `SessionKVCache`."""
        return (self._kv if self._kv is not None else SessionKVCache(0)).stats()

    def close(self) -> None:
        self.clear_kv()
        self.model = None  # type: ignore[assignment]
        self._tokenizer = None

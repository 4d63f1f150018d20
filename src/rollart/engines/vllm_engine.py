"""vLLM's async engine (``AsyncLLM``) as an :class:`~rollart.engines.base.AsyncEngine`
(``proxy.engine: vllm``).

Token ids in, token ids and log-probs out, under the contract of :mod:`rollart.engines.base`:

- log-probs are vLLM's ``raw_logprobs`` (``log_softmax`` of the raw logits, before
  temperature, top-p and logits processors), i.e. the policy at temperature 1;
- a constrained row (``choices``) is masked by :class:`~rollart.engines.vllm_choices.ChoiceLogitsProcessor`
  and its log-probs are renormalised here over the tokens allowed at each step, from the raw
  log-probs of those tokens (``SamplingParams.logprob_token_ids``; a step with one allowed
  token has log-prob 0; :mod:`~rollart.engines.choice_trie`). When a request's branching
  tokens exceed vLLM's 128 ids, the renormaliser is scored afterwards with one-token requests;
- stopping is rollart's: the model's eos tokens (``generation_config.json`` and
  ``config.json``) and the row's ``stop_token_ids`` (vLLM's own eos handling is off, so the
  two engines stop on the same tokens); the stop token is kept with its log-prob;
- sampling: greedy, temperature, top-p, and a per-request seed drawn from the engine's seed
  and the request's arrival order (``enable_chunked_prefill`` stays off: vLLM's CPU backend
  crashes on per-request seeds with chunked prefill).

Weights: :meth:`VllmEngine.load_weights` checks names and shapes against the model folder's
safetensors headers (:mod:`~rollart.engines.weight_files`) *before* anything reaches vLLM (a
wrong shape kills vLLM's engine, missing names load silently), puts the file in the engine's
weights folder and calls vLLM's ``reload_weights`` in place, then resets the prefix cache
(cached KV of the old weights).

vLLM is imported lazily; it runs as separate processes (EngineCore and a worker), started
with ``spawn``. ``engine_args`` (``proxy.engine_args``) are fields of vLLM's
``AsyncEngineArgs`` and override the defaults here (``dtype: float32``, and on CPU
``enforce_eager: true``, ``gpu_memory_utilization: 0.1``, the fraction of host RAM vLLM
reserves for its KV cache there).

Kept whole (~440 lines): its methods follow one request through vLLM, from validation to
abort and weight reload, and share one request table; the pure parts are in
:mod:`~rollart.engines.weight_files` and :mod:`~rollart.engines.choice_trie`.
"""

from __future__ import annotations

import asyncio
import importlib.util
import logging
import os
import shutil
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from rollart.aio import first_of

from .base import (
    FINISH_CHOICE,
    FINISH_INTERRUPTED,
    FINISH_LENGTH,
    FINISH_STOP,
    PAUSE_MODES,
    AsyncEngine,
    EngineAborted,
    GenInput,
    GenOutput,
    validate_choices,
)
from .choice_trie import accepted_prefix, branch_ids, choice_trie, renormalised_logprobs
from .weight_files import check_weights, place_weights, read_header, read_model_info

__all__ = ["INSTALL_HINT", "VllmEngine"]

log = logging.getLogger(__name__)

INSTALL_HINT = "proxy.engine 'vllm' needs vLLM: pip install 'rollart[vllm]' (CPU: see README)"
CHOICES_PROCESSOR = "rollart.engines.vllm_choices:ChoiceLogitsProcessor"
MAX_LOGPROB_IDS = 128  # vllm.sampling_params.MAX_LOGPROB_TOKEN_IDS
_WEIGHTS_NAME = "model.safetensors"
# Files of the model folder linked next to the weights vLLM reloads (reload_weights points the
# worker's model config at that folder).
SIDE_FILES = ("config.json", "generation_config.json", "tokenizer.json", "tokenizer_config.json",
               "special_tokens_map.json", "chat_template.jinja")


def _import_vllm():
    try:  # optional dependency
        import vllm
    except ImportError as e:
        raise RuntimeError(INSTALL_HINT) from e
    return vllm


@dataclass
class _Req:
    vllm_ids: set[str] = field(default_factory=set)
    active: bool = False
    aborted: bool = False
    abort_event: asyncio.Event = field(default_factory=asyncio.Event)
    done: asyncio.Event = field(default_factory=asyncio.Event)


class VllmEngine(AsyncEngine):
    """``proxy.engine: vllm``: vLLM's ``AsyncLLM`` on the model in ``model_dir``.

    Args:
        model_dir: a local HF model folder (the run's provisioned model).
        seed: vLLM's seed and the base of the per-request sampling seeds.
        threads: ignored (vLLM binds its own OpenMP threads on CPU); kept for ``build_engine``.
        engine_args: fields of ``vllm.AsyncEngineArgs`` overriding the defaults.
    """

    def __init__(self, model_dir: str | os.PathLike, *, seed: int = 0, threads: int | None = None,
                 engine_args: dict[str, Any] | None = None, version: int = 0) -> None:
        self.model_dir = Path(model_dir)
        self.seed = int(seed)
        self.threads = threads
        self.engine_args = dict(engine_args or {})
        self.version = int(version)
        self.vocab_size: int | None = None
        self.max_model_len: int | None = None
        self._eos: tuple[int, ...] = ()
        self._llm: Any = None
        self._sp_cls: Any = None
        self._output_kind: Any = None
        self._reqs: dict[str, _Req] = {}
        self._serving: asyncio.Event | None = None
        self._weights_lock: asyncio.Lock | None = None
        self._wdir: Path | None = None
        self._want_shapes: dict[str, tuple[int, ...]] = {}
        self._optional_names: set[str] = set()
        self._n = 0  # requests seen (per-request seeds)
        self._vid = 0  # vLLM request ids issued
        self._seeded = True
        self._bg: set[asyncio.Task] = set()

    # ------------------------------------------------------------------ lifecycle
    def _engine_args(self, vllm) -> Any:
        from vllm import AsyncEngineArgs  # optional dependency
        from vllm.platforms import current_platform

        cpu = current_platform.is_cpu()
        args: dict[str, Any] = dict(
            model=str(self.model_dir),
            dtype="float32",
            seed=self.seed,
            enable_chunked_prefill=False,
            logprobs_mode="raw_logprobs",
            disable_log_stats=True,
            use_tqdm_on_load=False,  # else a progress bar per weight update
        )
        if cpu:
            args.update(enforce_eager=True, gpu_memory_utilization=0.1)
        user = dict(self.engine_args)
        procs = list(user.pop("logits_processors", None) or [])
        args.update(user)
        if CHOICES_PROCESSOR not in procs:
            procs.append(CHOICES_PROCESSOR)
        args["logits_processors"] = procs
        if args.get("logprobs_mode", "raw_logprobs") != "raw_logprobs":
            raise ValueError("proxy.engine_args.logprobs_mode must be raw_logprobs (rollart's "
                             "log-prob contract is the raw policy at temperature 1)")
        # Per-request seeds with chunked prefill crash vLLM's CPU engine; without
        # them sampling is still seeded by `seed`, but not per request.
        self._seeded = not args.get("enable_chunked_prefill")
        return AsyncEngineArgs(**args)

    async def start(self) -> None:
        if self._llm is not None:
            return
        if importlib.util.find_spec("vllm") is None:
            raise RuntimeError(INSTALL_HINT)
        self._serving = asyncio.Event()
        self._serving.set()
        self._weights_lock = asyncio.Lock()
        info = await asyncio.to_thread(read_model_info, self.model_dir)
        if not info.shapes:
            raise ValueError(f"no *.safetensors weights in {self.model_dir}")
        self._want_shapes = info.shapes
        # vLLM loads a tied model's embedding, not its lm_head: that one may come or not
        self._optional_names = {"lm_head.weight"} if info.tied else set()
        self._eos = info.eos_token_ids
        # EngineCore and the worker are separate processes; start them with spawn (this
        # process may have threads, and fork would copy their locks).
        os.environ.setdefault("VLLM_WORKER_MULTIPROC_METHOD", "spawn")
        # vLLM logs ~10 INFO lines per weight update (VLLM_LOGGING_LEVEL=INFO brings them back)
        os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")
        vllm = await asyncio.to_thread(_import_vllm)
        from vllm.sampling_params import RequestOutputKind, SamplingParams  # optional dependency
        from vllm.v1.engine.async_llm import AsyncLLM

        self._sp_cls, self._output_kind = SamplingParams, RequestOutputKind.FINAL_ONLY
        args = self._engine_args(vllm)
        self._llm = await asyncio.to_thread(AsyncLLM.from_engine_args, args)
        mc = self._llm.model_config
        self.vocab_size = int(mc.get_vocab_size())
        self.max_model_len = int(mc.max_model_len)
        self._wdir = Path(tempfile.mkdtemp(prefix="rollart-vllm-weights-"))
        for name in SIDE_FILES:
            if (self.model_dir / name).exists():
                os.symlink((self.model_dir / name).resolve(), self._wdir / name)

    async def close(self) -> None:
        llm, self._llm = self._llm, None
        for t in list(self._bg):
            t.cancel()
        if llm is not None:
            handler = getattr(llm, "output_handler", None)
            if handler is not None:  # else it logs the dying EngineCore as an error
                handler.cancel()
            await asyncio.to_thread(llm.shutdown)
        if self._wdir is not None:
            shutil.rmtree(self._wdir, ignore_errors=True)
            self._wdir = None

    @property
    def eos_token_ids(self) -> tuple[int, ...]:
        return self._eos

    def _need_started(self) -> None:
        if self._llm is None:
            raise RuntimeError("VllmEngine is not started (await engine.start())")

    # ------------------------------------------------------------------ generation
    def _validate(self, inp: GenInput) -> None:
        if not inp.prompt_ids:
            raise ValueError("prompt_ids is empty")
        V = self.vocab_size
        bad = [t for t in inp.prompt_ids if not 0 <= int(t) < V]
        if bad:
            raise ValueError(f"prompt token ids out of range [0, {V}): {bad[:5]}")
        if self.max_model_len is not None and len(inp.prompt_ids) >= self.max_model_len:
            raise ValueError(f"prompt of {len(inp.prompt_ids)} tokens leaves no room in "
                             f"max_model_len {self.max_model_len} (proxy.engine_args.max_model_len)")
        if inp.choices is not None:
            validate_choices(inp.choices)
            bad = [t for c in inp.choices for t in c if not 0 <= int(t) < V]
            if bad:
                raise ValueError(f"choice token ids out of range [0, {V}): {bad[:5]}")
            longest = max(len(c) for c in inp.choices)
            if self.max_model_len is not None and len(inp.prompt_ids) + longest + 1 > self.max_model_len:
                raise ValueError(f"prompt + longest choice exceed max_model_len {self.max_model_len}")
        elif not 0 < inp.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {inp.top_p}")

    def _next_vid(self, request_id: str) -> str:
        self._vid += 1
        return f"{request_id}#{self._vid}"

    async def generate(self, inp: GenInput, request_id: str) -> GenOutput:
        self._need_started()
        self._validate(inp)
        self._n += 1
        seed = (self.seed * 1_000_003 + self._n) % (2**31 - 1) if self._seeded else None
        if inp.choices is None and inp.max_new_tokens <= 0:
            return GenOutput([], [], FINISH_LENGTH, self.version)
        if request_id in self._reqs:
            raise ValueError(f"request {request_id!r} is already in flight")
        req = self._reqs[request_id] = _Req()
        try:
            while not self._serving.is_set() and not req.aborted:  # paused: wait for resume
                await first_of(self._serving.wait(), req.abort_event.wait())
            if req.aborted:
                raise EngineAborted(request_id, GenOutput([], [], FINISH_INTERRUPTED, self.version),
                                    self.version)
            req.active = True  # no await since the gate: pause() sees it
            if inp.choices is not None:
                return await self._generate_choice(inp, request_id, req, seed)
            return await self._generate_free(inp, request_id, req, seed)
        finally:
            del self._reqs[request_id]
            req.done.set()

    def _greedy(self, inp: GenInput) -> bool:
        return inp.greedy or inp.temperature <= 0 or (inp.choices is not None and inp.top_p <= 0)

    async def _run(self, prompt: list[int], sp: Any, request_id: str, req: _Req):
        """One vLLM request to its end: the final CompletionOutput."""
        vid = self._next_vid(request_id)
        req.vllm_ids.add(vid)
        final = None
        try:
            async for out in self._llm.generate({"prompt_token_ids": list(prompt)}, sp, vid):
                final = out
        except Exception as e:
            from vllm.exceptions import VLLMClientError  # optional dependency

            if isinstance(e, VLLMClientError):
                raise ValueError(str(e)) from e
            raise
        finally:
            req.vllm_ids.discard(vid)
        return final.outputs[0]

    async def _generate_free(self, inp: GenInput, request_id: str, req: _Req, seed) -> GenOutput:
        greedy = self._greedy(inp)
        stops = sorted(set(self._eos) | {int(t) for t in inp.stop_token_ids})
        sp = self._sp_cls(
            max_tokens=int(inp.max_new_tokens),
            temperature=0.0 if greedy else float(inp.temperature),
            top_p=1.0 if greedy else float(inp.top_p),
            seed=None if greedy else seed,
            logprobs=0,
            ignore_eos=True,  # rollart's eos set is in stop_token_ids
            stop_token_ids=stops,
            detokenize=False,
            output_kind=self._output_kind,
        )
        c = await self._run(inp.prompt_ids, sp, request_id, req)
        tokens = [int(t) for t in c.token_ids]
        lps = [float(d[t].logprob) for t, d in zip(tokens, c.logprobs or [])]
        version = self.version
        if c.finish_reason == "abort":
            raise EngineAborted(request_id, GenOutput(tokens, lps, FINISH_INTERRUPTED, version), version)
        finish = FINISH_STOP if tokens and tokens[-1] in stops else FINISH_LENGTH
        return GenOutput(tokens, lps, finish, version)

    async def _generate_choice(self, inp: GenInput, request_id: str, req: _Req, seed) -> GenOutput:
        choices = [[int(t) for t in c] for c in inp.choices]
        trie = choice_trie(choices)
        union = {t for c in choices for t in c}
        end = next(t for t in (*self._eos, *range(self.vocab_size)) if t not in union)
        lengths = {len(c) for c in choices}
        branch = branch_ids(trie)
        direct = len(branch) <= MAX_LOGPROB_IDS
        greedy = self._greedy(inp)
        sp = self._sp_cls(
            max_tokens=max(lengths) + (0 if len(lengths) == 1 else 1),
            temperature=0.0 if greedy else float(inp.temperature),
            top_p=1.0 if greedy else min(1.0, float(inp.top_p)),
            seed=None if greedy else seed,
            logprobs=None if (direct and branch) else 0,
            logprob_token_ids=branch if (direct and branch) else None,
            ignore_eos=True,
            stop_token_ids=[end],
            detokenize=False,
            output_kind=self._output_kind,
            extra_args={"rollart_choices": choices, "rollart_choice_end": end},
        )
        c = await self._run(inp.prompt_ids, sp, request_id, req)
        tokens = [int(t) for t in c.token_ids]
        # The response is the longest prefix the trie accepts (drops the end token).
        resp, complete = accepted_prefix(trie, tokens)
        version = self.version
        raw = ([{t: float(lp.logprob) for t, lp in d.items()} for d in c.logprobs or []]
               if direct else None)
        prompt = list(inp.prompt_ids)

        def score(k: int, allowed: list[int]):  # a step's log-probs after the fact
            return self._score(prompt + resp[:k], allowed, request_id, req)

        lps = await renormalised_logprobs(trie, resp, raw, score)
        if complete:
            return GenOutput(resp, lps, FINISH_CHOICE, version)
        if c.finish_reason == "abort" or req.aborted:
            raise EngineAborted(request_id, GenOutput(resp, lps, FINISH_INTERRUPTED, version), version)
        raise RuntimeError(f"vLLM returned {tokens} ({c.finish_reason}), not a whole choice")

    async def _score(self, prefix: list[int], ids: list[int], request_id: str, req: _Req) -> dict[int, float]:
        """Raw log-probs of ``ids`` after ``prefix`` (one-token requests of <= 128 ids each)."""
        parts = [ids[i : i + MAX_LOGPROB_IDS] for i in range(0, len(ids), MAX_LOGPROB_IDS)]

        async def one(part):
            sp = self._sp_cls(max_tokens=1, temperature=0.0, logprob_token_ids=part, ignore_eos=True,
                              detokenize=False, output_kind=self._output_kind)
            c = await self._run(prefix, sp, request_id, req)
            if c.finish_reason == "abort" or not c.logprobs:
                raise EngineAborted(request_id, GenOutput([], [], FINISH_INTERRUPTED, self.version),
                                    self.version)
            return {int(t): float(lp.logprob) for t, lp in c.logprobs[0].items()}

        got: dict[int, float] = {}
        for d in await asyncio.gather(*(one(p) for p in parts)):
            got.update(d)
        return got

    # ------------------------------------------------------------------ control
    async def abort(self, request_ids: list[str]) -> None:
        self._need_started()
        vids: list[str] = []
        for rid in request_ids:
            req = self._reqs.get(rid)
            if req is None:
                continue
            req.aborted = True
            req.abort_event.set()
            vids.extend(req.vllm_ids)
        if vids:
            await self._llm.abort(vids)
        # A request whose vLLM submission was under way may have missed that abort: repeat it
        # for any still in flight.
        live = [rid for rid in request_ids if rid in self._reqs and self._reqs[rid].active]
        if live:
            t = asyncio.ensure_future(self._reabort(live))
            self._bg.add(t)
            t.add_done_callback(self._bg.discard)

    async def _reabort(self, request_ids: list[str]) -> None:
        for delay in (0.02, 0.1, 0.5, 2.0):
            await asyncio.sleep(delay)
            vids = [v for rid in request_ids if (r := self._reqs.get(rid)) is not None
                    for v in r.vllm_ids]
            if not vids:
                return
            if self._llm is None:
                return
            await self._llm.abort(vids)

    async def pause(self, mode: str = "wait") -> None:
        self._need_started()
        if mode not in PAUSE_MODES:
            raise ValueError(f"pause mode must be one of {PAUSE_MODES}, got {mode!r}")
        self._serving.clear()
        running = [(rid, r) for rid, r in self._reqs.items() if r.active]
        if mode == "abort" and running:
            await self.abort([rid for rid, _ in running])
        for _, r in running:
            await r.done.wait()
        # Nothing of ours is in vLLM now; its own pause is a second gate.
        await self._llm.pause_generation(mode="wait", clear_cache=False)

    async def resume(self) -> None:
        self._need_started()
        await self._llm.resume_generation()
        self._serving.set()

    # ------------------------------------------------------------------ weights
    async def load_weights(self, source: str | Path | bytes, version: int) -> None:
        self._need_started()
        async with self._weights_lock:
            await asyncio.to_thread(self._stage_weights, source)
            try:
                await self._llm.collective_rpc("reload_weights", kwargs={"weights_path": str(self._wdir)})
                await self._llm.reset_prefix_cache()
            except Exception as e:
                raise RuntimeError(f"vLLM failed to reload weights (version {version}): {e}") from e
            self.version = int(version)

    def _stage_weights(self, source: str | Path | bytes) -> None:
        """Check ``source`` against the model (ValueError) and put it in the weights folder."""
        is_bytes = isinstance(source, (bytes, bytearray, memoryview))
        what = "weights bytes" if is_bytes else f"weights in {source}"
        check_weights(read_header(source), self._want_shapes, optional=self._optional_names,
                      what=what)
        # a hard link pins the checked file even if its path is replaced
        place_weights(source, self._wdir / _WEIGHTS_NAME, hard_link=True)

"""An emulated continuous-batching generation engine (an :class:`AsyncEngine`) and the
LLMProxy that drives it.

:class:`EmulatedEngine` keeps a running batch like vLLM / SGLang: a request joins at once if
fewer than ``max_batch`` sequences run, else it queues. Time advances in modelled seconds:

- each admitted request's uncached prompt tokens cost ``profile.prefill_s(tokens)``, during
  which no sequence decodes (prefill is not chunked);
- each decode step costs ``profile.decode_s(b)`` with ``b`` sequences running, and gives every
  running sequence one token;
- a request's output length is drawn (lognormal, ``out_mean`` tokens, ``out_sigma`` of the
  log) from the hash of its prompt, so the same prompt gets the same length in every run, and
  capped at its ``max_new_tokens``;
- a session (the trajectory) keeps its tokens cached: a later turn prefills only its new
  tokens (cleared when weights load, like the torch engine's cache).

The loop is event driven (it sleeps until the next sequence finishes or a request arrives,
``modelled seconds x time_scale``), not one wake-up per token. Log-probs are drawn in
``[-3, -0.01]``; token ids avoid the model's special tokens; the output follows the
:mod:`rollart.engines.base` contract (a constrained turn gets one whole choice).

Use it with ``actors.generate.type: rollart.emulate.engine:EmulatedLLMProxy`` and
``actors.generate.args: {emulate: {profile: h800, time_scale: 0.05, out_mean: 200}}``; the
proxy, its bus subjects, weight loads and batching statistics are the real ones.
"""

from __future__ import annotations

import asyncio
import hashlib
import math
import random
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from rollart.actors.generate.proxy import LLMProxy
from rollart.emulate.profiles import HardwareProfile
from rollart.emulate.profiles import profile as _profile
from rollart.emulate.profiles import time_scale as _time_scale
from rollart.emulate.records import RECORDS
from rollart.engines.base import (
    FINISH_CHOICE,
    FINISH_INTERRUPTED,
    FINISH_LENGTH,
    FINISH_STOP,
    AsyncEngine,
    EngineAborted,
    GenInput,
    GenOutput,
)

__all__ = ["EmulatedEngine", "EmulatedLLMProxy"]


@dataclass(eq=False)
class _Req:
    inp: GenInput
    rid: str
    n_out: int
    prefill_tokens: int
    fut: asyncio.Future
    arrived: float  # modelled clock
    admitted: float = -1.0
    done: float = 0.0  # tokens generated (fractional between events)
    batch_sum: float = 0.0
    batch_n: int = 0


class EmulatedEngine(AsyncEngine):
    """Continuous batching with modelled prefill and decode times (module docstring).

    Args:
        profile: ``h800``, ``h20`` or a dict of :class:`HardwareProfile` fields.
        time_scale: wall seconds per modelled second (default: ``$ROLLART_EMULATE_TIME_SCALE``).
        out_mean: mean output length in tokens (lognormal); ``out_sigma``: sigma of its log.
        out_min: shortest output.
        model_gb: declared weight size (GB), for the load time (``profile.load_gbps``).
        vocab: ``(lo, hi)`` token ids drawn from (avoid the model's special tokens).
        eos_id: a token that ends a "stop" response (None: no eos is emitted).
        max_batch: overrides the profile's.
        seed: of the log-prob and token draws (lengths come from the prompt's hash).
    """

    def __init__(self, *, profile: str | dict | HardwareProfile = "h800",
                 time_scale: float | None = None, out_mean: float = 128.0,
                 out_sigma: float = 0.5, out_min: int = 4, model_gb: float = 16.0,
                 vocab: tuple[int, int] = (10, 250), eos_id: int | None = None,
                 max_batch: int | None = None, seed: int = 0, name: str = "emulated",
                 record_prefix: str = "") -> None:
        self.profile = _profile(profile)
        self.time_scale = _time_scale(time_scale)
        self.max_batch = int(max_batch or self.profile.max_batch)
        if out_mean <= 0 or out_sigma < 0 or out_min < 1:
            raise ValueError("emulated engine: out_mean > 0, out_sigma >= 0, out_min >= 1")
        self.out_mean, self.out_sigma, self.out_min = float(out_mean), float(out_sigma), int(out_min)
        self.model_gb = float(model_gb)
        self.vocab = (int(vocab[0]), int(vocab[1]))
        self.eos_id = eos_id
        self.name = name
        self.record_prefix = record_prefix
        self.version = 0
        self.vocab_size = None
        self._rng = random.Random(f"emulated-engine:{seed}")
        self._waiting: list[_Req] = []
        self._running: list[_Req] = []
        self._cache: dict[str, int] = {}  # session -> tokens cached
        self._prefill_debt = 0.0  # modelled seconds of prefill still to run
        self._paused = False
        self._wake = asyncio.Event()
        self._idle = asyncio.Event()
        self._idle.set()
        self._task: asyncio.Task | None = None
        self.clock = 0.0
        """Modelled seconds the engine has been busy or idle-waiting (its own clock)."""
        self._mark = 0.0  # loop time the clock was last advanced at
        self._plan: float | None = None  # modelled seconds of the current busy wait
        self.busy_model_s = 0.0
        """Modelled seconds with something running or prefilling."""
        self.tokens = 0
        self.requests = 0
        self.batch_samples: list[int] = []
        self.before_load: Callable[[int], Awaitable[None]] | None = None
        """Awaited with the version at the start of each load, while generation is paused:
        a synchronous weight transfer from another site (:mod:`rollart.emulate.link`)."""

    # -- AsyncEngine -------------------------------------------------------------------
    async def start(self) -> None:
        if self._task is None:
            self._task = asyncio.get_running_loop().create_task(self._loop(),
                                                                name=f"{self.name}-loop")

    async def close(self) -> None:
        if self._task is not None:
            self._task.cancel()
            try:
                await self._task
            except asyncio.CancelledError:
                pass
            self._task = None
        for r in self._waiting + self._running:
            if not r.fut.done():
                r.fut.set_exception(EngineAborted(r.rid, self._partial(r), self.version))
        self._waiting.clear()
        self._running.clear()

    async def generate(self, inp: GenInput, request_id: str) -> GenOutput:
        if not inp.prompt_ids:
            raise ValueError("empty prompt")
        if self._task is None:
            await self.start()
        cached = self._cache.get(inp.session, 0) if inp.session else 0
        new = len(inp.prompt_ids) - cached if 0 < cached <= len(inp.prompt_ids) else len(inp.prompt_ids)
        n_out = len(inp.choices[0]) if inp.choices else self._length(inp)
        r = _Req(inp, request_id, n_out, new, asyncio.get_running_loop().create_future(),
                 arrived=self._now())
        self._waiting.append(r)
        self._idle.clear()
        self._wake.set()
        out = await r.fut
        return out

    async def abort(self, request_ids: list[str]) -> None:
        ids = set(request_ids)
        for lst in (self._waiting, self._running):
            for r in [r for r in lst if r.rid in ids]:
                lst.remove(r)
                if not r.fut.done():
                    r.fut.set_exception(EngineAborted(r.rid, self._partial(r), self.version))
        self._check_idle()

    async def pause(self, mode: str = "wait") -> None:
        self._paused = True
        if mode == "abort":
            await self.abort([r.rid for r in self._running])
        while self._running:
            self._idle.clear()
            await self._idle.wait()

    async def resume(self) -> None:
        self._paused = False
        self._wake.set()

    async def load_weights(self, source: str | Path | bytes, version: int) -> None:
        if self.before_load is not None:
            await self.before_load(int(version))
        s = self.model_gb / max(1e-9, self.profile.load_gbps)
        RECORDS.loads.append({"model_s": s, "version": int(version), "engine": self.name})
        await asyncio.sleep(s * self.time_scale)
        self._cache.clear()
        self.version = int(version)

    # -- the model -----------------------------------------------------------------------
    def _length(self, inp: GenInput) -> int:
        # the prompt (not the trajectory id, which differs between runs) picks the length
        h = hashlib.blake2b(repr((tuple(inp.prompt_ids[-64:]), len(inp.prompt_ids))).encode(),
                            digest_size=8).digest()
        rng = random.Random(h)
        mu = math.log(self.out_mean) - self.out_sigma ** 2 / 2  # mean of the lognormal = out_mean
        n = int(round(rng.lognormvariate(mu, self.out_sigma)))
        return max(self.out_min, min(int(inp.max_new_tokens), n))

    def _partial(self, r: _Req) -> GenOutput:
        k = int(r.done)
        return GenOutput(self._tokens(r, k), self._logprobs(k), FINISH_INTERRUPTED,
                         version=self.version)

    def _tokens(self, r: _Req, k: int) -> list[int]:
        if r.inp.choices:
            return list(r.inp.choices[self._rng.randrange(len(r.inp.choices))])[:k]
        lo, hi = self.vocab
        toks = [self._rng.randrange(lo, hi) for _ in range(k)]
        if self.eos_id is not None and k and k < r.inp.max_new_tokens:
            toks[-1] = self.eos_id
        return toks

    def _logprobs(self, k: int) -> list[float]:
        return [-self._rng.uniform(0.01, 3.0) for _ in range(k)]

    def _finish(self, r: _Req) -> None:
        inp = r.inp
        if inp.choices:
            toks = list(inp.choices[self._rng.randrange(len(inp.choices))])
            reason = FINISH_CHOICE
        else:
            toks = self._tokens(r, r.n_out)
            reason = FINISH_LENGTH if r.n_out >= inp.max_new_tokens else FINISH_STOP
        if inp.session:
            self._cache[inp.session] = len(inp.prompt_ids) + len(toks)
        self.tokens += len(toks)
        self.requests += 1
        RECORDS.gen[self.record_prefix + (inp.session or r.rid)].append({
            "model_s": self.clock - r.admitted, "queue_s": r.admitted - r.arrived,
            "prefill_tokens": r.prefill_tokens, "tokens": len(toks),
            "batch_mean": r.batch_sum / max(1, r.batch_n), "engine": self.name,
            "profile": self.profile.name})
        if not r.fut.done():
            r.fut.set_result(GenOutput(toks, self._logprobs(len(toks)), reason,
                                       version=self.version))

    def _now(self) -> float:
        """The modelled clock now (between the loop's updates)."""
        if self._task is None:
            return self.clock
        el = (asyncio.get_running_loop().time() - self._mark) / self.time_scale
        return self.clock + (el if self._plan is None else min(el, self._plan))

    def _check_idle(self) -> None:
        if not self._running:
            self._idle.set()

    def _admit(self) -> None:
        while self._waiting and not self._paused and len(self._running) < self.max_batch:
            r = self._waiting.pop(0)
            r.admitted = self.clock
            self._prefill_debt += self.profile.prefill_s(r.prefill_tokens)
            self._running.append(r)

    async def _loop(self) -> None:
        loop = asyncio.get_running_loop()
        while True:
            self._admit()
            if not self._running:
                self._check_idle()
                self._wake.clear()
                t0 = self._mark = loop.time()
                self._plan = None
                await self._wake.wait()
                self.clock += (loop.time() - t0) / self.time_scale  # idle: modelled = real
                continue
            b = len(self._running)
            d = self.profile.decode_s(b)
            rem = min(r.n_out - r.done for r in self._running)
            plan = self._prefill_debt + max(0.0, rem) * d
            self._wake.clear()
            t0 = self._mark = loop.time()
            self._plan = plan
            woke = False
            if plan > 0:
                try:
                    await asyncio.wait_for(self._wake.wait(), plan * self.time_scale)
                    woke = True
                except TimeoutError:
                    pass
            # the modelled time that passed: the plan, unless an arrival woke us earlier
            # (sleeping late is the host's delay, not the model's)
            dt = min(plan, (loop.time() - t0) / self.time_scale) if woke else plan
            self.clock += dt
            self.busy_model_s += dt
            pre = min(dt, self._prefill_debt)
            self._prefill_debt -= pre
            steps = (dt - pre) / d
            self.batch_samples.append(b)
            if len(self.batch_samples) > 100_000:
                del self.batch_samples[:50_000]
            for r in list(self._running):
                r.done += steps
                r.batch_sum += b * steps
                r.batch_n += 1 if steps > 0 else 0
                if r.done >= r.n_out - 1e-6:
                    self._running.remove(r)
                    self._finish(r)
            self._check_idle()

    def stats(self) -> dict[str, float]:
        return {"requests": float(self.requests), "tokens": float(self.tokens),
                "busy_model_s": self.busy_model_s, "clock_model_s": self.clock,
                "utilisation": self.busy_model_s / self.clock if self.clock else 0.0}


@dataclass(kw_only=True, eq=False)
class EmulatedLLMProxy(LLMProxy):
    """The real :class:`LLMProxy` serving an :class:`EmulatedEngine` built from ``emulate``
    (its keyword arguments: ``actors.generate.args.emulate``); named ``emulated`` in every
    table."""

    emulate: dict[str, Any] = field(default_factory=dict)
    """The engine's keyword arguments, and ``pool_profiles: {pool: profile}``: the profile of
    a replica in that pool (hardware pools: an ``h800`` pool beside an ``h20`` one);
    ``records_per_run: true`` keys its records ``<run>/<traj_id>`` (several runs in one
    process have the same trajectory ids)."""
    _emulated: EmulatedEngine | None = field(default=None, init=False, repr=False)

    async def setup(self) -> None:
        if self.engine_obj is None:
            args = {"seed": self.seed, "name": f"emulated-{self.name}", **self.emulate}
            by_pool = args.pop("pool_profiles", None) or {}
            if args.pop("records_per_run", False):  # several runs in one process (E4)
                args["record_prefix"] = f"{self.run}/"
            if self.pool in by_pool:
                args["profile"] = by_pool[self.pool]
            self._emulated = EmulatedEngine(**args)
            self.engine_obj = self._emulated
        await super().setup()

    async def teardown(self) -> None:
        try:
            await super().teardown()
        finally:
            if self._emulated is not None:
                await self._emulated.close()

"""LLMProxy: generation as a request/reply service in a queue group.

The proxy drives an :class:`~rollart.engines.base.AsyncEngine` (``proxy.engine``): each
request is one ``await engine.generate(...)``; the engine batches concurrent requests as it
likes (the torch engine gathers them for ``gather_ms``; a lone request never waits for a
batch to fill). New policy versions are loaded between ``pause()`` and ``resume()`` after a
digest check: ``proxy.on_update: finish`` lets the requests in flight finish on the old
weights; ``interrupt`` stops them, and each continues from the tokens it had under the new
weights (its reply's ``token_versions`` say which version produced each token). Every reply
carries the version that produced it, and a request whose ``min_version`` is newer than the
loaded weights waits for the load instead of being served stale. A cancelled group
(``rollout.cancel``) aborts its trajectories' requests in flight.

Each replica answers its pool's queue group ``generate.request.<pool>`` and its own subject
``generate.direct.<pool>.<token>`` (announced in its progress reports), where requesters
send the later turns of the trajectories it served, so that the engine's per-trajectory KV
cache is hit (``rollout.affinity``; :mod:`rollart.actors.kernel.service_client`).
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import time
from dataclasses import dataclass, field, replace
from typing import Any

from rollart import messages as m
from rollart.actors.kernel.base import Actor, replica_suffix, serve
from rollart.actors.kernel.cancelled import CancelledGroups
from rollart.actors.kernel.policy_gate import PolicyGate
from rollart.actors.generate.policy import PolicyFollow, PolicyLoading, StalePolicy
from rollart.actors.kernel.runtime import decode_core
from rollart.actors.kernel.service import ServiceUnavailable
from rollart.actors.kernel.progress import ProgressReporter
from rollart.bus import Subscription
from rollart.config import ActorConfig, RunConfig
from rollart.engines import build_engine, lora_engine_args
from rollart.engines.base import (
    FINISH_CHOICE,
    FINISH_LENGTH,
    FINISH_STOP,
    AsyncEngine,
    EngineAborted,
    EngineUnavailable,
    GenInput,
    GenOutput,
)
from rollart.engines.batched import BatchedEngine
from rollart.engines.provision import model_dir
from rollart.engines.weight_stream import StreamLimits, serving_dtype
from rollart.telemetry import tracing

__all__ = ["GroupCancelled", "LLMProxy", "StalePolicy"]

log = logging.getLogger(__name__)


MAX_FRUITLESS_ABORTS = 16
"""An engine that aborts one request this many times in a row without a new token fails it."""


class GroupCancelled(ServiceUnavailable):
    """The request's trajectory belongs to a cancelled group: nobody waits for the answer
    (its EnvManager cancelled the trajectory on the same ``rollout.cancel``)."""


@dataclass(kw_only=True, eq=False)
class LLMProxy(PolicyLoading, Actor):
    role = "generate"
    model_dir: str
    """Local HF model folder (version 0 weights and tokenizer)."""
    engine: str = "torch"
    """``proxy.engine``: torch | vllm | vllm-server | sglang (see :func:`rollart.engines.build_engine`)."""
    engine_args: dict[str, Any] = field(default_factory=dict)
    """``proxy.engine_args``, passed to the engine."""
    on_update: str = "finish"
    """``proxy.on_update``: ``finish`` (requests in flight finish on the old weights, then the
    load) or ``interrupt`` (they stop, and continue from their tokens on the new weights)."""
    gather_ms: float = 2.0
    max_batch: int = 128
    dtype: str = "auto"
    """``proxy.dtype``: the torch engine's weights (``auto``: the model folder's, see
    :func:`rollart.engines.weight_stream.serving_dtype`)."""
    threads: int | None = 1
    seed: int = 0
    version_wait: float = 60.0
    """Seconds a request may wait for a newer policy than the loaded one."""
    initial_weights: str | None = None
    """A safetensors file to load (as version 0) instead of the model folder's weights."""
    engine_obj: Any = field(default=None, repr=False)
    """An engine instance to use instead of building one (embedding, tests): an
    :class:`AsyncEngine` not started yet (the proxy starts it; its owner closes it) or a
    synchronous ``GenerationEngine`` (wrapped in a ``BatchedEngine`` with ``gather_ms`` and
    ``max_batch``; the proxy never closes it)."""
    progress_every: float = 1.0
    """Seconds between ``service.progress`` reports (the request ids this replica holds)."""
    site: str = ""
    """The site of this replica's host (``python -m rollart.node --site``; "": none): streamed
    versions come from the site's weight relay when one is up (:mod:`.relay`), else from the
    trainer's store."""
    relay_wait: float = 30.0
    """Seconds a load waits for the site's relay to hold a version (the old one serves
    meanwhile) before it reads the trainer's store."""
    stream_limits: Any = None
    """What a streamed version may make this replica allocate and stage
    (:class:`rollart.engines.weight_stream.StreamLimits`, from ``trainer.sync``; None: the
    defaults)."""

    # -- state made by setup() (and by the handlers) ---------------------------------
    async_engine: AsyncEngine | None = field(default=None, init=False, repr=False)
    """The engine this proxy drives (``engine_obj`` itself, or built or wrapped); None
    before :meth:`setup`."""
    _owns_engine: bool = field(default=True, init=False, repr=False)
    """The proxy built (or wrapped) the engine, so it closes it."""
    _engine_reports_start: bool = field(default=False, init=False, repr=False)
    """The engine reports when each request's work began (a ``BatchedEngine``'s ``on_start``)."""
    _stopping: bool = field(default=False, init=False, repr=False)
    _lock: asyncio.Lock = field(default_factory=asyncio.Lock, init=False, repr=False)
    """Held while a policy version loads."""
    _loaded: asyncio.Condition = field(default_factory=asyncio.Condition, init=False, repr=False)
    """Notified when a policy version loaded (requests waiting for it go on)."""
    _target: m.PolicyPublished | None = field(default=None, init=False, repr=False)
    """The newest policy record the gate accepted (loaded, or to load)."""
    gate: PolicyGate = field(default_factory=lambda: PolicyGate(digests=True), init=False,
                             repr=False)
    """Which policy records this replica accepts."""
    _follow: PolicyFollow = field(default_factory=PolicyFollow, init=False, repr=False)
    """Which policy records this replica loaded or refused, and when to try again."""
    loads: list[tuple[int, float]] = field(default_factory=list, init=False, repr=False)
    """``(version, seconds)`` of each policy load."""
    pauses: list[tuple[int, float]] = field(default_factory=list, init=False, repr=False)
    """``(version, seconds)`` generation was paused for each load (``pause()`` to
    ``resume()`` returning)."""
    _stage: Any = field(default=None, init=False, repr=False)
    """Streamed versions (``trainer.sync.format: stream``): the staging folder and the
    staged file of the version loaded, the base of the next delta
    (:class:`rollart.actors.generate.policy.StreamStage`); made at the first such version."""
    interrupted: int = field(default=0, init=False)
    """Engine requests stopped by an ``interrupt`` update (or the engine) and continued."""
    _seq: itertools.count = field(default_factory=itertools.count, init=False, repr=False)
    _inflight: dict[str, str] = field(default_factory=dict, init=False, repr=False)
    """Engine request id -> traj_id, for the requests in the engine."""
    _cancelled: set[str] = field(default_factory=set, init=False, repr=False)
    """Engine request ids aborted because their group was cancelled."""
    cancelled_groups: CancelledGroups = field(default_factory=CancelledGroups, init=False,
                                              repr=False)
    """Cancelled groups (``rollout.cancel``), to refuse their requests that arrive late."""
    _trace_started: dict[str, float | None] = field(default_factory=dict, init=False, repr=False)
    """Tracing on: engine request id -> when the engine started it (None: not yet)."""
    progress: ProgressReporter = field(default=None, init=False, repr=False)
    _cancel_sub: Subscription | None = field(default=None, init=False, repr=False)

    @classmethod
    def from_config(cls, run_cfg: RunConfig, actor_cfg: ActorConfig, *, pool: str,
                    index: int = 0) -> "LLMProxy":
        px, lora = run_cfg.proxy, run_cfg.trainer.lora
        name = f"generate-{pool}-{replica_suffix()}-{index}"  # unique across hosts
        return cls.configured(actor_cfg, dict(
            run=run_cfg.run, pool=pool, name=name, model_dir=str(model_dir(run_cfg)),
            engine=px.engine, on_update=px.on_update,
            engine_args=lora_engine_args(px.engine, px.engine_args, lora.rank if lora else None),
            gather_ms=px.gather_ms, max_batch=px.max_batch, dtype=px.dtype,
            threads=run_cfg.model.threads, seed=index,
            stream_limits=StreamLimits.of(run_cfg.trainer.sync)))

    async def setup(self) -> None:
        if self.on_update not in ("finish", "interrupt"):
            raise ValueError(f"proxy.on_update {self.on_update!r} is not finish or interrupt")
        eng, self._owns_engine = self.engine_obj, True
        if eng is None:
            args = dict(self.engine_args)
            if self.engine == "torch" and "dtype" not in args:
                args["dtype"] = serving_dtype(self.dtype, self.model_dir)
            eng = build_engine(self.engine, self.model_dir, seed=self.seed, threads=self.threads,
                               gather_s=self.gather_ms / 1e3, max_batch=self.max_batch,
                               engine_args=args)
        elif not isinstance(eng, AsyncEngine):  # a synchronous engine: batch it here
            eng = BatchedEngine(eng, gather_s=self.gather_ms / 1e3, max_batch=self.max_batch,
                                owns=False)
        else:
            self._owns_engine = False
        self._engine_reports_start = isinstance(eng, BatchedEngine)
        if isinstance(eng, BatchedEngine):
            eng.replica, eng.pool = self.name, self.pool
            eng.on_start = self._engine_started
        self.async_engine = eng
        await eng.start()
        if self.initial_weights:
            await eng.load_weights(self.initial_weights, 0)
        self.progress = ProgressReporter(self, "generate.request", every=self.progress_every,
                                         pool=self.settings_of("generate").pool or self.pool)
        self._cancel_sub = await self.bus.subscribe(self.subject("rollout.cancel"),
                                                    self._on_cancel)

    async def teardown(self) -> None:
        if self._cancel_sub is not None:
            await self._cancel_sub.unsubscribe()
        if self._stage is not None:
            await asyncio.to_thread(self._stage.close)

    @property
    def version(self) -> int:
        return int(self.async_engine.version)

    @property
    def in_flight(self) -> dict[str, str]:
        """Engine request id -> traj_id of the requests in the engine now (a copy)."""
        return dict(self._inflight)

    @property
    def aborting(self) -> frozenset[str]:
        """Engine request ids aborted for a cancelled group that have not returned yet."""
        return frozenset(self._cancelled)

    @property
    def batcher(self) -> Any:
        """The ``BatchedEngine`` (its batch statistics: ``sizes``, ``items``, ``batches``,
        ``busy_s``, ``mean_batch``), or None for an engine that batches on its own."""
        eng = self.async_engine
        return eng if isinstance(eng, BatchedEngine) else None

    def node_stats(self) -> dict[str, float]:
        """Engine occupancy for the node's heartbeat: ``<name>.engine.<stat>`` (see
        :meth:`BatchedEngine.stats`: calls, rows, mean rows per call against the mean
        requests waiting when a call was cut, busy seconds, KV-cache counters)."""
        b = self.batcher
        return {} if b is None else {f"{self.name}.engine.{k}": v for k, v in b.stats().items()}

    async def main(self) -> None:
        try:
            async with asyncio.TaskGroup() as tg:
                tg.create_task(self._watch())
                tg.create_task(self.progress.run())
        finally:  # stopping: requests still in the engine are answered "unavailable"
            self._stopping = True
            b = self.batcher
            if b is not None and b.batches:
                st = b.stats()
                log.info("%s: %d engine calls, %.1f rows per call (%.1f more waiting when cut), "
                         "engine busy %.1f s%s", self.name, b.batches, st["mean_rows"],
                         st["mean_waiting"], st["busy_s"],
                         f", KV cache reused {st['kv_reused_tokens']:.0f} of "
                         f"{st['kv_reused_tokens'] + st['kv_prefilled_tokens']:.0f} prompt tokens"
                         if "kv_reused_tokens" in st and "kv_prefilled_tokens" in st else "")
            if self._owns_engine:
                await self.async_engine.close()

    @serve("generate.request", max_inflight=1024, direct="generate.direct")
    async def generate(self, req: m.GenerateRequest) -> m.GenerateResult:
        rid = f"{req.request_id or req.traj_id}#{next(self._seq)}"  # unique in the engine
        if tracing.enabled():
            return await self._generate_traced(req, rid)
        return await self._generate(req, rid)

    async def _generate_traced(self, req: m.GenerateRequest, rid: str) -> m.GenerateResult:
        """:meth:`_generate` in a ``generate.request`` span: a child of the requester's span
        (the runtime made the request's ``traceparent`` current), linked from its batches'
        (``generate.batch``, by the engine). ``queue_wait_s``: arrival here to the start of
        the engine's work on it."""
        with tracing.span("generate.request", {"traj_id": req.traj_id, "replica": self.name,
                                               "prompt_tokens": len(req.prompt_ids)}) as sp:
            t0 = time.monotonic()
            self._trace_started[rid] = None
            try:
                res = await self._generate(req, rid)
            finally:
                started = self._trace_started.pop(rid, None)
            if started is not None:
                sp.set_attribute("queue_wait_s", max(0.0, started - t0))
            sp.set_attribute("version", res.version)
            sp.set_attribute("response_tokens", len(res.token_ids))
            if res.token_versions:
                sp.set_attribute("versions", sorted(set(res.token_versions)))
            return res

    def _engine_started(self, request_ids: list[str]) -> None:
        """The ``BatchedEngine``'s ``on_start``: when each traced request's work began."""
        t = self._trace_started
        if t:
            now = time.monotonic()
            for rid in request_ids:
                if rid in t and t[rid] is None:
                    t[rid] = now

    async def _generate(self, req: m.GenerateRequest, rid: str) -> m.GenerateResult:
        # the runtime lists req.request_id in self.progress while it is queued or here
        if self._stopping:
            raise ServiceUnavailable(f"{self.name} is stopping")
        self._check_tokens(req)
        self._check_not_cancelled(req.traj_id)
        self._inflight[rid] = req.traj_id  # from here a cancel of its group reaches it
        try:
            if req.min_version > self.version:
                await self._check_reachable(req.min_version)
                await self._wait_for_version(req.min_version)
            inp = GenInput(prompt_ids=list(req.prompt_ids),
                           max_new_tokens=req.sampling.max_new_tokens,
                           temperature=req.sampling.temperature, top_p=req.sampling.top_p,
                           stop_token_ids=tuple(req.sampling.stop_token_ids),
                           choices=[list(c) for c in req.choices] or None, greedy=req.greedy,
                           session=req.traj_id)  # the engine may keep its KV cache between turns
            return await self._serve(req, inp, rid)
        except EngineUnavailable as e:  # its server died: another replica, or this one later
            raise ServiceUnavailable(f"{self.name}: {e}") from e
        except Exception as e:
            if self._stopping and not isinstance(e, ServiceUnavailable):
                # the engine closed under it: its requester asks another replica
                raise ServiceUnavailable(f"{self.name} is stopping: {e}") from e
            raise
        finally:
            self._inflight.pop(rid, None)
            self._cancelled.discard(rid)

    async def _serve(self, req: m.GenerateRequest, inp: GenInput, rid: str) -> m.GenerateResult:
        """One engine request, or several when updates interrupt it: each continues from the
        tokens so far (prompt + partial response, the choices left, fewer new tokens) under
        the new weights; tokens, log-probs and per-token versions are concatenated."""
        tokens: list[int] = []
        logprobs: list[float] = []
        versions: list[int] = []
        cur, fruitless = inp, 0
        while True:
            if rid in self._cancelled:
                raise GroupCancelled(f"{self.name}: the group of {req.traj_id} was cancelled")
            if not self._engine_reports_start and self._trace_started.get(rid, 0.0) is None:
                self._trace_started[rid] = time.monotonic()  # the engine's queue is its own
            try:
                out = await self._engine_generate(req, cur, rid)
            except EngineAborted as e:
                if rid in self._cancelled:
                    raise GroupCancelled(f"{self.name}: the group of {req.traj_id} was "
                                         "cancelled") from None
                if self._stopping:
                    raise ServiceUnavailable(f"{self.name} is stopping") from None
                part = e.partial
                fruitless = 0 if part.token_ids else fruitless + 1
                if fruitless >= MAX_FRUITLESS_ABORTS:
                    raise RuntimeError(f"the engine aborted {req.traj_id}'s request "
                                       f"{fruitless} times without a token") from None
                self.interrupted += 1
                tokens += part.token_ids
                logprobs += part.logprobs
                versions += [int(e.partial_version)] * len(part.token_ids)
                nxt = self._continuation(inp, tokens)
                if isinstance(nxt, str):  # the partial response was complete after all
                    return self._result(tokens, logprobs, versions, nxt)
                cur = nxt
                continue
            tokens += out.token_ids
            logprobs += out.logprobs
            v = int(out.version) if out.version >= 0 else self.version
            versions += [v] * len(out.token_ids)
            return self._result(tokens, logprobs, versions, out.finish_reason, v)

    async def _engine_generate(self, req: m.GenerateRequest, inp: GenInput, rid: str) -> GenOutput:
        """One engine call (a test double's hook: ``tests/faults/slow_proxy.py``)."""
        return await self.async_engine.generate(inp, rid)

    def _continuation(self, inp: GenInput, tokens: list[int]) -> GenInput | str:
        """The input that continues ``inp`` after the response ``tokens``, or the finish
        reason when they already are a whole response."""
        n = len(tokens)
        if inp.choices is not None:
            rest = [c[n:] for c in inp.choices if c[:n] == tokens]
            if not rest:
                raise RuntimeError(f"the engine's partial response {tokens} starts no choice")
            if any(not c for c in rest):
                return FINISH_CHOICE
            return replace(inp, prompt_ids=[*inp.prompt_ids, *tokens], choices=rest)
        stops = set(inp.stop_token_ids) | set(self.async_engine.eos_token_ids)
        if tokens and tokens[-1] in stops:
            return FINISH_STOP
        if n >= inp.max_new_tokens:
            return FINISH_LENGTH
        return replace(inp, prompt_ids=[*inp.prompt_ids, *tokens],
                       max_new_tokens=inp.max_new_tokens - n)

    def _result(self, tokens: list[int], logprobs: list[float], versions: list[int],
                finish: str, version: int | None = None) -> m.GenerateResult:
        if version is None:
            version = versions[-1] if versions else self.version
        mixed = any(v != version for v in versions)
        return m.GenerateResult(token_ids=tokens, logprobs=logprobs, version=version,
                                finish_reason=finish, replica=self.name,
                                token_versions=versions if mixed else [])

    # -- group cancel --------------------------------------------------------------------
    async def _on_cancel(self, msg) -> None:
        """``rollout.cancel``: abort the requests in flight of the group's unfinished
        trajectories (those not in ``keep``), and refuse ones that arrive later."""
        cmd = decode_core(m.CancelGroup, msg)
        if cmd is None:  # junk on a core subject: counted and dropped
            return
        keep = self.cancelled_groups.add(cmd.group_id, cmd.keep)
        ids = [rid for rid, tid in self._inflight.items()
               if _group_of(tid) == cmd.group_id and tid not in keep]
        if ids:
            self._cancelled.update(ids)
            log.debug("%s: group %s cancelled, aborting %d request(s)", self.name,
                      cmd.group_id, len(ids))
            await self.async_engine.abort(ids)

    def _check_not_cancelled(self, traj_id: str) -> None:
        if self.cancelled_groups.cancels(_group_of(traj_id), traj_id):
            raise GroupCancelled(f"{self.name}: the group of {traj_id} was cancelled")

    def _check_tokens(self, req: m.GenerateRequest) -> None:
        """Token ids the engine cannot embed would fail the whole batch they share: refuse
        the one request instead (the runtime already checked the rest of its form)."""
        vocab = self.async_engine.vocab_size
        if vocab is None:
            return
        top = max([*req.prompt_ids, *(t for c in req.choices for t in c)], default=-1)
        if top >= vocab:
            raise ValueError(f"invalid: token id {top} is outside the model's vocabulary "
                             f"({vocab} tokens)")

def _group_of(traj_id: str) -> str:
    """The group id of a trajectory id (``<group id>-<index>``)."""
    return traj_id.rsplit("-", 1)[0]

"""LLMProxy: generation as a request/reply service in a queue group.

Concurrent requests from many trajectories are gathered into engine batches (a short
``gather_ms`` window; a lone request never waits for a batch to fill). New policy
versions are loaded between batches after a digest check; every reply carries the
version that produced it, and a request whose ``min_version`` is newer than the loaded
weights waits for the load instead of being served stale.
"""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass, field
from typing import Any

from rollart import messages as m
from rollart.actors.base import Actor, replica_suffix, serve
from rollart.actors.batching import Batcher
from rollart.actors.policy import fetch_weights
from rollart.actors.policy_gate import PolicyGate, follow_policy
from rollart.actors.runtime import ServiceUnavailable
from rollart.actors.service_client import ProgressReporter
from rollart.telemetry import otel_metrics, tracing

log = logging.getLogger(__name__)


class StalePolicy(RuntimeError):
    """The proxy cannot serve a version as new as the request needs."""


@dataclass(kw_only=True, eq=False)
class LLMProxy(Actor):
    role = "generate"
    model_dir: str
    """Local HF model folder (version 0 weights and tokenizer)."""
    engine: str = "torch"
    gather_ms: float = 2.0
    max_batch: int = 128
    threads: int | None = 1
    seed: int = 0
    version_wait: float = 60.0
    """Seconds a request may wait for a newer policy than the loaded one."""
    initial_weights: str | None = None
    """A safetensors file to load (as version 0) instead of the model folder's weights."""
    engine_obj: Any = field(default=None, repr=False)
    """An engine instance to use instead of building one (embedding, tests)."""
    progress_every: float = 1.0
    """Seconds between ``service.progress`` reports (the request ids this replica holds)."""

    @classmethod
    def from_config(cls, run_cfg: Any, actor_cfg: Any, *, pool: str, index: int = 0) -> "LLMProxy":
        from rollart.engines.provision import model_dir

        px = run_cfg.proxy
        kw = dict(model_dir=str(model_dir(run_cfg)), engine=px.engine, gather_ms=px.gather_ms,
                  max_batch=px.max_batch, threads=run_cfg.model.threads, seed=index)
        kw.update(actor_cfg.args)
        name = f"generate-{pool}-{replica_suffix()}-{index}"  # unique across hosts
        settings = {h: hc.overrides() for h, hc in actor_cfg.handlers.items()}
        return cls(run=run_cfg.run, pool=pool, name=name, settings=settings, **kw)

    async def setup(self) -> None:
        if self.engine_obj is None:
            if self.engine != "torch":
                raise ValueError(f"proxy.engine {self.engine!r} is not available; use 'torch'")
            from rollart.engines.torch_engine import TorchGenerationEngine

            self.engine_obj = await asyncio.to_thread(
                TorchGenerationEngine, self.model_dir, threads=self.threads, seed=self.seed)
        if self.initial_weights:
            await asyncio.to_thread(self.engine_obj.load_weights, self.initial_weights, 0)
        self._lock = asyncio.Lock()
        self._loaded = asyncio.Condition()
        self._target: m.PolicyPublished | None = None
        self.gate = PolicyGate(digests=True)
        self.batcher: Batcher = Batcher(self._engine_call, gather_s=self.gather_ms / 1e3,
                                        max_batch=self.max_batch, before_batch=self._maybe_load)
        self.loads: list[tuple[int, float]] = []
        self.progress = ProgressReporter(self, "generate.request", every=self.progress_every,
                                         pool=self.settings_of("generate").pool or self.pool)

    @property
    def version(self) -> int:
        return int(self.engine_obj.version)

    async def main(self) -> None:
        async with asyncio.TaskGroup() as tg:
            tg.create_task(self.batcher.run())
            tg.create_task(self._watch())
            tg.create_task(self.progress.run())

    async def _watch(self) -> None:
        """Follow KV ``policy.version`` through the policy gate (:class:`PolicyGate`: only
        versions the trainer's ledger and announcements confirm, one by one); load each newer
        version (and a version already loaded whose digest changed). A refused record is tried
        again when it is announced again (a new KV record, even an identical one) and
        otherwise after a backoff."""
        follow = self._follow

        async def accepted(pub: m.PolicyPublished) -> None:
            if follow.wanted(pub, self.version):
                self._target = pub
                follow.announced(pub)  # wakes loads()

        async def records() -> None:  # only what the gate accepts (see PolicyGate)
            await follow_policy(self, self.gate, accepted)

        async def loads() -> None:
            # Loads run here, not in the gate's callback: a slow or failed weight read must
            # not hold up judging the records after it (a newer version supersedes it).
            while True:
                follow.changed.clear()
                pub = self._target
                await self._maybe_load()
                if pub is not None and not follow.wanted(pub, self.version):
                    follow.refused.pop(follow.key(pub), None)  # superseded: no retry
                due = follow.due_at(self._target)
                timeout = None if due is None else max(0.0, due - time.monotonic())
                try:
                    await asyncio.wait_for(follow.changed.wait(), timeout)
                except TimeoutError:
                    pass

        async with asyncio.TaskGroup() as tg:
            tg.create_task(records())
            tg.create_task(loads())

    async def _maybe_load(self) -> None:
        """Load ``self._target`` if it is newer than the loaded weights (between batches:
        this is the batcher's ``before_batch``). Never raises for a bad record or a failed
        status publish: a refused record keeps the old weights serving."""
        follow = self._follow
        pub = self._target
        if pub is None or not follow.wanted(pub, self.version) or follow.blocked(pub):
            return
        async with self._lock:
            if not follow.wanted(pub, self.version) or follow.blocked(pub):
                return
            t0 = time.perf_counter()
            try:
                with tracing.span("policy.load", {"version": pub.version, "replica": self.name}):
                    data = await fetch_weights(self.bus, pub)
                    await asyncio.to_thread(self._load_bytes, data, pub.version)
            except Exception as e:  # noqa: BLE001 - refuse, keep serving the old weights
                tries, delay = follow.refuse(pub)
                log.error("%s refused policy v%s (try %d, again in %.0fs or when announced "
                          "again): %s", self.name, pub.version, tries, delay, e)
                report = m.PolicyLoaded(version=self.version, replica=self.name, pool=self.pool,
                                        error=str(e))
                msg_id = f"refused:{self.name}:{pub.version}:{pub.digest.rsplit(':', 1)[-1][:16]}:{tries}"
            else:
                dt = time.perf_counter() - t0
                follow.loaded_ok(pub)
                self.gate.loaded(pub)
                self.loads.append((pub.version, dt))
                log.info("%s loaded policy v%s in %.2fs", self.name, pub.version, dt)
                report = m.PolicyLoaded(version=pub.version, replica=self.name, pool=self.pool,
                                        load_s=dt)
                msg_id = f"loaded:{self.name}:{pub.version}:{pub.digest.rsplit(':', 1)[-1][:16]}"
        if not report.error:
            async with self._loaded:
                self._loaded.notify_all()
        await self._report_loaded(report, msg_id)

    async def _report_loaded(self, report: m.PolicyLoaded, msg_id: str) -> None:
        """Publish ``policy.loaded``: bus errors are retried briefly, then logged, never raised
        (a status report must not take the proxy down)."""
        try:
            await self.publish_patiently("policy.loaded", report, msg_id=msg_id,
                                         deadline=self._follow.report_deadline)
        except Exception as e:  # noqa: BLE001 - a lost status report is not fatal
            log.warning("%s: policy.loaded report (v%s%s) not published: %s", self.name,
                        report.version, ", refused" if report.error else "", e)

    @property
    def _follow(self) -> "_PolicyFollow":
        f = self.__dict__.get("_policy_follow")
        if f is None:
            f = self.__dict__["_policy_follow"] = _PolicyFollow()
        return f

    def _load_bytes(self, data: bytes, version: int) -> None:
        from safetensors.torch import load as load_safetensors

        self.engine_obj.load_state_dict(load_safetensors(data), version)

    async def _engine_call(self, reqs: list[m.GenerateRequest]) -> list[m.GenerateResult]:
        """The batcher's call: run a batch; ``rollart.engine.*`` metrics of each one served."""
        waiting = self.batcher.queued  # left queued when this batch was cut
        out = await self._run_batch(reqs)
        otel_metrics.engine_batch(len(reqs), waiting, self.pool)
        return out

    async def _run_batch(self, reqs: list[m.GenerateRequest]) -> list[m.GenerateResult]:
        from rollart.engines.base import GenInput

        inputs = [GenInput(prompt_ids=list(r.prompt_ids), max_new_tokens=r.sampling.max_new_tokens,
                           temperature=r.sampling.temperature, top_p=r.sampling.top_p,
                           stop_token_ids=tuple(r.sampling.stop_token_ids),
                           choices=[list(c) for c in r.choices] or None, greedy=r.greedy)
                  for r in reqs]
        heads = self.__dict__.get("_trace_heads")  # tracing on: request id -> its span's headers
        with tracing.span("generate.batch", {"batch_size": len(reqs), "replica": self.name},
                          links=[heads[r.request_id] for r in reqs if r.request_id in heads]
                          if heads else None) as sp:
            async with self._lock:
                version = self.version
                if heads:  # when each request left the queue: its span's queue_wait_s
                    started = self.__dict__.setdefault("_trace_started", {})
                    now = time.monotonic()
                    started.update((r.request_id, now) for r in reqs if r.request_id in heads)
                outs = await asyncio.to_thread(self.engine_obj.generate, inputs)
            if sp is not None:
                sp.set_attribute("version", version)
        return [m.GenerateResult(token_ids=o.token_ids, logprobs=o.logprobs, version=version,
                                 finish_reason=o.finish_reason, replica=self.name) for o in outs]

    @serve("generate.request", max_inflight=1024)
    async def generate(self, req: m.GenerateRequest) -> m.GenerateResult:
        if tracing.enabled():
            return await self._generate_traced(req)
        return await self._generate(req)

    async def _generate_traced(self, req: m.GenerateRequest) -> m.GenerateResult:
        """:meth:`_generate` in a ``generate.request`` span: a child of the requester's span
        (the runtime made the request's ``traceparent`` current), linked from its batch's."""
        heads = self.__dict__.setdefault("_trace_heads", {})
        with tracing.span("generate.request", {"traj_id": req.traj_id, "replica": self.name,
                                               "prompt_tokens": len(req.prompt_ids)}) as sp:
            heads[req.request_id] = tracing.headers() or {}
            t0 = time.monotonic()
            try:
                res = await self._generate(req)
            finally:
                heads.pop(req.request_id, None)
                started = self.__dict__.get("_trace_started", {}).pop(req.request_id, None)
            if started is not None:
                sp.set_attribute("queue_wait_s", max(0.0, started - t0))
            sp.set_attribute("version", res.version)
            sp.set_attribute("response_tokens", len(res.token_ids))
            return res

    async def _generate(self, req: m.GenerateRequest) -> m.GenerateResult:
        # the runtime lists req.request_id in self.progress while it is queued or here
        if self.batcher.stopped:
            raise ServiceUnavailable(f"{self.name} is stopping")
        self._check_tokens(req)
        if req.min_version > self.version:
            await self._check_reachable(req.min_version)
            await self._wait_for_version(req.min_version)
        return await self.batcher.submit_or_unavailable(
            req, lambda why: ServiceUnavailable(f"{self.name} {why}"))

    def _check_tokens(self, req: m.GenerateRequest) -> None:
        """Token ids the engine cannot embed would fail the whole batch they share: refuse
        the one request instead (the runtime already checked the rest of its form)."""
        vocab = getattr(self.engine_obj, "vocab_size", None)
        if vocab is None:
            return
        top = max([*req.prompt_ids, *(t for c in req.choices for t in c)], default=-1)
        if top >= vocab:
            raise ValueError(f"invalid: token id {top} is outside the model's vocabulary "
                             f"({vocab} tokens)")

    async def _check_reachable(self, v: int) -> None:
        """Refuse at once a ``min_version`` beyond the published policy (+1): no requester
        can have seen it, and waiting ``version_wait`` for it holds the caller for nothing."""
        from rollart.actors.policy import current_policy
        from rollart.bus import BusError
        from rollart.bus.codec import DecodeError

        known = max(self.version, self._target.version if self._target is not None else 0)
        if v <= known + 1:
            return
        try:  # the watch may lag: ask KV itself before refusing
            pub = await current_policy(self.bus, self.run)
        except (BusError, DecodeError):
            return
        latest = max(known, pub.version if pub is not None else 0)
        if v > latest + 1:
            raise ValueError(f"invalid: min_version {v} is beyond the published policy v{latest}")

    async def _wait_for_version(self, v: int) -> None:
        deadline = time.monotonic() + self.version_wait
        async with self._loaded:
            while self.version < v:
                left = deadline - time.monotonic()
                if left <= 0:
                    raise StalePolicy(f"{self.name} serves v{self.version}, request needs >= v{v}")
                try:
                    await asyncio.wait_for(self._loaded.wait(), left)
                except TimeoutError:
                    pass


class _PolicyFollow:
    """Which policy records a proxy loaded or refused; when a refused one is tried again."""

    first_retry = 2.0
    max_retry = 60.0
    report_deadline = 2.0
    """Seconds a ``policy.loaded`` report is retried (it delays the next batch meanwhile)."""

    def __init__(self) -> None:
        self.loaded: tuple[int, str] | None = None
        """``(version, digest)`` of the last record loaded."""
        self.refused: dict[tuple[int, str, str], tuple[float, int]] = {}
        """``(version, digest, uri)`` -> ``(monotonic time of the next try, tries)``."""
        self.changed = asyncio.Event()

    @staticmethod
    def key(pub: m.PolicyPublished) -> tuple[int, str, str]:
        return (pub.version, pub.digest, pub.uri)

    def wanted(self, pub: m.PolicyPublished, version: int) -> bool:
        return pub.version > version or (
            pub.version == version and self.loaded is not None
            and self.loaded != (pub.version, pub.digest))

    def blocked(self, pub: m.PolicyPublished) -> bool:
        r = self.refused.get(self.key(pub))
        return r is not None and time.monotonic() < r[0]

    def due_at(self, pub: m.PolicyPublished | None) -> float | None:
        r = self.refused.get(self.key(pub)) if pub is not None else None
        return None if r is None else r[0]

    def announced(self, pub: m.PolicyPublished) -> None:
        """A (re-)announced record: if it was refused, try it now."""
        r = self.refused.get(self.key(pub))
        if r is not None:
            self.refused[self.key(pub)] = (0.0, r[1])
        self.changed.set()

    def refuse(self, pub: m.PolicyPublished) -> tuple[int, float]:
        tries = self.refused.get(self.key(pub), (0.0, 0))[1] + 1
        delay = min(self.max_retry, self.first_retry * 2 ** (tries - 1))
        self.refused[self.key(pub)] = (time.monotonic() + delay, tries)
        self.changed.set()
        return tries, delay

    def loaded_ok(self, pub: m.PolicyPublished) -> None:
        self.loaded = (pub.version, pub.digest)
        self.refused = {k: r for k, r in self.refused.items() if k[0] > pub.version}
        self.changed.set()

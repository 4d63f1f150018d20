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
from rollart.actors.base import Actor, serve
from rollart.actors.batching import Batcher
from rollart.actors.policy import fetch_weights, watch_policy

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

    @classmethod
    def from_config(cls, run_cfg: Any, actor_cfg: Any, *, pool: str, index: int = 0) -> "LLMProxy":
        from rollart.engines.provision import model_dir

        px = run_cfg.proxy
        kw = dict(model_dir=str(model_dir(run_cfg)), engine=px.engine, gather_ms=px.gather_ms,
                  max_batch=px.max_batch, threads=run_cfg.model.threads, seed=index)
        kw.update(actor_cfg.args)
        name = f"generate-{pool}-{index}"
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
        self._refused: set[int] = set()
        self.batcher: Batcher = Batcher(self._run_batch, gather_s=self.gather_ms / 1e3,
                                        max_batch=self.max_batch, before_batch=self._maybe_load)
        self.loads: list[tuple[int, float]] = []

    @property
    def version(self) -> int:
        return int(self.engine_obj.version)

    async def main(self) -> None:
        async with asyncio.TaskGroup() as tg:
            tg.create_task(self.batcher.run())
            tg.create_task(self._watch())

    async def _watch(self) -> None:
        async for pub in watch_policy(self.bus, self.run):
            if pub.version > self.version and pub.version not in self._refused:
                self._target = pub
                await self._maybe_load()

    async def _maybe_load(self) -> None:
        pub = self._target
        if pub is None or pub.version <= self.version or pub.version in self._refused:
            return
        async with self._lock:
            if pub.version <= self.version:
                return
            t0 = time.perf_counter()
            try:
                data = await fetch_weights(self.bus, pub)
                await asyncio.to_thread(self._load_bytes, data, pub.version)
            except Exception as e:  # noqa: BLE001 - refuse, keep serving the old weights
                self._refused.add(pub.version)
                log.error("%s refused policy v%s: %s", self.name, pub.version, e)
                await self.publish("policy.loaded", m.PolicyLoaded(
                    version=self.version, replica=self.name, pool=self.pool, error=str(e)))
                return
            dt = time.perf_counter() - t0
            self.loads.append((pub.version, dt))
            log.info("%s loaded policy v%s in %.2fs", self.name, pub.version, dt)
        async with self._loaded:
            self._loaded.notify_all()
        await self.publish("policy.loaded", m.PolicyLoaded(
            version=pub.version, replica=self.name, pool=self.pool, load_s=dt),
            msg_id=f"loaded:{self.name}:{pub.version}")

    def _load_bytes(self, data: bytes, version: int) -> None:
        from safetensors.torch import load as load_safetensors

        self.engine_obj.load_state_dict(load_safetensors(data), version)

    async def _run_batch(self, reqs: list[m.GenerateRequest]) -> list[m.GenerateResult]:
        from rollart.engines.base import GenInput

        inputs = [GenInput(prompt_ids=list(r.prompt_ids), max_new_tokens=r.sampling.max_new_tokens,
                           temperature=r.sampling.temperature, top_p=r.sampling.top_p,
                           stop_token_ids=tuple(r.sampling.stop_token_ids),
                           choices=[list(c) for c in r.choices] or None, greedy=r.greedy)
                  for r in reqs]
        async with self._lock:
            version = self.version
            outs = await asyncio.to_thread(self.engine_obj.generate, inputs)
        return [m.GenerateResult(token_ids=o.token_ids, logprobs=o.logprobs, version=version,
                                 finish_reason=o.finish_reason, replica=self.name) for o in outs]

    @serve("generate.request", max_inflight=1024)
    async def generate(self, req: m.GenerateRequest) -> m.GenerateResult:
        if req.min_version > self.version:
            await self._wait_for_version(req.min_version)
        return await self.batcher.submit(req)

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

"""A generation replica whose engine batches take ``delay`` seconds (a slow or stuck GPU)."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass

from rollart.actors.llm_proxy import LLMProxy


@dataclass(kw_only=True, eq=False)
class SlowProxy(LLMProxy):
    delay: float = 30.0

    async def _run_batch(self, reqs):
        print(f"slow proxy {self.progress.replica}: batch of {len(reqs)} in flight", flush=True)
        await asyncio.sleep(self.delay)
        return await super()._run_batch(reqs)

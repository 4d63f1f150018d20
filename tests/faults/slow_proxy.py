"""A generation replica whose engine calls take ``delay`` seconds (a slow or stuck GPU)."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass

from rollart.actors.generate.proxy import LLMProxy


@dataclass(kw_only=True, eq=False)
class SlowProxy(LLMProxy):
    delay: float = 30.0

    async def _engine_generate(self, req, inp, rid):
        print(f"slow proxy {self.progress.replica}: batch of 1 in flight", flush=True)
        await asyncio.sleep(self.delay)
        return await super()._engine_generate(req, inp, rid)

"""A trainer that cannot get a batch says what it waits for, in the log and in KV."""

from __future__ import annotations

import asyncio
import time

from rollart.actors.groups.ledger import watch_summary
from rollart.config import RunConfig, convert
from rollart.node.build import training_actors
from rollart.node import Node


async def test_trainer_reports_what_it_waits_for(bus, tiny_model, tmp_path, caplog):
    run = f"wait{int(time.time() * 1000) % 10**8}"
    cfg = convert({"run": run, "run_dir": str(tmp_path / "runs"), "model": {"path": str(tiny_model)},
                   "envs": {"main": {"type": "frozenlake"}},
                   "rollout": {"group_size": 2, "batch_groups": 2},
                   "trainer": {"steps": 2, "stall_after": 0.5}}, RunConfig)
    sched, trainer, _ = training_actors(cfg)  # no EnvManager, no LLMProxy: nothing can finish
    async with Node(bus, [sched, trainer], heartbeat_every=0.2):
        deadline = time.monotonic() + 30
        while not trainer.waiting and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        assert "group 0: nothing received" in trainer.waiting
        assert "no live node serves env or generate" in trainer.waiting
        assert "work queue holds 8 requests" in trainer.waiting  # 2 groups x 2 x (α+1)=2 steps

        async def first_waiting():
            async for s in watch_summary(bus, run):
                if s.waiting:
                    return s

        summary = await asyncio.wait_for(first_waiting(), 10)
        assert summary.waiting == trainer.waiting and summary.lost == 0
    assert any("trainer waited" in r.getMessage() for r in caplog.records)

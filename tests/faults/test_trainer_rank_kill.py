"""A trainer rank SIGKILLed during a run (real processes: `rollart run` on a nats-server, its
node children, trainer rank 1 a child of the trainer's process): the run stops non-zero with
one message naming rank 1, within ``trainer.dist_timeout``, never hangs; ``--resume`` then
trains every step, and no trajectory is trained twice or lost to the failed step. Replicated
ranks, and sharded ones (``trainer.shard: fsdp2``, versions streamed: every version gathered a
tensor at a time, the resume's full checkpoint scattered back to the shards)."""

from __future__ import annotations

import asyncio
import os
import re
import signal
import time
from pathlib import Path

import pytest

from rollart.app.launch import with_overrides
from rollart.app.run import train
from rollart.config.trainer import SyncConfig
from tests.e2e.test_learning import _rows, quickstart

pytestmark = pytest.mark.slow
STEPS = 6


@pytest.mark.timeout(900)
@pytest.mark.parametrize("shard", ["none", "fsdp2"])
async def test_a_killed_rank_stops_the_run_and_resume_trains_each_group_once(tmp_path, nats_server, shard):
    # small steps (2 groups of 4, each trained): the ranks are the point, not the learning
    more = {"shard": "fsdp2", "sync": SyncConfig(format="stream"), "full_checkpoint_every": 2} \
        if shard == "fsdp2" else {}
    cfg = with_overrides(quickstart(tmp_path, f"rank-kill-{shard}", 1),  # one nats-server: own run
                         rollout={"group_size": 4, "batch_groups": 2},
                         trainer={"steps": STEPS, "world_size": 2, "dist_timeout": 10.0,
                                  "skip_uniform": 0, "eval_groups": 1, **more})
    run = Path(cfg.run_dir) / cfg.run
    killed: dict = {}

    async def kill_rank1_after_two_steps():
        while not (run / "metrics.jsonl").exists() or len(_rows(cfg)) < 2:
            await asyncio.sleep(0.05)
        text = (run / "logs" / "trainer-rank1.log").read_text()
        pid = int(re.findall(r"joined \S+ \(.*, pid (\d+)\)", text)[-1])
        os.kill(pid, signal.SIGKILL)
        killed.update(pid=pid, at=time.monotonic(), rows=len(_rows(cfg)))

    killer = asyncio.ensure_future(kill_rank1_after_two_steps())
    summary = await asyncio.wait_for(train(cfg, nats=nats_server.url, resume=False, quiet=True), 400)
    stopped = time.monotonic()
    killer.cancel()
    assert killed, "the run ended before rank 1 was killed"
    failed = summary.get("failed", "")
    assert "trainer rank 1" in failed and "SIGKILL" in failed, summary
    assert summary["steps"] < STEPS
    assert stopped - killed["at"] < 10.0 + 120, "the run stops soon after the rank died"
    rows = _rows(cfg)
    assert len(rows) == summary["steps"], "no row for the failed step"

    summary = await asyncio.wait_for(train(cfg, nats=nats_server.url, resume=True, quiet=True), 400)
    assert summary["steps"] == STEPS and not summary.get("failed"), summary
    rows = _rows(cfg)
    assert [r["step"] for r in rows] == list(range(1, STEPS + 1))
    ids = [t for r in rows for t in r["traj_ids"]]
    assert len(ids) == len(set(ids)), "a trajectory trained twice"
    assert all(r["world_size"] == 2 for r in rows)

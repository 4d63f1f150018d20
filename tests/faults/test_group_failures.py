"""Runs that lose groups keep training (real `rollart run` processes): failed groups free
their headroom and are replaced, a stray CancelGroup does not stall the trainer, and a
systematic failure stops the run with its reason instead of hanging."""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[2]
pytestmark = pytest.mark.slow


def _config(tmp_path: Path, tiny_model: Path, run: str, env: dict, **rollout) -> Path:
    cfg = {
        "run": run, "run_dir": str(tmp_path / "runs"),
        "model": {"path": str(tiny_model)},
        "envs": {"main": {"max_turns": 3, "reset_retries": 0, **env}},
        "rollout": {"group_size": 2, "batch_groups": 2, "alpha": 1, **rollout},
        "trainer": {"steps": 4, "lr": 1e-3, "eval_groups": 1},
    }
    p = tmp_path / f"{run}.yaml"
    p.write_text(yaml.safe_dump(cfg))
    return p


def _rollart(*args: str, cwd: Path, timeout: float) -> subprocess.CompletedProcess:
    env = dict(os.environ, PYTHONPATH=f"{ROOT}{os.pathsep}{os.environ.get('PYTHONPATH', '')}")
    return subprocess.run([sys.executable, "-m", "rollart", *args], cwd=cwd, env=env,
                          capture_output=True, text=True, timeout=timeout)


def _metrics(run_dir: Path) -> list[dict]:
    return [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines() if x]


@pytest.mark.parametrize("alpha", [0, 1])
def test_failing_groups_are_replaced_and_the_run_finishes(tmp_path, tiny_model, alpha):
    """Groups whose task seed cannot be reset all fail; before the ledger a single one
    stalled α = 0 training for good."""
    cfg = _config(tmp_path, tiny_model, f"fail{alpha}",
                  {"type": "tests.e2e.faulty_envs:SeedFailLake", "check": False}, alpha=alpha)
    res = _rollart("run", str(cfg), "--quiet", "--nats", "memory", cwd=tmp_path, timeout=240)
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    rows = _metrics(tmp_path / "runs" / f"fail{alpha}")
    assert [r["step"] for r in rows] == [1, 2, 3, 4], "no step skipped"
    ids = [t for r in rows for t in r["traj_ids"]]
    assert len(ids) == len(set(ids)), "no trajectory trained twice"
    groups = {t.rsplit("-", 1)[0] for t in ids}
    assert not any(int(g[1:]) % 3 == 0 for g in groups), "a failed task was trained on"
    assert rows[-1]["groups_lost"] >= 1 and rows[-1]["count_groups_failed"] >= 1
    for r in rows:  # the α bound holds for every trained trajectory
        assert min(r["traj_min_versions"]) >= r["step"] - 1 - alpha


def test_systematic_failure_stops_the_run_with_its_reason(tmp_path, tiny_model):
    cfg = _config(tmp_path, tiny_model, "broken",
                  {"type": "tests.e2e.faulty_envs:BrokenStepLake", "check": False})
    t0 = time.monotonic()
    res = _rollart("run", str(cfg), "--quiet", "--nats", "memory", cwd=tmp_path, timeout=240)
    took = time.monotonic() - t0
    assert res.returncode != 0, res.stdout[-3000:]
    summary = json.loads((tmp_path / "runs" / "broken" / "summary.json").read_text())
    assert "groups all failed" in summary["failed"]
    assert summary["groups_failed"] >= 4 and summary["dead_letters_by_kind"]
    assert "stopped:" in res.stderr
    assert took < 120, f"the breaker took {took:.0f}s"


async def test_a_stray_cancel_does_not_stall_training(memory_bus_only, tiny_model, tmp_path):
    """One CancelGroup for an in-flight group: its members report cancelled, the trainer
    closes the group as failed and a fresh group takes its place."""
    from rollart import messages as m
    from rollart.bus.codec import encode
    from rollart.config import RunConfig, convert
    from rollart.node.build import training_actors
    from rollart.node import Node

    bus = memory_bus_only
    cfg = convert({"run": "cancel", "run_dir": str(tmp_path / "runs"),
                   "model": {"path": str(tiny_model)},
                   "envs": {"main": {"type": "tests.e2e.faulty_envs:JitterLake", "max_turns": 3}},
                   "rollout": {"group_size": 2, "batch_groups": 2, "alpha": 0},
                   "trainer": {"steps": 3, "lr": 1e-3}}, RunConfig)
    sched, trainer, actors = training_actors(cfg)
    async with Node(bus, actors, heartbeat_every=0):
        await bus.publish_core(m.subject("cancel", "rollout.cancel"),
                               encode(m.CancelGroup(group_id="g000000", reason="stray")))
        await asyncio.wait_for(trainer.finished.wait(), 120)
    assert trainer.version == 3 and trainer.failure is None
    # alpha = 0 is on-policy: every step trained on trajectories of the version before it
    # (the quickstart's alpha = 0 learning run checks the same over a long run, in test-scale)
    rows = [json.loads(x) for x in (tmp_path / "runs" / "cancel" / "metrics.jsonl")
            .read_text().splitlines() if x.strip()]
    assert [r["step"] for r in rows] == [1, 2, 3]
    assert all(r["max_staleness"] == 0 for r in rows), [r["max_staleness"] for r in rows]
    assert all(mv == r["step"] - 1 for r in rows for mv in r["traj_min_versions"]), rows

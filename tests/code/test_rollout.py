"""``rollart rollout`` on a code task, with its tests left to the reward service: each
trajectory's last reply goes to the ``code_tests`` scorer (a reward host's sandbox), every
trajectory completes, and the scorer's time is in the trajectories' ``reward`` stage."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import yaml


def test_a_rollout_scored_by_the_reward_service(tmp_path: Path, tiny_model):
    cfg = {"run": "code", "run_dir": "runs", "model": {"path": str(tiny_model)},
           "envs": {"main": {"type": "pyexpr", "args": {"execute": False}, "scorer": "code_tests",
                             "max_turns": 1, "sampling": {"max_new_tokens": 8}}},
           "rollout": {"group_size": 2, "batch_groups": 2, "alpha": 1},
           "trainer": {"steps": 1, "eval_groups": 3}}
    (tmp_path / "c.yaml").write_text(yaml.safe_dump(cfg))
    out = tmp_path / "o.jsonl"
    r = subprocess.run([sys.executable, "-m", "rollart", "rollout", "c.yaml", "--groups", "3",
                        "--out", str(out), "--nats", "memory", "--quiet"], cwd=tmp_path,
                       env=dict(os.environ), capture_output=True, text=True, timeout=180)
    assert r.returncode == 0, r.stderr[-3000:]
    rows = [json.loads(x) for x in out.read_text().splitlines()]
    assert len(rows) == 6 and all(x["stop_reason"] == "terminated" for x in rows), rows[0]
    assert all(x["timings"]["reward"] > 0 for x in rows)  # scored on the reward service
    assert all(x["reward"] in (0.0, 1.0) for x in rows)

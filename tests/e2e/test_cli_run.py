"""`rollart run` as a user runs it: it says how to watch the run, and when its output is not
a terminal it prints one progress line per step (the fields of the bar) instead of a bar."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from tests.actors.sample_actors import new_run

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[2]


def test_run_prints_the_top_line_and_a_line_per_step(tmp_path, tiny_model):
    run = new_run()
    cfg = tmp_path / "run.yaml"
    cfg.write_text(
        f"run: {run}\n"
        f"run_dir: {tmp_path / 'runs'}\n"
        f"model: {{path: '{tiny_model}'}}\n"
        "node: {heartbeat_every: 0.5}\n"
        "envs: {main: {type: frozenlake, max_turns: 4}}\n"
        "rollout: {group_size: 4, batch_groups: 2, alpha: 1}\n"
        "trainer: {steps: 2, eval_groups: 1}\n")
    env = dict(os.environ, PYTHONPATH=f"{ROOT}{os.pathsep}{os.environ.get('PYTHONPATH', '')}")
    r = subprocess.run([sys.executable, "-m", "rollart", "run", str(cfg)], cwd=tmp_path, env=env,
                       capture_output=True, text=True, timeout=240)
    assert r.returncode == 0, r.stdout + r.stderr
    out = r.stdout
    # the exact command, once, at the default log level
    top = re.findall(rf"rollart top --nats nats://127\.0\.0\.1:\d+ --run {run}$", out, re.M)
    assert len(top) == 1, out
    steps = [line for line in out.splitlines() if line.startswith("step ")]
    assert [s.split()[1] for s in steps] == ["1/2", "2/2"], out
    for i, line in enumerate(steps, 1):
        assert re.match(rf"step {i}/2 v{i} success \d\.\d\d reward -?\d\.\d\d ETA \S+ tok/s", line), line
    summary = json.loads(out[out.index("{"):])
    assert summary["steps"] == 2 and "greedy_success" in summary

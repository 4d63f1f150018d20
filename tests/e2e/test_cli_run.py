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


def rollart_run(tmp_path: Path, cfg: Path, *flags: str) -> subprocess.CompletedProcess:
    """``python -m rollart run CFG FLAGS`` from ``tmp_path``, with this checkout importable."""
    env = dict(os.environ, PYTHONPATH=f"{ROOT}{os.pathsep}{os.environ.get('PYTHONPATH', '')}")
    return subprocess.run([sys.executable, "-m", "rollart", "run", str(cfg), *flags], cwd=tmp_path,
                          env=env, capture_output=True, text=True, timeout=240)


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
    r = rollart_run(tmp_path, cfg)
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


def test_a_run_that_does_not_learn_says_so_and_how_to_go_on(tmp_path, tiny_model):
    """A map whose goal no move reaches: the final greedy success is 0, below the config's
    ``trainer.expect_success``; the run ends normally (exit 0), says so in one line and
    records it in summary.json."""
    run = new_run()
    cfg = tmp_path / "run.yaml"
    cfg.write_text(
        f"run: {run}\n"
        f"run_dir: {tmp_path / 'runs'}\n"
        f"model: {{path: '{tiny_model}'}}\n"
        "envs: {main: {type: frozenlake, args: {map: ['SH', 'HG']}, max_turns: 4}}\n"
        "rollout: {group_size: 4, batch_groups: 2, alpha: 1}\n"
        "trainer: {steps: 2, eval_groups: 1, expect_success: 0.9}\n")
    r = rollart_run(tmp_path, cfg, "--nats", "memory")
    assert r.returncode == 0, r.stdout + r.stderr
    lines = [x for x in r.stderr.splitlines() if "did not learn" in x]
    assert len(lines) == 1, r.stderr
    folder = tmp_path / "runs" / run
    assert ("greedy success 0.00 is below the 0.90 its config expects" in lines[0]
            and f"rollart run --resume {folder} --steps 4" in lines[0]), lines[0]
    below = json.loads((folder / "summary.json").read_text())["below_expected"]
    assert below["expected"] == 0.9 and below["greedy_success"] == 0.0
    assert below["last_sampled_success"] == [0.0, 0.0]


def test_an_env_that_fails_one_task_in_three_trains(tmp_path, tiny_model):
    """The start check samples task seeds: reset raising for one seed in three is one
    warning, and the run trains (the failed tasks' groups are replaced); an env failing
    every seed still stops the run before it starts (exit 2)."""
    run = new_run()
    cfg = tmp_path / "run.yaml"
    body = (f"run_dir: {tmp_path / 'runs'}\n"
            f"model: {{path: '{tiny_model}'}}\n"
            "rollout: {group_size: 2, batch_groups: 2, alpha: 1, same_seed_per_group: true}\n"
            "trainer: {steps: 2, eval_groups: 1}\n")
    cfg.write_text(f"run: {run}\n" + body + "envs: {main: {type: 'tests.envs.fake_envs:OneInThreeEnv', "
                   "max_turns: 3, reset_retries: 1}}\n")
    r = rollart_run(tmp_path, cfg, "--nats", "memory", "--quiet")
    assert r.returncode == 0, r.stdout + r.stderr
    warned = [x for x in r.stderr.splitlines() if "task seeds checked failed" in x]
    assert len(warned) == 1 and "2 of the 4" in warned[0] and "the run starts anyway" in warned[0], r.stderr
    summary = json.loads(r.stdout[r.stdout.index("{"):])
    assert summary["steps"] == 2
    rows = [json.loads(x) for x in (tmp_path / "runs" / run / "metrics.jsonl").read_text().splitlines()]
    assert rows[-1]["groups_lost"] >= 1, "a failed task's group was replaced"
    cfg.write_text(f"run: {new_run()}\n" + body + "envs: {main: {type: 'tests.envs.fake_envs:FailingEnv', "
                   "reset_retries: 0}}\n")
    r = rollart_run(tmp_path, cfg, "--nats", "memory", "--quiet")
    assert r.returncode == 2 and "every one of the 4 task seeds checked failed" in r.stderr, r.stderr

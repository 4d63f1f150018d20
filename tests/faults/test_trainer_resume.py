"""Kill -9 the training process mid-run, resume: no trajectory trained twice, none skipped."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[2]
pytestmark = pytest.mark.slow


def _config(tmp_path: Path, tiny_model: Path) -> Path:
    cfg = {
        "run": "resume", "run_dir": str(tmp_path / "runs"),
        "model": {"path": str(tiny_model)},
        "envs": {"main": {"type": "frozenlake", "max_turns": 4}},
        "rollout": {"group_size": 4, "batch_groups": 2, "alpha": 1, "ack_wait": 3},
        "trainer": {"steps": 8, "lr": 1e-3, "eval_groups": 1},
        "actors": {"trainer": {"handlers": {"on_completed": {"ack_wait": 3}}}},
    }
    p = tmp_path / "run.yaml"
    p.write_text(yaml.safe_dump(cfg))
    return p


def _rollart(*args: str, cwd: Path) -> subprocess.Popen:
    env = dict(os.environ, PYTHONPATH=f"{ROOT}{os.pathsep}{os.environ.get('PYTHONPATH', '')}")
    return subprocess.Popen([sys.executable, "-m", "rollart", *args], cwd=cwd, env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


def _steps(metrics: Path) -> int:
    if not metrics.exists():
        return 0
    return sum(1 for line in metrics.read_text().splitlines() if line.strip())


def test_kill_trainer_and_resume(tmp_path, tiny_model):
    cfg = _config(tmp_path, tiny_model)
    run_dir = tmp_path / "runs" / "resume"
    first = _rollart("run", str(cfg), "--quiet", cwd=tmp_path)
    deadline = time.monotonic() + 180
    while _steps(run_dir / "metrics.jsonl") < 3 and time.monotonic() < deadline:
        assert first.poll() is None, first.communicate()[0]
        time.sleep(0.1)
    assert _steps(run_dir / "metrics.jsonl") >= 3, "the first run made no progress"
    first.send_signal(signal.SIGKILL)
    first.wait()

    second = _rollart("run", "--resume", str(run_dir), "--quiet", cwd=tmp_path)
    out, _ = second.communicate(timeout=300)
    assert second.returncode == 0, out
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["steps"] == 8 and not summary["interrupted"]

    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == list(range(1, 9)), "one record per step, none repeated"
    ids = [t for r in rows for t in r["traj_ids"]]
    assert len(ids) == len(set(ids)) == 8 * 2 * 4, "no trajectory trained twice"
    groups = sorted({t.rsplit("-", 1)[0] for t in ids})
    assert groups == [f"g{i:06d}" for i in range(16)], "groups trained in order, none skipped"
    for r in rows:  # the α rule on recorded data: step v+1 uses min_version >= v - alpha
        assert all(mv >= (r["step"] - 1) - 1 for mv in r["traj_min_versions"])

    import torch

    state = torch.load(run_dir / "checkpoints" / "latest.pt", weights_only=False)
    assert set(state["trained"]) == set(ids) and state["backend"]["version"] == 8

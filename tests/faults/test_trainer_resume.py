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

from tests.waiting import until_sync

ROOT = Path(__file__).resolve().parents[2]
pytestmark = pytest.mark.slow


def _steps(metrics: Path) -> int:
    if not metrics.exists():
        return 0
    return sum(1 for line in metrics.read_text().splitlines() if line.strip())


def _journal_state(run_dir: Path) -> tuple[int, int] | None:
    """``(steps the durable state holds, steps the full checkpoint holds)``; None: not both yet."""
    from rollart.actors.trainer.files import RunFiles

    try:
        state = RunFiles(run_dir).load_state()
    except (FileNotFoundError, ValueError):
        return None
    if not state or not state.get("full"):
        return None
    return state["seq"], state["full"]["seq"]


def test_kill_between_full_checkpoints_replays_the_journal(tmp_path, tiny_model):
    """``full_checkpoint_every: 3``: kill -9 once the full checkpoint of step 3 is on disk and
    the durable state holds later steps; the resume loads step 3's full checkpoint, trains the
    journaled steps again (bit for bit: each replayed version's digest is the one published,
    so no weights file under a second name) and finishes: every trajectory id trained exactly
    once, every step once, the journal empty after the last (full) checkpoint."""
    steps = 8
    cfg = _small_config(tmp_path, tiny_model, run="journal", steps=steps,
                        trainer={"full_checkpoint_every": 3})
    run_dir, log = tmp_path / "runs" / "journal", tmp_path / "journal.log"
    proc = _start(tmp_path, log, "run", str(cfg), "--quiet")
    def between() -> bool:  # and the version the state holds published (its digest is checked)
        js = _journal_state(run_dir)
        return bool(js and js[1] == 3 and js[0] > 3
                    and (run_dir / "weights" / f"v{js[0]:06d}.safetensors").exists())

    _wait(between, 180, "the durable state past the full checkpoint of step 3", proc, log)
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    held, full = _journal_state(run_dir)
    assert full == 3 < held < 6, (held, full)  # between two full checkpoints
    assert sorted(int(p.stem) for p in (run_dir / "checkpoints" / "journal").glob("*.msgpack")) \
        == list(range(4, held + 1)), "the journal holds exactly the steps after the full checkpoint"
    published = _weights(run_dir)

    proc = _start(tmp_path, log, "--log-level", "INFO", "run", "--resume", str(run_dir), "--quiet")
    assert proc.wait(timeout=300) == 0, log.read_text()[-4000:]
    out = log.read_text().rsplit("=== rollart", 1)[-1]
    assert (f"resumed at version {held} with {2 * held} trained groups: the full checkpoint of "
            f"version 3 and {held - 3} journaled steps trained again") in out, out[-4000:]
    assert "holds other tensors" not in out, out[-4000:]
    if f"v{held:06d}.safetensors" in published:  # (unless a step ended between poll and kill)
        assert f"announcing the existing v{held:06d}.safetensors again" in out, out[-4000:]
    _assert_never_rewritten(published, run_dir)
    assert set(_weights(run_dir)) == {f"v{v:06d}.safetensors" for v in range(1, steps + 1)}

    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == list(range(1, steps + 1)), "one record per step"
    ids = [t for r in rows for t in r["traj_ids"]]
    assert len(ids) == len(set(ids)) == steps * 2 * 4, "every trajectory trained exactly once"
    assert sorted({t.rsplit("-", 1)[0] for t in ids}) == [f"g{i:06d}" for i in range(2 * steps)]
    assert any(r.get("full_checkpoint_version") == 6 and r["full_checkpoint_bytes"] > 0
               for r in rows), "the full checkpoint of step 6 is in a later step's row"
    assert _journal_state(run_dir) == (steps, steps)
    assert not list((run_dir / "checkpoints" / "journal").glob("*.msgpack"))


# -- weights by content: a published version's file is never rewritten ------------------


def _small_config(tmp_path: Path, tiny_model: Path, *, run: str, steps: int,
                  trainer: dict | None = None) -> Path:
    cfg = {
        "run": run, "run_dir": str(tmp_path / "runs"),
        "model": {"path": str(tiny_model)},
        "envs": {"main": {"type": "frozenlake", "max_turns": 4}},
        "rollout": {"group_size": 4, "batch_groups": 2, "alpha": 1, "ack_wait": 3},
        # one safetensors file per version: these tests check that a published file is
        # never rewritten, by its bytes and mtime (the default streamed layout's manifests
        # are named by their digest: tests/engines/test_weight_stream.py)
        "trainer": {"steps": steps, "lr": 1e-3, "eval_groups": 1, "keep_weights": 1000,
                    "sync": {"format": "file"}, **(trainer or {})},
        "actors": {"trainer": {"handlers": {"on_completed": {"ack_wait": 3}}}},
    }
    p = tmp_path / f"{run}.yaml"
    p.write_text(yaml.safe_dump(cfg))
    return p


def _start(tmp_path: Path, log: Path, *args: str) -> subprocess.Popen:
    env = dict(os.environ, PYTHONPATH=f"{ROOT}{os.pathsep}{os.environ.get('PYTHONPATH', '')}")
    with log.open("a") as out:
        out.write(f"\n=== rollart {' '.join(args)}\n")
        out.flush()
        return subprocess.Popen([sys.executable, "-m", "rollart", *args], cwd=tmp_path, env=env,
                                stdout=out, stderr=subprocess.STDOUT)


def _weights(run_dir: Path) -> dict[str, tuple[str, int]]:
    """name -> (sha256 of the bytes, mtime_ns) of every complete weights file."""
    import hashlib

    out = {}
    for p in sorted((run_dir / "weights").glob("v*.safetensors")):
        try:
            st = p.stat()
            out[p.name] = (hashlib.sha256(p.read_bytes()).hexdigest(), st.st_mtime_ns)
        except FileNotFoundError:
            pass
    return out


def _wait(cond, deadline: float, what: str, proc: subprocess.Popen | None = None,
          log: Path | None = None) -> None:
    until_sync(cond, deadline=deadline, what=what, step=0.02,
               abort=lambda: proc is not None and proc.poll() is not None
               and f"rollart exited ({proc.returncode}) while",
               state=lambda: log.read_text()[-4000:] if log else "")


def _assert_never_rewritten(seen: dict[str, tuple[str, int]], run_dir: Path) -> None:
    now = _weights(run_dir)
    for name, (sha, mtime) in seen.items():
        assert name in now, f"{name} was deleted"
        assert now[name] == (sha, mtime), f"{name} was rewritten"


def test_kill9_and_resume_three_times(tmp_path, tiny_model):
    """Three kill -9 / resume cycles in a row (right after a metrics row, and once the
    version is published), then a SIGINT: every resume makes progress, the SIGINT stops at
    once, the last resume finishes; no published weights file is ever rewritten; no
    trajectory is trained twice. Then the finished run: ``--resume`` (with or without
    ``--steps`` at most its steps) exits 0 at once and changes no file; ``--resume --steps
    N`` trains up to N steps in all, reusing (never rewriting) the published files, and N
    stays its target."""
    steps = 10  # more than the kill cycles can reach
    cfg = _small_config(tmp_path, tiny_model, run="k5", steps=steps)
    run_dir, log = tmp_path / "runs" / "k5", tmp_path / "k5.log"
    proc = _start(tmp_path, log, "run", str(cfg), "--quiet")
    seen: dict[str, tuple[str, int]] = {}
    t0 = time.monotonic()
    for cycle in range(3):
        start_rows = _steps(run_dir / "metrics.jsonl")
        target = start_rows + 1  # this process trains at least one step of its own
        _wait(lambda: _steps(run_dir / "metrics.jsonl") >= target, 120,
              f"step {target} in cycle {cycle}", proc, log)
        if cycle % 2:  # sometimes right after the metrics row, sometimes once it is published
            _wait(lambda: (run_dir / "weights" / f"v{target:06d}.safetensors").exists(), 60,
                  f"v{target} published", proc, log)
        proc.send_signal(signal.SIGKILL)
        proc.wait()
        _assert_never_rewritten(seen, run_dir)
        seen.update(_weights(run_dir))
        proc = _start(tmp_path, log, "run", "--resume", str(run_dir), "--quiet")
    # a resumed run stops cleanly on the first SIGINT
    target = _steps(run_dir / "metrics.jsonl") + 1
    _wait(lambda: _steps(run_dir / "metrics.jsonl") >= target, 120, "a step after resume", proc, log)
    proc.send_signal(signal.SIGINT)
    assert proc.wait(timeout=30) == 130, log.read_text()[-4000:]
    assert json.loads((run_dir / "summary.json").read_text())["interrupted"]
    _assert_never_rewritten(seen, run_dir)
    seen.update(_weights(run_dir))
    proc = _start(tmp_path, log, "run", "--resume", str(run_dir), "--quiet")
    assert proc.wait(timeout=180) == 0, log.read_text()[-4000:]
    _assert_never_rewritten(seen, run_dir)
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["steps"] == steps and not summary["interrupted"]
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == list(range(1, steps + 1)), "one record per step"
    ids = [t for r in rows for t in r["traj_ids"]]
    assert len(ids) == len(set(ids)), "no trajectory trained twice"
    # No group member is lost. A kill between an env node's publish of an outcome and its ack
    # (CI, ci49) runs the redelivered request again: the stored first copy is trained and the
    # rerun's other copy is acked as a rerun, never a conflict that trains neither.
    assert "two different completions" not in log.read_text(), log.read_text()[-4000:]
    assert len(ids) == steps * 2 * 4, (
        "group members lost", steps * 2 * 4 - len(ids),
        {k: v for k, v in rows[-1].items() if k.startswith("count_") or k == "groups_lost"})
    names = set(_weights(run_dir))
    assert {f"v{v:06d}.safetensors" for v in range(1, steps + 1)} <= names
    for r in rows:  # the α rule on recorded data: step v+1 uses min_version >= v - alpha
        assert all(mv >= (r["step"] - 1) - 1 for mv in r["traj_min_versions"])
    # The trainer's KV guard takes the previous process's records for its own, not a forger's.
    assert "by another client" not in log.read_text(), log.read_text()[-4000:]
    from rollart.actors.trainer.files import RunFiles

    state = RunFiles(run_dir).load_checkpoint()
    ledger = state["ledger"]  # every trained group closed, none lost
    assert ledger["trained"] == steps * 2 and ledger["lost"] == 0, ledger
    assert state["backend"]["version"] == steps
    print(f"3 kill/resume cycles + finish: {time.monotonic() - t0:.1f}s")

    # a finished run: says so at once, exits 0, touches nothing
    before = _weights(run_dir)
    ckpt = {p.name: p.stat().st_mtime_ns for p in (run_dir / "checkpoints").glob("full-*")}
    assert ckpt
    for extra in ([], ["--steps", str(steps)]):
        t1 = time.monotonic()
        done = _start(tmp_path, log, "run", "--resume", str(run_dir), "--quiet", *extra)
        assert done.wait(timeout=60) == 0, log.read_text()[-2000:]
        assert time.monotonic() - t1 < 30, "a finished run's resume starts nothing"
        assert "is finished" in log.read_text().rsplit("=== rollart", 1)[-1]
        assert _weights(run_dir) == before
        assert {p.name: p.stat().st_mtime_ns
                for p in (run_dir / "checkpoints").glob("full-*")} == ckpt

    # trained further: one more step, nothing rewritten, the new target kept
    more = _start(tmp_path, log, "run", "--resume", str(run_dir), "--quiet", "--steps",
                  str(steps + 1))
    assert more.wait(timeout=180) == 0, log.read_text()[-4000:]
    _assert_never_rewritten(before, run_dir)
    assert json.loads((run_dir / "summary.json").read_text())["steps"] == steps + 1
    assert yaml.safe_load((run_dir / "config.yaml").read_text())["trainer"]["steps"] == steps + 1
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == list(range(1, steps + 2))
    # the groups the finished run had admitted ahead (alpha) and handed back come back at
    # once: the first step does not wait out a redelivery delay (it waited 15-25 s while a
    # trainer handed its held trajectories back with a 30 s delay)
    assert rows[-1]["wait_s"] < 10, rows[-1]["wait_s"]
    ids = [t for r in rows for t in r["traj_ids"]]
    assert len(ids) == len(set(ids)), "no trajectory trained twice"
    again = _start(tmp_path, log, "run", "--resume", str(run_dir), "--quiet")
    assert again.wait(timeout=60) == 0
    assert "is finished" in log.read_text().rsplit("=== rollart", 1)[-1]

"""``rollart report`` from a real traced run: the time split, the trajectory Gantt, the trainer
step bars and the staleness histogram (rollart.app.trace_report)."""

from __future__ import annotations

import itertools
import json
import os
import shutil
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from rollart.config import RunConfig, convert
from rollart.app import trace_report as tr
from rollart.telemetry import tracing
from rollart.app.report import read_metrics, report
from tests.actors.sample_actors import new_run
from tests.telemetry.test_report import fake_run

ROOT = Path(__file__).resolve().parents[2]
STEPS, GROUP, GROUPS = 3, 4, 2
PNG = b"\x89PNG\r\n\x1a\n"


@pytest.fixture(scope="module")
async def traced_run(tiny_model, tmp_path_factory) -> Path:
    """A short training run (3 steps of 2 groups of 4 trajectories, alpha 1) on the in-process
    bus with ``tracing: {exporter: jsonl}``: its folder, with traces.jsonl and metrics.jsonl."""
    from rollart.app.run import train

    root = tmp_path_factory.mktemp("traced")
    cfg = convert({"run": new_run(), "run_dir": str(root), "model": {"path": str(tiny_model)},
                   "envs": {"main": {"type": "frozenlake", "max_turns": 4}},
                   "rollout": {"group_size": GROUP, "batch_groups": GROUPS, "alpha": 1},
                   "trainer": {"steps": STEPS, "eval_groups": 1},
                   "tracing": {"exporter": "jsonl"}}, RunConfig)
    run = root / cfg.run
    run.mkdir()
    stop = tracing.setup_tracing(cfg, "rollart-run", run)
    try:
        summary = await train(cfg, nats="memory", resume=False, quiet=True)
    finally:
        stop()  # flushes every span to traces.jsonl
    assert summary["version"] == STEPS and not summary.get("failed"), summary
    return run


def spans_named(run: Path, name: str) -> list[dict]:
    return [s for s in map(json.loads, (run / "traces.jsonl").read_text().splitlines())
            if s["name"] == name]


def test_time_split_sums_to_one_and_every_segment_lies_inside_its_trajectory(traced_run):
    traces = tr.load(traced_run)
    trajs = tr.trajectory_rows(traces)
    n = tr.summarize(traces, read_metrics(traced_run), trajs=trajs)
    assert n["trajectories"] == len(spans_named(traced_run, "trajectory")) == len(trajs)
    assert len(trajs) >= STEPS * GROUP * GROUPS and n["spans"] == len(traces.spans)
    assert abs(sum(n["split"].values()) - 1) < 1e-6
    assert abs(sum(n["split_s"].values()) - n["traj_s"]) < 1e-6
    # one process made every span here, so every generate is split into queued and engine
    assert n["split"]["engine"] > 0 and n["split"]["env_step"] > 0 and n["split"]["env_init"] > 0
    assert n["split"]["generate"] == 0 and all(0 <= f <= 1 for f in n["split"].values())
    assert n["processes"] == [("rollart-run", socket.gethostname(), str(os.getpid()))]
    assert n["hosts"] == [socket.gethostname()] and n["bad_lines"] == 0
    for row in tr.pick_rows(trajs, 10) + trajs:
        segs = row["segments"]
        assert segs and {k for k, _, _ in segs} <= set(tr.KINDS)
        assert segs[0][1] == row["start"] and segs[-1][2] == row["end"], row["traj_id"]
        for (k, s, e), nxt in zip(segs, segs[1:] + [None]):
            assert row["start"] <= s < e <= row["end"], (row["traj_id"], k, s, e)
            assert nxt is None or nxt[1] == e  # contiguous: they tile the span
    assert len(tr.pick_rows(trajs, 10)) == 10


def test_step_seconds_one_row_per_trainer_step(traced_run):
    steps = tr.step_rows(tr.load(traced_run))
    assert len(steps) == len(spans_named(traced_run, "trainer.step")) == STEPS
    assert [s["step"] for s in steps] == list(range(1, STEPS + 1))
    for s in steps:
        assert all(0 <= s[p] <= s["total"] for p in tr.STEP_PARTS) and s["train"] > 0
        assert abs(sum(s[p] for p in tr.STEP_PARTS) - s["total"]) < 1e-6
    assert all(a["end"] < b["end"] for a, b in itertools.pairwise(steps))


def test_staleness_counts_every_trained_sample(traced_run):
    n = tr.summarize(tr.load(traced_run), read_metrics(traced_run))
    st = n["staleness"]
    assert st["source"] in ("traces", "metrics") and st["unit"] == "samples"
    assert sum(st["counts"].values()) == STEPS * GROUP * GROUPS
    assert [s for s, _ in st["mean_by_step"]] == list(range(1, STEPS + 1))
    assert st["mean_by_step"][0][1] == 0  # the first step trains on version 0's samples


def test_staleness_from_the_trainer_step_spans_when_they_carry_it():
    def step(v, counts, start):
        return {"name": "trainer.step", "span_id": f"s{v}", "start_ns": start, "end_ns": start + 10**9,
                "attributes": {"version": v, "staleness": counts}}

    traces = tr.Traces([step(0, [4], 0), step(1, [1, 3], 2 * 10**9)])
    st = tr.summarize(traces)["staleness"]
    assert st == {"source": "traces", "unit": "samples", "counts": {0: 5, 1: 3},
                  "mean_by_step": [(1, 0.0), (2, 0.75)]}


def test_a_long_run_is_drawn_over_a_window_of_steps_and_a_short_one_whole():
    steps = [{"step": k, "end": 5.0 * k} for k in range(1, 21)]  # 20 steps of 5 s
    trajs = [{"start": 0.1 * i, "end": 0.1 * i + 2.0} for i in range(1000)]  # 2 s each
    lo, hi, what = tr.gantt_window(trajs, steps)
    assert (lo, hi, what) == (40, 60, "trainer steps 9-12 of 20")
    rows = tr.pick_rows(trajs, 48, (lo, hi))
    assert len(rows) == 48 and all(lo <= r["start"] < hi for r in rows)
    assert rows == sorted(rows, key=lambda r: r["start"])
    assert tr.gantt_window(trajs[:30], steps[:8]) == (0.0, 40.0, "the whole run")


def test_report_writes_the_figures_and_a_markdown_with_the_time_split(traced_run, tmp_path):
    _, files = report(traced_run, tmp_path / "out")
    names = {"report.txt", "report.png", "report.md", "gantt.png", "steps.png", "staleness.png"}
    assert set(files) == names and all(p.parent == tmp_path / "out" for p in files.values())
    for name in names - {"report.txt", "report.md"}:
        data = files[name].read_bytes()
        assert data[:8] == PNG and 10_000 < len(data) < 1_000_000, (name, len(data))
    md = files["report.md"].read_text()
    for name in names - {"report.txt", "report.md"}:
        assert f"]({name})" in md
    n = tr.summarize(tr.load(traced_run), read_metrics(traced_run))
    assert "| stage | seconds | share |" in md
    shares = [float(ln.rsplit("|", 2)[1].strip().rstrip("%")) for ln in md.splitlines()
              if ln.endswith("% |") and not ln.startswith("| total")]
    assert abs(sum(shares) - 100) < 0.5 and len(shares) >= 4
    assert f"| {tr.LABELS['engine']} | {n['split_s']['engine']:.2f} | {100 * n['split']['engine']:.1f}% |" in md
    assert f"{n['trajectories']} trajectories" in md and "## Trainer steps" in md
    assert "tracing: {exporter: jsonl}" not in md  # the hint is for runs without traces
    assert not list((tmp_path / "out").glob(".*tmp"))  # atomic writes leave nothing behind


def test_a_garbage_line_and_a_half_written_last_line_are_skipped(traced_run, tmp_path):
    lines = (traced_run / "traces.jsonl").read_bytes().splitlines(keepends=True)
    run = tmp_path / "r"
    run.mkdir()
    mid = len(lines) // 2
    bad = [b"not json\n", b"\xff\xfe\x00garbage\n", b'{"name": 1, "span_id": "x"}\n', b"[1, 2]\n"]
    (run / "traces.jsonl").write_bytes(b"".join(lines[:mid] + bad + lines[mid:]) + lines[0][:40])
    shutil.copy(traced_run / "metrics.jsonl", run / "metrics.jsonl")
    spans, skipped = tr.read_spans(run / "traces.jsonl")
    assert len(spans) == len(lines) and skipped == len(bad) + 1
    a, b = tr.summarize(tr.load(run)), tr.summarize(tr.load(traced_run))
    assert (a["trajectories"], a["steps"], a["split"]) == (b["trajectories"], b["steps"], b["split"])
    _, files = report(run)
    assert "gantt.png" in files and f"({len(bad) + 1} lines skipped)" in files["report.md"].read_text()


def test_a_run_without_traces_gets_markdown_and_staleness_and_the_hint(tmp_path):
    run = fake_run(tmp_path / "r", steps=30)
    _, files = report(run)
    assert set(files) == {"report.txt", "report.png", "report.md", "staleness.png"}
    assert not (run / "gantt.png").exists() and not (run / "steps.png").exists()
    assert files["staleness.png"].read_bytes()[:8] == PNG
    md = files["report.md"].read_text()
    assert "tracing: {exporter: jsonl}" in md and "gantt.png" in md and "](staleness.png)" in md
    assert "| staleness | steps |" in md  # metrics without per-sample versions: steps by max
    assert "](gantt.png)" not in md and "](steps.png)" not in md


def test_cli_report_prints_where_each_file_went(traced_run, tmp_path):
    out = tmp_path / "out"
    res = subprocess.run([sys.executable, "-m", "rollart", "report", str(traced_run), "--out", str(out)],
                         cwd=ROOT, capture_output=True, text=True, timeout=120, check=False)
    assert res.returncode == 0, res.stderr
    for name in ("report.txt", "report.png", "report.md", "gantt.png", "steps.png", "staleness.png"):
        assert f"wrote {out / name}" in res.stdout and (out / name).exists()
    assert "no traces.jsonl" not in res.stdout
    helptext = subprocess.run([sys.executable, "-m", "rollart", "report", "--help"], cwd=ROOT,
                              capture_output=True, text=True, timeout=60, check=False).stdout
    assert "Gantt" in helptext and "traces.jsonl" in helptext and "staleness" in helptext

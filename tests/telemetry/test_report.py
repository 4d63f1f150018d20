"""``rollart report``: a short summary table, its own files, the greedy result on the plot."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from rollart.app.report import plot, read_metrics, stride, table

ROOT = Path(__file__).resolve().parents[2]


def fake_run(path: Path, steps: int = 100, *, summary: bool = True, partial: bool = False) -> Path:
    path.mkdir(parents=True)
    lines = []
    for s in range(1, steps + 1):
        ok = min(1.0, s / 50)
        lines.append(json.dumps({"step": s, "version": float(s), "reward": ok, "success": ok,
                                 "staleness": 0.5, "loss": 0.01, "train_s": 0.5, "wait_s": 0.1,
                                 "wall_s": s * 0.7, "traj_generate_s": 0.3, "traj_step_s": 0.01}))
    text = "\n".join(lines) + "\n"
    if partial:  # a live run in the middle of writing a line
        text += '{"step": 101, "reward": 0.'
    (path / "metrics.jsonl").write_text(text)
    if summary:
        (path / "summary.json").write_text(json.dumps(
            {"run": path.name, "steps": steps, "version": steps, "greedy_success": 1.0,
             "greedy_reward": 1.0, "trajectories": 32}))
    (path / "learning.png").write_bytes(b"the live run's plot")
    os.utime(path / "learning.png", (1_000_000_000, 1_000_000_000))
    return path


def test_table_is_a_summary_of_first_best_last_and_every_10th(tmp_path):
    run = fake_run(tmp_path / "r")
    text = table(run)
    rows = [ln for ln in text.splitlines() if ln[:5].strip().isdigit()]
    assert len(rows) <= 12, text
    steps = [int(ln.split()[0]) for ln in rows]
    assert steps == [1, 10, 20, 30, 40, 50, 60, 70, 80, 90, 100]
    assert rows[0].endswith("first") and rows[-1].endswith("last")
    assert next(ln for ln in rows if ln.split()[0] == "50").endswith("best")  # first to reach 1.0
    assert "final greedy evaluation of v100: success 1.000, reward 1.000 over 32 trajectories" in text
    assert " 100.0" not in rows[-1].split()[1]  # versions are integers
    assert len(table(run, every=1).splitlines()) > 100


def test_stride_keeps_long_runs_short():
    assert [stride(n) for n in (10, 100, 200, 201, 1000, 5000)] == [10, 10, 10, 20, 50, 500]


def test_a_half_written_last_line_is_skipped(tmp_path):
    run = fake_run(tmp_path / "r", steps=5, summary=False, partial=True)
    assert [r["step"] for r in read_metrics(run)] == [1, 2, 3, 4, 5]
    assert "final greedy" not in table(run)


def test_plot_styles_and_greedy_marker(tmp_path, monkeypatch):
    import matplotlib

    matplotlib.use("Agg")
    from matplotlib.figure import Figure

    seen = []
    orig = Figure.savefig

    def spy(self, *a, **k):
        seen.append(self)
        return orig(self, *a, **k)

    monkeypatch.setattr(Figure, "savefig", spy)
    run = fake_run(tmp_path / "r")
    out = plot(run, tmp_path / "p.png")
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    ax = seen[0].axes[0]
    reward, success = ax.get_lines()[:2]
    assert (reward.get_linestyle(), reward.get_marker()) != (success.get_linestyle(), success.get_marker())
    labels = [t.get_text() for t in ax.get_legend().get_texts()]
    assert "greedy success (final eval) 1.00" in labels and "greedy reward (final eval) 1.00" in labels
    assert "final greedy" in seen[0]._suptitle.get_text()


@pytest.mark.parametrize("out", [None, "elsewhere"])
def test_cli_report_prints_a_short_table_and_leaves_learning_png_alone(tmp_path, out):
    run = fake_run(tmp_path / "r")
    png = run / "learning.png"
    before = (png.read_bytes(), png.stat().st_mtime_ns)
    cmd = [sys.executable, "-m", "rollart", "report", str(run)]
    if out:
        cmd += ["--out", str(tmp_path / out)]
    res = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert res.returncode == 0, res.stderr
    assert len(res.stdout.splitlines()) <= 20, res.stdout
    assert (png.read_bytes(), png.stat().st_mtime_ns) == before
    where = tmp_path / out if out else run
    assert (where / "report.png").stat().st_size > 1000 and "step" in (where / "report.txt").read_text()
    written = ["report.png", "report.txt", "report.md", "staleness.png"]  # no traces: no Gantt
    assert all(f"wrote {where / name}" in res.stdout for name in written)
    assert "tracing: {exporter: jsonl}" in res.stdout
    assert sorted(p.name for p in run.iterdir()) == sorted(
        ["metrics.jsonl", "summary.json", "learning.png"] + ([] if out else written))


def test_cli_report_of_a_folder_without_metrics_says_so(tmp_path):
    res = subprocess.run([sys.executable, "-m", "rollart", "report", str(tmp_path)], cwd=ROOT,
                         capture_output=True, text=True, timeout=60)
    assert res.returncode == 2 and "no metrics.jsonl" in res.stderr

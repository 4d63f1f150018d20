"""Plots and tables from a run folder's ``metrics.jsonl``."""

from __future__ import annotations

import json
from pathlib import Path


def read_metrics(run_path: str | Path) -> list[dict]:
    p = Path(run_path) / "metrics.jsonl"
    if not p.exists():
        raise FileNotFoundError(f"{p} does not exist: is {run_path} a rollart run folder?")
    rows = [json.loads(line) for line in p.read_text().splitlines() if line.strip()]
    last: dict[int, dict] = {}
    for r in rows:  # a resumed run may repeat a step: keep the latest record
        last[int(r["step"])] = r
    return [last[k] for k in sorted(last)]


def plot(run_path: str | Path, out: str | Path | None = None) -> Path:
    """Reward and success against steps and against wall time, as one PNG."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = read_metrics(run_path)
    out = Path(out or Path(run_path) / "learning.png")
    steps = [r["step"] for r in rows]
    wall = [r.get("wall_s", 0.0) for r in rows]
    fig, axes = plt.subplots(1, 3, figsize=(15, 4))
    for ax, x, label in ((axes[0], steps, "step"), (axes[1], wall, "wall time (s)")):
        ax.plot(x, [r["reward"] for r in rows], label="mean reward")
        ax.plot(x, [r["success"] for r in rows], label="success (sampled)")
        ax.set_xlabel(label)
        ax.grid(alpha=0.3)
        ax.legend()
    stages = ["traj_generate_s", "traj_step_s", "traj_reset_s", "traj_wait_s", "train_s", "wait_s"]
    bottom = [0.0] * len(rows)
    for s in stages:
        vals = [r.get(s, 0.0) for r in rows]
        axes[2].bar(steps, vals, bottom=bottom, label=s.removeprefix("traj_").removesuffix("_s"))
        bottom = [b + v for b, v in zip(bottom, vals)]
    axes[2].set_xlabel("step")
    axes[2].set_ylabel("seconds")
    axes[2].set_title("time per step (trajectory stages are per-trajectory means)")
    axes[2].legend(fontsize=7)
    fig.suptitle(Path(run_path).name)
    fig.tight_layout()
    fig.savefig(out, dpi=90)
    plt.close(fig)
    return out


def table(run_path: str | Path, every: int = 1) -> str:
    rows = read_metrics(run_path)
    head = f"{'step':>5} {'reward':>7} {'success':>7} {'stale':>5} {'loss':>8} {'train_s':>7} {'wait_s':>6} {'wall_s':>7}"
    lines = [head]
    for r in rows[::every]:
        lines.append(f"{r['step']:>5} {r['reward']:>7.3f} {r['success']:>7.3f} {r['staleness']:>5.2f} "
                     f"{r.get('loss', 0):>8.4f} {r['train_s']:>7.2f} {r['wait_s']:>6.2f} {r['wall_s']:>7.1f}")
    return "\n".join(lines)

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
    fig, axes = plt.subplots(1, 4, figsize=(19, 4))
    for ax, x, label in ((axes[0], steps, "step"), (axes[1], wall, "wall time (s)")):
        ax.plot(x, [r["reward"] for r in rows], label="mean reward")
        ax.plot(x, [r["success"] for r in rows], label="success (sampled)")
        ax.set_xlabel(label)
        ax.grid(alpha=0.3)
        ax.legend()
    _stacked(axes[2], steps, rows, {"train_s": "train", "wait_s": "waiting for a batch",
                                    "publish_s": "checkpoint + publish"},
             "trainer: seconds per step")
    _stacked(axes[3], steps, rows, {"traj_generate_s": "generate", "traj_step_s": "env step",
                                    "traj_reset_s": "env reset", "traj_reward_s": "reward",
                                    "traj_wait_s": "lock-step wait"},
             "one trajectory: seconds by stage (mean)")
    fig.suptitle(Path(run_path).name)
    fig.tight_layout()
    fig.savefig(out, dpi=90)
    plt.close(fig)
    return out


def _stacked(ax, steps, rows, series: dict[str, str], title: str) -> None:
    bottom = [0.0] * len(rows)
    for key, label in series.items():
        vals = [r.get(key, 0.0) for r in rows]
        if not any(vals):
            continue
        ax.bar(steps, vals, bottom=bottom, label=label, width=1.0)
        bottom = [b + v for b, v in zip(bottom, vals)]
    ax.set_xlabel("step")
    ax.set_title(title, fontsize=10)
    ax.legend(fontsize=7)


def table(run_path: str | Path, every: int = 1) -> str:
    rows = read_metrics(run_path)
    head = f"{'step':>5} {'reward':>7} {'success':>7} {'stale':>5} {'loss':>8} {'train_s':>7} {'wait_s':>6} {'wall_s':>7}"
    lines = [head]
    for r in rows[::every]:
        lines.append(f"{r['step']:>5} {r['reward']:>7.3f} {r['success']:>7.3f} {r['staleness']:>5.2f} "
                     f"{r.get('loss', 0):>8.4f} {r['train_s']:>7.2f} {r['wait_s']:>6.2f} {r['wall_s']:>7.1f}")
    return "\n".join(lines)

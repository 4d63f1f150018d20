"""Plots and tables from a run folder's ``metrics.jsonl`` (and ``summary.json``).

:func:`plot` draws reward and success (distinct line styles and markers, so equal curves stay
visible) with the final greedy evaluation marked; :func:`table` is a summary (first, best, last
and every 10th step); :func:`report` writes both under a folder of its own choosing, so that
``rollart report`` never touches the ``learning.png`` a live run keeps rewriting, with
``report.md`` and the figures of :mod:`rollart.app.trace_report` (the trajectory Gantt
and trainer step bars from ``traces.jsonl``, the staleness histogram). All of them read a run
that is still being written (a half-written last line is skipped).
"""

from __future__ import annotations

import json
import math
import os
from pathlib import Path

from rollart.actors.trainer.files import read_evals
from rollart.app import trace_report as tr
from rollart.app.trace_report import LABELS, STEP_PARTS, save_png
from rollart.telemetry import sandboxes as sandbox_stats


def read_summary(run_path: str | Path) -> dict:
    """``summary.json`` of a finished run, or ``{}`` (running, or not readable yet)."""
    try:
        data = json.loads((Path(run_path) / "summary.json").read_text())
    except (OSError, ValueError):
        return {}
    return data if isinstance(data, dict) else {}


def read_metrics(run_path: str | Path) -> list[dict]:
    p = Path(run_path) / "metrics.jsonl"
    if not p.exists():
        raise FileNotFoundError(f"{p} does not exist: is {run_path} a rollart run folder?")
    rows = []
    for line in p.read_text().splitlines():
        if not line.strip():
            continue
        try:
            rows.append(json.loads(line))
        except ValueError:  # the line a live run is writing right now
            continue
    rows = [r for r in rows if isinstance(r, dict) and "step" in r]
    last: dict[int, dict] = {}
    for r in rows:  # a resumed run may repeat a step: keep the latest record
        last[int(r["step"])] = r
    return [last[k] for k in sorted(last)]


def plot(run_path: str | Path, out: str | Path | None = None, *,
         summary: dict | None = None) -> Path:
    """Reward and success against steps and against wall time, plus the time split, as one PNG.

    ``out`` defaults to ``<run>/learning.png``. ``summary`` is the run's final summary (default:
    its ``summary.json`` when there is one): its greedy evaluation is marked at the last step.
    The file is replaced atomically (a reader never sees half a PNG)."""
    import matplotlib  # optional: the train extra

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt  # optional: the train extra

    rows = read_metrics(run_path)
    out = Path(out or Path(run_path) / "learning.png")
    summary = read_summary(run_path) if summary is None else summary
    evals = [e for e in read_evals(run_path) if "greedy_success" in e]
    steps = [r["step"] for r in rows]
    wall = [r.get("wall_s", 0.0) for r in rows]
    fig, axes = plt.subplots(1, 4, figsize=(19, 4))
    every = max(1, len(rows) // 25)  # markers on about 25 points, so curves stay readable
    for ax, x, label in ((axes[0], steps, "step"), (axes[1], wall, "wall time (s)")):
        # reward and success are often equal (reward 1 exactly on success): a solid line with
        # dots under a dashed line with crosses keeps both visible
        ax.plot(x, [r.get("reward", 0.0) for r in rows], label="mean reward", color="tab:blue",
                linestyle="-", linewidth=2.2, marker="o", markersize=4, markevery=every, zorder=2)
        ax.plot(x, [r.get("success", 0.0) for r in rows], label="success (sampled)",
                color="tab:orange", linestyle="--", linewidth=1.6, marker="x", markersize=6,
                markevery=(every // 2, every), zorder=3)  # markers between the reward's
        _plot_evals(ax, evals, "step" if label == "step" else "wall_s")
        _mark_greedy(ax, (x[-1] if x else 0), summary)
        ax.set_xlabel(label)
        ax.grid(alpha=0.3)
        leg = ax.legend(fontsize=8)
        for h in getattr(leg, "legend_handles", getattr(leg, "legendHandles", [])):
            if hasattr(h, "set_sizes"):  # the greedy markers at legend size
                h.set_sizes([70])
    _stacked(axes[2], steps, rows, {"train_s": "train", "wait_s": "waiting for a batch",
                                    "publish_s": "checkpoint + publish"},
             "trainer: seconds per step")
    _stacked(axes[3], steps, rows, {"traj_generate_s": "generate", "traj_step_s": "env step",
                                    "traj_reset_s": "env reset", "traj_reward_s": "reward",
                                    "traj_wait_s": "lock-step wait"},
             "one trajectory: seconds by stage (mean)")
    title = Path(run_path).resolve().name
    g = _greedy(summary)
    if g:
        title += "   final greedy: " + ", ".join(f"{k} {v:.2f}" for k, v in g.items())
    fig.suptitle(title)
    fig.tight_layout()
    return save_png(fig, out, dpi=90)


def _plot_evals(ax, evals: list[dict], xkey: str) -> None:
    """The held-out evaluations of ``trainer.eval_every`` (greedy and sampled success)."""
    if not evals:
        return
    x = [e.get(xkey, 0.0) for e in evals]
    ax.plot(x, [e["greedy_success"] for e in evals], color="tab:red", linestyle=":",
            marker="s", markersize=5, zorder=4, label="greedy success (held-out eval)")
    ax.plot(x, [e["sampled_success"] for e in evals], color="tab:purple", linestyle=":",
            marker="^", markersize=5, zorder=4, label="sampled success (held-out eval)")


def evals_table(run_path: str | Path) -> list[str]:
    """Lines of the held-out evaluations (``trainer.eval_every``), [] when the run has none."""
    evals = read_evals(run_path)
    if not evals:
        return []
    lines = [f"held-out evaluations (trainer.eval_every), {len(evals)}:",
             f"{'version':>7} {'greedy':>7} {'sampled':>7} {'served':>9} {'eval_s':>7} {'wall_s':>7}"]
    for e in evals:
        if "eval_error" in e:
            lines.append(f"{e['version']:>7}  failed: {e['eval_error']}")
            continue
        lo, hi = (e.get("served") or [e["version"]] * 2)[:2]
        served = f"v{lo}" if lo == hi else f"v{lo}-{hi}"
        lines.append(f"{e['version']:>7} {e['greedy_success']:>7.3f} {e['sampled_success']:>7.3f} "
                     f"{served:>9} {e.get('eval_s', 0.0):>7.1f} {e.get('wall_s', 0.0):>7.1f}")
    return lines


def _greedy(summary: dict | None) -> dict[str, float]:
    """``{"success": .., "reward": ..}`` of the final greedy evaluation in a summary."""
    out = {}
    for k in ("success", "reward"):
        v = (summary or {}).get(f"greedy_{k}")
        if isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v):
            out[k] = float(v)
    return out


def _mark_greedy(ax, x: float, summary: dict | None) -> None:
    g = _greedy(summary)
    if "success" in g:
        ax.scatter([x], [g["success"]], marker="*", s=220, color="tab:red", edgecolor="black",
                   zorder=5, label=f"greedy success (final eval) {g['success']:.2f}")
    if "reward" in g:
        # a hollow diamond around the star: both stay visible when they are equal
        ax.scatter([x], [g["reward"]], marker="D", s=420, facecolor="none", edgecolor="tab:green",
                   linewidth=2, zorder=6, label=f"greedy reward (final eval) {g['reward']:.2f}")


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


def stride(n: int) -> int:
    """Steps between rows of the summary table of ``n`` steps: 10, or more (20, 50, 100, 200,
    500, ...) so that it stays at about 20 rows at most."""
    s = 10
    while n > 20 * s:
        s = s * 5 // 2 if str(s)[0] == "2" else s * 2  # 10, 20, 50, 100, 200, 500, ...
    return s


def _best(rows: list[dict]) -> dict | None:
    """The step with the highest sampled success, ties broken by reward, then the earliest."""
    if not rows:
        return None
    return max(rows, key=lambda r: (r.get("success", 0.0), r.get("reward", 0.0), -r["step"]))


def table(run_path: str | Path, every: int | None = None, *, summary: dict | None = None) -> str:
    """A summary of a run: the first, best and last steps and every ``every``-th (default
    :func:`stride`: 10 for up to 200 steps), then the final greedy evaluation if there is one.
    ``every=1`` lists every step."""
    rows = read_metrics(run_path)
    summary = read_summary(run_path) if summary is None else summary
    if not rows:
        return f"{run_path}: no step recorded yet"
    n = every if every and every > 0 else stride(len(rows))
    best = _best(rows)
    first, last = rows[0]["step"], rows[-1]["step"]
    notes: dict[int, list[str]] = {}
    notes.setdefault(first, []).append("first")
    notes.setdefault(best["step"], []).append("best")
    notes.setdefault(last, []).append("last")
    keep = [r for r in rows if r["step"] in notes or r["step"] % n == 0]
    head = (f"{'step':>5} {'version':>7} {'reward':>7} {'success':>7} {'stale':>5} {'loss':>8} "
            f"{'train_s':>7} {'wait_s':>6} {'wall_s':>7}  ")
    lines = [head.rstrip()]
    for r in keep:
        v = r.get("version", r["step"])
        lines.append((f"{r['step']:>5} {int(v) if isinstance(v, (int, float)) else v!s:>7} "
                      f"{r.get('reward', 0.0):>7.3f} {r.get('success', 0.0):>7.3f} "
                      f"{r.get('staleness', 0.0):>5.2f} {r.get('loss', 0.0):>8.4f} "
                      f"{r.get('train_s', 0.0):>7.2f} {r.get('wait_s', 0.0):>6.2f} "
                      f"{r.get('wall_s', 0.0):>7.1f}  {', '.join(notes.get(r['step'], []))}").rstrip())
    shown = "every step" if n == 1 else f"first, best, last and every {n}th"
    lines.append(f"({len(rows)} steps; {shown}; all of them: --every 1)")
    share = env_init_share(rows)
    if share is not None:
        lines.append(f"env init (the env, its sandbox, the reset): {100 * share:.1f}% of trajectory "
                     f"time (the paper: {100 * PAPER_ENV_INIT:.0f}% of a healthy step)")
    if boxes := sandboxes_line(rows):
        lines.append(boxes)
    g = _greedy(summary)
    if g:
        extra = f" over {summary['trajectories']} trajectories" if summary.get("trajectories") else ""
        at = f" of v{int(summary['version'])}" if isinstance(summary.get("version"), (int, float)) else ""
        lines.append(f"final greedy evaluation{at}: " + ", ".join(f"{k} {v:.3f}" for k, v in g.items())
                     + extra)
    lines += evals_table(run_path)
    if summary.get("failed"):
        lines.append(f"run stopped: {summary['failed']}")
    elif summary.get("interrupted"):
        lines.append("run interrupted before its last step")
    return "\n".join(lines)


def _write_text(path: Path, text: str) -> Path:
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    tmp.write_text(text)
    os.replace(tmp, path)
    return path


NO_TRACES = ("No `traces.jsonl` in this run folder: run with `tracing: {exporter: jsonl}` in the "
             "config for the trajectory Gantt (`gantt.png`) and the trainer step bars "
             "(`steps.png`); the staleness histogram below comes from `metrics.jsonl`.")


def report(run_path: str | Path, out_dir: str | Path | None = None, *,
           every: int | None = None) -> tuple[str, dict[str, Path]]:
    """Write into ``out_dir`` (default: the run folder; never ``learning.png``):
    ``report.txt`` (the :func:`table`), ``report.png`` (the :func:`plot`), ``report.md`` (the
    summary, the time split, per-step seconds and links to the figures) and the figures of
    :mod:`rollart.app.trace_report`: ``staleness.png`` always, ``gantt.png`` and
    ``steps.png`` when the run has a ``traces.jsonl``. Returns (table, {file name: path})."""
    run_path = Path(run_path)
    out = Path(out_dir) if out_dir is not None else run_path
    out.mkdir(parents=True, exist_ok=True)
    summary = read_summary(run_path)
    text = table(run_path, every, summary=summary)
    files = {"report.txt": _write_text(out / "report.txt", text + "\n"),
             "report.png": plot(run_path, out / "report.png", summary=summary)}
    rows = read_metrics(run_path)
    traces = tr.load(run_path)
    trajs = tr.trajectory_rows(traces) if traces is not None else []
    steps = tr.step_rows(traces) if traces is not None else []
    numbers = {**tr.summarize(traces, rows, trajs=trajs, steps=steps),
               "env_init_share": env_init_share(rows), "sandboxes": sandboxes_line(rows)}
    name = run_path.resolve().name
    if trajs:
        files["gantt.png"] = tr.plot_gantt(trajs, steps, out / "gantt.png", title=name,
                                           wall_s=numbers["wall_s"])
    if trajs or steps:
        files["steps.png"] = tr.plot_steps(numbers, out / "steps.png", title=name)
    files["staleness.png"] = tr.plot_staleness(numbers, out / "staleness.png", title=name)
    md = markdown(name, summary, text, numbers, files, traced=traces is not None)
    files["report.md"] = _write_text(out / "report.md", md)
    return text, files


TRAJ_STAGES = ("generate", "step", "reset", "reward", "wait")
"""The stages of ``RolloutCompleted.timings``, as ``traj_<stage>_s`` in ``metrics.jsonl``."""
PAPER_ENV_INIT = 0.15
"""The paper's env init share of a healthy step (15%; 78% of a step with env failures)."""


def env_init_share(rows: list[dict]) -> float | None:
    """Env init's share of trajectory time over the run (``traj_reset_s`` against the sum of
    the ``traj_*_s`` stages, every step weighted alike): building the env, the sandbox it
    takes, and its reset. None when no step recorded trajectory timings."""
    reset = sum(float(r.get("traj_reset_s", 0.0)) for r in rows)
    total = sum(float(r.get(f"traj_{k}_s", 0.0)) for r in rows for k in TRAJ_STAGES)
    return reset / total if total > 0 else None


def sandboxes_line(rows: list[dict]) -> str:
    """The env hosts' sandbox pools as the last step that saw them recorded them (counts
    since each host's process started), or ``""`` in a run without sandboxes."""
    last = next((r for r in reversed(rows) if any(k.startswith("sandbox_") for k in r)), None)
    if last is None:
        return ""
    return (f"sandboxes (env hosts, at step {last['step']}): "
            + sandbox_stats.describe({k: v for k, v in last.items() if k.startswith("sandbox_")}))


def _cell(v) -> str:
    if isinstance(v, float):
        return f"{v:.4g}"
    return str(v).replace("|", "\\|")


def markdown(name: str, summary: dict, text: str, numbers: dict, files: dict[str, Path], *,
             traced: bool) -> str:
    """``report.md``: the run's summary, table, time split and per-step seconds, and links to
    the figures in ``files`` (all in report.md's folder)."""
    md = [f"# rollart report: {name}", ""]
    scalars = {k: v for k, v in summary.items() if isinstance(v, (str, int, float, bool))}
    if scalars:
        md += ["## Summary", "", "| | |", "|---|---|"]
        md += [f"| {k} | {_cell(v)} |" for k, v in scalars.items()] + [""]
    md += ["## Learning", "", "```", text, "```", "", "![reward and success](report.png)", ""]
    md += ["## Where trajectory time went", ""]
    if numbers.get("env_init_share") is not None:
        md += [(f"Env init (building the env and the sandbox it takes, and its reset): "
                f"{100 * numbers['env_init_share']:.1f}% of trajectory time, from `metrics.jsonl` "
                f"(the paper: {100 * PAPER_ENV_INIT:.0f}% of a healthy step)."), ""]
    if numbers.get("sandboxes"):
        md += [f"{numbers['sandboxes'][0].upper()}{numbers['sandboxes'][1:]}.", ""]
    if not traced:
        md += [NO_TRACES, ""]
    else:
        n = numbers
        md += [(f"From `traces.jsonl`: {n['spans']} spans ({n['bad_lines']} lines skipped) from "
                f"{len(n['processes'])} process(es) on {len(n['hosts'])} host(s) "
                f"({', '.join(n['hosts'])}); {n['trajectories']} trajectories, "
                f"{n['traj_s']:.1f} s of trajectory time over {n['wall_s']:.1f} s of wall time."), ""]
        md += ["| stage | seconds | share |", "|---|---:|---:|"]
        md += [f"| {LABELS[k]} | {n['split_s'][k]:.2f} | {100 * f:.1f}% |"
               for k, f in n["split"].items() if n["split_s"][k] > 0]
        md += [f"| total | {n['traj_s']:.2f} | 100.0% |", ""]
        if n["admission_mean_s"] is not None:
            md += [(f"Before starting, a trajectory waited {n['admission_mean_s']:.3f} s on average "
                    f"for an EnvManager (in JetStream; not in the split above)."), ""]
        if "gantt.png" in files:
            md += ["![trajectory Gantt](gantt.png)", ""]
    if numbers["steps"]:
        steps = numbers["steps"]
        k = stride(len(steps))
        keep = [s for i, s in enumerate(steps)
                if len(steps) <= 20 or i in (0, len(steps) - 1) or s["step"] % k == 0]
        parts = [p for p in STEP_PARTS if p != "other"]
        md += ["## Trainer steps (seconds)", "",
               "| step | " + " | ".join(parts) + " | total |", "|---:|" + "---:|" * (len(parts) + 1)]
        md += [f"| {s['step']} | " + " | ".join(f"{s[p]:.3f}" for p in parts) + f" | {s['total']:.3f} |"
               for s in keep]
        mean = {p: sum(s[p] for s in steps) / len(steps) for p in [*parts, "total"]}
        md += ["| mean | " + " | ".join(f"{mean[p]:.3f}" for p in parts) + f" | {mean['total']:.3f} |"]
        if len(keep) < len(steps):
            md += ["", f"({len(steps)} steps: first, last and every {k}th shown; the mean is over all)"]
        md += [""] + (["![trainer step bars](steps.png)", ""] if "steps.png" in files else [])
    st = numbers["staleness"]
    md += ["## Staleness", ""]
    if st["counts"]:
        src = {"traces": "the `trainer.step` spans", "metrics": "`metrics.jsonl` (per sample)",
               "metrics_max": "`metrics.jsonl` (steps by their max staleness)"}[st["source"]]
        md += [f"From {src}:", "", f"| staleness | {st['unit']} |", "|---:|---:|"]
        md += [f"| {k} | {c} |" for k, c in st["counts"].items()] + [""]
    md += ["![staleness](staleness.png)", ""]
    return "\n".join(md)

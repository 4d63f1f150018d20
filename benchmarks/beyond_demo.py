"""RL beyond its demonstrator: SFT on a demonstrator's episodes, then RL, against RL alone.

::

    python benchmarks/beyond_demo.py --seeds 3 --write                 # random-map FrozenLake
    python benchmarks/beyond_demo.py --seeds 1 --rl-steps 60 --no-cold   # a quick look
    python benchmarks/beyond_demo.py --seeds 2 --all-demos   # SFT on failed episodes too

Per seed ``s``, as a user runs it, each a fresh ``python -m rollart`` process:

1. ``rollart demos CONFIG --policy POLICY`` plays ``--demos`` episodes on training maps (task
   seeds 5,000,000 + 10,000 s + i: never an evaluation's) and the same demonstrator plays the
   run's held-out maps (seeds 1,000,000 + 1000 s + i, the ones ``trainer.eval_groups`` uses),
   which is the bar to beat;
2. ``rollart sft CONFIG --data demos.jsonl --success-only`` (``--sft-steps`` x ``--sft-batch``;
   ``--all-demos``: the failed episodes too), with a greedy evaluation on the same held-out maps
   and a sampled one (``--eval-sampled``: ``rollout.group_size`` episodes on each of the
   config's ``trainer.eval_sampled_groups`` first tasks, as the RL run's evaluations sample);
3. ``rollart run CONFIG --init-from <sft>`` (*warm*, ``configs/frozenlake-warm.yaml``) and,
   unless ``--no-cold``, RL alone (*cold*, ``--cold-config``: ``configs/frozenlake-random.yaml``,
   its cold-start recipe), with ``trainer.eval_every`` so that held-out greedy success is known
   along the way; seed s is the sampling seed and ``rollout.seed = 1000 s``.

A warm run's clock starts with its demonstrations: its wall time is demos + SFT + RL. It
prints JSON; ``--write`` stores ``benchmarks/results/beyond_demo_<label>.json``, a plot of
held-out greedy success against wall time (median and min-max band over seeds, the
demonstrator's line) as ``beyond_demo_<label>.png`` and the README section
``beyond_demo:<label>``.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import yaml

from common import RESULTS, ROOT, child_env, labelled, machine, render, sayer, store, table
from quickstart_seeds import merged  # a config with overrides on top

EVAL_OFFSET = 1_000_000  # the scheduler's held-out seeds (rollart.node.build.rollout_actors)
DEMO_OFFSET = 5_000_000


say = sayer("beyond-demo")


def rollart(args: list[str], work: Path, timeout: float) -> subprocess.CompletedProcess:
    env = child_env()
    r = subprocess.run([sys.executable, "-m", "rollart", *args], cwd=work, env=env,
                       capture_output=True, text=True, timeout=timeout)
    if r.returncode != 0:
        raise RuntimeError(f"rollart {' '.join(args)} exited {r.returncode}:\n{r.stderr[-2000:]}")
    return r


def read_jsonl(path: Path) -> list[dict]:
    return [json.loads(x) for x in path.read_text().splitlines() if x.strip()] if path.exists() else []


def play(config: Path, policy: str, episodes: int, first_seed: int, out: Path, work: Path) -> dict:
    t0 = time.perf_counter()
    rollart(["demos", str(config), "--policy", policy, "--episodes", str(episodes),
             "--seed", str(first_seed), "--out", str(out), "--quiet"], work, 900)
    rows = read_jsonl(out)
    return {"episodes": len(rows), "success": sum(bool(r.get("success")) for r in rows) / max(1, len(rows)),
            "wall_s": round(time.perf_counter() - t0, 1)}


def rl_run(config: Path, name: str, seed: int, over: dict, work: Path, timeout: float,
           init_from: Path | None, nats: str | None) -> dict:
    raw = yaml.safe_load(config.read_text())
    cfg = merged(raw, merged(over, {"actors": {"generate": {"args": {"seed": seed}}},
                                    "rollout": {"seed": 1000 * seed}}))
    cfg |= {"run": name, "run_dir": str(work / "runs")}
    path = work / f"{name}.yaml"
    path.write_text(yaml.safe_dump(cfg, sort_keys=False))
    args = ["run", str(path), "--quiet"] + (["--init-from", str(init_from)] if init_from else [])
    if nats:
        args += ["--nats", nats]
    t0 = time.perf_counter()
    rollart(args, work, timeout)
    folder = work / "runs" / name
    summary = json.loads((folder / "summary.json").read_text())
    evals = [e for e in read_jsonl(folder / "eval.jsonl") if "eval_error" not in e]
    metrics = read_jsonl(folder / "metrics.jsonl")
    return {"greedy_success": summary.get("greedy_success"), "wall_s": round(float(summary["wall_s"]), 1),
            "process_s": round(time.perf_counter() - t0, 1), "steps": summary.get("steps"),
            "evals": [{"version": e["version"], "wall_s": round(float(e["wall_s"]), 1),
                       "greedy_success": e["greedy_success"], "sampled_success": e["sampled_success"]}
                      for e in evals],
            "sampled": [round(float(x.get("success", 0.0)), 3) for x in metrics]}


def one_seed(args, seed: int, work: Path) -> dict:
    config = Path(args.config)
    tag = f"s{seed}-{uuid.uuid4().hex[:4]}"
    out: dict = {"seed": seed}
    bar = play(config, args.policy, args.eval_groups, EVAL_OFFSET + 1000 * seed,
               work / f"heldout-{tag}.jsonl", work)
    out["demonstrator_heldout"] = bar
    say(f"seed {seed}: {args.policy} on {bar['episodes']} held-out maps: {bar['success']:.3f}")
    over = {"trainer": {"eval_every": args.eval_every, "eval_groups": args.eval_groups}}
    if args.rl_steps:
        over = merged(over, {"trainer": {"steps": args.rl_steps}})
    if args.rl_lr:
        over = merged(over, {"trainer": {"lr": args.rl_lr}})
    if args.rl_entropy is not None:
        over = merged(over, {"trainer": {"entropy_coef": args.rl_entropy}})
    demos = play(config, args.policy, args.demos, DEMO_OFFSET + 10_000 * seed, work / f"demos-{tag}.jsonl", work)
    out["demos"] = demos
    sft_dir = work / "runs" / f"sft-{tag}"
    t0 = time.perf_counter()
    raw = yaml.safe_load(config.read_text())
    sampled = min(raw.get("trainer", {}).get("eval_sampled_groups") or args.eval_groups, args.eval_groups)
    sft_config = work / f"sft-{tag}.yaml"  # rollout.seed as the RL runs': the same held-out tasks
    sft_config.write_text(yaml.safe_dump(merged(raw, {"rollout": {"seed": 1000 * seed}}), sort_keys=False))
    sft_args = ["sft", str(sft_config), "--data", str(work / f"demos-{tag}.jsonl"), "--steps", str(args.sft_steps),
                "--batch", str(args.sft_batch), "--eval", str(args.eval_groups),
                "--eval-sampled", str(sampled), "--out", str(sft_dir), "--quiet"]
    if args.sft_lr:
        sft_args += ["--lr", str(args.sft_lr)]
    if not args.all_demos:
        sft_args.append("--success-only")
    rollart(sft_args, work, 1800)
    sft = json.loads((sft_dir / "summary.json").read_text())
    out["sft"] = {"wall_s": round(time.perf_counter() - t0, 1), "final_loss": sft["final_loss"],
                  "final_token_acc": sft["final_token_acc"],
                  "heldout_greedy": sft.get("eval", {}).get("greedy_success"),
                  "heldout_sampled": sft.get("eval", {}).get("sampled_success")}
    say(f"seed {seed}: SFT {out['sft']['wall_s']} s, held-out greedy {out['sft']['heldout_greedy']}, "
        f"sampled {out['sft']['heldout_sampled']}")
    arms = [("warm", config, sft_dir)] + ([] if args.no_cold else [("cold", Path(args.cold_config), None)])
    for arm, cfg, init in arms:
        try:
            out[arm] = rl_run(cfg, f"{arm}-{tag}", seed, over, work, args.timeout, init, args.nats)
        except (subprocess.TimeoutExpired, RuntimeError) as e:  # the other arms and seeds still count
            out[f"{arm}_error"] = str(e)[-500:]
            say(f"seed {seed}: {arm} RL failed: {str(e)[-300:]}")
            continue
        say(f"seed {seed}: {arm} RL: held-out greedy {out[arm]['greedy_success']} in {out[arm]['wall_s']} s")
    return out


def curve(r: dict, arm: str, kind: str = "greedy") -> list[tuple[float, float]]:
    """(wall s since the arm's start, held-out ``kind`` success, greedy or sampled): a warm
    run's clock includes its demonstrations and SFT, and starts at the SFT model's success.
    The final evaluation is greedy only, so a sampled curve ends at the last periodic one."""
    if arm == "warm":
        lead = r["demos"]["wall_s"] + r["sft"]["wall_s"]
        start = r["sft"].get(f"heldout_{kind}")
        pts = [] if start is None else [(lead, start)]
    else:  # from its first evaluation: a random-init model's success is not measured
        lead, pts = 0.0, []
    run = r[arm]
    pts += [(lead + e["wall_s"], e[f"{kind}_success"]) for e in run["evals"]]
    if kind == "greedy":
        pts.append((lead + run["wall_s"], run["greedy_success"]))
    return pts


def last_sampled(r: dict, arm: str) -> float | None:
    """Held-out sampled success of an RL arm's last periodic evaluation (the final one is
    greedy only)."""
    evals = r[arm]["evals"]
    return evals[-1]["sampled_success"] if evals else None


def first_at(pts: list[tuple[float, float]], bar: float) -> float | None:
    return next((t for t, y in pts if y >= bar), None)


def band_plot(results: list[dict], arms: list[str], path: Path, title: str) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np

    fig, axes = plt.subplots(1, 2, figsize=(12, 4.2), sharey=True)
    bar = statistics.fmean(r["demonstrator_heldout"]["success"] for r in results)
    for ax, kind in zip(axes, ("greedy", "sampled")):
        for arm, colour in zip(arms, ("tab:blue", "tab:orange")):
            curves = [c for c in (curve(r, arm, kind) for r in results if arm in r) if len(c) > 1]
            if not curves:  # every run of this arm failed (or has no sampled evaluation)
                continue
            # each seed's curve where it exists (seeds run at once take longer than one alone)
            grid = np.linspace(min(c[0][0] for c in curves), max(c[-1][0] for c in curves), 200)
            ys = np.array([np.interp(grid, [t for t, _ in c], [y for _, y in c], left=np.nan,
                                     right=np.nan) for c in curves])
            ax.fill_between(grid, np.nanmin(ys, axis=0), np.nanmax(ys, axis=0), color=colour, alpha=0.2)
            ax.plot(grid, np.nanmedian(ys, axis=0), color=colour,
                    label=f"{arm} (median, min-max over {len(curves)} seeds)")
        ax.axhline(bar, color="grey", linestyle="--", label=f"demonstrator {bar:.2f} (greedy)")
        ax.set_xlabel("wall s (warm: demos + SFT + RL)")
        ax.set_ylabel(f"held-out {kind} success")
        ax.set_ylim(0, 1.02)
        ax.legend(fontsize=8, loc="lower right")
    fig.suptitle(title, fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


COLUMNS = ["label", "arm", "held-out greedy", "held-out sampled", "wall s", "seeds at target",
           "first wall s at target"]


def rows(out: dict, arms: list[str]) -> list[list]:
    """A run's rows: the demonstrator, its SFT, and each RL arm, over its seeds."""
    results, target, label = out["results"], out["target"], out["label"]

    def band(xs: list[float | None], f: str = ".3f") -> str | None:
        xs = [x for x in xs if x is not None]
        return f"{statistics.median(xs):{f}} ({min(xs):{f}}-{max(xs):{f}})" if xs else None

    sft = [r["sft"]["heldout_greedy"] for r in results]
    out_rows = [[label, "demonstrator", band([r["demonstrator_heldout"]["success"] for r in results]),
                 None, None, None, None],
                [label, "SFT on it", band(sft), band([r["sft"].get("heldout_sampled") for r in results]),
                 band([r["demos"]["wall_s"] + r["sft"]["wall_s"] for r in results], ".0f"),
                 f"{sum((x or 0) >= target for x in sft)}/{len(sft)}", None]]
    for arm in arms:
        got = [r for r in results if arm in r]
        finals = [r[arm]["greedy_success"] for r in got]
        failed = sum(f"{arm}_error" in r for r in results)
        name = ("SFT, then RL" if arm == "warm" else "RL alone") + (f" ({failed} failed)" if failed else "")
        firsts = [first_at(curve(r, arm), target) for r in got]
        out_rows.append([label, name, band(finals), band([last_sampled(r, arm) for r in got]),
                         band([curve(r, arm)[-1][0] for r in got], ".0f"),
                         f"{sum((x or 0) >= target for x in finals)}/{len(finals)} (>= {target})",
                         ", ".join("-" if f is None else f"{f:.0f}" for f in firsts)])
    return out_rows


def arms_of(out: dict) -> list[str]:
    return [a for a in ("warm", "cold") if any(a in r for r in out["results"])]


def readme_section(out: dict) -> str:
    """One table for every stored label: this run and the others."""
    return render("beyond_demo", table=table(
        COLUMNS, [row for r in labelled("beyond_demo", out) for row in rows(r, arms_of(r))]))


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--config", default=str(ROOT / "configs" / "frozenlake-warm.yaml"))
    p.add_argument("--cold-config", default=str(ROOT / "configs" / "frozenlake-random.yaml"),
                   help="the RL-alone twin's config (its own recipe; same env and held-out maps)")
    p.add_argument("--policy", default="heuristic", help="the demonstrator (default heuristic)")
    p.add_argument("--seeds", type=int, default=3)
    p.add_argument("--first-seed", type=int, default=0)
    p.add_argument("--demos", type=int, default=512, help="demonstration episodes (default 512)")
    p.add_argument("--sft-steps", type=int, default=150)
    p.add_argument("--all-demos", action="store_true",
                   help="SFT on every demonstration (default: the successful ones only)")
    p.add_argument("--sft-batch", type=int, default=32)
    p.add_argument("--sft-lr", type=float, default=0.002,
                   help="SFT's peak lr (default 0.002; the warm config's RL lr, 0.0002, under-trains SFT)")
    p.add_argument("--rl-steps", type=int, default=None, help="override trainer.steps")
    p.add_argument("--rl-lr", type=float, default=None, help="override trainer.lr")
    p.add_argument("--rl-entropy", type=float, default=None, help="override trainer.entropy_coef")
    p.add_argument("--eval-every", type=int, default=25)
    p.add_argument("--eval-groups", type=int, default=256, help="held-out tasks (default 256)")
    p.add_argument("--target", type=float, default=0.85)
    p.add_argument("--no-cold", action="store_true", help="no RL-alone twin")
    p.add_argument("--nats", default=None, help="memory: the in-process bus (default: embedded)")
    p.add_argument("--parallel", type=int, default=1, help="seeds at once (default 1)")
    p.add_argument("--timeout", type=float, default=3600.0,
                   help="seconds one RL run may take (a run past it is recorded as failed)")
    p.add_argument("--label", default="frozenlake-random")
    p.add_argument("--write", action="store_true")
    p.add_argument("--from-json", default=None, metavar="FILE",
                   help="run nothing: the JSON this script printed (or wrote), re-tabled, and with "
                        "--write its plot and README section (under its own arguments and date)")
    args = p.parse_args()
    arms = ["warm"] + ([] if args.no_cold else ["cold"])
    if args.from_json:
        text = Path(args.from_json).read_text()
        out = json.loads(text[text.index("\n{") + 1:] if not text.startswith("{") else text)
        write = args.write
        args = p.parse_args(out["argv"])
        arms = ["warm"] + ([] if args.no_cold else ["cold"])
        out["table"] = table(COLUMNS, rows(out, arms))
        print(out["table"])
        if write:
            write_results(out, args, arms)
        return 0
    seeds = list(range(args.first_seed, args.first_seed + args.seeds))
    host = machine()
    with tempfile.TemporaryDirectory(prefix="rollart-beyond-") as tmp, \
            ThreadPoolExecutor(max_workers=max(1, args.parallel)) as pool:
        results = list(pool.map(lambda s: one_seed(args, s, Path(tmp)), seeds))
    out = {"label": args.label, "argv": sys.argv[1:], "config": args.config, "policy": args.policy,
           "date": time.strftime("%Y-%m-%d"), "host": host, "target": args.target,
           "results": results}
    out["table"] = table(COLUMNS, rows(out, arms))
    print(json.dumps(out, indent=1))
    if args.write:
        write_results(out, args, arms)
    return 0


def write_results(out: dict, args, arms: list[str]) -> None:
    """``benchmarks/results/beyond_demo_<label>.{json,png}`` and the README section."""
    results = out["results"]
    name = f"beyond_demo_{args.label}"
    png = RESULTS / f"{name}.png"
    png.parent.mkdir(parents=True, exist_ok=True)
    band_plot(results, arms, png, f"{Path(args.config).stem}: {args.policy} demos -> SFT -> RL, "
                                  f"{args.eval_groups} held-out tasks")
    store(RESULTS / f"{name}.json", out, "beyond_demo", readme_section(out))


if __name__ == "__main__":
    raise SystemExit(main())

"""Does the quickstart learn on every seed? ``rollart run`` as a user runs it, over seeds.

::

    python benchmarks/quickstart_seeds.py --seeds 20                  # the promise: 20 seeds
    python benchmarks/quickstart_seeds.py --seeds 6 --variants default,constant-lr
    python benchmarks/quickstart_seeds.py --seeds 20 --nats memory --alpha 0
    python benchmarks/quickstart_seeds.py --seeds 3 --steps 150 --parallel 2   # after learning, under load

Each run is the packaged config (``--config``, default ``quickstart``) through
``python -m rollart run`` in a fresh process (child node processes and an embedded
nats-server unless ``--nats memory``), one run at a time (``--parallel N``: N at once), with seed ``s`` as both the
sampling seed (``actors.generate.args.seed``) and the task seed (``rollout.seed = 1000 s``),
and a variant's overrides on top. Runs are interleaved: seed 0 of every variant, then
seed 1, ..., so a busy spell of the machine does not fall on one variant.

Per run it reads ``summary.json`` (the final greedy success, ``wall_s``) and
``metrics.jsonl`` (sampled success per step): the first step whose sampled success is
>= 0.5, the mean of the last 10 steps, and after the first step with sampled success >= 0.9
the lowest sampled success and the largest gradient norm (a late collapse and the spike
before it). A run *learned* when its final greedy success
is >= ``--threshold`` (0.9). It prints JSON; ``--write`` also stores it in
``benchmarks/results/quickstart_seeds_<label>.json`` and the section of ``benchmarks/README.md``
between ``<!-- quickstart_seeds:<label>:begin -->`` and ``<!-- quickstart_seeds:<label>:end -->``
(``--label``, default from the bus and alpha: ``embedded-acfg``, ``memory-acfg``, ``embedded-a0``).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import yaml


LORA_ALL = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj", "lm_head"]
VARIANTS: dict[str, dict] = {
    "default": {},
    "constant-lr": {"trainer": {"schedule": "constant"}},
    "lr-0.001": {"trainer": {"lr": 0.001}},
    "lr-0.005": {"trainer": {"lr": 0.005}},
    "entropy-0.03": {"trainer": {"entropy_coef": 0.03}},
    "grpo": {"trainer": {"advantage": "grpo"}},
    "group-16": {"rollout": {"group_size": 16, "batch_groups": 4}},
    "skip-8": {"trainer": {"skip_uniform": 8}},
    "skip-16": {"trainer": {"skip_uniform": 16}},
    "skip-16-lr-0.005": {"trainer": {"skip_uniform": 16, "lr": 0.005}},
    "clip-0.3": {"trainer": {"grad_clip": 0.3}},
    "kl-0.01": {"trainer": {"kl_coef": 0.01}},
    # trainer.sync.format: stream (versions as buckets and deltas), the variant that collapsed
    # after learning in CI (tests/e2e/test_learning_scale.py)
    "stream": {"trainer": {"sync": {"format": "stream"}}},
    "stream-kl-0.01": {"trainer": {"sync": {"format": "stream"}, "kl_coef": 0.01}},
    "skip-failed-16": {"trainer": {"skip_uniform": 16, "skip_which": "failed"}},
    # Adam's beta2 (issue 28 item 3: the one-step collapses follow a gradient spike; at 0.999
    # a spike after small gradients moves each weight ~3.2 lr, at 0.95 ~0.45 lr)
    "adam-b2-0.95": {"trainer": {"adam_betas": [0.9, 0.95]}},
    # issue 25's placement: generation in a child of its own, env steps on threads, every
    # turn through nats-server (the default before the one-child layout and local calls)
    "split-thread": {"node": {"local_processes": [["generate"], ["env", "reward"]]},
                     "envs": {"main": {"executor": "thread"}}, "rollout": {"local_calls": False}},
    "adam-b2-0.999": {"trainer": {"adam_betas": [0.9, 0.999]}},  # torch's default, the recipe before
    "adam-b2-0.99": {"trainer": {"adam_betas": [0.9, 0.99]}},
    # adaptive entropy control: the coefficient rises while the entropy is below the target
    "entropy-target-0.2": {"trainer": {"entropy_target": 0.2}},
    "entropy-target-0.05": {"trainer": {"entropy_target": 0.05}},
    "adam-b2-0.95-entropy-target-0.2": {"trainer": {"adam_betas": [0.9, 0.95], "entropy_target": 0.2}},
    # trainer.schedule_clock (issue 28 item 3): the cosine moves on every step, the recipe
    # before the schedule held on steps without a signal
    "clock-steps": {"trainer": {"schedule_clock": "steps"}},
    "skip-failed-16-lr-0.005": {"trainer": {"skip_uniform": 16, "skip_which": "failed", "lr": 0.005}},
    # trainer.lora on the quickstart (tests/e2e/test_learning_scale.py): adapters on the 7
    # projections and the head, rank = the model's width
    "lora-r64": {"trainer": {"lora": {"rank": 64, "alpha": 64.0, "targets": LORA_ALL}}},
    "lora-r64-lr-0.01": {"trainer": {"lora": {"rank": 64, "alpha": 64.0, "targets": LORA_ALL}, "lr": 0.01}},
    "lora-r64-lr-0.0015": {"trainer": {"lora": {"rank": 64, "alpha": 64.0, "targets": LORA_ALL}, "lr": 0.0015}},
    "lora-r64-lr-0.001": {"trainer": {"lora": {"rank": 64, "alpha": 64.0, "targets": LORA_ALL}, "lr": 0.001}},
    "lora-r64-lr-0.001-b2-0.95": {"trainer": {"lora": {"rank": 64, "alpha": 64.0, "targets": LORA_ALL},
                                              "lr": 0.001, "adam_betas": [0.9, 0.95]}},
    "lora-r64-lr-0.001-constant": {"trainer": {"lora": {"rank": 64, "alpha": 64.0, "targets": LORA_ALL},
                                               "lr": 0.001, "schedule": "constant"}},
}

from common import RESULTS, ROOT, child_env, in_turn, labelled, render, sayer, store, table

say = sayer("quickstart-seeds")


def merged(base: dict, over: dict) -> dict:
    out = dict(base)
    for k, v in over.items():
        out[k] = merged(out.get(k) or {}, v) if isinstance(v, dict) else v
    return out


def run_one(config: Path, variant: str, seed: int, *, nats: str | None, alpha: int | None,
            work: Path, timeout: float, steps: int | None = None) -> dict:
    raw = yaml.safe_load(config.read_text())
    over = merged(VARIANTS[variant], {"actors": {"generate": {"args": {"seed": seed}}},
                                      "rollout": {"seed": 1000 * seed}})
    if alpha is not None:
        over = merged(over, {"rollout": {"alpha": alpha}})
    if steps is not None:
        over = merged(over, {"trainer": {"steps": steps}})
    name = f"qs-{variant.replace('.', '_')}-s{seed}-{uuid.uuid4().hex[:4]}"
    cfg = merged(raw, over) | {"run": name, "run_dir": str(work / "runs")}
    path = work / f"{name}.yaml"
    path.write_text(yaml.safe_dump(cfg, sort_keys=False))
    cmd = [sys.executable, "-m", "rollart", "run", str(path), "--quiet"]
    if nats:
        cmd += ["--nats", nats]
    env = child_env()
    t0 = time.perf_counter()
    r = subprocess.run(cmd, cwd=work, env=env, capture_output=True, text=True, timeout=timeout)
    wall = time.perf_counter() - t0
    folder = work / "runs" / name
    out = {"variant": variant, "seed": seed, "rc": r.returncode, "process_s": round(wall, 1)}
    try:
        summary = json.loads((folder / "summary.json").read_text())
        rows = [json.loads(x) for x in (folder / "metrics.jsonl").read_text().splitlines() if x]
    except (OSError, ValueError) as e:
        return out | {"error": f"{e}; stderr: {r.stderr[-400:]}"}
    sampled = [float(x.get("success", 0.0)) for x in rows]
    half = next((int(x["step"]) for x in rows if float(x.get("success", 0.0)) >= 0.5), None)
    most = next((int(x["step"]) for x in rows if float(x.get("success", 0.0)) >= 0.9), None)
    return out | {"greedy_success": summary.get("greedy_success"),
                  "wall_s": round(float(summary.get("wall_s", 0.0)), 1),
                  "steps": summary.get("steps"), "first_sampled_0_5": half,
                  "first_sampled_0_9": most,
                  "last10_sampled": round(statistics.fmean(sampled[-10:]), 3) if sampled else None,
                  "sampled": [round(x, 2) for x in sampled],
                  **after_learning(rows, most),
                  "entropy": [round(float(x.get("entropy", 0.0)), 2) for x in rows]}


def after_learning(rows: list[dict], learned_at: int | None) -> dict:
    """What happened once sampled success first reached 0.9 (step ``learned_at``): the lowest
    sampled success after it, whether it *collapsed* (a later step below 0.5), and the largest
    gradient norm after it (before clipping): the spike that precedes a collapse."""
    if learned_at is None:
        return {"min_sampled_after_0_9": None, "collapsed": None, "max_grad_norm_after_0_9": None}
    later = [x for x in rows if int(x["step"]) > learned_at]
    low = min((float(x.get("success", 0.0)) for x in later), default=None)
    norm = max((float(x.get("grad_norm", 0.0)) for x in later), default=None)
    return {"min_sampled_after_0_9": low, "collapsed": low is not None and low < 0.5,
            "max_grad_norm_after_0_9": None if norm is None else round(norm, 3)}


def rows(out: dict) -> list[list]:
    """One row per variant of a stored run ``out``."""
    def median(xs: list) -> str | None:
        xs = [x for x in xs if x is not None]
        return f"{statistics.median(xs):.0f} ({min(xs):.0f}-{max(xs):.0f})" if xs else None

    table_rows = []
    for v in out["variants"]:
        rs = [r for r in out["results"] if r["variant"] == v]
        ok = sum((r.get("greedy_success") or 0) >= out["threshold"] for r in rs)
        table_rows.append([out.get("label") or "default", v, out["nats"],
                           "config" if out["alpha"] is None else out["alpha"],
                           f"{ok}/{len(rs)} (>= {out['threshold']})",
                           median([r.get("first_sampled_0_5") for r in rs]),
                           median([r.get("wall_s") for r in rs]), out["date"]])
    return table_rows


COLUMNS = ["label", "variant", "bus", "alpha", "learned", "first sampled 0.5", "wall s", "date"]


def readme_section(out: dict) -> str:
    """One table for every stored label: this run and the others."""
    return render("quickstart_seeds", table=table(
        COLUMNS, [row for r in labelled("quickstart_seeds", out) for row in rows(r)]))


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--config", default=str(ROOT / "configs" / "quickstart.yaml"))
    p.add_argument("--seeds", type=int, default=20, help="seeds 0..N-1 (default 20)")
    p.add_argument("--first-seed", type=int, default=0)
    p.add_argument("--variants", default="default", help=f"comma-separated: {', '.join(VARIANTS)}")
    p.add_argument("--nats", default=None, help="memory: the in-process bus (default: embedded server)")
    p.add_argument("--alpha", type=int, default=None, help="override rollout.alpha")
    p.add_argument("--steps", type=int, default=None, help="override trainer.steps (longer runs "
                   "test what happens after the policy has learned)")
    p.add_argument("--parallel", type=int, default=1, help="runs at once (2: the load of a CI "
                   "host running two learning tests; default 1)")
    p.add_argument("--threshold", type=float, default=0.9)
    p.add_argument("--timeout", type=float, default=900.0, help="seconds one run may take")
    p.add_argument("--write", action="store_true", help="store results and the README section")
    p.add_argument("--label", default=None,
                   help="name of the stored result and README section (default: from --nats "
                        "and --alpha, e.g. embedded-a1)")
    args = p.parse_args()
    variants = [v.strip() for v in args.variants.split(",") if v.strip()]
    unknown = [v for v in variants if v not in VARIANTS]
    if unknown:
        p.error(f"unknown variant(s) {unknown}; known: {', '.join(VARIANTS)}")
    seeds = list(range(args.first_seed, args.first_seed + args.seeds))
    order = [(v, seed) for k, seed in enumerate(seeds)
             for v in in_turn(variants, k)]
    with tempfile.TemporaryDirectory(prefix="rollart-qs-seeds-") as tmp, \
            ThreadPoolExecutor(max_workers=max(1, args.parallel)) as pool:
        def one(job: tuple[str, int]) -> dict:
            v, seed = job
            r = run_one(Path(args.config), v, seed, nats=args.nats, alpha=args.alpha,
                        work=Path(tmp), timeout=args.timeout, steps=args.steps)
            say(f"{v} seed {seed}: greedy {r.get('greedy_success')} first sampled 0.5 at "
                f"{r.get('first_sampled_0_5')} collapsed {r.get('collapsed')} wall "
                f"{r.get('wall_s')} s {r.get('error', '')}")
            return r
        results = list(pool.map(one, order))
    label = args.label or f"{args.nats or 'embedded'}-a{'cfg' if args.alpha is None else args.alpha}"
    out = {"label": label, "config": args.config, "nats": args.nats or "embedded", "alpha": args.alpha,
           "threshold": args.threshold, "seeds": seeds, "variants": variants,
           "host": {"cpus": os.cpu_count()}, "date": time.strftime("%Y-%m-%d"),
           "results": results}
    out["table"] = table(COLUMNS, rows(out))
    print(json.dumps(out, indent=1))
    if args.write:
        store(RESULTS / f"quickstart_seeds_{label}.json", out, "quickstart_seeds",
              readme_section(out))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

"""Evaluations beside training (``trainer.eval_every``): how long a training step takes while
one runs, paced by ``trainer.eval_share`` against unpaced (every held-out request of the
evaluation published at once, as rollart did before the share existed).

::

    python benchmarks/eval_share.py [--quick] [--steps N] [--every E] [--groups G] [--share S]

``configs/frozenlake-warm.yaml`` (its batch of 8 groups of 8, ``rollout.concurrency`` 128,
256 held-out groups every 25 steps) from its random init, the in-memory bus, both variants one
after the other on the same machine: *unpaced* and *paced* (``eval_share`` S, default 0.25:
at most 32 held-out trajectories in flight). From ``metrics.jsonl`` and ``eval.jsonl``: each
step's wall time (the time since the previous step's row), split into the steps that overlap
an evaluation and the others (step 1 left out: it includes start-up), and how long the
evaluations took. Prints JSON; a full run writes ``results/eval_share.json`` and its section
of ``README.md``.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

from common import RESULTS, ROOT, add_run_flags, begin, describe_machine, finish, render, sayer, table, writes

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

NAME = "eval_share"
say = sayer(NAME)


def one_run(variant: str, *, steps: int, every: int, groups: int, share: float, work: Path) -> dict:
    """One run of ``variant`` (``paced`` or ``unpaced``); its step times and evaluations."""
    from rollart.actors.trainer.files import read_evals
    from rollart.app import periodic_eval as pe
    from rollart.app.launch import with_overrides
    from rollart.app.run import train
    from rollart.config import RunConfig, load

    cfg = load(ROOT / "configs" / "frozenlake-warm.yaml", RunConfig)
    cfg = with_overrides(cfg, run=f"eval-{variant}", run_dir=str(work),
                         trainer={"steps": steps, "eval_every": every, "eval_groups": groups,
                                  "eval_share": share, "expect_success": None})
    orig = pe.evaluate_version
    if variant == "unpaced":  # as before trainer.eval_share: every request at once
        async def unpaced(*a, share=None, **k):  # noqa: ARG001 - the share is dropped
            return await orig(*a, share=None, **k)

        pe.evaluate_version = unpaced
    t0 = time.perf_counter()
    try:
        asyncio.run(train(cfg, nats="memory", resume=False, quiet=True))
    finally:
        pe.evaluate_version = orig
    run = work / cfg.run
    rows = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
    evals = [e for e in read_evals(run) if "eval_s" in e]
    windows = [(e["wall_s"], e["wall_s"] + e["eval_s"]) for e in evals]
    during, outside = [], []
    for prev, row in zip(rows, rows[1:]):
        a, b = prev["wall_s"], row["wall_s"]
        (during if any(a < hi and b > lo for lo, hi in windows) else outside).append(b - a)
    return {"variant": variant, "steps": len(rows), "wall_s": round(time.perf_counter() - t0, 1),
            "evaluations": len(evals), "eval_s": [round(e["eval_s"], 2) for e in evals],
            "step_s_outside": round(statistics.median(outside), 3) if outside else None,
            "step_s_during": round(statistics.median(during), 3) if during else None,
            "step_s_during_max": round(max(during), 3) if during else None,
            "steps_during": len(during),
            "during_over_outside": (round(statistics.median(during) / statistics.median(outside), 2)
                                    if during and outside else None)}


def section(res: dict) -> str:
    rows = [[r["variant"], r["steps_during"], r["step_s_outside"], r["step_s_during"],
             r["step_s_during_max"], r["during_over_outside"],
             round(statistics.mean(r["eval_s"]), 1) if r["eval_s"] else None, r["wall_s"]]
            for r in res["runs"]]
    c = res["config"]
    return render(NAME, steps=c["steps"], every=c["every"], groups=c["groups"], share=c["share"],
                  machine=describe_machine(res["machine"]), date=res["timestamp"][:10],
                  table=table(["variant", "steps beside an evaluation", "step s (others)",
                               "step s (beside)", "max step s (beside)", "beside / others",
                               "evaluation s", "run s"], rows))


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--steps", type=int, default=80, help="training steps per run (default 80)")
    p.add_argument("--every", type=int, default=25, help="trainer.eval_every (default 25)")
    p.add_argument("--groups", type=int, default=256, help="trainer.eval_groups (default 256)")
    p.add_argument("--share", type=float, default=0.25, help="the paced run's trainer.eval_share")
    add_run_flags(p, quick="8 steps, an evaluation of 8 groups every 3")
    args = p.parse_args(argv)
    if args.quick:
        args.steps, args.every, args.groups = 8, 3, 8
    res = begin(NAME, args, ("steps", "every", "groups", "share"))
    res["runs"] = []
    with tempfile.TemporaryDirectory(prefix="rollart-eval-share-") as tmp:
        for variant in ("unpaced", "paced"):
            r = one_run(variant, steps=args.steps, every=args.every, groups=args.groups,
                        share=args.share, work=Path(tmp))
            say(f"{variant}: step {r['step_s_outside']} s, beside an evaluation "
                f"{r['step_s_during']} s (max {r['step_s_during_max']}), evaluations {r['eval_s']} s")
            res["runs"].append(r)
    return finish(res, writes(args), RESULTS / f"{NAME}.json", NAME, section, say)


if __name__ == "__main__":
    sys.exit(main())

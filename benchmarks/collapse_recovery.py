"""Can a run climb out of a collapse? The quickstart's late-collapse deadlock, made on purpose.

::

    python benchmarks/collapse_recovery.py                      # every variant, 2 seeds
    python benchmarks/collapse_recovery.py --variants default,adam-b2-0.95 --seeds 1 --quick

What CI saw (issue 28, item 3): a quickstart run that had learned (sampled success 0.94) took
one step that flipped an action on its path into a hole; from then on every group failed, so
there was no policy gradient, the entropy (0.03) was too low to find the goal again and the
entropy bonus's gradient vanishes at a one-hot policy; the steps that were left moved nothing
(gradient norm 0.003) because AdamW divides each step by the root of the mean squared
gradient of the run so far (beta2 = 0.999 remembers ~1000 steps), which the large gradients of
the learning phase dominate. Such collapses are too rare to study by waiting for them, so
this script makes one, the same way each time:

1. a *collapsed policy*: ``rollart demos`` with a demonstrator that plays a shortest path
   with one move flipped into a hole (:data:`NEAR_MISS`), then ``rollart sft`` on those
   episodes until the policy is near one-hot (``--sft-steps``; entropy ~0.03 per move, as in
   the CI collapse);
2. per variant and seed, the plain synchronous loop of ``plain_loop.py`` (rollart's trainer
   backend, engine, chat format and dynamic sampling, no bus: deterministic for a seed)
   trains the quickstart from its random init for ``--learn`` steps (it learns: sampled
   success ~0.9), so AdamW holds a real run's moments; then the model's weights are replaced
   by the collapsed policy's, the optimizer's moments kept, and it trains on for
   ``--after`` steps with the same schedule (cosine over the whole run);
3. it reports, after the swap: the first step with sampled success >= 0.5 again (recovered),
   the sampled success and entropy along the way, and the final greedy success.

The variants are ``quickstart_seeds.py``'s: the packaged recipe (``default``), AdamW beta2
0.95, adaptive entropy control (``trainer.entropy_target``). It prints JSON; ``--write``
stores it in ``benchmarks/results/collapse_recovery.json`` and the section of
``benchmarks/README.md`` between ``<!-- collapse_recovery:begin -->`` and
``<!-- collapse_recovery:end -->`` (with ``--label L``: ``collapse_recovery_L.json`` and the
section ``collapse_recovery:L``, e.g. for a deeper collapse with ``--sft-steps 150``).
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from common import (RESULTS as RESULTS_DIR, HERE, child_env, labelled, machine, quiet_transformers, render,
                    sayer, store, table)

RESULTS = RESULTS_DIR / "collapse_recovery.json"


NEAR_MISS = "RRDDR"
"""The collapsed policy's moves on the quickstart map: a shortest path (R, R, D, D, then D, R
to the goal) with its fifth move flipped into the hole right of it; the moves after it are
never seen."""


class NearMiss:
    """The collapsed demonstrator: :data:`NEAR_MISS`, one move per turn."""

    def __init__(self) -> None:
        self.turn = 0

    def reset(self, observation: str, info: dict) -> None:
        self.turn = 0

    def act(self, observation: str, legal: list[str] | None) -> str:
        move = NEAR_MISS[min(self.turn, len(NEAR_MISS) - 1)]
        self.turn += 1
        return move


def near_miss(env, rng) -> NearMiss:  # a demonstrator factory for `rollart demos --policy`
    return NearMiss()


say = sayer("collapse-recovery")


def collapsed_policy(work: Path, config: str, sft_steps: int) -> Path:
    """The SFT'd near-miss model folder (step 1 of the module docstring)."""
    env = child_env(HERE)
    demos = work / "near-miss.jsonl"
    for cmd in (["demos", config, "--policy", "collapse_recovery:near_miss", "--episodes", "32",
                 "--out", str(demos), "--quiet"],
                ["sft", config, "--data", str(demos), "--steps", str(sft_steps), "--batch", "16",
                 "--out", str(work / "sft-near-miss"), "--quiet"]):
        r = subprocess.run([sys.executable, "-m", "rollart", *cmd], cwd=work, env=env,
                           capture_output=True, text=True)
        if r.returncode:
            raise SystemExit(f"rollart {cmd[0]} failed: {r.stderr[-800:]}")
    return work / "sft-near-miss" / "model"


def greedy_success(engine, chat, env_cfg, seed: int) -> float:
    """Greedy success on the fixed map (every episode is the same: one suffices)."""
    import plain_loop

    got = plain_loop.rollout_lockstep(engine, chat, env_cfg, [("eval-0", 0, seed)], counts={},
                                      greedy=True)
    return float(got[0].success)


def run_variant(config: str, variant: str, seed: int, collapsed: Path, *, learn: int, after: int,
                work: Path) -> dict:
    import torch
    from safetensors.torch import load_file

    import plain_loop
    from quickstart_seeds import VARIANTS, merged
    from rollart.app.configs import resolve_config
    from rollart.config import RunConfig, convert

    import yaml

    raw = yaml.safe_load(Path(resolve_config(config)).read_text())
    over = merged(VARIANTS[variant], {"actors": {"generate": {"args": {"seed": seed}}},
                                      "rollout": {"seed": 1000 * seed},
                                      "trainer": {"steps": learn + after}})
    cfg = convert(merged(raw, over) | {"run": f"cr-{seed}", "run_dir": str(work / "runs")}, RunConfig)
    built: dict = {}
    real_build = plain_loop.build

    def build(*a, **kw):  # keep the engine and backend the loop makes, for the swap
        built["engine"], built["backend"], built["chat"] = out = real_build(*a, **kw)
        return out

    weights = load_file(str(next(collapsed.glob("*.safetensors"))))
    swapped: dict = {}

    def on_step(rec: dict) -> None:
        if rec["step"] == learn:  # the collapse: the policy's weights, not the optimizer's state
            b, e = built["backend"], built["engine"]
            swapped["greedy_before"] = greedy_success(e, built["chat"], cfg.envs[cfg.rollout.env], seed)
            with torch.no_grad():
                missing, unexpected = b.model.load_state_dict(weights, strict=False)
            if unexpected or [k for k in missing if k != "lm_head.weight"]:
                raise SystemExit(f"the collapsed model does not fit: {missing} {unexpected}")
            e.load_state_dict(b.model.state_dict(), b.version)
            swapped["greedy_after_swap"] = greedy_success(e, built["chat"], cfg.envs[cfg.rollout.env], seed)

    plain_loop.build = build
    try:
        t0 = time.perf_counter()
        rows = plain_loop.run_plain(cfg, on_step=on_step)
    finally:
        plain_loop.build = real_build
    final = greedy_success(built["engine"], built["chat"], cfg.envs[cfg.rollout.env], seed)
    post = rows[learn:]
    back = next((r["step"] - learn for r in post if r["success"] >= 0.5), None)
    return {"variant": variant, "seed": seed, "wall_s": round(time.perf_counter() - t0, 1),
            "sampled_before_swap": round(statistics.fmean(r["success"] for r in rows[max(0, learn - 5):learn]), 3),
            **swapped, "recovered_after": back, "final_greedy": final,
            "sampled_after": [round(r["success"], 2) for r in post],
            "entropy_after": [round(r.get("train_entropy", 0.0), 3) for r in post],
            "entropy_coef_after": [round(r.get("entropy_coef", 0.0), 3) for r in post],
            "grad_norm_after": [round(r.get("train_grad_norm", 0.0), 4) for r in post]}


def results_path(label: str | None):
    return RESULTS.with_name(f"collapse_recovery_{label}.json") if label else RESULTS


def readme_section(res: dict) -> str:
    """One table for every labelled run: this one and the stored others."""
    rows = []
    for r in labelled("collapse_recovery", res):
        for run in r["runs"]:
            ent = [run["entropy_after"][i] for i in (0, 4, 9) if i < len(run["entropy_after"])]
            rows.append([r.get("label") or "default", f"{r['learn']} + {r['after']}",
                         r.get("sft_steps", 80), run["variant"], run["seed"],
                         f"{run['sampled_before_swap']:.2f}",
                         "never" if run["recovered_after"] is None else run["recovered_after"],
                         f"{run['final_greedy']:.1f}", ", ".join(f"{x:.3f}" for x in ent),
                         r["date"]])
    return render("collapse_recovery", near_miss=NEAR_MISS, table=table(
        ["label", "steps before + after", "SFT steps", "variant", "seed", "sampled before swap",
         "recovered after (steps)", "final greedy", "entropy at swap +1, +5, +10", "date"], rows))


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--config", default="quickstart", help="run config (default: quickstart)")
    p.add_argument("--variants", default="default,adam-b2-0.95,entropy-target-0.05",
                   help="quickstart_seeds.py variants, comma-separated")
    p.add_argument("--seeds", type=int, default=2, help="seeds 0..N-1 per variant (default 2)")
    p.add_argument("--learn", type=int, default=40, help="steps before the collapse (default 40)")
    p.add_argument("--after", type=int, default=40, help="steps after it (default 40)")
    p.add_argument("--sft-steps", type=int, default=80, help="SFT steps of the collapsed policy "
                   "(default 80: entropy ~0.03 per move, as the CI collapse had)")
    p.add_argument("--quick", action="store_true", help="4 + 4 steps, 20 SFT steps, seed 0: that it runs")
    p.add_argument("--write", action="store_true", help="store results and the README section")
    p.add_argument("--label", default=None, help="results file and README section suffix")
    a = p.parse_args(argv)
    if a.quick:
        a.learn, a.after, a.sft_steps, a.seeds = 4, 4, 20, 1
    quiet_transformers()
    from quickstart_seeds import VARIANTS

    variants = a.variants.split(",")
    unknown = [v for v in variants if v not in VARIANTS]
    if unknown:
        p.error(f"unknown variants {unknown}; known: {', '.join(VARIANTS)}")
    host = machine()
    runs = []
    with tempfile.TemporaryDirectory(prefix="rollart-collapse-") as tmp:
        work = Path(tmp)
        collapsed = collapsed_policy(work, a.config, a.sft_steps)
        for seed in range(a.seeds):
            for v in variants:
                r = run_variant(a.config, v, seed, collapsed, learn=a.learn, after=a.after, work=work)
                say(f"{v} seed {seed}: before {r['sampled_before_swap']:.2f}, recovered after "
                    f"{r['recovered_after']}, final greedy {r['final_greedy']}, {r['wall_s']} s")
                runs.append(r)
    res = {"command": "python benchmarks/collapse_recovery.py " + " ".join(argv or sys.argv[1:]),
           "date": time.strftime("%Y-%m-%d"), "host": host, "learn": a.learn, "after": a.after,
           "config": a.config, "label": a.label, "sft_steps": a.sft_steps, "runs": runs}
    print(json.dumps(res, indent=2))
    if a.write and not a.quick:
        store(results_path(a.label), res, "collapse_recovery", readme_section(res))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

"""Does the terminal agent learn? ``rollart run agent-terminal`` as a user runs it, over seeds,
against the luck of a policy choosing uniformly from the menu.

::

    python benchmarks/terminal_agent.py --seeds 3 --parallel 3 --write   # the packaged 40 steps
    python benchmarks/terminal_agent.py --seeds 3 --steps 20 --parallel 3   # shorter runs
    python benchmarks/terminal_agent.py --quick     # one seed, 2 small steps (< 40 s), writes nothing

Each run is the packaged config (``--config``, default ``agent-terminal``: the terminal agent of
issue 46, ``menu: true``, the quickstart's random-init tiny model) through ``python -m rollart
run`` in a fresh process (an embedded nats-server and a child node process unless ``--nats
memory``), run folder in a temporary directory, seed ``s`` as both the sampling seed
(``actors.generate.args.seed``) and the task seed (``rollout.seed = 1000 s``), as
``quickstart_seeds.py`` varies them; ``--parallel N`` runs N seeds at once. Overrides beyond the
seeds: ``trainer.steps`` (``--steps``) and ``trainer.eval_groups`` (``--eval-groups``, default
64: the final greedy evaluation's held-out tasks; the packaged 4 make it a coin toss). Per run
it reads ``metrics.jsonl`` and ``summary.json``: sampled success and turns per trajectory
(mean of the first 10 and of the last 10 steps), the final greedy success, the trajectories
trained (those in the steps' batches) and the wall time.

The *uniform menu* baseline plays ``--baseline`` episodes of the same tasks (the config's kinds,
levels and ``max_turns``, task seeds ``10,000,000 + i``) through the agent's own episode loop
(``rollart.code.terminal.run_episode``) in real sandboxes, each reply drawn uniformly from the
turn's menu (``rollart.code.terminal.menu``: the task's commands as tool calls and its answers,
answers only on the last turn), and scored by the task's checker: the success a policy has by
luck alone, the bar a trained one must clear.

It prints JSON; ``--write`` stores ``benchmarks/results/terminal_agent.json``, a plot of sampled
success and turns per step (median and min-max band over seeds, the baseline's line) as
``benchmarks/results/terminal_agent.png`` and the README section ``terminal_agent``.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import statistics
import subprocess
import sys
import tempfile
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from types import SimpleNamespace

import yaml

from common import RESULTS, ROOT, child_env, describe_machine, machine, render, sayer, store, table
from quickstart_seeds import merged  # a config with overrides on top

NAME = "terminal_agent"
BASELINE_SEED = 10_000_000  # task seeds of the uniform-menu episodes (no run's first tasks)
WINDOW = 10  # steps averaged at the start and at the end of a run
say = sayer("terminal-agent")


# -- the runs ---------------------------------------------------------------------------------
def read_jsonl(path: Path) -> list[dict]:
    return [json.loads(x) for x in path.read_text().splitlines() if x.strip()] if path.exists() else []


def mean(xs: list[float]) -> float | None:
    return round(statistics.fmean(xs), 3) if xs else None


def run_one(config: Path, seed: int, over: dict, *, nats: str | None, work: Path,
            timeout: float) -> dict:
    """One ``rollart run`` of ``config`` with seed ``seed`` and ``over`` on top."""
    raw = yaml.safe_load(config.read_text())
    name = f"term-s{seed}-{uuid.uuid4().hex[:4]}"
    cfg = merged(raw, merged(over, {"actors": {"generate": {"args": {"seed": seed}}},
                                    "rollout": {"seed": 1000 * seed}}))
    cfg |= {"run": name, "run_dir": str(work / "runs")}
    path = work / f"{name}.yaml"
    path.write_text(yaml.safe_dump(cfg, sort_keys=False))
    cmd = [sys.executable, "-m", "rollart", "run", str(path), "--quiet"]
    if nats:
        cmd += ["--nats", nats]
    t0 = time.perf_counter()
    try:
        r = subprocess.run(cmd, cwd=work, env=child_env(), capture_output=True, text=True,
                           timeout=timeout)
        rc, err = r.returncode, r.stderr
    except subprocess.TimeoutExpired as e:
        rc, err = None, f"timed out after {timeout:.0f} s; {(e.stderr or b'')[-400:]!r}"
    out = {"seed": seed, "rc": rc, "process_s": round(time.perf_counter() - t0, 1)}
    folder = work / "runs" / name
    try:
        rows = read_jsonl(folder / "metrics.jsonl")
    except (OSError, ValueError):
        rows = []
    if not rows:
        return out | {"error": f"no metrics; stderr: {err[-400:]}"}
    try:  # a run stopped early has its steps' metrics but no summary
        summary = json.loads((folder / "summary.json").read_text())
    except (OSError, ValueError):
        summary = {"steps": len(rows), "wall_s": out["process_s"]}
    sampled = [float(x.get("success", 0.0)) for x in rows]
    turns = [float(x.get("turns", 0.0)) for x in rows]
    return out | {
        "steps": summary.get("steps"), "wall_s": round(float(summary.get("wall_s", 0.0)), 1),
        "greedy_success": summary.get("greedy_success"),
        "greedy_trajectories": summary.get("trajectories"),
        "trajectories_trained": sum(len(x.get("traj_ids") or []) for x in rows),
        "groups_skipped": sum(int(x.get("groups_skipped", 0)) for x in rows),
        "sampled_first10": mean(sampled[:WINDOW]), "sampled_last10": mean(sampled[-WINDOW:]),
        "turns_first10": mean(turns[:WINDOW]), "turns_last10": mean(turns[-WINDOW:]),
        "sampled": [round(x, 3) for x in sampled], "turns": [round(x, 3) for x in turns],
        **({"error": f"exit {rc}: {err[-400:]}"} if rc != 0 else {})}


# -- the uniform-menu baseline ----------------------------------------------------------------
class UniformMenu:
    """An ``openai`` client stand-in for :func:`rollart.code.terminal.run_episode`: each reply
    is drawn uniformly from the turn's ``guided_choice`` (the menu), a ``<tool_call>`` entry
    returned as the tool call the endpoint would parse from it."""

    def __init__(self, rng: random.Random) -> None:
        self.rng = rng
        self.chat = SimpleNamespace(completions=self)

    async def create(self, *, extra_body: dict, **_: object):
        from openai.types.chat import ChatCompletionMessage, ChatCompletionMessageToolCall

        text = self.rng.choice(extra_body["guided_choice"])
        if text.startswith("<tool_call>"):
            call = json.loads(text.removeprefix("<tool_call>").removesuffix("</tool_call>"))
            msg = ChatCompletionMessage(role="assistant", content=None, tool_calls=[
                ChatCompletionMessageToolCall(id=f"call_{uuid.uuid4().hex[:8]}", type="function",
                                              function={"name": call["name"],
                                                        "arguments": json.dumps(call["arguments"])})])
        else:
            msg = ChatCompletionMessage(role="assistant", content=text)
        return SimpleNamespace(choices=[SimpleNamespace(message=msg)])


async def _baseline(args: dict, episodes: int, at_once: int) -> list[dict]:
    from rollart import sandbox
    from rollart.code.terminal import menu, run_episode
    from rollart.code.terminal_tasks import make_task, setup

    pool = sandbox.SandboxPool(warm=at_once)
    gate = asyncio.Semaphore(at_once)

    async def one(i: int) -> dict:
        task = make_task(BASELINE_SEED + i, kinds=args.get("kinds", ("find", "count", "fix")),
                         levels=args.get("levels", (0,)))
        async with gate, pool.session() as sb:
            await setup(task, sb)
            out = await run_episode(UniformMenu(random.Random(i)), sb, task, args, choices=menu)
        return {"kind": task.kind, "level": task.level, "success": bool(out["success"]),
                "turns": sum(m.get("role") == "assistant" for m in out["messages"]),
                "commands": out["commands"]}

    try:
        return list(await asyncio.gather(*(one(i) for i in range(episodes))))
    finally:
        pool.close()


def uniform_baseline(config: Path, episodes: int, at_once: int = 4) -> dict:
    """Success and turns of a policy that picks every reply uniformly from the menu."""
    raw = yaml.safe_load(config.read_text())
    args = dict(raw["envs"]["main"].get("args") or {})
    t0 = time.perf_counter()
    eps = asyncio.run(_baseline(args, episodes, at_once))
    kinds = sorted({e["kind"] for e in eps})
    return {"episodes": len(eps), "first_task_seed": BASELINE_SEED,
            "max_turns": args.get("max_turns"), "levels": args.get("levels"),
            "success": mean([float(e["success"]) for e in eps]),
            "turns": mean([float(e["turns"]) for e in eps]),
            "by_kind": {k: {"episodes": sum(e["kind"] == k for e in eps),
                            "success": mean([float(e["success"]) for e in eps if e["kind"] == k])}
                        for k in kinds},
            "wall_s": round(time.perf_counter() - t0, 1)}


# -- the report -------------------------------------------------------------------------------
COLUMNS = ["seed", "sampled success, first 10 steps", "last 10 steps", "turns, first 10",
           "turns, last 10", "final greedy success", "trajectories trained", "wall s"]


def _f(x: float | None, f: str = ".2f") -> str | None:
    return None if x is None else f"{x:{f}}"


def rows(out: dict) -> list[list]:
    ok = [r for r in out["results"] if "sampled_first10" in r]
    body = [[r["seed"], _f(r["sampled_first10"]), _f(r["sampled_last10"]), _f(r["turns_first10"], ".1f"),
             _f(r["turns_last10"], ".1f"),
             None if r.get("greedy_success") is None
             else f"{r['greedy_success']:.2f} ({r.get('greedy_trajectories')} tasks)",
             r["trajectories_trained"], _f(r["wall_s"], ".0f")] for r in ok]
    failed = [[r["seed"], "failed", None, None, None, None, None, _f(r.get("process_s"), ".0f")]
              for r in out["results"] if "sampled_first10" not in r]
    if len(ok) > 1:
        def med(key: str, f: str = ".2f") -> str | None:
            xs = [r[key] for r in ok if r.get(key) is not None]
            return _f(statistics.median(xs), f) if xs else None
        body.append(["median", med("sampled_first10"), med("sampled_last10"), med("turns_first10", ".1f"),
                     med("turns_last10", ".1f"), med("greedy_success"), med("trajectories_trained", ".0f"),
                     med("wall_s", ".0f")])
    b = out["baseline"]
    body.append([f"uniform menu ({b['episodes']} episodes)", _f(b["success"]), _f(b["success"]),
                 _f(b["turns"], ".1f"), _f(b["turns"], ".1f"), None, None, None])
    return body + failed


def summary_line(out: dict) -> str:
    """The finding in one sentence, from the numbers (whatever they are)."""
    ok = [r for r in out["results"] if "sampled_first10" in r]
    luck = out["baseline"]["success"]
    if not ok:
        return "Every run failed: no numbers."
    first = statistics.median(r["sampled_first10"] for r in ok)
    last = statistics.median(r["sampled_last10"] for r in ok)
    t0 = statistics.median(r["turns_first10"] for r in ok)
    t1 = statistics.median(r["turns_last10"] for r in ok)
    rose = sum(r["sampled_last10"] > r["sampled_first10"] for r in ok)
    above = sum(r["sampled_last10"] > luck for r in ok)
    return (f"Median over {len(ok)} seeds: sampled success {first:.2f} in the first 10 steps, "
            f"{last:.2f} in the last 10 ({last - first:+.2f}); turns a trajectory {t0:.1f} -> {t1:.1f}. "
            f"The last 10 steps beat the first 10 on {rose}/{len(ok)} seeds and the uniform menu's "
            f"{luck:.2f} on {above}/{len(ok)}.")


def readme_section(out: dict) -> str:
    b = out["baseline"]
    kinds = ", ".join(f"{k} {v['success']:.2f} of {v['episodes']}" for k, v in b["by_kind"].items())
    return render(NAME, table=table(COLUMNS, rows(out)), summary=summary_line(out),
                  seeds=len(out["seeds"]), steps=out["steps"], batch=out["batch"], parallel=out["parallel"],
                  bus=out["nats"], eval_groups=out["eval_groups"], date=out["date"],
                  machine=describe_machine(out["machine"]), episodes=b["episodes"],
                  luck=f"{b['success']:.2f}", luck_kinds=kinds, luck_turns=f"{b['turns']:.1f}")


def band_plot(out: dict, path: Path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np

    ok = [r for r in out["results"] if r.get("sampled")]
    fig, axes = plt.subplots(1, 2, figsize=(11, 3.8))
    for ax, key, label, base in ((axes[0], "sampled", "sampled success of the step's batch",
                                  out["baseline"]["success"]),
                                 (axes[1], "turns", "turns a trajectory", out["baseline"]["turns"])):
        n = min(len(r[key]) for r in ok)
        ys = np.array([r[key][:n] for r in ok])
        steps = np.arange(1, n + 1)
        ax.fill_between(steps, ys.min(axis=0), ys.max(axis=0), color="tab:blue", alpha=0.2)
        ax.plot(steps, np.median(ys, axis=0), color="tab:blue",
                label=f"median, min-max over {len(ok)} seeds")
        ax.axhline(base, color="grey", linestyle="--", label=f"uniform menu {base:.2f}")
        ax.set_xlabel("step")
        ax.set_ylabel(label)
        ax.legend(fontsize=8, loc="lower right")
    axes[0].set_ylim(0, 1.02)
    axes[1].set_ylim(0, (out["baseline"].get("max_turns") or 5) + 0.2)
    fig.suptitle(f"rollart run agent-terminal: {len(ok)} seeds, {out['steps']} steps", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


# -- main -------------------------------------------------------------------------------------
def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--config", default=str(ROOT / "configs" / "agent-terminal.yaml"))
    p.add_argument("--seeds", type=int, default=3, help="seeds 0..N-1 (default 3)")
    p.add_argument("--first-seed", type=int, default=0)
    p.add_argument("--steps", type=int, default=None, help="override trainer.steps (default: "
                   "the config's)")
    p.add_argument("--eval-groups", type=int, default=64,
                   help="trainer.eval_groups: held-out tasks of the final greedy evaluation")
    p.add_argument("--parallel", type=int, default=1, help="runs at once (default 1)")
    p.add_argument("--nats", default=None, help="memory: the in-process bus (default: embedded server)")
    p.add_argument("--baseline", type=int, default=300, help="uniform-menu episodes (default 300)")
    p.add_argument("--timeout", type=float, default=3600.0, help="seconds one run may take")
    p.add_argument("--quick", action="store_true",
                   help="one seed, 2 steps of 2 groups of 4, 8 baseline episodes; writes nothing")
    p.add_argument("--write", action="store_true", help="store results, plot and README section")
    args = p.parse_args()
    over: dict = {"trainer": {"eval_groups": args.eval_groups}}
    if args.quick:
        args.seeds, args.steps, args.baseline, args.eval_groups = 1, 2, 8, 2
        over = {"trainer": {"eval_groups": 2, "skip_uniform": 0},
                "rollout": {"group_size": 4, "batch_groups": 2, "concurrency": 8},
                "sandbox": {"warm": 4}}
    if args.steps is not None:
        over = merged(over, {"trainer": {"steps": args.steps}})
    config = Path(args.config)
    packaged = merged(yaml.safe_load(config.read_text()), over)
    steps = packaged["trainer"]["steps"]
    batch = packaged["rollout"]["group_size"] * packaged["rollout"]["batch_groups"]
    seeds = list(range(args.first_seed, args.first_seed + args.seeds))
    host = machine()
    t0 = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="rollart-terminal-") as tmp, \
            ThreadPoolExecutor(max_workers=max(1, args.parallel)) as pool:
        def one(seed: int) -> dict:
            r = run_one(config, seed, over, nats=args.nats, work=Path(tmp), timeout=args.timeout)
            say(f"seed {seed}: sampled {r.get('sampled_first10')} -> {r.get('sampled_last10')}, turns "
                f"{r.get('turns_first10')} -> {r.get('turns_last10')}, greedy {r.get('greedy_success')}, "
                f"wall {r.get('wall_s')} s {r.get('error', '')}")
            return r
        results = list(pool.map(one, seeds))
    runs_s = round(time.perf_counter() - t0, 1)
    say(f"runs took {runs_s} s; uniform-menu baseline: {args.baseline} episodes")
    baseline = uniform_baseline(config, args.baseline)
    say(f"uniform menu: success {baseline['success']}, turns {baseline['turns']} "
        f"({baseline['wall_s']} s)")
    out = {"benchmark": NAME, "argv": sys.argv[1:], "config": str(config), "date": time.strftime("%Y-%m-%d"),
           "quick": args.quick, "seeds": seeds, "steps": steps, "batch": batch, "parallel": args.parallel,
           "nats": args.nats or "embedded", "eval_groups": args.eval_groups, "overrides": over,
           "machine": host, "runs_wall_s": runs_s, "baseline": baseline, "results": results}
    out["summary"] = summary_line(out)
    out["table"] = table(COLUMNS, rows(out))
    print(json.dumps(out, indent=1))
    if args.write:
        png = RESULTS / f"{NAME}.png"
        png.parent.mkdir(parents=True, exist_ok=True)
        band_plot(out, png)
        store(RESULTS / f"{NAME}.json", out, NAME, readme_section(out))
        say(f"wrote {RESULTS / NAME}.json, {png.name} and the README section {NAME}")
    return 0 if all("error" not in r for r in results) else 1


if __name__ == "__main__":
    raise SystemExit(main())

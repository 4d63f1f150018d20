"""Routing: the cost of ``route:`` rules and of generating in another pool than the env's.

::

    python benchmarks/routing.py            # full run (about a minute); rewrites its README section
    python benchmarks/routing.py --quick    # smoke run; prints JSON, writes nothing

Two measurements:

- **Router.pick**: the time the EnvManager spends choosing the generation pool of one turn
  (:class:`rollart.config.placement.Router`), for the two-rule route of the README
  (``prompt_tokens_gt`` then a default) and for a nine-rule route whose match is the last.
- **Side by side, one process, MemoryBus**: the same rollout (FrozenLake 4x4, a random map
  per seed, greedy from one
  warm tiny torch engine, the same task seeds, so the same trajectories and turns) run
  ``plain`` (no ``pools``: scheduler, EnvManager and LLMProxy in one pool, no router) and
  ``routed`` (``pools: {gpu, cpu}``, ``mapping: {generate: gpu, env: cpu, reward: cpu}`` and a
  two-rule ``route``: the EnvManager in ``cpu`` routes every turn, the scheduler publishes to
  ``rollout.requested.cpu``, the generator answers on ``generate.request.gpu``). Reported per
  turn: the run's wall time divided by its turns, and the mean generate round trip the
  EnvManager saw; the ratio routed / plain (median over repetitions, modes alternating).

The JSON goes to stdout; the full run writes ``benchmarks/results/routing.json`` and the
section of ``benchmarks/README.md`` between ``<!-- routing:begin -->`` and ``<!-- routing:end -->``.
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import tempfile
import time
import timeit
import uuid
from pathlib import Path

from common import (RESULTS as RESULTS_DIR, add_run_flags, begin, describe_machine, finish, in_turn,
                    render, sayer, table, writes)

from rollart.bus.memory import MemoryBus
from rollart.config import RunConfig, convert
from rollart.config.placement import RouteRule, RouteWhen, Router
from rollart.node.build import rollout_actors
from rollart.node import Node

RESULTS = RESULTS_DIR / "routing.json"
MODES = ("plain", "routed")
ROUTED = {"pools": {"gpu": {"tags": ["gpu"]}, "cpu": {"tags": ["cpu"]}},
          "mapping": {"generate": "gpu", "env": "cpu", "reward": "cpu"},
          "route": [{"when": {"prompt_tokens_gt": 2048}, "pool": "gpu"}, {"pool": "gpu"}]}


say = sayer("routing")


def pick_cost(n: int) -> dict:
    """Microseconds per Router.pick, best of 5 rounds of ``n`` picks."""
    two = Router([RouteRule(pool="big", when=RouteWhen(prompt_tokens_gt=2048)),
                  RouteRule(pool="small")], default_pool="small")
    nine = Router([RouteRule(pool="p", when=RouteWhen(env=f"env{i}", turn_gt=1))
                   for i in range(8)] + [RouteRule(pool="small")], default_pool="small")
    out = {}
    for name, r, tokens in (("two_rules_default", two, 100), ("two_rules_first", two, 4096),
                            ("nine_rules_last", nine, 100)):
        t = min(timeit.repeat(lambda r=r, tokens=tokens: r.pick(prompt_tokens=tokens, turn=3,
                                                                  env="main"),
                              number=n, repeat=5))
        out[name] = round(t / n * 1e6, 3)
    return out


def make_cfg(args, mode: str, model_dir: Path) -> RunConfig:
    data = {
        "run": f"rt{uuid.uuid4().hex[:8]}",
        "model": {"path": str(model_dir), "threads": args.threads},
        "envs": {"main": {"type": "frozenlake", "args": {"size": 4, "random_map": True},
                          "instruction": "FrozenLake", "max_turns": args.max_turns}},
        "rollout": {"group_size": args.group_size, "batch_groups": args.groups,
                    "concurrency": args.groups * args.group_size, "same_seed_per_group": False},
        "actors": {"generate": {"replicas": 1}, "reward": {"replicas": 0}},
    }
    if mode == "routed":
        data.update(ROUTED)
    return convert(data, RunConfig)


async def measure(args, mode: str, engine, model_dir: Path) -> dict:
    cfg = make_cfg(args, mode, model_dir)
    bus = MemoryBus()
    await bus.connect()
    try:
        sched, actors = rollout_actors(cfg, groups=args.groups, bounded=False, keep_results=True,
                                       greedy=True)
        for a in actors:
            if a.role == "generate":
                a.engine_obj = engine
        async with Node(bus, actors, heartbeat_every=0):
            t0 = time.perf_counter()
            await asyncio.wait_for(sched.all_done.wait(), args.timeout)
            wall = time.perf_counter() - t0
    finally:
        await bus.close()
    res = sched.results
    turns = [t for r in res for t in r.turns]
    pools = sorted({t.pool for t in turns})
    return {"mode": mode, "wall_s": round(wall, 4), "turns": len(turns),
            "trajectories": len(res), "pools": pools,
            "per_turn_ms": round(wall / len(turns) * 1e3, 4),
            "generate_rtt_ms": round(sum(r.timings["generate"] for r in res) / len(turns) * 1e3, 4),
            "_moves": {r.seed: [t.action for t in r.turns] for r in res}}


async def suite(args, engine, model_dir: Path) -> list[dict]:
    await measure(args, "plain", engine, model_dir)  # warm-up (imports, first allocations)
    runs = []
    for rep in range(args.reps):
        for mode in in_turn(MODES, rep):
            r = await measure(args, mode, engine, model_dir)
            r["rep"] = rep
            say(f"rep {rep + 1}/{args.reps} {mode}: {r['per_turn_ms']:.3f} ms/turn over "
                f"{r['turns']} turns, generate round trip {r['generate_rtt_ms']:.3f} ms, "
                f"pools {r['pools']}")
            runs.append(r)
    return runs


def readme_section(res: dict) -> str:
    c, s, p = res["config"], res["summary"], res["pick_us"]
    rows = [[mo, f"{s['per_turn_ms'][mo]:.3f}", f"{s['generate_rtt_ms'][mo]:.3f}",
             ", ".join(f"{x:.3f}" for x in s["per_rep_ms"][mo])] for mo in MODES]
    return render("routing", trajs=c["groups"] * c["group_size"], max_turns=c["max_turns"],
                  reps=c["reps"], same_moves="yes" if s["same_moves"] else "**no**",
                  table=table(["mode", "per turn (ms)", "generate round trip (ms)",
                               "per repetition (ms/turn)"], rows),
                  ratio=f"{s['ratio']:.3f}", pick=p["two_rules_default"], pick9=p["nine_rules_last"],
                  share=f"{s['pick_share_pct']:.4f}", machine=describe_machine(res["machine"]),
                  date=res["timestamp"][:10])


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_run_flags(p, "1 repetition")
    p.add_argument("--reps", type=int, default=None, help="repetitions per mode (default 4; --quick 1)")
    p.add_argument("--groups", type=int, default=4, help="groups (default 4)")
    p.add_argument("--group-size", type=int, default=8, help="trajectories per group (default 8)")
    p.add_argument("--max-turns", type=int, default=8, help="env max_turns (default 8)")
    p.add_argument("--threads", type=int, default=1, help="torch threads (default 1)")
    p.add_argument("--picks", type=int, default=200_000, help="Router.pick calls per round")
    p.add_argument("--timeout", type=float, default=300.0, help="seconds per run at most")
    args = p.parse_args(argv)
    args.reps = args.reps or (1 if args.quick else 4)
    t_start = time.perf_counter()
    res = begin("routing", args, ("reps", "groups", "group_size", "max_turns", "threads", "picks"))
    res["pick_us"] = pick_cost(args.picks)
    say(f"Router.pick: {res['pick_us']} µs")
    with tempfile.TemporaryDirectory(prefix="rollart-routing-") as tmp:
        from rollart.engines.tiny import build_tiny_model
        from rollart.engines.torch_engine import TorchGenerationEngine

        model_dir = build_tiny_model(Path(tmp) / "model", seed=0)
        engine = TorchGenerationEngine(model_dir, threads=args.threads, seed=0)
        runs = asyncio.run(suite(args, engine, model_dir))
    by = {mo: [r for r in runs if r["mode"] == mo] for mo in MODES}
    per_turn = {mo: statistics.median(r["per_turn_ms"] for r in by[mo]) for mo in MODES}
    rtt = {mo: statistics.median(r["generate_rtt_ms"] for r in by[mo]) for mo in MODES}
    res["summary"] = {
        "per_turn_ms": {mo: round(v, 4) for mo, v in per_turn.items()},
        "generate_rtt_ms": {mo: round(v, 4) for mo, v in rtt.items()},
        "per_rep_ms": {mo: [r["per_turn_ms"] for r in by[mo]] for mo in MODES},
        "ratio": round(per_turn["routed"] / per_turn["plain"], 4),
        "ratio_per_rep": [round(b["per_turn_ms"] / a["per_turn_ms"], 4)
                          for a, b in zip(by["plain"], by["routed"])],
        "pick_share_pct": round(res["pick_us"]["two_rules_default"] / (per_turn["plain"] * 1e3)
                                * 100, 5),
        "same_moves": all(r["_moves"] == runs[0]["_moves"] for r in runs),
        "routed_pools": sorted({p for r in by["routed"] for p in r["pools"]}),
        "plain_pools": sorted({p for r in by["plain"] for p in r["pools"]}),
    }
    for r in runs:
        r.pop("_moves")
    res["runs"] = runs
    res["total_s"] = round(time.perf_counter() - t_start, 1)
    return finish(res, writes(args), RESULTS, "routing", readme_section, say)


if __name__ == "__main__":
    raise SystemExit(main())

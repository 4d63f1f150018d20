"""Replica-affine turns: the KV-cache hit share and the load balance with 1, 2 and 4 replicas.

::

    python benchmarks/affinity.py            # full run (~2-3 minutes); rewrites its README section
    python benchmarks/affinity.py --quick    # smoke run; prints JSON, writes nothing

The quickstart env (``configs/quickstart.yaml``: FrozenLake 4x4, the classic map, up to 16
turns, the tiny model, constrained decoding, sampled) rolled out in one process on the
MemoryBus by a scheduler, one EnvManager and 1, 2 or 4 LLMProxy replicas, each with its own
tiny torch engine and so its own per-trajectory KV cache, with ``rollout.affinity`` on and
off. More trajectories than ``rollout.concurrency``, so that new ones are placed all along
as others end. Reported per run:

- **cache share**: the prompt tokens the replicas' KV caches served, over all prompt tokens
  (sum over replicas of ``kv_reused_tokens / (kv_reused_tokens + kv_prefilled_tokens)``);
  one replica holds every trajectory's cache, so its share is the ceiling;
- **load**: generate requests each replica served, max / min over the replicas;
- the turns, the wall time and the EnvManager's ``affinity_moves`` (a pin left a saturated,
  silent or unknown replica) and ``affinity_fallbacks`` (a replica's own subject did not
  answer).

Target (issue 25): with 2 and 4 replicas and affinity on, a cache share of at least 90% of
the one-replica share and a load max / min of at most 1.2. With affinity off the MemoryBus
hands a pool's requests round robin (nats-server: at random), which balances requests
perfectly and scatters each trajectory's turns.

The JSON goes to stdout; the full run writes ``benchmarks/results/affinity.json`` and the
section of ``benchmarks/README.md`` between ``<!-- affinity:begin -->`` and
``<!-- affinity:end -->``.
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import tempfile
import time
from pathlib import Path

from common import (RESULTS as RESULTS_DIR, add_run_flags, begin, describe_machine, finish, in_turn,
                    quickstart_cfg, render, sayer, table, writes)
from rollart.bus.memory import MemoryBus
from rollart.config import RunConfig
from rollart.node import Node
from rollart.node.build import rollout_actors

RESULTS = RESULTS_DIR / "affinity.json"
SHARE_TARGET = 0.9
LOAD_TARGET = 1.2
say = sayer("affinity")


def make_cfg(args, replicas: int, affinity: bool, run_dir: Path) -> RunConfig:
    return quickstart_cfg("af", run_dir, threads=args.threads,
                          rollout={"batch_groups": args.groups, "concurrency": args.concurrency,
                                   "affinity": affinity},
                          actors={"generate": {"replicas": replicas}, "reward": {"replicas": 0}})


async def measure(args, replicas: int, affinity: bool, run_dir: Path) -> dict:
    cfg = make_cfg(args, replicas, affinity, run_dir)
    bus = MemoryBus()
    await bus.connect()
    try:
        sched, actors = rollout_actors(cfg, groups=args.groups, bounded=False, keep_results=True)
        proxies = [a for a in actors if a.role == "generate"]
        env = next(a for a in actors if a.role == "env")
        assert len(proxies) == replicas
        async with Node(bus, actors, heartbeat_every=0):
            t0 = time.perf_counter()
            await asyncio.wait_for(sched.all_done.wait(), args.timeout)
            wall = time.perf_counter() - t0
            stats = [p.batcher.stats() for p in proxies]
    finally:
        await bus.close()
    reused = sum(s["kv_reused_tokens"] for s in stats)
    prefilled = sum(s["kv_prefilled_tokens"] for s in stats)
    served = [int(s["rows"]) for s in stats]
    res = sched.results
    turns = sum(len(r.turns) for r in res)
    return {"replicas": replicas, "affinity": affinity, "wall_s": round(wall, 3),
            "trajectories": len(res), "turns": turns, "served": served,
            "load_max_min": round(max(served) / max(1, min(served)), 4),
            "reused_tokens": int(reused), "prefilled_tokens": int(prefilled),
            "cache_share": round(reused / max(1.0, reused + prefilled), 4),
            "affinity_moves": env.stats.get("affinity_moves", 0),
            "affinity_fallbacks": env.stats.get("affinity_fallbacks", 0)}


async def suite(args, run_dir: Path) -> list[dict]:
    runs = []
    for rep in range(args.reps):
        for n in args.replicas:
            for aff in in_turn((True, False), rep):
                if n == 1 and not aff:
                    continue  # one replica: nothing to be affine to
                r = await measure(args, n, aff, run_dir)
                r["rep"] = rep
                say(f"rep {rep + 1}/{args.reps} replicas {n} affinity {'on ' if aff else 'off'}: "
                    f"cache share {r['cache_share']:.3f}, served {r['served']} "
                    f"(max/min {r['load_max_min']:.3f}), {r['turns']} turns in {r['wall_s']:.1f} s, "
                    f"moves {r['affinity_moves']}, fallbacks {r['affinity_fallbacks']}")
                runs.append(r)
    return runs


def summarize(args, runs: list[dict]) -> dict:
    def med(n: int, aff: bool, key: str) -> float:
        xs = [r[key] for r in runs if r["replicas"] == n and r["affinity"] == aff]
        return round(statistics.median(xs), 4)

    base = med(1, True, "cache_share") if 1 in args.replicas else None
    out: dict = {"one_replica_share": base, "by_replicas": {}}
    ok = True
    for n in args.replicas:
        row: dict = {}
        for aff, name in ((True, "on"), (False, "off")):
            if n == 1 and not aff:
                continue
            row[name] = {"cache_share": med(n, aff, "cache_share"),
                         "load_max_min": med(n, aff, "load_max_min"),
                         "wall_s": med(n, aff, "wall_s"), "turns": med(n, aff, "turns")}
            if base:
                row[name]["share_of_one"] = round(row[name]["cache_share"] / base, 4)
        if n > 1 and base:
            on = row["on"]
            on["meets_target"] = (on["share_of_one"] >= SHARE_TARGET
                                  and on["load_max_min"] <= LOAD_TARGET)
            ok = ok and on["meets_target"]
        out["by_replicas"][str(n)] = row
    out["meets_target"] = ok
    return out


def readme_section(res: dict) -> str:
    c, s = res["config"], res["summary"]
    rows = [[n, name, f"{v['cache_share']:.3f}",
             f"{v['share_of_one'] * 100:.1f}%" if "share_of_one" in v else None,
             f"{v['load_max_min']:.3f}", f"{v['turns']:.0f}", f"{v['wall_s']:.1f}"]
            for n, row in s["by_replicas"].items() for name, v in row.items()]
    on = [r for r in res["runs"] if r["affinity"]]
    return render("affinity", groups=c["groups"], concurrency=c["concurrency"], reps=c["reps"],
                   table=table(["replicas", "affinity", "cache share", "of 1 replica",
                                "load max/min", "turns", "wall (s)"], rows),
                   share_target=f"{SHARE_TARGET:.0%}", load_target=LOAD_TARGET,
                   verdict="**met**" if s["meets_target"] else "**not met**",
                   moves=sum(r["affinity_moves"] for r in on),
                   falls=sum(r["affinity_fallbacks"] for r in on),
                   machine=describe_machine(res["machine"]), date=res["timestamp"][:10])


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_run_flags(p, "1 repetition, fewer groups")
    p.add_argument("--reps", type=int, default=None, help="repetitions (default 3; --quick 1)")
    p.add_argument("--groups", type=int, default=None,
                   help="groups of 8 per run (default 48; --quick 6)")
    p.add_argument("--concurrency", type=int, default=None,
                   help="trajectories at once (default 64; --quick 16)")
    p.add_argument("--replicas", type=int, nargs="+", default=[1, 2, 4])
    p.add_argument("--threads", type=int, default=1, help="torch threads per engine (default 1)")
    p.add_argument("--timeout", type=float, default=600.0, help="seconds per run at most")
    args = p.parse_args(argv)
    args.reps = args.reps or (1 if args.quick else 3)
    args.groups = args.groups or (6 if args.quick else 48)
    args.concurrency = args.concurrency or (16 if args.quick else 64)
    t_start = time.perf_counter()
    res = begin("affinity", args, ("reps", "groups", "concurrency", "replicas", "threads"))
    with tempfile.TemporaryDirectory(prefix="rollart-affinity-") as tmp:
        runs = asyncio.run(suite(args, Path(tmp)))
    res.update(summary=summarize(args, runs), runs=runs,
               total_s=round(time.perf_counter() - t_start, 1))
    return finish(res, writes(args), RESULTS, "affinity", readme_section, say)


if __name__ == "__main__":
    raise SystemExit(main())

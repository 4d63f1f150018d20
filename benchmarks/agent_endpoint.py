"""What the OpenAI-compatible endpoint costs per turn, against the EnvManager's own turn loop.

::

    python benchmarks/agent_endpoint.py              # full run (about 3 minutes); rewrites its README section
    python benchmarks/agent_endpoint.py --quick      # smoke run; prints JSON, writes nothing

The same rollout two ways, side by side in one process on the MemoryBus (one scheduler, one
EnvManager, one LLMProxy with the tiny torch engine of ``configs/quickstart.yaml``):

- ``env``: ``type: frozenlake``, the EnvManager steps the env and encodes each turn itself;
- ``agent``: ``type: agent:rollart.agents.examples:frozenlake``, the README's agent: the
  ``openai`` client asks the trajectory's endpoint (Starlette on uvicorn, in the EnvManager)
  for each move and steps its own FrozenLake.

Same map, seeds, sampling (the quickstart's: sampled, decoding constrained to L/D/R/U) and
engine. Two loads: ``serial`` (one trajectory at a time: the latency of a turn alone) and
``loaded`` (``--concurrency`` trajectories at once, the quickstart's 128 by default, with
the engine batching them). The two paths alternate within each repetition.

**Per turn.** Each LLMProxy generation is timed (its ``_generate``, patched in this script
only: arrival of the request at the proxy to the reply handed back). A turn's *round trip
outside the engine* is the time from the end of one generation of a trajectory to the start
of its next: for ``env``, the reply's bus hop back, the env step, the next prompt's encoding
and the request's bus hop; for ``agent``, the same hops plus the HTTP reply, the openai
client, the agent's own env step, its next HTTP request and the endpoint's tokenisation of
it. p50 and p99 over every such gap. *CPU per turn*: the process's CPU time
(``time.process_time``) over the rollout / its turns (everything: engine included).
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import tempfile
import time
from collections import defaultdict
from pathlib import Path

from common import (RESULTS as RESULTS_DIR, add_run_flags, begin, describe_machine, finish, in_turn,
                    quickstart_cfg, render, sayer, table, writes)

from rollart.actors.generate.proxy import LLMProxy
from rollart.bus.memory import MemoryBus
from rollart.config import RunConfig
from rollart.node import Node
from rollart.node.build import rollout_actors

RESULTS = RESULTS_DIR / "agent_endpoint.json"
AGENT = "agent:rollart.agents.examples:frozenlake"
RAW = "agent:benchmark:raw-http"
PATHS = ("env", "agent", "raw")
AGENTS = {"agent": AGENT, "raw": RAW}

_spans: dict[str, list[tuple[float, float]]] = defaultdict(list)
"""traj_id -> (start, end) of each of its generations (perf_counter seconds)."""


def _patch_proxy() -> None:
    orig = LLMProxy._generate

    async def timed(self, req, rid):
        t0 = time.perf_counter()
        try:
            return await orig(self, req, rid)
        finally:
            _spans[req.traj_id].append((t0, time.perf_counter()))

    LLMProxy._generate = timed


_http = None


async def raw_frozenlake(base_url: str, task: dict) -> dict:
    """:func:`rollart.agents.examples.frozenlake` without the openai client: the same
    requests as plain JSON over one shared ``httpx`` client (what the endpoint costs by
    itself, the client library's share left out)."""
    import httpx

    from rollart.agents.examples import _LAKE_ARGS
    from rollart.envs.frozenlake import FrozenLakeEnv

    global _http
    if _http is None:
        _http = httpx.AsyncClient(timeout=60)
    env = FrozenLakeEnv(**{k: v for k, v in task.items() if k in _LAKE_ARGS})
    obs, info = env.reset(task["seed"])
    messages = [{"role": "system", "content": env.instruction}, {"role": "user", "content": obs}]
    total, done = 0.0, False
    while not done:
        r = await _http.post(f"{base_url}/chat/completions", json={
            "model": "policy", "messages": messages, "max_tokens": 1,
            "guided_choice": env.legal_actions()})
        r.raise_for_status()
        move = r.json()["choices"][0]["message"]["content"]
        obs, reward, terminated, truncated, info = env.step(move)
        total += reward
        done = terminated or truncated
        messages += [{"role": "assistant", "content": move}, {"role": "user", "content": obs}]
    return {"reward": total, "success": info["success"]}


def _register_raw() -> None:
    from rollart.envs import agent_type

    agent_type._agents[RAW] = raw_frozenlake


say = sayer("agent_endpoint")


def make_cfg(args, path: str, concurrency: int, run_dir: Path) -> RunConfig:
    def env(main: dict) -> dict:
        if path in AGENTS:
            main["type"] = AGENTS[path]
            main["args"] = {**main.get("args", {}), "instruction": main.pop("instruction", "")}
        return main

    return quickstart_cfg("ae", run_dir, env=env, actors={"reward": {"replicas": 0}},
                          rollout={"batch_groups": args.groups, "concurrency": concurrency,
                                   "seed": 0})


def _pct(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q * len(xs)))] if xs else float("nan")


async def measure(args, path: str, load: str, run_dir: Path) -> dict:
    concurrency = 1 if load == "serial" else args.concurrency
    cfg = make_cfg(args, path, concurrency, run_dir)
    groups = args.serial_groups if load == "serial" else args.groups
    _spans.clear()
    bus = MemoryBus()
    await bus.connect()
    try:
        sched, actors = rollout_actors(cfg, groups=groups, bounded=False, keep_results=True)
        async with Node(bus, actors, heartbeat_every=0):
            c0, t0 = time.process_time(), time.perf_counter()
            await asyncio.wait_for(sched.all_done.wait(), args.timeout)
            wall, cpu = time.perf_counter() - t0, time.process_time() - c0
    finally:
        await bus.close()
    res = sched.results
    turns = sum(len(r.turns) for r in res)
    gaps, gen = [], []
    for spans in _spans.values():
        spans.sort()
        gen += [e - s for s, e in spans]
        gaps += [spans[i + 1][0] - spans[i][1] for i in range(len(spans) - 1)]
    return {"path": path, "load": load, "concurrency": concurrency,
            "trajectories": len(res), "turns": turns, "wall_s": round(wall, 3),
            "cpu_s": round(cpu, 3), "cpu_ms_per_turn": round(1000 * cpu / max(1, turns), 3),
            "wall_ms_per_turn": round(1000 * wall / max(1, turns), 3),
            "gap_ms_p50": round(1000 * _pct(gaps, 0.5), 3),
            "gap_ms_p99": round(1000 * _pct(gaps, 0.99), 3),
            "gen_ms_p50": round(1000 * _pct(gen, 0.5), 3),
            "success": round(sum(r.success for r in res) / max(1, len(res)), 4)}


async def suite(args, run_dir: Path) -> list[dict]:
    runs = []
    for rep in range(args.reps):
        for load in args.loads:
            for path in in_turn(PATHS, rep):
                r = await measure(args, path, load, run_dir)
                r["rep"] = rep
                say(f"rep {rep + 1}/{args.reps} {load:7s} {path:5s}: {r['turns']} turns in "
                    f"{r['wall_s']:.1f} s, round trip p50 {r['gap_ms_p50']:.2f} ms p99 "
                    f"{r['gap_ms_p99']:.2f} ms, CPU {r['cpu_ms_per_turn']:.2f} ms/turn")
                runs.append(r)
    return runs


KEYS = ("gap_ms_p50", "gap_ms_p99", "cpu_ms_per_turn", "wall_ms_per_turn", "gen_ms_p50", "turns")


def summarize(args, runs: list[dict]) -> dict:
    out: dict = {}
    for load in args.loads:
        row: dict = {p: {k: round(statistics.median(r[k] for r in runs
                                                    if r["path"] == p and r["load"] == load), 3)
                         for k in KEYS} for p in PATHS}
        env = row["env"]
        for p in AGENTS:
            row[f"{p}_over_env"] = {k: round(row[p][k] / env[k], 3) for k in KEYS[:4] if env[k]}
            row[f"{p}_extra_ms"] = {
                "round_trip_p50": round(row[p]["gap_ms_p50"] - env["gap_ms_p50"], 3),
                "round_trip_p99": round(row[p]["gap_ms_p99"] - env["gap_ms_p99"], 3),
                "cpu": round(row[p]["cpu_ms_per_turn"] - env["cpu_ms_per_turn"], 3)}
        out[load] = row
    return out


def readme_section(res: dict) -> str:
    rows = []
    for load, row in res["summary"].items():
        rows += [[load, p, f"{v['gap_ms_p50']:.2f}", f"{v['gap_ms_p99']:.2f}",
                  f"{v['cpu_ms_per_turn']:.2f}", f"{v['wall_ms_per_turn']:.2f}", f"{v['turns']:.0f}"]
                 for p, v in ((p, row[p]) for p in PATHS)]
        for p in AGENTS:
            r, x = row[f"{p}_over_env"], row[f"{p}_extra_ms"]
            rows.append([load, f"{p} / env", *(f"{r.get(k, 0):.2f}x" for k in (
                "gap_ms_p50", "gap_ms_p99", "cpu_ms_per_turn", "wall_ms_per_turn")), None])
            rows.append([load, f"{p} - env (ms)", f"{x['round_trip_p50']:+.2f}",
                         f"{x['round_trip_p99']:+.2f}", f"{x['cpu']:+.2f}", None, None])
    return render("agent_endpoint", concurrency=res["config"]["concurrency"],
                  reps=res["config"]["reps"], machine=describe_machine(res["machine"]),
                  date=res["timestamp"][:10],
                  table=table(["load", "path", "round trip p50 (ms)", "p99 (ms)", "CPU (ms/turn)",
                               "wall (ms/turn)", "turns"], rows))


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_run_flags(p, "1 repetition, few groups")
    p.add_argument("--reps", type=int, default=None, help="repetitions (default 3; --quick 1)")
    p.add_argument("--groups", type=int, default=None,
                   help="groups of 8 for the loaded runs (default 16; --quick 2)")
    p.add_argument("--serial-groups", type=int, default=None,
                   help="groups of 8 for the serial runs (default 4; --quick 1)")
    p.add_argument("--concurrency", type=int, default=128,
                   help="trajectories at once in the loaded runs (default 128, the quickstart's)")
    p.add_argument("--loads", nargs="+", choices=("serial", "loaded"), default=["serial", "loaded"])
    p.add_argument("--timeout", type=float, default=600.0, help="seconds per run at most")
    args = p.parse_args(argv)
    args.reps = args.reps or (1 if args.quick else 3)
    args.groups = args.groups or (2 if args.quick else 16)
    args.serial_groups = args.serial_groups or (1 if args.quick else 4)
    res = begin("agent_endpoint", args, ("reps", "groups", "serial_groups", "concurrency", "loads"))
    _patch_proxy()
    _register_raw()
    t_start = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="rollart-agent-endpoint-") as tmp:
        runs = asyncio.run(suite(args, Path(tmp)))
    res.update(summary=summarize(args, runs), runs=runs,
               total_s=round(time.perf_counter() - t_start, 1))
    return finish(res, writes(args), RESULTS, "agent_endpoint", readme_section, say)


if __name__ == "__main__":
    raise SystemExit(main())

"""Rollout modes: trajectory-level vs batch-level env interaction under Gaussian env latency.

::

    python benchmarks/rollout_modes.py               # full suite (a few minutes)
    python benchmarks/rollout_modes.py --quick       # smoke run; prints JSON, writes nothing
    python benchmarks/rollout_modes.py --bus nats    # the same over an embedded nats-server
    python benchmarks/rollout_modes.py --proxy-vs-direct   # only generation via the proxy vs direct

The paper (ROLLART, arXiv 2512.22560) compares trajectory-level with batch-level env
interaction while injecting Gaussian latency into env steps, and reports a 1.23-2.27x
shorter rollout for sigma 1-10. This script repeats that on one host with the real actor
system: a ``RolloutScheduler``, one ``EnvManager``, one ``LLMProxy`` serving a real tiny torch
model (greedy, decoding constrained to L/D/R/U), and the in-process ``MemoryBus`` (or an
embedded ``nats-server`` with ``--bus nats``).

- **Env**: ``latency_envs:LatencyLake``, FrozenLake 4x4 with a random map per
  seed, whose every step sleeps ``max(0, N(mu, sigma)) * unit`` seconds (default
  ``mu = 10``, ``unit = 40 ms``, so a step takes 400 ms on average; sigma is swept over
  1, 2, 5, 10 units, i.e. 40-400 ms: the paper's sigma 1-10 with mu in the same units). The draws are seeded by the task seed, so a
  trajectory sees the same latencies in both modes.
- **Same work in both modes**: the same groups (``--batches`` x ``batch_groups`` groups of
  ``group_size``), the same task seeds (one per trajectory: ``same_seed_per_group: false``),
  greedy decoding from the same weights, so each trajectory makes the same moves and
  takes the same number of turns in both modes (checked, and reported as
  ``same_trajectories``). One warm engine serves every measurement.
- **Same resources**: ``rollout.concurrency`` = trajectories per wave (32), so both modes
  run at most 32 trajectories (envs) at once on one EnvManager; one generation replica.
- **trajectory** mode: every trajectory advances on its own; a finished one frees its slot
  for the next queued trajectory at once.
- **batch** mode: waves of ``batch_groups`` groups; the wave's trajectories generate
  together, then step their envs together (each phase waits for the slowest), and the next
  wave starts when the whole wave is done.

**Proxy vs direct** (part of every run; alone with ``--proxy-vs-direct``, which writes only
with ``--write`` and then keeps the rest of the results file): 64 trajectories (8 groups x 8,
``rollout.concurrency`` 64, all in flight), no env latency, greedy, the same task seeds,
rolled out (a) by ``plain_loop.rollout_lockstep`` calling the same torch engine directly, one
call per turn with every live trajectory, (b) by the actors through the ``LLMProxy`` in
``rollout.mode: trajectory`` and (c) the same in ``rollout.mode: batch``. Reported per path:
wall seconds, generated tokens, tokens/s, engine calls, rows per call, requests waiting when a
call was cut / queued when a call ended, engine seconds, and the ratio proxy / direct
tokens/s against the 0.9 target (medians over ``--pvd-reps``, path order rotating).

Reported: rollout time per batch (span from the first admission to the last group done,
divided by the number of batches) for each mode and sigma, and the ratio batch / trajectory
(how many times longer a batch takes in batch mode; the paper's speed-up). Modes alternate
in order per sigma and repetition. The full run writes ``benchmarks/results/rollout_modes.json``
and the section of ``benchmarks/README.md`` between ``<!-- rollout_modes:begin -->`` and
``<!-- rollout_modes:end -->``. Progress goes to stderr, the JSON to stdout.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import inspect
import json
import logging
import statistics
import tempfile
import time
import uuid
from pathlib import Path

from common import (RESULTS as RESULTS_DIR, add_run_flags, describe_machine, event_loop, in_turn,
                    loadavg, machine, open_bus, quiet_transformers, render, sayer, store, table,
                    until_done)


from rollart.config import RunConfig, convert
from rollart.node.build import rollout_actors
from rollart.node import Node

RESULTS = RESULTS_DIR / "rollout_modes.json"

ENV_TYPES = {"thread": "latency_envs:LatencyLake",
             "async": "latency_envs:AsyncLatencyLake"}
PAPER = {"sigma_low": 1, "ratio_low": 1.23, "sigma_high": 10, "ratio_high": 2.27}
"""The paper's row: sigma 1-10 -> 1.23-2.27x (trajectory-level over batch-level)."""
MODES = ("trajectory", "batch")


say = sayer("rollout-modes")


def paper_target(sigma: float) -> tuple[float, str]:
    """The ratio to reach at ``sigma``: the paper's value at its ends (1 and 10), else the
    low end of its range (the paper reports only the range)."""
    if sigma >= PAPER["sigma_high"]:
        return PAPER["ratio_high"], f"paper {PAPER['ratio_high']}x at sigma {PAPER['sigma_high']}"
    if sigma == PAPER["sigma_low"]:
        return PAPER["ratio_low"], f"paper {PAPER['ratio_low']}x at sigma {PAPER['sigma_low']}"
    return PAPER["ratio_low"], (f"low end of the paper's {PAPER['ratio_low']}-{PAPER['ratio_high']}x "
                                f"over sigma {PAPER['sigma_low']}-{PAPER['sigma_high']}")


# -- one measurement -----------------------------------------------------------------------
def make_cfg(args, *, mode: str, sigma: float, model_dir: Path, run_dir: Path) -> RunConfig:
    env_args = {"mu": args.mu, "sigma": sigma, "unit": args.unit, "size": 4, "random_map": True}
    env = {"type": ENV_TYPES[args.env_kind], "args": env_args, "max_turns": args.max_turns,
           "step_timeout": 60.0}
    if args.instruction:
        env["instruction"] = args.instruction
    return convert({
        "run": f"rm{uuid.uuid4().hex[:8]}",
        "run_dir": str(run_dir),
        "model": {"path": str(model_dir), "threads": args.threads},
        "envs": {"main": env},
        "rollout": {"mode": mode, "group_size": args.group_size, "batch_groups": args.batch_groups,
                    "concurrency": args.concurrency, "same_seed_per_group": False,
                    "seed": args.seed, "generate_timeout": 120.0, "ack_wait": 120.0},
        "proxy": {"gather_ms": args.gather_ms, "max_batch": args.max_batch},
        "actors": {"generate": {"replicas": 1}, "reward": {"replicas": 0}},
    }, RunConfig)


async def measure(args, *, mode: str, sigma: float, engine, model_dir: Path, run_dir: Path,
                  url: str | None, label: str, on_ready=None) -> dict:
    """Roll out ``args.batches`` batches in ``mode``; return timings and the trajectories.
    ``on_ready(proxies)``, if given, is called once the actors are set up."""
    cfg = make_cfg(args, mode=mode, sigma=sigma, model_dir=model_dir, run_dir=run_dir)
    groups = args.batches * args.batch_groups
    load_start = loadavg()
    async with open_bus(args.bus, url) as bus:
        sched, actors = rollout_actors(cfg, groups=groups, bounded=False, keep_results=True,
                                       greedy=not args.sample)
        proxies = [a for a in actors if a.role == "generate"]
        envs = [a for a in actors if a.role == "env"]
        for p in proxies:
            p.engine_obj = engine  # one warm engine for every measurement
        t_node = time.perf_counter()
        async with Node(bus, actors, heartbeat_every=0):
            t_ready = time.perf_counter()
            if on_ready is not None:
                on_ready(proxies)
            shown = 0

            def tick() -> None:
                nonlocal shown
                done = sched.groups_settled // args.batch_groups
                if shown < done < args.batches:
                    shown = done
                    say(f"  {label}: {done}/{args.batches} batches settled, "
                        f"{time.perf_counter() - t_ready:.1f}s")

            await until_done(sched, args.timeout, label, groups, tick)
            t_done = time.perf_counter()
    gs = sorted(sched.groups.items())
    start = min(g.opened_at for _, g in gs)
    end = max(g.done_at for _, g in gs)
    span = end - start
    # per batch (groups w*batch_groups...): first admission -> last group done. Batch mode
    # admits a wave when the last is done, so these are the waves' durations; trajectory
    # mode admits every group at once, so they are the batches' completion times.
    waves = []
    for w in range(args.batches):
        part = [g for _, g in gs[w * args.batch_groups:(w + 1) * args.batch_groups]]
        waves.append(round(max(g.done_at for g in part) - min(g.opened_at for g in part), 3))
    res = sched.results
    n = max(1, len(res))
    sizes = [s for p in proxies for s in p.batcher.sizes]
    trajs = {r.seed: [t.action for t in r.turns] for r in res}
    shape = [(r.group_index, r.seed, len(r.turns)) for r in res]
    out = {
        "mode": mode,
        "sigma": sigma,
        "span_s": round(span, 3),
        "per_batch_s": round(span / args.batches, 3),
        "batch_spans_s": waves,
        "startup_s": round(t_ready - t_node, 3),
        "node_wall_s": round(t_done - t_ready, 3),
        "trajectories": len(res),
        "outcomes": sched.summary(),
        "turns_total": sum(len(r.turns) for r in res),
        "mean_turns": round(sum(len(r.turns) for r in res) / n, 3),
        "max_turns_seen": max((len(r.turns) for r in res), default=0),
        "success_rate": round(sum(r.success for r in res) / n, 3),
        "stop_reasons": {s: sum(r.stop_reason == s for r in res)
                         for s in sorted({r.stop_reason for r in res})},
        "mean_stage_s": {k: round(sum(r.timings.get(k, 0.0) for r in res) / n, 4)
                         for k in ("reset", "generate", "step", "wait")},
        "generate_batches": len(sizes),
        "generate_batch_mean": round(sum(sizes) / max(1, len(sizes)), 2),
        "generate_batch_max": max(sizes, default=0),
        "generate_batch_hist": {str(k): sizes.count(k) for k in sorted(set(sizes))},
        "engine_busy_s": round(sum(p.batcher.busy_s for p in proxies), 3),
        "env_stats": {k: v for e in envs for k, v in e.stats.items()},
        "loadavg_start": load_start,
        "loadavg_end": loadavg(),
    }
    waiting = [getattr(p.batcher, "waiting_sizes", None) for p in proxies]
    out["_waiting"] = None if any(w is None for w in waiting) else [x for w in waiting for x in w]
    out["_trajs"], out["_shape"] = trajs, shape
    return out


def env_only(args, sigma: float, shape: list[tuple[int, int, int]]) -> dict:
    """Env latency alone, per batch, from the very draws the envs made (the same RNG as
    :class:`latency_envs.LatencyLake`): in batch mode a wave pays, turn by turn,
    the slowest step of its trajectories still running; in trajectory mode, with perfect
    packing, the batch's slots share the total latency (sum over trajectories / concurrency).
    Generation, overheads and the tail of the last batch are left out."""
    import random

    lat: dict[int, list[float]] = {}
    waves: dict[int, list[int]] = {}
    for g, seed, turns in shape:
        rng = random.Random(f"latency:{seed}")
        lat[seed] = [max(0.0, rng.gauss(args.mu, sigma)) * args.unit for _ in range(turns)]
        waves.setdefault(g // args.batch_groups, []).append(seed)
    batch = sum(max((lat[s][t] for s in members if t < len(lat[s])), default=0.0)
                for members in waves.values()
                for t in range(max(len(lat[s]) for s in members))) / max(1, len(waves))
    traj = sum(map(sum, lat.values())) / args.concurrency / max(1, len(waves))
    return {"batch_s": round(batch, 3), "trajectory_s": round(traj, 3),
            "ratio": round(batch / traj, 3) if traj else None}


def _same(a: dict, b: dict) -> float:
    keys = set(a) | set(b)
    return sum(a.get(k) == b.get(k) for k in keys) / max(1, len(keys))


async def measurements(args, url: str | None, engine, model_dir: Path,
                       run_dir: Path) -> tuple[list[dict], dict]:
    """The rollout modes (unless ``--proxy-vs-direct``), then proxy vs direct."""
    runs = [] if args.proxy_vs_direct else await suite(args, url, engine, model_dir, run_dir)
    return runs, await proxy_vs_direct(args, url, engine, model_dir, run_dir)


async def suite(args, url: str | None, engine, model_dir: Path, run_dir: Path) -> list[dict]:
    runs: list[dict] = []
    total = len(args.sigmas) * args.reps * 2
    k = 0
    for si, sigma in enumerate(args.sigmas):
        for rep in range(args.reps):
            order = in_turn(MODES, si + rep)
            for mode in order:
                k += 1
                label = f"sigma={sigma:g} rep {rep + 1}/{args.reps} {mode}"
                say(f"[{k}/{total}] {label}: {args.batches} batches x "
                             f"{args.batch_groups * args.group_size} trajectories, load "
                             f"{loadavg()[0]}")
                r = await measure(args, mode=mode, sigma=sigma, engine=engine,
                                  model_dir=model_dir, run_dir=run_dir, url=url, label=label)
                r["rep"], r["order"] = rep, order.index(mode)
                spans = "wave durations" if mode == "batch" else "batches done at"
                say(f"[{k}/{total}] {label}: {r['per_batch_s']:.2f} s/batch "
                             f"({spans} {r['batch_spans_s']}), {r['mean_turns']:.2f} turns/traj, "
                             f"generate batch mean {r['generate_batch_mean']:.1f} over "
                             f"{r['generate_batches']} batches")
                runs.append(r)
    return runs


def summarize(args, runs: list[dict]) -> list[dict]:
    rows = []
    for sigma in args.sigmas:
        by = {mo: [r for r in runs if r["sigma"] == sigma and r["mode"] == mo] for mo in MODES}
        t = {mo: statistics.median(r["per_batch_s"] for r in by[mo]) for mo in MODES}
        ratio = t["batch"] / t["trajectory"]
        per_rep = [round(b["per_batch_s"] / tr["per_batch_s"], 3)
                   for tr, b in zip(by["trajectory"], by["batch"])]
        same = [_same(tr["_trajs"], b["_trajs"]) for tr, b in zip(by["trajectory"], by["batch"])]
        target, source = paper_target(sigma)
        eo = env_only(args, sigma, by["batch"][0]["_shape"])
        rows.append({
            "sigma": sigma,
            "sigma_s": round(sigma * args.unit, 4),
            "trajectory_per_batch_s": round(t["trajectory"], 3),
            "batch_per_batch_s": round(t["batch"], 3),
            "ratio": round(ratio, 3),
            "ratio_per_rep": per_rep,
            "target": target,
            "target_source": source,
            "pass": ratio >= target,
            "same_trajectories": round(min(same), 3),
            "env_only": eo,
            "engine_busy_per_batch_s": {mo: round(statistics.mean(r["engine_busy_s"] for r in by[mo])
                                                  / args.batches, 3) for mo in MODES},
            "generate_batch_mean": {mo: round(statistics.mean(r["generate_batch_mean"]
                                                              for r in by[mo]), 2) for mo in MODES},
            "mean_stage_s": {mo: {k: round(statistics.mean(r["mean_stage_s"][k] for r in by[mo]), 3)
                                  for k in by[mo][0]["mean_stage_s"]} for mo in MODES},
            "mean_turns": by["trajectory"][0]["mean_turns"],
        })
    return rows


# -- through the LLMProxy vs the engine called directly --------------------------------------
PVD_TARGET = 0.9
"""Tokens/s through the LLMProxy over tokens/s of the engine called directly in lock step."""
PVD_PATHS = ("direct", "proxy", "proxy_batch")
"""direct: ``rollout_lockstep`` on the engine; proxy: the actors in ``rollout.mode:
trajectory`` (the measurement the target is about); proxy_batch: the actors in ``rollout.mode:
batch`` (one wave of every trajectory: full engine calls, so it shows the cost of the actors
and the bus alone)."""
PVD_MODES = {"proxy": "trajectory", "proxy_batch": "batch"}


class CountingEngine:
    """The synchronous engine, counting what passes through ``generate``: calls, rows per
    call, generated tokens, seconds in calls, rows that named a ``session``, and (once
    ``queued`` is set to the BatchedEngine's queue length) the requests queued when each call
    ended, i.e. those that arrived while it ran. Everything else is the engine's own."""

    def __init__(self, engine) -> None:
        self._engine = engine
        try:
            self._stoppable = "stop_rows" in inspect.signature(engine.generate).parameters
        except (TypeError, ValueError):
            self._stoppable = False
        self.reset()

    def reset(self) -> None:
        self.rows: list[int] = []
        self.tokens = 0
        self.busy_s = 0.0
        self.with_session = 0
        self.queued_after: list[int] = []
        self.queued = None

    def __getattr__(self, name: str):
        if name == "_engine":
            raise AttributeError(name)
        return getattr(self._engine, name)

    def generate(self, inputs, stop_rows=None):
        t0 = time.perf_counter()
        if stop_rows is not None and self._stoppable:
            outs = self._engine.generate(inputs, stop_rows=stop_rows)
        else:
            outs = self._engine.generate(inputs)
        self.busy_s += time.perf_counter() - t0
        self.rows.append(len(inputs))
        self.tokens += sum(len(o.token_ids) for o in outs)
        self.with_session += sum(bool(getattr(i, "session", "")) for i in inputs)
        if self.queued is not None:
            self.queued_after.append(int(self.queued()))
        return outs


def clear_kv(engine) -> int | None:
    """Forget every session's K/V in the engine, so that neither path starts from the other's
    cache (both name sessions by trajectory id). Returns the number of sessions dropped, or
    None if the engine has no ``clear_kv`` (no session cache to clear)."""
    fn = _engine_method(engine, "clear_kv")
    return fn() if fn is not None else None


def _engine_method(engine, name: str):
    """``engine.<name>``, or else that of the engine a wrapper drives (a CountingEngine's
    ``_engine``, a BatchedEngine's ``engine``); None if there is none."""
    for _ in range(4):  # wrappers nest a few deep at most
        fn = getattr(engine, name, None)
        if callable(fn):
            return fn
        inner = getattr(engine, "_engine", None)
        engine = inner if inner is not None else getattr(engine, "engine", None)
        if engine is None:
            break
    return None


def kv_counters(engine) -> dict[str, float]:
    """The engine's ``kv_stats()`` (through wrappers) as floats; {} if it has none."""
    fn = _engine_method(engine, "kv_stats")
    if not callable(fn):
        return {}
    try:
        return {k: float(v) for k, v in fn().items() if isinstance(v, (int, float))}
    except Exception:  # noqa: BLE001 - statistics only
        return {}


def warm_rows(args, engine, model_dir: Path, n: int) -> None:
    """One untimed engine call of ``n`` first-turn rows (the first call of a size allocates)."""
    from rollart.actors.env.chat import ChatFormat
    from rollart.engines.base import GenInput
    from rollart.envs.frozenlake import INSTRUCTION, FrozenLakeEnv

    chat = ChatFormat.load(model_dir)
    env = FrozenLakeEnv(random_map=True)
    prompt = chat.first_prompt(args.instruction or INSTRUCTION, env.reset(0)[0])
    choices = [chat.encode(a) for a in env.legal_actions()]
    engine.generate([GenInput(prompt_ids=prompt, max_new_tokens=1, choices=choices, greedy=True)
                     for _ in range(n)])


def pvd_args(args) -> argparse.Namespace:
    """The settings of this measurement: the script's, with no env latency and
    ``pvd_groups`` x ``group_size`` trajectories all in flight at once, in one batch."""
    a = argparse.Namespace(**vars(args))
    a.batch_groups = args.pvd_groups
    a.concurrency = args.pvd_groups * args.group_size
    a.batches, a.mu = 1, 0.0
    return a


def _path_stats(path: str, wall: float, eng: CountingEngine, kv0: dict, kv1: dict,
                trajs: dict, load: tuple[list[float], list[float]]) -> dict:
    rows = eng.rows
    n = max(1, len(rows))
    out = {
        "path": path,
        "wall_s": round(wall, 3),
        "tokens": eng.tokens,
        "tokens_per_s": round(eng.tokens / wall, 2) if wall > 0 else None,
        "engine_calls": len(rows),
        "mean_rows": round(sum(rows) / n, 2),
        "rows_hist": {str(k): rows.count(k) for k in sorted(set(rows))},
        "engine_s": round(eng.busy_s, 3),
        "engine_tokens_per_s": round(eng.tokens / eng.busy_s, 2) if eng.busy_s > 0 else None,
        "rows_with_session": round(eng.with_session / max(1, sum(rows)), 3),
        "turns": sum(len(v) for v in trajs.values()),
        "trajectories": len(trajs),
        "loadavg_start": load[0],
        "loadavg_end": load[1],
    }
    reused = kv1.get("reused_tokens", 0.0) - kv0.get("reused_tokens", 0.0)
    pre = kv1.get("prefilled_tokens", 0.0) - kv0.get("prefilled_tokens", 0.0)
    out["kv_reused_share"] = round(reused / (reused + pre), 3) if reused + pre > 0 else None
    return out


def run_direct(args, eng: CountingEngine, model_dir: Path, run_dir: Path) -> dict:
    """The same trajectories as the proxy path, rolled out by ``plain_loop.rollout_lockstep``:
    one engine call per turn over every live trajectory, in this thread."""
    from plain_loop import rollout_lockstep

    from rollart.actors.groups.admission import group_id, member_seed
    from rollart.actors.env.chat import ChatFormat

    a = pvd_args(args)
    cfg = make_cfg(a, mode="trajectory", sigma=0.0, model_dir=model_dir, run_dir=run_dir)
    r = cfg.rollout
    tasks = [(f"{group_id(g)}-{i}", g, member_seed(r, g, i))
             for g in range(a.batch_groups) for i in range(r.group_size)]
    chat = ChatFormat.load(model_dir)
    eng.reset()
    kv_cleared = clear_kv(eng._engine)
    kv0, load0 = kv_counters(eng), loadavg()
    t0 = time.perf_counter()
    res = rollout_lockstep(eng, chat, cfg.envs[r.env], tasks, greedy=not args.sample)
    wall = time.perf_counter() - t0
    trajs = {x.seed: [t.action for t in x.turns] for x in res}
    out = _path_stats("direct", wall, eng, kv0, kv_counters(eng), trajs, (load0, loadavg()))
    out["kv_cleared_before"] = kv_cleared
    out["_trajs"] = trajs
    return out


async def run_proxy(args, path: str, eng: CountingEngine, model_dir: Path, run_dir: Path,
                    url: str | None, label: str) -> dict:
    """The real actors (scheduler, EnvManager, LLMProxy on the bus) in ``PVD_MODES[path]``."""
    a = pvd_args(args)
    eng.reset()
    kv_cleared = clear_kv(eng._engine)
    kv0 = kv_counters(eng)

    def ready(proxies) -> None:
        b = proxies[0].batcher
        if b is not None:
            eng.queued = lambda: b.queued

    r = await measure(a, mode=PVD_MODES[path], sigma=0.0, engine=eng, model_dir=model_dir,
                      run_dir=run_dir, url=url, label=label, on_ready=ready)
    out = _path_stats(path, r["span_s"], eng, kv0, kv_counters(eng), r["_trajs"],
                      (r["loadavg_start"], r["loadavg_end"]))
    w, q = r["_waiting"], eng.queued_after
    out.update({
        "node_wall_s": r["node_wall_s"],
        "batcher_calls": r["generate_batches"],
        "mean_waiting_at_cut": round(statistics.mean(w), 2) if w else None,
        "max_waiting_at_cut": max(w) if w else None,
        "mean_queued_at_call_end": round(statistics.mean(q), 2) if q else None,
        "mean_stage_s": r["mean_stage_s"],
        "kv_cleared_before": kv_cleared,
        "outcomes": r["outcomes"],
    })
    out["_trajs"] = r["_trajs"]
    return out


async def proxy_vs_direct(args, url: str | None, engine, model_dir: Path,
                          run_dir: Path) -> dict:
    """Generation through the LLMProxy against the engine called directly in lock step:
    ``args.pvd_reps`` repetitions, the order of the paths rotating."""
    a = pvd_args(args)
    n = a.batch_groups * a.group_size
    eng = CountingEngine(engine)
    runs: list[dict] = []
    t0 = time.perf_counter()
    await asyncio.to_thread(warm_rows, args, engine, model_dir, n)
    for rep in range(args.pvd_reps):
        k = rep % len(PVD_PATHS)
        order = PVD_PATHS[k:] + PVD_PATHS[:k]
        for path in order:
            label = f"proxy-vs-direct rep {rep + 1}/{args.pvd_reps} {path}"
            say(f"{label}: {n} trajectories in flight, load {loadavg()[0]}")
            if path == "direct":
                r = await asyncio.to_thread(run_direct, args, eng, model_dir, run_dir)
            else:
                r = await run_proxy(args, path, eng, model_dir, run_dir, url, label)
            r["rep"], r["order"] = rep, order.index(path)
            say(f"{label}: {r['wall_s']:.2f} s, {r['tokens']} tokens, "
                         f"{r['tokens_per_s']:.1f} tok/s, {r['engine_calls']} engine calls, "
                         f"{r['mean_rows']:.1f} rows/call"
                         + (f", {r['mean_queued_at_call_end']} queued at call end"
                            if r.get("mean_queued_at_call_end") is not None else ""))
            runs.append(r)
    by = {p: [r for r in runs if r["path"] == p] for p in PVD_PATHS}
    med = {p: {k: statistics.median(r[k] for r in by[p])
               for k in ("wall_s", "tokens", "tokens_per_s", "engine_calls", "mean_rows",
                         "engine_s")} for p in PVD_PATHS}
    ratio = med["proxy"]["tokens_per_s"] / med["direct"]["tokens_per_s"]
    same = [_same(d["_trajs"], p["_trajs"]) for d, *ps in zip(*(by[q] for q in PVD_PATHS))
            for p in ps]

    def _med(path: str, key: str):
        vals = [r[key] for r in by[path] if r.get(key) is not None]
        return round(statistics.median(vals), 2) if vals else None

    def _ratios(path: str) -> list[float]:
        return [round(p["tokens_per_s"] / d["tokens_per_s"], 3)
                for d, p in zip(by["direct"], by[path])]

    summary = {
        "trajectories": n,
        "median": {p: {k: round(v, 3) for k, v in med[p].items()} for p in PVD_PATHS},
        "ratio": round(ratio, 3),
        "ratio_per_rep": _ratios("proxy"),
        "engine_s_ratio": round(med["proxy"]["engine_s"] / med["direct"]["engine_s"], 3),
        "target": PVD_TARGET,
        "pass": ratio >= PVD_TARGET,
        "ratio_batch_mode": round(med["proxy_batch"]["tokens_per_s"]
                                  / med["direct"]["tokens_per_s"], 3),
        "ratio_batch_mode_per_rep": _ratios("proxy_batch"),
        "engine_s_ratio_batch_mode": round(med["proxy_batch"]["engine_s"]
                                           / med["direct"]["engine_s"], 3),
        "same_trajectories": round(min(same), 3),
        "mean_waiting_at_cut": {q: _med(q, "mean_waiting_at_cut") for q in PVD_MODES},
        "mean_queued_at_call_end": {q: _med(q, "mean_queued_at_call_end") for q in PVD_MODES},
        "rows_with_session": {p: by[p][0]["rows_with_session"] for p in PVD_PATHS},
        "kv_reused_share": {p: by[p][0]["kv_reused_share"] for p in PVD_PATHS},
        "turns": by["direct"][0]["turns"],
    }
    for r in runs:
        r.pop("_trajs", None)
    return {
        "timestamp": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "config": {"groups": a.batch_groups, "group_size": a.group_size,
                   "concurrency": a.concurrency, "env": ENV_TYPES[a.env_kind],
                   "mu": a.mu, "sigma": 0.0, "max_turns": a.max_turns, "reps": args.pvd_reps,
                   "greedy": not args.sample, "bus": args.bus, "gather_ms": args.gather_ms,
                   "max_batch": args.max_batch, "threads": args.threads, "seed": args.seed},
        "summary": summary,
        "runs": runs,
        "total_s": round(time.perf_counter() - t0, 1),
    }


def modes_table(results: dict) -> str:
    """A row per sigma: the two modes' seconds per batch, their ratio against the paper's."""
    rows = [[f"{r['sigma']:g} / {r['sigma_s'] * 1e3:g}", f"{r['trajectory_per_batch_s']:.2f}",
             f"{r['batch_per_batch_s']:.2f}", f"{r['ratio']:.2f}x",
             ", ".join(f"{x:.2f}" for x in r["ratio_per_rep"]),
             f">= {r['target']}x", "pass" if r["pass"] else "**fail**",
             f"{r['env_only']['ratio']:.2f}x",
             f"{r['engine_busy_per_batch_s']['trajectory']:.2f} / {r['engine_busy_per_batch_s']['batch']:.2f}",
             f"{min(1.0, r['same_trajectories']):.0%}"] for r in results["summary"]]
    return table(["sigma (units / ms)", "trajectory (s/batch)", "batch (s/batch)", "ratio",
                  "per repetition", "paper", "result", "env latency only", "engine busy traj / batch",
                  "same trajectories"], rows)


def pvd_table(pvd: dict) -> str:
    """A row per path of the proxy-vs-direct measurement."""
    s = pvd["summary"]
    names = {"direct": "direct", "proxy": "proxy, trajectory mode", "proxy_batch": "proxy, batch mode"}
    ratios = {"direct": "1.00", "proxy": f"{s['ratio']:.2f}", "proxy_batch": f"{s['ratio_batch_mode']:.2f}"}
    rows = [[names[p], f"{m['wall_s']:.2f}", f"{m['tokens']:.0f}", f"{m['tokens_per_s']:.1f}",
             ratios[p], f"{m['engine_calls']:.0f}", f"{m['mean_rows']:.1f}", f"{m['engine_s']:.2f}",
             None if s["kv_reused_share"].get(p) is None else f"{s['kv_reused_share'][p]:.0%}"]
            for p, m in ((p, s["median"][p]) for p in PVD_PATHS)]
    return table(["path", "wall (s)", "generated tokens", "tokens/s", "/ direct", "engine calls",
                  "rows per call", "engine time (s)", "prompt tokens from KV cache"], rows)


def readme_section(results: dict) -> str:
    """The README section: the rollout modes and proxy vs direct (each when measured)."""
    c, pvd = results["config"], results.get("proxy_vs_direct")
    s = pvd["summary"] if pvd else {}
    return render(
        "rollout_modes", mu=f"{c['mu']:g}", unit_ms=f"{c['unit'] * 1e3:g}", batches=c["batches"],
        wave=c["batch_groups"] * c["group_size"], concurrency=c["concurrency"], reps=c["reps"],
        modes_table=modes_table(results) if results.get("summary") else "Not measured yet.",
        pvd_table=pvd_table(pvd) if pvd else "Not measured yet.",
        pvd_trajectories=s.get("trajectories", "-"), pvd_ratio=f"{s.get('ratio', 0):.2f}",
        pvd_target=s.get("target", "-"), pvd_verdict="pass" if s.get("pass") else "**fail**",
        pvd_same=f"{s.get('same_trajectories', 0):.0%}",
        machine=describe_machine(results["machine"]), date=results["timestamp"][:10])


# -- main -------------------------------------------------------------------------------------
def machine_info(loop_name: str) -> dict:
    return machine("torch", "transformers", "nats-py", "rollart", event_loop=loop_name)


def build_engine(args, model_dir: Path):
    from rollart.actors.env.chat import ChatFormat
    from rollart.engines.base import GenInput
    from rollart.engines.torch_engine import TorchGenerationEngine
    from rollart.envs.frozenlake import INSTRUCTION, FrozenLakeEnv

    engine = TorchGenerationEngine(model_dir, threads=args.threads, seed=0)
    chat = ChatFormat.load(model_dir)
    env = FrozenLakeEnv(random_map=True)
    prompt = chat.first_prompt(args.instruction or INSTRUCTION, env.reset(0)[0])
    choices = [chat.encode(a) for a in env.legal_actions()]
    wave = args.batch_groups * args.group_size
    for n in (1, wave, wave):  # warm-up: the first calls pay for allocation
        engine.generate([GenInput(prompt_ids=prompt, max_new_tokens=1, choices=choices, greedy=True)
                         for _ in range(n)])
    t0 = time.perf_counter()
    engine.generate([GenInput(prompt_ids=prompt, max_new_tokens=1, choices=choices, greedy=True)
                     for _ in range(wave)])
    gen_wave = time.perf_counter() - t0
    t0 = time.perf_counter()
    engine.generate([GenInput(prompt_ids=prompt, max_new_tokens=1, choices=choices, greedy=True)])
    gen_one = time.perf_counter() - t0
    return engine, {"prompt_tokens": len(prompt), "generate_1_s": round(gen_one, 4),
                    f"generate_{wave}_s": round(gen_wave, 4)}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    add_run_flags(p, "smoke run: sigma 1 and 10, 1 batch, 1 repetition")
    p.add_argument("--proxy-vs-direct", action="store_true",
                   help="only the proxy-vs-direct measurement (no rollout modes); writes "
                        "nothing unless --write (then it replaces that part of the results "
                        "file and README section, keeping the rest)")
    p.add_argument("--pvd-reps", type=int, default=None,
                   help="proxy-vs-direct repetitions per path (default 6, --quick 1)")
    p.add_argument("--pvd-groups", type=int, default=8,
                   help="proxy-vs-direct groups, all in flight at once (default 8, x group size)")
    p.add_argument("--bus", choices=("memory", "nats"), default="memory",
                   help="MemoryBus (default) or NatsBus to an embedded nats-server")
    p.add_argument("--sigmas", default=None, help="comma-separated sigmas in units "
                   "(default 1,2,5,10; --quick 1,10)")
    p.add_argument("--mu", type=float, default=10.0, help="mean step latency in units (default 10)")
    p.add_argument("--unit", type=float, default=0.04, help="seconds per unit (default 0.04)")
    p.add_argument("--reps", type=int, default=None, help="repetitions per mode and sigma "
                   "(default 2, --quick 1)")
    p.add_argument("--batches", type=int, default=None, help="batches per measurement "
                   "(default 3, --quick 1)")
    p.add_argument("--batch-groups", type=int, default=4, help="groups per batch (default 4)")
    p.add_argument("--group-size", type=int, default=8, help="trajectories per group (default 8)")
    p.add_argument("--concurrency", type=int, default=None,
                   help="rollout.concurrency (default: trajectories per batch)")
    p.add_argument("--max-turns", type=int, default=8, help="env max_turns (default 8)")
    p.add_argument("--env-kind", choices=("thread", "async"), default="thread",
                   help="sync env sleeping in its runner thread (default) or async env")
    p.add_argument("--instruction", default=None,
                   help="system prompt (default: FrozenLake's own instruction)")
    p.add_argument("--sample", action="store_true",
                   help="sample at temperature 1 instead of greedy (trajectories then differ "
                        "between modes)")
    p.add_argument("--threads", type=int, default=1, help="torch threads (default 1)")
    p.add_argument("--gather-ms", type=float, default=2.0, help="proxy.gather_ms (default 2)")
    p.add_argument("--max-batch", type=int, default=128, help="proxy.max_batch (default 128)")
    p.add_argument("--seed", type=int, default=1000, help="base task seed (default 1000)")
    p.add_argument("--timeout", type=float, default=600.0, help="seconds per measurement at most")
    args = p.parse_args(argv)
    args.sigmas = [float(s) for s in (args.sigmas or ("1,10" if args.quick else "1,2,5,10")).split(",")]
    args.reps = args.reps or (1 if args.quick else 2)
    args.batches = args.batches or (1 if args.quick else 3)
    wave = args.batch_groups * args.group_size
    args.concurrency = args.concurrency or wave
    if args.concurrency < wave:
        p.error(f"--concurrency {args.concurrency} < {wave} trajectories per batch: batch mode "
                "needs a whole wave on the EnvManager")
    args.pvd_reps = args.pvd_reps or (1 if args.quick else 6)
    write = not args.no_write and (args.write or not (args.quick or args.proxy_vs_direct))
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    quiet_transformers()
    run, loop_name = event_loop()

    t_start = time.perf_counter()
    results: dict = {
        "benchmark": "rollout_modes",
        "timestamp": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "quick": args.quick,
        "config": {k: getattr(args, k) for k in (
            "bus", "sigmas", "mu", "unit", "reps", "batches", "batch_groups", "group_size",
            "concurrency", "max_turns", "env_kind", "instruction", "sample", "threads",
            "gather_ms", "max_batch", "seed", "proxy_vs_direct", "pvd_reps", "pvd_groups")},
        "paper": PAPER,
        "machine": machine_info(loop_name),
    }
    with tempfile.TemporaryDirectory(prefix="rollart-rollout-modes-") as tmp:
        from rollart.engines.tiny import build_tiny_model

        say(f"building the tiny model; load {loadavg()[0]}")
        model_dir = build_tiny_model(Path(tmp) / "model", seed=0)
        engine, probe = build_engine(args, model_dir)
        results["engine_probe"] = probe
        say(f"engine warm: {probe}")
        server, url = None, None
        if args.bus == "nats":
            from rollart.bus.server import EmbeddedServer

            server = EmbeddedServer(Path(tmp) / "nats").start()
            url = server.url
            say(f"nats-server at {url}")
        try:
            runs, pvd = run(measurements(args, url, engine, model_dir, Path(tmp) / "runs"))
        finally:
            if server is not None:
                server.stop()
    if runs:
        results["summary"] = summarize(args, runs)
        for r in runs:
            r.pop("_trajs", None)
            r.pop("_shape", None)
        results["runs"] = runs
        loads = [x for r in runs for x in (r["loadavg_start"][0], r["loadavg_end"][0])]
        results["machine"].update(loadavg_end=loadavg(), loadavg_min=min(loads),
                                  loadavg_max=max(loads))
        results["all_pass"] = all(r["pass"] for r in results["summary"])
    else:
        results["machine"].update(loadavg_end=loadavg())
    results["proxy_vs_direct"] = pvd
    results["proxy_vs_direct_pass"] = pvd["summary"]["pass"]
    results["total_s"] = round(time.perf_counter() - t_start, 1)

    text = json.dumps(results, indent=2)
    print(text)
    if write:
        if not runs and RESULTS.exists():  # --proxy-vs-direct alone: keep the modes' results
            with contextlib.suppress(ValueError):
                old = json.loads(RESULTS.read_text())
                old.update(proxy_vs_direct=pvd, proxy_vs_direct_pass=pvd["summary"]["pass"])
                results = old
                text = json.dumps(results, indent=2)
        store(RESULTS, results, "rollout_modes", readme_section(results))
        say(f"wrote {RESULTS} and the rollout_modes section of the README")
    for r in results["summary"] if runs else []:
        say(f"sigma {r['sigma']:g}: trajectory {r['trajectory_per_batch_s']:.2f} s/batch, "
                     f"batch {r['batch_per_batch_s']:.2f} s/batch, ratio {r['ratio']:.2f}x "
                     f"(>= {r['target']}x: {'pass' if r['pass'] else 'FAIL'})")
    ps = pvd["summary"]
    say(f"proxy vs direct ({ps['trajectories']} in flight): direct "
                 f"{ps['median']['direct']['tokens_per_s']:.1f} tok/s, proxy "
                 f"{ps['median']['proxy']['tokens_per_s']:.1f} tok/s, ratio {ps['ratio']:.2f} "
                 f"(>= {ps['target']}: {'pass' if ps['pass'] else 'FAIL'}); batch mode "
                 f"{ps['median']['proxy_batch']['tokens_per_s']:.1f} tok/s, ratio "
                 f"{ps['ratio_batch_mode']:.2f}; same trajectories {ps['same_trajectories']:.0%}")
    say(f"total {time.perf_counter() - t_start:.0f} s")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

"""The paper's experiments on an emulated cluster: the real actors and bus, emulated hardware.

::

    python benchmarks/emulate.py e1 [--quick]     # trajectory- vs batch-level env interaction
    python benchmarks/emulate.py e2 [--quick]     # redundant env rollouts, k = 0, 1, 2, 4
    python benchmarks/emulate.py e3 [--quick]     # alpha = 0, 1, 2, 4 vs fully synchronous
    python benchmarks/emulate.py e4 [--quick]     # reward as a service vs a dedicated reward GPU
    python benchmarks/emulate.py e5 [--quick]     # h800 + h20 pools with routes vs one kind
    python benchmarks/emulate.py e6 [--quick]     # 64 -> 128 -> 256 generate replicas

The expensive parts are latency models (:mod:`rollart.emulate`), plugged in through the
extension points a user has: ``actors.generate.type`` (the real ``LLMProxy`` driving an
emulated continuous-batching engine), ``envs.<name>.type`` (an emulated env) and
``actors.trainer.type`` (the real ``Trainer`` on an emulated backend). Scheduler,
EnvManagers, LLMProxy, Trainer, admission (alpha), weight-version messages and the bus
(in-process ``MemoryBus``, or an embedded nats-server with ``--bus nats``) are rollart's own.

Each experiment prints JSON (stdout) and, unless ``--quick``, writes
``benchmarks/results/emulate_<exp>.json`` and its section of ``benchmarks/README.md``
(``<!-- emulate_<exp>:begin -->``). For every configuration it reports the paper's number,
the **ideal** (the critical path of the very latencies the emulated components drew in that
run, see :func:`fifo_makespan` / :func:`pipeline_ideal`), rollart's **measured** wall time and
**efficiency** = ideal / measured; with a trainer, the share of its wall time spent waiting
for a batch. ``--quick`` (< 2 minutes) checks that it runs and that the accounting adds up
(ideal <= measured, fractions in [0, 1]), not speed.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import heapq
import json
import os
import platform
import sys
import tempfile
import time
import uuid
from pathlib import Path
from typing import Any

# HERE is read by tests/e2e/test_emulate.py as this module's (the README beside it)
from common import (HERE, RESULTS, in_turn, open_bus, public, render, replace_section, sayer, table,  # noqa: F401
                    until_done)

from rollart.actors.groups.admission import group_id, member_id, member_seed
import msgspec

from rollart.config import ActorConfig, RunConfig, convert
from rollart.emulate.env import EmulatedEnv
from rollart.emulate.profiles import PROFILES
from rollart.emulate.records import RECORDS
from rollart.node import Node
from rollart.node.build import rollout_actors, training_actors

EMULATED = "emulated"
ENGINE_TYPE = "rollart.emulate.engine:EmulatedLLMProxy"
ENV_TYPE = "rollart.emulate.env:EmulatedEnv"
TRAINER_TYPE = "rollart.emulate.trainer:EmulatedTrainer"
PAPER_E1 = {1: 1.23, 10: 2.27}
"""Trajectory- over batch-level env interaction, Gaussian latency sigma 1-10: 1.23-2.27x."""
PAPER_E3 = (2.65, 4.58)
"""Normalised throughput vs the synchronous baseline: 2.65-4.58x."""
EXPERIMENTS = ("e1", "e2", "e3", "e4", "e5", "e6")
TOL = 0.02
"""An ideal may exceed the measured time by this fraction (timer granularity) before the
accounting is called wrong."""


say = sayer("emulate")


# -- the critical path ---------------------------------------------------------------------
def fifo_makespan(chains: list[tuple[float, float]], slots: int) -> float:
    """Makespan of ``(release, duration)`` jobs run in the given order on ``slots`` identical
    slots, each starting on the first free slot at or after its release (the EnvManager's
    FIFO over its ``rollout.concurrency`` places, with zero overhead)."""
    free = [0.0] * max(1, slots)
    heapq.heapify(free)
    end = 0.0
    for release, dur in chains:
        t = max(heapq.heappop(free), release)
        heapq.heappush(free, t + dur)
        end = max(end, t + dur)
    return end


def chain_of(seed: int, traj_id: str, turns: int) -> dict[str, float]:
    """One trajectory's modelled critical path: its resets (failed tries too), and for each
    turn its generation (queue + prefill + decode at the batch it ran in) then its env step."""
    env = RECORDS.env[seed]
    gen = RECORDS.gen.get(traj_id, [])
    gens = [g["queue_s"] + g["model_s"] for g in gen[:turns]]
    steps = env["steps_s"][:turns]
    reset = env["reset_s"] + sum(env.get("failed_reset_s", []))
    return {"reset": reset, "gen": sum(gens), "step": sum(steps),
            "total": reset + sum(gens) + sum(steps), "gens": gens, "steps": steps}


def lockstep_wave(members: list[dict]) -> dict[str, float]:
    """A batch-mode wave: every member resets, then each turn all live members generate and
    then all step, each phase as long as its slowest member."""
    reset = max(c["reset"] for c in members)
    turns = max(len(c["gens"]) for c in members)
    gen = sum(max((c["gens"][t] for c in members if t < len(c["gens"])), default=0.0)
              for t in range(turns))
    step = sum(max((c["steps"][t] for c in members if t < len(c["steps"])), default=0.0)
               for t in range(turns))
    return {"reset": reset, "gen": gen, "step": step, "total": reset + gen + step}


def pipeline_ideal(batches: list[list[dict]], train: list[float], *, alpha: int, slots: int,
                   lockstep: bool, loads: list[float]) -> dict[str, Any]:
    """The critical path of a training run with asynchrony bound ``alpha``: batch ``j``'s
    groups are admitted once the policy reaches version ``j - alpha`` (the end of step
    ``j - alpha - 1``, plus ``loads[j - alpha - 1]`` if given), its trajectories run on
    ``slots`` env places (``lockstep``: as one wave), step ``j`` starts when batch ``j`` is
    complete and step ``j - 1`` is done and takes ``train[j]`` (train + publish)."""
    ends: list[float] = []
    ready: list[float] = []
    free = [0.0] * max(1, slots)
    waits = 0.0
    for j, members in enumerate(batches):
        k = j - alpha - 1
        release = 0.0 if k < 0 else ends[k] + (loads[k] if k < len(loads) else 0.0)
        if lockstep:
            prev = ready[-1] if ready else 0.0
            done = max(release, prev) + lockstep_wave(members)["total"]
        else:
            done = 0.0
            for c in members:
                t = max(heapq.heappop(free), release)
                heapq.heappush(free, t + c["total"])
                done = max(done, t + c["total"])
        ready.append(done)
        start = max(done, ends[-1] if ends else 0.0)
        waits += start - (ends[-1] if ends else 0.0)
        ends.append(start + train[j])
    total = ends[-1] if ends else 0.0
    return {"total_s": total, "wait_share": waits / total if total else 0.0,
            "step_ends_s": [round(e, 3) for e in ends]}


# -- running the actors ----------------------------------------------------------------------
def emulated_model(args) -> Path:
    """A model folder for the emulated engine: the tiny model's tokenizer and config with a
    long context (``max_position_embeddings``), no weights (nothing loads them)."""
    import shutil

    out = args.run_dir / "_emulated_model"
    if (out / "config.json").exists():
        return out
    # optional dependency: provision builds the tiny model with torch
    from rollart.engines.provision import model_dir

    src = model_dir(convert({"run": "emulate-model", "run_dir": str(args.run_dir)}, RunConfig))
    tmp = args.run_dir / f"_emulated_model.tmp{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    for f in src.iterdir():
        if f.is_file() and not f.name.endswith((".safetensors", ".bin", ".pt")):
            shutil.copy2(f, tmp / f.name)
    cfg = json.loads((tmp / "config.json").read_text())
    cfg["max_position_embeddings"] = 131072
    (tmp / "config.json").write_text(json.dumps(cfg, indent=1))
    os.replace(tmp, out)
    return out


def base_cfg(args, *, env_args: dict, mode: str, alpha: int, engine: dict, max_turns: int,
             trainer: dict | None = None, steps: int = 1, redundancy: int = 0,
             extra: dict | None = None) -> RunConfig:
    actors: dict[str, Any] = {
        "generate": {"type": ENGINE_TYPE, "replicas": args.replicas, "args": {"emulate": engine}},
        "reward": {"replicas": 0}}
    if trainer is not None:
        actors["trainer"] = {"type": TRAINER_TYPE, "args": {"emulate": trainer}}
    return convert({
        "run": f"em{uuid.uuid4().hex[:8]}",
        "run_dir": str(args.run_dir),
        "model": {"threads": 1, "path": str(emulated_model(args))},
        "envs": {"main": {"type": ENV_TYPE, "args": env_args, "max_turns": max_turns,
                          "max_context_tokens": 16384, "step_timeout": 3600.0,
                          "reset_timeout": 3600.0, "reset_retries": 8, "check": False,
                          "sampling": {"max_new_tokens": args.max_new_tokens}}},
        "rollout": {"mode": mode, "group_size": args.group_size, "redundancy": redundancy,
                    "batch_groups": args.batch_groups, "concurrency": args.concurrency,
                    "same_seed_per_group": False, "seed": args.seed, "alpha": alpha,
                    "generate_timeout": 3600.0, "ack_wait": 3600.0},
        "trainer": {"steps": steps, "stall_after": 3600.0, "full_checkpoint_every": 1000},
        "actors": actors, **(extra or {}),
    }, RunConfig)


def slug(label: str) -> str:
    return "".join(c if c.isalnum() or c in ".-" else "_" for c in label).strip("_")


@contextlib.contextmanager
def traced(args, label: str):
    """With ``--gantt DIR``: trace this run (``traces.jsonl`` in a folder of its own) and draw
    its trajectory Gantt (``rollart report``'s) to ``DIR/emulate-<label>.png`` when it ends.
    Tracing costs CPU per span, so a traced run is a picture, not a measurement."""
    if args.gantt is None:
        yield
        return
    from rollart.app import trace_report as tr
    from rollart.config import TracingConfig
    from rollart.telemetry.tracing import setup_tracing

    folder = args.run_dir / "traces" / slug(label)
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "traces.jsonl").unlink(missing_ok=True)
    stop = setup_tracing(TracingConfig(exporter="jsonl"), "rollart-emulate", folder)
    try:
        yield
    finally:
        stop()  # flushes
    traces = tr.load(folder)
    if traces is None:
        raise RuntimeError(f"{label}: no traces were written to {folder}")
    out = args.gantt / f"emulate-{slug(label)}.png"
    tr.plot_gantt(tr.trajectory_rows(traces), tr.step_rows(traces), out,
                  title=f"{label} (emulated hardware, real actors)")
    say(f"{label}: Gantt in {out}")


async def run_rollout(args, cfg: RunConfig, groups: int, label: str) -> dict:
    with traced(args, label):
        return await _run_rollout(args, cfg, groups, label)


async def _run_rollout(args, cfg: RunConfig, groups: int, label: str) -> dict:
    RECORDS.clear()
    async with open_bus(args.bus) as bus:
        sched, actors = rollout_actors(cfg, groups=groups, bounded=False, keep_results=True)
        async with Node(bus, actors, heartbeat_every=0):
            cpu0 = time.process_time()
            await until_done(sched, args.timeout, label, groups)
            cpu = time.process_time() - cpu0
        engines = [a._emulated for a in actors if a.role == "generate"]
    gs = sorted(sched.groups.items())
    span = max(g.done_at for _, g in gs) - min(g.opened_at for _, g in gs)
    res = sorted(sched.results, key=lambda r: (r.group_index, r.index_in_group))
    chains = [(r.group_index, chain_of(r.seed, r.traj_id, len(r.turns))) for r in res]
    return {"span_s": span, "results": res, "chains": chains, "cpu_s": cpu,
            "outcomes": sched.summary(),
            "engine": [e.stats() for e in engines if e is not None]}


async def run_training(args, cfg: RunConfig, label: str) -> dict:
    with traced(args, label):
        return await _run_training(args, cfg, label)


async def _run_training(args, cfg: RunConfig, label: str, bus: str | None = None) -> dict:
    """One run of ``cfg`` to its last step on ``bus`` (default ``args.bus``): its wall time,
    the trainer's rows, the trainer, the actors and the emulated engines' stats."""
    RECORDS.clear()
    async with open_bus(bus or args.bus) as bus:
        sched, trainer, actors = training_actors(cfg)
        t0 = None
        async with Node(bus, actors, heartbeat_every=0):
            t0 = time.perf_counter()
            try:
                await asyncio.wait_for(trainer.finished.wait(), args.timeout)
            except TimeoutError:
                raise TimeoutError(f"{label}: trainer at version {trainer.version} of "
                                   f"{cfg.trainer.steps} after {args.timeout:.0f} s") from None
            wall = time.perf_counter() - t0
        engines = [a._emulated for a in actors if a.role == "generate"]
    if trainer.failure:
        raise RuntimeError(f"{label}: {trainer.failure}")
    rows = list(trainer.history)
    return {"wall_s": wall, "rows": rows, "trainer": trainer, "actors": actors,
            "engine": [e.stats() for e in engines if e is not None]}


# -- E1 -------------------------------------------------------------------------------------
E1_SIGMAS = (1.0, 2.0, 5.0, 10.0)


def e1_env(args, sigma: float) -> dict:
    return {"step_mu": args.step_mu, "step_sigma": sigma, "step_dist": "gauss",
            "reset_mu": args.reset_mu, "reset_sigma": args.reset_mu / 5, "turns": [3, 6],
            "success": 0.5, "obs_words": 16, "time_scale": args.time_scale}


def e1_engine(args) -> dict:
    return {"profile": args.profile, "time_scale": args.time_scale, "out_mean": args.out_mean,
            "out_sigma": 0.5}


async def e1(args) -> dict:
    sigmas = (1.0, 10.0) if args.quick else E1_SIGMAS
    groups = args.batches * args.batch_groups
    rows = []
    for si, sigma in enumerate(sigmas):
        by: dict[str, dict] = {}
        for mode in in_turn(("trajectory", "batch"), si):
            label = f"e1 sigma={sigma:g} {mode}"
            say(f"{label}: {groups} groups x {args.group_size}, concurrency {args.concurrency}")
            cfg = base_cfg(args, env_args=e1_env(args, sigma), mode=mode, alpha=0,
                           engine=e1_engine(args), max_turns=8)
            r = await run_rollout(args, cfg, groups, label)
            per_group: dict[int, list[dict]] = {}
            for g, c in r["chains"]:
                per_group.setdefault(g, []).append(c)
            scale = args.time_scale
            if mode == "trajectory":
                chains = [c for _, c in r["chains"]]
                ideal_model = fifo_makespan([(0.0, c["total"]) for c in chains], args.concurrency)
                bound = max(max(c["total"] for c in chains),
                            sum(c["total"] for c in chains) / args.concurrency)
            else:
                waves = []
                for w in range(args.batches):
                    members = [c for g in range(w * args.batch_groups, (w + 1) * args.batch_groups)
                               for c in per_group.get(g, [])]
                    if members:
                        waves.append(lockstep_wave(members))
                ideal_model = sum(wv["total"] for wv in waves)
                bound = ideal_model
            ideal = ideal_model * scale
            measured = r["span_s"]
            n = len(r["chains"])
            by[mode] = {
                "mode": mode, "measured_s": round(measured, 4), "ideal_s": round(ideal, 4),
                "lower_bound_s": round(bound * scale, 4),
                "efficiency": round(ideal / measured, 4) if measured else None,
                "per_batch_measured_s": round(measured / args.batches, 4),
                "per_batch_ideal_model_s": round(ideal_model / args.batches, 3),
                "trajectories": n, "outcomes": r["outcomes"],
                "mean_stage_model_s": {k: round(sum(c[k] for _, c in r["chains"]) / max(1, n), 3)
                                       for k in ("reset", "gen", "step")},
                "engine": r["engine"],
            }
            say(f"{label}: measured {measured:.2f} s, ideal {ideal:.2f} s "
                f"(efficiency {by[mode]['efficiency']})")
        t, b = by["trajectory"], by["batch"]
        rows.append({
            "sigma_model_s": sigma, "step_mu_model_s": args.step_mu,
            "paper_speedup": PAPER_E1.get(int(sigma)),
            "paper_range": [1.23, 2.27],
            "ideal_speedup": round(b["ideal_s"] / t["ideal_s"], 3),
            "measured_speedup": round(b["measured_s"] / t["measured_s"], 3),
            "efficiency_trajectory": t["efficiency"], "efficiency_batch": b["efficiency"],
            "trajectory": t, "batch": b,
            "trainer_wait_share": None,
        })
    return {"experiment": "e1", "emulated": ["generation engine", "env"], "rows": rows}


# -- E2 -------------------------------------------------------------------------------------
E2_KS = (0, 1, 2, 4)
PAPER_E2 = 1.62
"""Redundant env rollouts (GEM-math): up to 1.62x faster trajectory generation."""


def e2_env(args) -> dict:
    """Heavy-tailed env latency: lognormal resets and steps whose standard deviation is
    ``--tail`` times their mean (a few envs of every batch are many times slower)."""
    return {"reset_mu": args.reset_mu, "reset_sigma": args.reset_mu * args.tail,
            "reset_dist": "lognormal", "step_mu": args.step_mu,
            "step_sigma": args.step_mu * args.tail, "step_dist": "lognormal", "turns": [2, 4],
            "success": 0.5, "obs_words": 16, "time_scale": args.time_scale}


def planned_env_s(env_args: dict, seed: int) -> float:
    """The env time trajectory ``seed`` would spend if it ran to its end (its reset, failed
    tries and every planned step), from the env's own deterministic draws."""
    p = EmulatedEnv(**env_args).plan(seed)
    return p["reset_s"] + sum(p["failed_reset_s"]) + sum(p["steps_s"])


def redundant_ideal(members: list[list[float]], need: int) -> float:
    """One batch whose members all start at once (concurrency covers every member): a group
    is delivered by its ``need``-th fastest chain, the batch by its slowest group."""
    return max(sorted(chains)[need - 1] for chains in members) if members else 0.0


async def e2(args) -> dict:
    ks = (0, 2) if args.quick else E2_KS
    env_args = e2_env(args)
    rows = []
    for k in ks:
        a = argparse.Namespace(**vars(args))
        a.concurrency = args.batch_groups * (args.group_size + k)  # every member at once
        measured = ideal_model = 0.0
        started = cancelled = completed = 0
        engines: list[dict] = []
        for b in range(args.batches):
            a.seed = args.seed + 100_000 * b  # batch b's tasks; the same tasks for every k
            label = f"e2 k={k} batch {b + 1}/{args.batches}"
            cfg = base_cfg(a, env_args=env_args, mode="trajectory", alpha=0,
                           engine=e1_engine(args), max_turns=8, redundancy=k)
            r = await run_rollout(a, cfg, args.batch_groups, label)
            done = {(res.group_index, res.index_in_group): c
                    for res, (_, c) in zip(r["results"], r["chains"])}
            groups = []
            for gi in range(args.batch_groups):
                chains = []
                for mi in range(args.group_size + k):
                    c = done.get((gi, mi))
                    if c is not None:
                        chains.append(c["total"])
                        continue
                    # not delivered (cancelled): a lower bound of its chain, its planned env
                    # time plus the generation time it had when it was cancelled
                    gens = RECORDS.gen.get(member_id(group_id(gi), mi), [])
                    chains.append(planned_env_s(env_args, member_seed(cfg.rollout, gi, mi))
                                  + sum(g["queue_s"] + g["model_s"] for g in gens))
                groups.append(chains)
            ideal_model += redundant_ideal(groups, args.group_size)
            measured += r["span_s"]
            started += args.batch_groups * (args.group_size + k)
            cancelled += r["outcomes"].get("cancelled", 0)
            completed += len(r["results"])
            engines += r["engine"]
        ideal = ideal_model * args.time_scale
        rows.append({
            "k": k, "members_per_group": args.group_size + k,
            "measured_s": round(measured, 4), "ideal_s": round(ideal, 4),
            "efficiency": round(ideal / measured, 4) if measured else None,
            "per_batch_measured_s": round(measured / args.batches, 4),
            "per_batch_ideal_model_s": round(ideal_model / args.batches, 3),
            "trajectories_started": started, "completed": completed, "cancelled": cancelled,
            "extra_env_share": round(k / args.group_size, 3),
            "engine_requests": sum(e.get("requests", 0) for e in engines),
        })
        say(f"e2 k={k}: measured {measured:.2f} s, ideal {ideal:.2f} s "
            f"(efficiency {rows[-1]['efficiency']}), {cancelled} cancelled")
    base = rows[0]
    for r in rows:
        r["measured_speedup"] = round(base["measured_s"] / r["measured_s"], 3)
        r["ideal_speedup"] = round(base["ideal_s"] / r["ideal_s"], 3)
    return {"experiment": "e2", "emulated": ["generation engine", "env"], "rows": rows,
            "paper_speedup": PAPER_E2, "env_args": env_args}


# -- E4 -------------------------------------------------------------------------------------
PAPER_E4 = {"utilisation": (0.06, 0.88), "rollout_s": (158.0, 77.0)}
"""Reward as a service vs a dedicated local reward GPU: reward GPU utilisation 6% -> 88%,
rollout time 158 s -> 77 s."""
REWARD_TYPE = "rollart.emulate.reward:EmulatedRewardService"


def e4_cfg(args, job: int, *, shared: bool, gen_replicas: int) -> RunConfig:
    a = argparse.Namespace(**vars(args))
    a.replicas = gen_replicas
    a.seed = args.seed + 1000 * job
    a.concurrency = args.batch_groups * args.group_size  # one batch in flight at a time
    env = {"reset_mu": 5.0, "reset_sigma": 1.0, "reset_dist": "gauss", "step_mu": 3.0,
           "step_sigma": 1.0, "step_dist": "gauss", "turns": 3, "success": 0.5,
           "obs_words": 16, "time_scale": args.time_scale}
    engine = {"profile": args.profile, "time_scale": args.time_scale, "out_mean": args.e4_out_mean,
              "out_sigma": 0.5, "records_per_run": True}
    cfg = base_cfg(a, env_args=env, mode="trajectory", alpha=0, engine=engine, max_turns=8)
    device = {"pass_s": args.reward_pass_s, "per_item_s": args.reward_item_s, "max_batch": 256,
              "time_scale": args.time_scale,
              "device": "shared-reward" if shared else f"dedicated-reward-{job}"}
    envs = {k: msgspec.structs.replace(v, scorer="emulated") for k, v in cfg.envs.items()}
    actors = dict(cfg.actors)
    actors["reward"] = convert({"type": REWARD_TYPE, "replicas": 1, "args": {"emulate": device}},
                               ActorConfig)
    return msgspec.structs.replace(cfg, envs=envs, actors=actors)


async def run_jobs(args, cfgs: list[RunConfig], label: str, *, groups: int,
                   offsets: list[float]) -> dict:
    """The jobs on one bus, job j started ``offsets[j]`` wall seconds after the first, each
    its own run (scheduler, EnvManager, generate and reward replicas) rolling out ``groups``
    groups one batch at a time; their reward replicas share devices by name."""
    from rollart.emulate.reward import DEVICES

    RECORDS.clear()
    DEVICES.clear()
    async with open_bus(args.bus) as bus:
        built = [rollout_actors(cfg, groups=groups, bounded=False, keep_results=True)
                 for cfg in cfgs]
        async with contextlib.AsyncExitStack() as stack:
            t0 = time.monotonic()
            for (_, actors), off in zip(built, offsets):
                await asyncio.sleep(max(0.0, t0 + off - time.monotonic()))
                await stack.enter_async_context(Node(bus, actors, heartbeat_every=0))
            deadline = time.monotonic() + args.timeout
            for sched, _ in built:
                await until_done(sched, deadline - time.monotonic(), f"{label}: a job", groups)
    jobs = []
    for cfg, (sched, _) in zip(cfgs, built):
        gs = list(sched.groups.values())
        start, end = min(g.opened_at for g in gs), max(g.done_at for g in gs)
        chains = []
        for r in sched.results:
            c = chain_of(r.seed, f"{cfg.run}/{r.traj_id}", len(r.turns))
            rw = RECORDS.reward.get(f"{cfg.run}/{r.traj_id}", {"model_s": 0.0, "queue_s": 0.0})
            chains.append((0.0, c["total"] + rw["model_s"] + rw["queue_s"]))
        jobs.append({"start": start, "end": end, "span_s": end - start,
                     # one batch in flight at a time: the chains on the batch's slots, FIFO
                     "ideal_model_s": fifo_makespan(chains, cfg.rollout.concurrency),
                     "device": cfg.actors["reward"].args["emulate"]["device"],
                     "trajectories": len(sched.results)})
    return {"jobs": jobs, "devices": dict(DEVICES)}


async def e4(args) -> dict:
    configs = [("dedicated", False, args.gpus_per_job - 1), ("service", True, args.gpus_per_job)]
    groups = args.batches * args.batch_groups
    # jobs are not in step in a cluster: job j starts j/J of a stagger after the first
    offsets = [j * args.e4_stagger * args.time_scale / args.jobs for j in range(args.jobs)]
    out = []
    for name, shared, gen in configs:
        label = f"e4 {name}"
        say(f"{label}: {args.jobs} jobs x {args.batches} batches of "
            f"{args.batch_groups * args.group_size} trajectories, started "
            f"{args.e4_stagger / args.jobs:g} modelled s apart, {gen} generate replica(s) per "
            f"job, reward: {'one device shared by every job' if shared else 'one device per job'}")
        cfgs = [e4_cfg(args, j, shared=shared, gen_replicas=gen) for j in range(args.jobs)]
        r = await run_jobs(args, cfgs, label, groups=groups, offsets=offsets)
        jobs = r["jobs"]
        # steady state: every job rolling out (after the last start, before the first end)
        lo, hi = max(j["start"] for j in jobs), min(j["end"] for j in jobs)
        if hi <= lo:
            lo, hi = min(j["start"] for j in jobs), max(j["end"] for j in jobs)
        if shared:
            utils = [r["devices"]["shared-reward"].busy_between(lo, hi) / (hi - lo)]
        else:  # a dedicated device is busy only for its own job
            utils = [r["devices"][j["device"]].busy_between(j["start"], j["end"]) / j["span_s"]
                     for j in jobs]
        per_batch = [j["span_s"] / args.batches for j in jobs]
        ideals = [j["ideal_model_s"] * args.time_scale / args.batches for j in jobs]
        waits = [x["queue_s"] for x in RECORDS.reward.values()]
        passes = sum(d.passes for d in r["devices"].values())
        items = sum(d.items for d in r["devices"].values())
        mean = sum(per_batch) / len(per_batch)
        ideal = sum(ideals) / len(ideals)
        out.append({
            "config": name, "generate_replicas_per_job": gen,
            "reward_devices": len(r["devices"]),
            "gpus": args.jobs * gen + (1 if shared else args.jobs),
            "rollout_s": round(mean, 4), "rollout_model_s": round(mean / args.time_scale, 2),
            "ideal_s": round(ideal, 4),
            "efficiency": round(ideal / mean, 4) if mean else None,
            "reward_utilisation": round(sum(utils) / len(utils), 4),
            "utilisation_window_s": round(hi - lo, 3) if shared else None,
            "reward_wait_model_s_mean": round(sum(waits) / len(waits), 3) if waits else 0.0,
            "reward_mean_batch": round(items / passes, 2) if passes else 0.0,
            "jobs": args.jobs, "batches": args.batches,
            "trajectories": sum(j["trajectories"] for j in jobs),
        })
        say(f"{label}: rollout {mean:.2f} s a batch (ideal {ideal:.2f} s), reward utilisation "
            f"{out[-1]['reward_utilisation']:.0%}")
    ded, svc = out
    return {"experiment": "e4", "emulated": ["generation engine", "env", "reward model"],
            "rows": out, "paper": PAPER_E4, "stagger_model_s": args.e4_stagger,
            "rollout_speedup": round(ded["rollout_s"] / svc["rollout_s"], 3),
            "ideal_speedup": round(ded["ideal_s"] / svc["ideal_s"], 3)}


# -- E5 -------------------------------------------------------------------------------------
PAPER_E5 = {"h20": (1.30, 1.68), "h800": (1.12, 1.37)}
"""Hardware affinity (64 H800 + 24 H20): step time 1.30-1.68x shorter than H20-only,
1.12-1.37x shorter than H800-only."""


def e5_configs(args) -> list[tuple[str, int, int]]:
    """``(name, h800 replicas, h20 replicas)`` at equal cost (an H20 costs ``--h20-price`` of
    an H800): the mixed pools, then all of that budget in H800s, then in H20s."""
    n = args.e5_gpus
    budget = n + n * args.h20_price
    return [("mixed", n, n), ("h800-only", round(budget), 0),
            ("h20-only", 0, round(budget / args.h20_price))]


def e5_cfg(args, seed: int, n800: int, n20: int) -> RunConfig:
    a = argparse.Namespace(**vars(args))
    a.seed = seed
    a.concurrency = args.batch_groups * args.group_size
    env = {"reset_mu": 5.0, "reset_sigma": 1.0, "reset_dist": "gauss", "step_mu": 3.0,
           "step_sigma": 1.0, "step_dist": "gauss", "turns": 3, "success": 0.5,
           "obs_words": 16, "long_share": args.long_share, "long_obs_words": args.long_words,
           "time_scale": args.time_scale}
    engine: dict[str, Any] = {"time_scale": args.time_scale, "out_mean": args.e5_out_mean,
                              "out_sigma": 0.5}
    extra: dict[str, Any] = {}
    if n800 and n20:
        if n800 != n20:
            raise ValueError("the mixed config deals its replicas round the pools: "
                             "as many h800 as h20")
        a.replicas = n800 + n20
        engine["pool_profiles"] = {"h800": "h800", "h20": "h20"}
        extra = {"pools": {"h800": {"tags": ["gpu", "prefill"]}, "h20": {"tags": ["gpu"]},
                           "cpu": {"tags": ["cpu"]}},
                 "mapping": {"generate": ["h800", "h20"], "env": "cpu", "reward": "cpu"},
                 "route": [{"when": {"prompt_tokens_gt": args.route_tokens}, "pool": "h800"},
                           {"pool": "h20"}]}
    else:
        a.replicas = n800 or n20
        engine["profile"] = "h800" if n800 else "h20"
    return base_cfg(a, env_args=env, mode="trajectory", alpha=0, engine=engine, max_turns=8,
                    extra=extra)


async def e5(args) -> dict:
    rows = []
    for name, n800, n20 in e5_configs(args):
        measured = ideal_model = 0.0
        pools: dict[str, int] = {}
        utils = []
        for b in range(args.batches):
            label = f"e5 {name} batch {b + 1}/{args.batches}"
            cfg = e5_cfg(args, args.seed + 100_000 * b, n800, n20)
            say(f"{label}: {n800} h800 + {n20} h20 replicas, {cfg.rollout.concurrency} "
                "trajectories in flight")
            r = await run_rollout(args, cfg, args.batch_groups, label)
            measured += r["span_s"]
            ideal_model += max(c["total"] for _, c in r["chains"])
            for res in r["results"]:
                for t in res.turns:
                    pools[t.pool] = pools.get(t.pool, 0) + 1
            utils += [e["utilisation"] for e in r["engine"]]
        ideal = ideal_model * args.time_scale
        rows.append({
            "config": name, "h800": n800, "h20": n20,
            "cost_h800_units": round(n800 + n20 * args.h20_price, 3),
            "measured_s": round(measured, 4), "ideal_s": round(ideal, 4),
            "efficiency": round(ideal / measured, 4) if measured else None,
            "per_batch_model_s": round(measured / args.batches / args.time_scale, 2),
            "turns_by_pool": pools,
            "engine_utilisation_mean": round(sum(utils) / max(1, len(utils)), 4),
        })
        say(f"e5 {name}: measured {measured:.2f} s, ideal {ideal:.2f} s "
            f"(efficiency {rows[-1]['efficiency']})")
    mixed = rows[0]
    for r in rows:
        r["mixed_speedup"] = round(r["measured_s"] / mixed["measured_s"], 3)
        r["ideal_mixed_speedup"] = round(r["ideal_s"] / mixed["ideal_s"], 3)
    return {"experiment": "e5", "emulated": ["generation engine (h800 and h20 profiles)", "env"],
            "rows": rows, "paper": PAPER_E5, "h20_price": args.h20_price,
            "route_tokens": args.route_tokens}


# -- E6 -------------------------------------------------------------------------------------
E6_REPLICAS = (64, 128, 256)
PAPER_E6 = (1.33, 2.08)
"""Scaling 64 -> 128 GPUs: ROLLART keeps a 1.33-2.08x throughput lead over its baselines."""


async def e6(args) -> dict:
    scales = (4, 8) if args.quick else E6_REPLICAS
    rows = []
    for n in scales:
        a = argparse.Namespace(**vars(args))
        a.replicas = n
        trajs = n * args.per_replica
        a.batch_groups = max(1, trajs // args.group_size)
        a.concurrency = a.batch_groups * args.group_size  # every trajectory in flight at once
        label = f"e6 {n} replicas"
        say(f"{label}: {a.concurrency} trajectories in flight")
        cfg = base_cfg(a, env_args=e1_env(args, 2.0), mode="trajectory", alpha=0,
                       engine=e1_engine(args), max_turns=8)
        r = await run_rollout(a, cfg, a.batch_groups, label)
        chains = [c for _, c in r["chains"]]
        ideal = fifo_makespan([(0.0, c["total"]) for c in chains], a.concurrency) * args.time_scale
        done = len(r["results"])
        turns = sum(len(x.turns) for x in r["results"])
        # events of a trajectory: its request, reset, each turn's generate request and reply
        # and env step, its completion
        events = sum(3 + 3 * len(x.turns) for x in r["results"])
        span = r["span_s"]
        rows.append({
            "replicas": n, "trajectories": done, "turns": turns,
            "measured_s": round(span, 4), "ideal_s": round(ideal, 4),
            "efficiency": round(ideal / span, 4) if span else None,
            "throughput_traj_per_model_s": round(done / (span / args.time_scale), 3),
            "ideal_throughput_traj_per_model_s": round(done / (ideal / args.time_scale), 3),
            "cpu_s": round(r["cpu_s"], 3),
            "cpu_ms_per_trajectory": round(1e3 * r["cpu_s"] / max(1, done), 3),
            "cpu_ms_per_turn": round(1e3 * r["cpu_s"] / max(1, turns), 3),
            "cpu_us_per_event": round(1e6 * r["cpu_s"] / max(1, events), 1),
            "cpu_share_of_wall": round(r["cpu_s"] / span, 3) if span else None,
            "engine_utilisation_mean": round(sum(e["utilisation"] for e in r["engine"])
                                             / max(1, len(r["engine"])), 4),
        })
        say(f"{label}: measured {span:.2f} s, ideal {ideal:.2f} s (efficiency "
            f"{rows[-1]['efficiency']}), CPU {r['cpu_s']:.2f} s = "
            f"{rows[-1]['cpu_ms_per_turn']} ms per turn")
    base = rows[0]
    for r in rows:
        r["throughput_scale"] = round(r["throughput_traj_per_model_s"]
                                      / base["throughput_traj_per_model_s"], 3)
        r["ideal_scale"] = round(r["replicas"] / base["replicas"], 3)
    return {"experiment": "e6", "emulated": ["generation engine", "env"], "rows": rows,
            "per_replica": args.per_replica}


# -- E3 -------------------------------------------------------------------------------------
E3_ALPHAS = (0, 1, 2, 4)
MIXES = {
    # sync step ~ 100 modelled s: env init ~15, generation ~54, training ~23, env steps ~8
    "healthy": {"env": {"reset_mu": 12.0, "reset_sigma": 2.0, "reset_dist": "gauss",
                        "step_mu": 1.8, "step_sigma": 0.4, "step_dist": "gauss", "turns": 3,
                        "reset_fail": 0.0},
                "out_mean": 800.0, "train": {"step_base_s": 1.0, "step_per_token_s": 2.4e-4,
                                             "model_gb": 16.0, "publish_gbps": 8.0},
                "paper_mix": {"generation": 0.54, "training": 0.23, "env_init": 0.15}},
    # env init dominating (78%): heavy-tailed resets that fail and are retried
    "failure": {"env": {"reset_mu": 30.0, "reset_sigma": 30.0, "reset_dist": "lognormal",
                        "step_mu": 1.8, "step_sigma": 0.4, "step_dist": "gauss", "turns": 3,
                        "reset_fail": 0.2},
                "out_mean": 300.0, "train": {"step_base_s": 1.0, "step_per_token_s": 1.0e-4,
                                             "model_gb": 16.0, "publish_gbps": 8.0},
                "paper_mix": {"env_init": 0.78}},
}


async def e3(args) -> dict:
    alphas = (0, 1) if args.quick else E3_ALPHAS
    mixes = ["healthy"] if args.quick or args.mix == "healthy" else (
        ["failure"] if args.mix == "failure" else ["healthy", "failure"])
    out_rows = []
    for mix in mixes:
        mx = MIXES[mix]
        configs = [("sync", "batch", 0)] + [(f"alpha={a}", "trajectory", a) for a in alphas]
        runs: dict[str, dict] = {}
        for name, mode, alpha in configs:
            label = f"e3 {mix} {name}"
            env = {**mx["env"], "success": 0.5, "obs_words": 16, "time_scale": args.time_scale}
            engine = {"profile": args.profile, "time_scale": args.time_scale,
                      "out_mean": mx["out_mean"], "out_sigma": 0.5}
            trainer = {**mx["train"], "time_scale": args.time_scale}
            cfg = base_cfg(args, env_args=env, mode=mode, alpha=alpha, engine=engine,
                           max_turns=8, trainer=trainer, steps=args.steps)
            say(f"{label}: {args.steps} steps of {args.batch_groups} groups x {args.group_size}")
            r = await run_training(args, cfg, label)
            batches = []
            trajs = RECORDS.trained
            for row in r["rows"]:
                batches.append([chain_of(trajs[tid][0], tid, trajs[tid][1])
                                for tid in row["traj_ids"] if tid in trajs])
            train_model = [x["model_s"] for x in RECORDS.train]
            pub = {p["version"]: p["model_s"] for p in RECORDS.publish}
            tsteps = [train_model[j] + pub.get(j + 1, 0.0) for j in range(len(batches))]
            # a batch is released at the step's end: its resets need no weights, and the
            # generators' loads are in the turns' engine times (queued behind the pause)
            ideal = pipeline_ideal(batches, tsteps, alpha=alpha, slots=args.concurrency,
                                   lockstep=(mode == "batch"), loads=[])
            ideal_s = ideal["total_s"] * args.time_scale
            measured = r["wall_s"]
            wait = sum(row["wait_s"] for row in r["rows"])
            trained = sum(len(b) for b in batches)
            # the stage mix of the step (modelled seconds, sync: lock-step waves)
            if mode == "batch":
                waves = [lockstep_wave(b) for b in batches if b]
                mix_s = {"env_init": sum(w["reset"] for w in waves),
                         "generation": sum(w["gen"] for w in waves),
                         "env_step": sum(w["step"] for w in waves),
                         "training": sum(tsteps)}
            else:
                mix_s = {}
            tot = sum(mix_s.values())
            runs[name] = {
                "config": name, "mode": mode, "alpha": alpha,
                "measured_s": round(measured, 4), "ideal_s": round(ideal_s, 4),
                "efficiency": round(ideal_s / measured, 4) if measured else None,
                "trajectories_trained": trained,
                "throughput_traj_per_s": round(trained / measured, 3) if measured else None,
                "trainer_wait_share": round(min(1.0, wait / measured), 4) if measured else None,
                "ideal_wait_share": round(ideal["wait_share"], 4),
                "stage_mix": {k: round(v / tot, 3) for k, v in mix_s.items()} if tot else None,
                "steps": len(r["rows"]), "engine": r["engine"],
            }
            say(f"{label}: measured {measured:.2f} s, ideal {ideal_s:.2f} s, efficiency "
                f"{runs[name]['efficiency']}, trainer waits {runs[name]['trainer_wait_share']}")
        sync = runs["sync"]
        for name, r in runs.items():
            r["measured_speedup"] = round(sync["measured_s"] / r["measured_s"], 3)
            r["ideal_speedup"] = round(sync["ideal_s"] / r["ideal_s"], 3)
            r["paper_speedup_range"] = list(PAPER_E3) if name != "sync" else None
        out_rows.append({"mix": mix, "paper_mix": mx["paper_mix"],
                         "sync_stage_mix": sync["stage_mix"], "configs": list(runs.values())})
    return {"experiment": "e3", "emulated": ["generation engine", "env", "trainer backend"],
            "mixes": out_rows}


# -- checks, README ---------------------------------------------------------------------------
def check(result: dict) -> list[str]:
    """What is wrong with the accounting (empty: it adds up)."""
    bad = []
    rows = []
    if result["experiment"] == "e1":
        for r in result["rows"]:
            rows += [(f"sigma={r['sigma_model_s']:g} {m}", r[m]) for m in ("trajectory", "batch")]
    elif result["experiment"] == "e4":
        for r in result["rows"]:
            rows.append((r["config"], {**r, "measured_s": r["rollout_s"]}))
            if not 0.0 <= r["reward_utilisation"] <= 1.0 + TOL:
                bad.append(f"{r['config']}: reward utilisation {r['reward_utilisation']} not in [0, 1]")
    elif result["experiment"] == "e6":
        rows += [(f"{r['replicas']} replicas", r) for r in result["rows"]]
    elif result["experiment"] == "e5":
        rows += [(r["config"], r) for r in result["rows"]]
        mixed = result["rows"][0]["turns_by_pool"]
        if set(mixed) != {"h800", "h20"}:
            bad.append(f"mixed: turns ran in pools {sorted(mixed)}, not in both h800 and h20")
    elif result["experiment"] == "e2":
        for r in result["rows"]:
            rows.append((f"k={r['k']}", r))
            if r["completed"] + r["cancelled"] > r["trajectories_started"]:
                bad.append(f"k={r['k']}: {r['completed']} completed + {r['cancelled']} "
                           f"cancelled > {r['trajectories_started']} started")
    else:
        for mx in result["mixes"]:
            rows += [(f"{mx['mix']} {c['config']}", c) for c in mx["configs"]]
            for c in mx["configs"]:
                for k in ("trainer_wait_share", "ideal_wait_share"):
                    if not 0.0 <= c[k] <= 1.0:
                        bad.append(f"{mx['mix']} {c['config']}: {k} {c[k]} not in [0, 1]")
                if mx["sync_stage_mix"] is not None and abs(sum(mx["sync_stage_mix"].values()) - 1) > 0.01:
                    bad.append(f"{mx['mix']}: the stage mix does not add up to 1")
    for name, r in rows:
        if not r["ideal_s"] > 0:
            bad.append(f"{name}: no ideal ({r['ideal_s']})")
        elif r["ideal_s"] > r["measured_s"] * (1 + TOL) + 0.01:
            bad.append(f"{name}: ideal {r['ideal_s']} s > measured {r['measured_s']} s")
        if r["efficiency"] is None or not 0 < r["efficiency"] <= 1 + TOL:
            bad.append(f"{name}: efficiency {r['efficiency']} not in (0, 1]")
    return bad


def _section(exp: str, res: dict, columns: list[str], rows: list[list], **values: object) -> str:
    """Experiment ``exp``'s README section: its table, the run's settings and machine."""
    machine = (f"{res.get('cpus')} cpu, load {res['loadavg'][0]:.2f}; wall {res.get('wall_s')} s; "
               f"results `benchmarks/results/emulate_{exp}.json`")
    return render(f"emulate_{exp}", table=table(columns, rows), machine=machine,
                   profile=res["profile"], bus=res["bus"], time_scale=f"{res['time_scale']:g}",
                   **values)


def _span(values: list[float]) -> str:
    return f"{min(values):.0%}-{max(values):.0%}"


def e1_section(res: dict, args) -> str:
    rows = [[f"{r['sigma_model_s']:g}", f"{r['paper_speedup']}x" if r["paper_speedup"] else "1.23-2.27x",
             f"{r['ideal_speedup']}x", f"{r['measured_speedup']}x",
             *(f"{r[m]['ideal_s']:.2f} / {r[m]['measured_s']:.2f} ({r[m]['efficiency']:.0%})"
               for m in ("trajectory", "batch"))] for r in res["rows"]]
    eff = [r[m]["efficiency"] for r in res["rows"] for m in ("trajectory", "batch")]
    ok_paper = all(r["measured_speedup"] >= (r["paper_speedup"] or PAPER_E1[1]) for r in res["rows"])
    return _section("e1", res, ["σ (s)", "paper", "ideal speed-up", "measured speed-up",
                                "trajectory: ideal / measured s (eff.)",
                                "batch: ideal / measured s (eff.)"], rows,
                    reset_mu=f"{args.reset_mu:g}", reset_sd=f"{args.reset_mu / 5:g}",
                    step_mu=f"{args.step_mu:g}", ok_paper="yes" if ok_paper else "no",
                    ok_eff="yes" if min(eff) >= 0.9 else "no", low_eff=f"{min(eff):.0%}")


def e3_section(res: dict, args) -> str:
    rows = [[mx["mix"], c["config"], "baseline" if c["config"] == "sync" else "2.65-4.58x",
             f"{c['ideal_speedup']}x", f"{c['measured_speedup']}x",
             f"{c['ideal_s']:.2f} / {c['measured_s']:.2f}", f"{c['efficiency']:.0%}",
             f"{c['trainer_wait_share']:.0%} ({c['ideal_wait_share']:.0%})"]
            for mx in res["mixes"] for c in mx["configs"]]
    return _section("e3", res, ["mix", "config", "paper", "ideal speed-up", "measured speed-up",
                                "ideal / measured s", "efficiency", "trainer waits (ideal)"], rows,
                    effs=_span([c["efficiency"] for mx in res["mixes"] for c in mx["configs"]]))


def e2_section(res: dict, args) -> str:
    rows = [[r["k"], "baseline" if r["k"] == 0 else f"up to {res['paper_speedup']}x",
             f"{r['ideal_speedup']}x", f"{r['measured_speedup']}x",
             f"{r['ideal_s']:.2f} / {r['measured_s']:.2f}", f"{r['efficiency']:.0%}",
             f"{r['cancelled']} / {r['trajectories_started']}"] for r in res["rows"]]
    last, best = res["rows"][-1], max(res["rows"], key=lambda r: r["measured_speedup"])
    return _section("e2", res, ["k (redundant members)", "paper", "ideal speed-up",
                                "measured speed-up", "ideal / measured s", "efficiency",
                                "cancelled / started"], rows,
                    ok="yes" if last["measured_speedup"] >= 1.6 else "no",
                    last=f"{last['measured_speedup']}x at k = {last['k']}",
                    best=f"{best['measured_speedup']}x at k = {best['k']}",
                    effs=_span([r["efficiency"] for r in res["rows"]]))


def e4_section(res: dict, args) -> str:
    ded, svc = res["rows"]
    p = res["paper"]
    rows = [[r["config"], r["reward_devices"], f"{pu:.0%}", f"{r['reward_utilisation']:.0%}",
             f"{pr:g} s", f"{r['rollout_s']:.2f} ({r['rollout_model_s']:g})", f"{r['ideal_s']:.2f}",
             f"{r['efficiency']:.0%}", f"{r['reward_wait_model_s_mean']:g}",
             f"{r['reward_mean_batch']:g}"]
            for r, pu, pr in ((ded, p["utilisation"][0], p["rollout_s"][0]),
                              (svc, p["utilisation"][1], p["rollout_s"][1]))]
    return _section("e4", res, ["config", "reward GPUs", "paper: utilisation", "utilisation",
                                "paper: rollout", "rollout s a batch (modelled)", "ideal s",
                                "efficiency", "reward wait (modelled s)", "judge batch"], rows,
                    speedup=(f"{res['rollout_speedup']}x measured, {res['ideal_speedup']}x ideal "
                             f"(paper {p['rollout_s'][0] / p['rollout_s'][1]:.2f}x)"),
                    ok=f"**{'yes' if svc['reward_utilisation'] >= 0.85 else 'no'}** "
                       f"({svc['reward_utilisation']:.0%})")


def e5_section(res: dict, args) -> str:
    mixed = res["rows"][0]
    rows = [[r["config"], f"{r['h800']} + {r['h20']} ({r['cost_h800_units']:g})",
             None if r is mixed else "{:g}-{:g}x".format(*res["paper"][r["config"].split("-")[0]]),
             f"{r['ideal_mixed_speedup']}x", f"{r['mixed_speedup']}x",
             f"{r['ideal_s']:.2f} / {r['measured_s']:.2f}", f"{r['efficiency']:.0%}",
             ", ".join(f"{k}: {v}" for k, v in sorted(r["turns_by_pool"].items())),
             f"{r['engine_utilisation_mean']:.0%}"] for r in res["rows"]]
    inside = {r["config"].split("-")[0]: r["mixed_speedup"] >= res["paper"][r["config"].split("-")[0]][0]
              for r in res["rows"][1:]}
    return _section("e5", res, ["config", "h800 + h20 (cost in H800s)", "paper: mixed faster by",
                                "ideal: mixed faster by", "measured: mixed faster by",
                                "ideal / measured s", "efficiency", "turns per pool",
                                "engine busy"], rows,
                    route_tokens=res["route_tokens"], h20_price=f"{res['h20_price']:g}",
                    inside=", ".join(f"vs {k}-only **{'yes' if v else 'no'}**"
                                     for k, v in inside.items()))


def e6_section(res: dict, args) -> str:
    rows = [[r["replicas"], r["trajectories"], f"{r['ideal_s']:.2f} / {r['measured_s']:.2f}",
             f"{r['efficiency']:.0%}", f"{r['throughput_traj_per_model_s']:g}",
             f"{r['throughput_scale']}x (ideal {r['ideal_scale']}x)", f"{r['cpu_s']:g}",
             f"{r['cpu_ms_per_trajectory']:g} ms", f"{r['cpu_ms_per_turn']:g} ms",
             f"{r['cpu_us_per_event']:g} µs", f"{r['cpu_share_of_wall']:.0%}"] for r in res["rows"]]
    last = res["rows"][-1]
    return _section("e6", res, ["replicas (emulated GPUs)", "trajectories", "ideal / measured s",
                                "efficiency", "traj / modelled s", "scale vs the first", "CPU s",
                                "CPU per trajectory", "per turn", "per event", "CPU / wall"], rows,
                    per_replica=res["per_replica"], ms_per_turn=f"{last['cpu_ms_per_turn']:g}",
                    turns_per_s=f"{1000 / max(last['cpu_ms_per_turn'], 1e-9):.0f}")


def parse(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("experiment", nargs="?", choices=[*EXPERIMENTS, "all"], default="all",
                   help="which experiment (default: all of them, one after the other)")
    p.add_argument("--quick", action="store_true", help="smoke run (< 2 min), writes nothing")
    p.add_argument("--bus", choices=["memory", "nats"], default="memory")
    p.add_argument("--profile", choices=sorted(PROFILES), default="h800")
    p.add_argument("--time-scale", type=float, default=None,
                   help="wall seconds per modelled second (default 0.04, E4 0.1, E6 0.25; quick 0.005)")
    p.add_argument("--group-size", type=int, default=8)
    p.add_argument("--batch-groups", type=int, default=4)
    p.add_argument("--batches", type=int, default=None,
                   help="E1, E2: batches; E4: batches of every job, one after the other (default 3, E2 6, E4 4; quick 2, E2 and E4 1)")
    p.add_argument("--steps", type=int, default=None, help="E3: training steps (default 6; quick 3)")
    p.add_argument("--concurrency", type=int, default=None,
                   help="rollout.concurrency (default: one batch; E3: (max α + 1) batches)")
    p.add_argument("--replicas", type=int, default=1)
    p.add_argument("--step-mu", type=float, default=10.0, help="E1: mean env step (modelled s)")
    p.add_argument("--reset-mu", type=float, default=5.0, help="E1: mean reset (modelled s)")
    p.add_argument("--out-mean", type=float, default=200.0, help="E1, E2: mean output tokens")
    p.add_argument("--tail", type=float, default=2.0,
                   help="E2: env latency standard deviation / mean (lognormal; default 2)")
    p.add_argument("--max-new-tokens", type=int, default=4096)
    p.add_argument("--jobs", type=int, default=None,
                   help="E4: training jobs at once (default 12; quick 2)")
    p.add_argument("--gpus-per-job", type=int, default=2,
                   help="E4: GPUs per job: generation + its dedicated reward GPU (default 2)")
    p.add_argument("--reward-pass-s", type=float, default=0.1,
                   help="E4: modelled seconds of one judge pass, whatever its size (its short "
                        "decode of a verdict; default 0.1)")
    p.add_argument("--reward-item-s", type=float, default=0.06,
                   help="E4: modelled seconds per scored trajectory in a pass (its prefill: "
                        "~2k tokens at the h800 profile's 0.032 ms; default 0.06)")
    p.add_argument("--e4-stagger", type=float, default=60.0,
                   help="E4: modelled seconds over which the jobs' starts are spread (jobs of a "
                        "cluster are not in step; default 60, about one batch's rollout)")
    p.add_argument("--e4-out-mean", type=float, default=600.0,
                   help="E4: mean output tokens of the policy (default 600)")
    p.add_argument("--e5-gpus", type=int, default=None,
                   help="E5: h800 replicas of the mixed config, and as many h20 (default 4; quick 2)")
    p.add_argument("--h20-price", type=float, default=0.5,
                   help="E5: an H20's price per hour / an H800's (default 0.5: an assumption)")
    p.add_argument("--long-share", type=float, default=0.5,
                   help="E5: share of long-context tasks (default 0.5)")
    p.add_argument("--long-words", type=int, default=1500,
                   help="E5: words per observation of a long-context task (default 1500)")
    p.add_argument("--route-tokens", type=int, default=2048,
                   help="E5: turns whose prompt so far is longer go to h800 (default 2048)")
    p.add_argument("--e5-out-mean", type=float, default=400.0,
                   help="E5: mean output tokens (default 400)")
    p.add_argument("--per-replica", type=int, default=8,
                   help="E6: trajectories in flight per generate replica (default 8)")
    p.add_argument("--mix", choices=["healthy", "failure", "both"], default="both")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--timeout", type=float, default=600.0)
    p.add_argument("--run-dir", type=Path, default=Path(tempfile.gettempdir()) / "rollart-emulate")
    p.add_argument("--no-write", action="store_true")
    p.add_argument("--gantt", type=Path, default=None, metavar="DIR",
                   help="trace every run and draw its trajectory Gantt to DIR/emulate-<run>.png "
                        "(pictures: tracing costs CPU, so nothing is written to results/ or "
                        "the README)")
    p.add_argument("--from-results", action="store_true",
                   help="rewrite the README section(s) from benchmarks/results/emulate_*.json")
    a = p.parse_args(argv)
    if a.steps is None:
        a.steps = 3 if a.quick else 6
    if a.jobs is None:
        a.jobs = 2 if a.quick else 12
    if a.e5_gpus is None:
        a.e5_gpus = 2 if a.quick else 4
    if a.quick:
        a.group_size, a.batch_groups = min(a.group_size, 4), min(a.batch_groups, 2)
    return a


def for_experiment(args, exp: str) -> argparse.Namespace:
    """``args`` for experiment ``exp`` (its default concurrency: one batch for E1, enough for
    the largest α's batches in flight for E3)."""
    a = argparse.Namespace(**vars(args))
    a.experiment = exp
    if a.time_scale is None:
        a.time_scale = 0.005 if a.quick else {"e6": 0.25, "e4": 0.1}.get(exp, 0.04)
    if a.batches is None:
        a.batches = {"e2": 1 if a.quick else 6, "e4": 1 if a.quick else 4,
                     "e5": 1 if a.quick else 2}.get(
            exp, 2 if a.quick else 3)
    if a.concurrency is None:
        wave = a.group_size * a.batch_groups
        a.concurrency = wave if exp == "e1" else wave * (max(E3_ALPHAS) + 1)
    return a




SECTIONS = {"e1": e1_section, "e2": e2_section, "e3": e3_section, "e4": e4_section,
            "e5": e5_section, "e6": e6_section}


async def amain(args) -> dict:
    """Run ``args.experiment`` (it must be one experiment; see :func:`for_experiment`)."""
    args.run_dir.mkdir(parents=True, exist_ok=True)
    t0 = time.perf_counter()
    res = await {"e1": e1, "e2": e2, "e3": e3, "e4": e4, "e5": e5, "e6": e6}[args.experiment](args)
    res.update(quick=args.quick, bus=args.bus, profile=args.profile, time_scale=args.time_scale,
               wall_s=round(time.perf_counter() - t0, 2), host=platform.node(),
               cpus=os.cpu_count(), loadavg=[round(x, 2) for x in os.getloadavg()])
    res["accounting_errors"] = check(res)
    return public(res)


def main(argv: list[str] | None = None) -> int:
    args = parse(argv)
    exps = EXPERIMENTS if args.experiment == "all" else (args.experiment,)
    if args.from_results:
        for exp in exps:
            res = json.loads((RESULTS / f"emulate_{exp}.json").read_text())
            a = for_experiment(args, exp)
            a.time_scale, a.bus, a.profile = res["time_scale"], res["bus"], res["profile"]
            replace_section(f"emulate_{exp}", SECTIONS[exp](res, a))
        return 0
    out: dict[str, dict] = {}
    errors: list[str] = []
    for exp in exps:
        a = for_experiment(args, exp)
        res = asyncio.run(amain(a))
        out[exp] = res
        errors += [f"{exp}: {e}" for e in res["accounting_errors"]]
        if not a.quick and not a.no_write and a.gantt is None:
            RESULTS.mkdir(exist_ok=True)
            (RESULTS / f"emulate_{exp}.json").write_text(json.dumps(res, indent=1, default=str))
            replace_section(f"emulate_{exp}", SECTIONS[exp](res, a))
    print(json.dumps(out[exps[0]] if len(exps) == 1 else out, indent=1, default=str))
    if errors:
        print("accounting does not add up:\n  " + "\n  ".join(errors), file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())

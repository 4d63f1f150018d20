"""Time to greedy success 0.9: rollart against a plain synchronous loop, same job.

::

    python benchmarks/learning.py                    # full run on configs/quickstart.yaml
    python benchmarks/learning.py --quick            # smoke run (3 steps); prints JSON, writes nothing
    python benchmarks/learning.py --variants plain,alpha1 --steps 40

One training job (``--config``, default ``configs/quickstart.yaml``), run once per variant,
one variant at a time, each in its own fresh Python process, all on this machine:

- ``plain``: :func:`plain_loop.run_plain`, a single-process synchronous generate-then-train
  loop with no bus and no actors (the floor for a synchronous trainer), with the engine's
  multi-turn KV cache as rollart has it; ``plain-nokv``: the same without the cache;
- ``alpha0-mp`` / ``alpha1-mp``: ``rollart.app.run.train`` as plain ``rollart run`` does it: an
  embedded ``nats-server``, the trainer in the head process and the roles of this host's default
  ``node.local_processes`` in child processes (on <= 2 cores one child for generation, envs and
  reward), ``rollout.alpha`` 0 or 1; ``alpha0-mp2`` / ``alpha1-mp2``: generation in one child,
  envs and reward in another (the default on bigger hosts); ``alpha1-mp1``: one child, explicitly;
  ``alpha1-mp1-bus``: one child with ``rollout.local_calls: false``; ``alpha0-batch-mp``: α = 0 with
  ``rollout.mode: batch`` (each turn of a step's trajectories in lock step), not run by default;
- ``alpha0`` / ``alpha1``: every actor in one process on the in-process bus
  (``--nats memory``); ``alpha1-nats``: one process on an embedded ``nats-server``.

The CPU of a variant is that of its whole process tree (its nodes and nats-server too).
Engine occupancy (rows per engine call against the requests left waiting when a call was
cut) comes from the generate replicas' node heartbeats.

Every variant uses the same tiny model folder (built once), seeds and hyper-parameters;
only ``rollout.alpha`` is overridden, plus ``trainer.keep_weights`` (every version's
weights are kept) and ``trainer.eval_groups = 1`` (the final in-run evaluation, after the
last step, is not timed anyway). Nothing is evaluated while a job runs: afterwards, every
saved policy version is loaded into a fresh engine and rolled out greedily. On a fixed,
non-slippery map greedy decoding is deterministic, so one episode per version gives its
greedy success exactly (0 or 1); otherwise ``--eval-episodes`` seeds are averaged.

*Time to 0.9* is the ``wall_s`` of the step that produced the first version whose greedy
success is >= 0.9 (first hit); *sustained* is the first version after which every later
version stays >= 0.9. ``wall_s`` runs from the trainer's first step (setup excluded, in
both: model loading, tokenizer, engine) to the end of that version's optimizer step.
A run that does not get there within the step budget (``trainer.steps``) is "not reached".

With ``--repeats R`` every variant runs R times (order reversed every other round) and
medians are reported. Repeat k samples with seed k (``actors.generate.args.seed``, the
LLMProxy's sampler; the plain loop reads the same key), because the plain loop is
deterministic for a given seed: repeating it with one seed would measure one lucky or
unlucky draw R times, while rollart runs differ anyway (engine batches depend on timing).
``--same-seed`` keeps the config's seed in every repeat.

The full run writes ``benchmarks/results/learning.json`` and the section of
``benchmarks/README.md`` between ``<!-- learning:begin -->`` and ``<!-- learning:end -->``.
Progress goes to stderr, the JSON to stdout.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from pathlib import Path

from common import (RESULTS as RESULTS_DIR, ROOT, add_run_flags, describe_machine, finish, in_turn,
                    machine, quiet_transformers, render, replace_section, sayer, table, writes)
from rollart.config.deploy import default_local_processes  # light, no torch

RESULTS = RESULTS_DIR / "learning.json"


def _layout_words(groups: list[list[str]]) -> str:
    kids = "; ".join(", ".join(g) for g in groups)
    return f"{len(groups) + 1} processes: head; {kids}"


_DEFAULT_LAYOUT = _layout_words(default_local_processes())

VARIANTS = {
    "plain": {"label": "plain loop (sync, no bus, KV cache)", "alpha": None, "nats": None},
    "plain-nokv": {"label": "plain loop without KV cache", "alpha": None, "nats": None,
                   "kv_cache": False},
    "alpha0-mp": {"label": f"rollart α = 0, default run ({_DEFAULT_LAYOUT})", "alpha": 0,
                  "nats": "embedded", "single": False},
    "alpha1-mp": {"label": f"rollart α = 1, default run ({_DEFAULT_LAYOUT})", "alpha": 1,
                  "nats": "embedded", "single": False},
    "alpha0-mp2": {"label": "rollart α = 0, 3 processes (generation; envs, reward)", "alpha": 0,
                   "nats": "embedded", "single": False,
                   "node": {"local_processes": [["generate"], ["env", "reward"]]}},
    "alpha1-mp-skim": {"label": "rollart α = 1, default run, trainer.skip_while_training",
                       "alpha": 1, "nats": "embedded", "single": False,
                       "trainer": {"skip_while_training": True}},
    "alpha1-mp2": {"label": "rollart α = 1, 3 processes (generation; envs, reward)", "alpha": 1,
                   "nats": "embedded", "single": False,
                   "node": {"local_processes": [["generate"], ["env", "reward"]]}},
    "alpha1-mp1": {"label": "rollart α = 1, 2 processes (generation, envs, reward in one child)",
                   "alpha": 1, "nats": "embedded", "single": False,
                   "node": {"local_processes": [["generate", "env", "reward"]]}},
    "alpha1-mp1-bus": {"label": "rollart α = 1, 2 processes, every turn through nats-server "
                                "(rollout.local_calls false)",
                       "alpha": 1, "nats": "embedded", "single": False,
                       "node": {"local_processes": [["generate", "env", "reward"]]},
                       "rollout": {"local_calls": False}},
    "alpha0-batch-mp": {"label": "rollart α = 0, rollout.mode batch, 3 processes", "alpha": 0,
                        "nats": "embedded", "single": False, "rollout": {"mode": "batch"}},
    "alpha0": {"label": "rollart α = 0, MemoryBus, 1 process", "alpha": 0, "nats": "memory"},
    "alpha1": {"label": "rollart α = 1, MemoryBus, 1 process", "alpha": 1, "nats": "memory"},
    "alpha1-nats": {"label": "rollart α = 1, embedded nats-server, 1 process", "alpha": 1,
                    "nats": "embedded"},
    # not run by default: benchmarks/tracing_overhead.py sets it beside alpha1
    "alpha1-traced": {"label": "rollart α = 1, MemoryBus, tracing jsonl", "alpha": 1,
                      "nats": "memory", "tracing": "jsonl"},
}
DEFAULT_VARIANTS = ("plain", "plain-nokv", "alpha0-mp", "alpha1-mp", "alpha1")
THRESHOLD = 0.9
TARGETS = [  # (variant, what, limit): rollart against the plain loop, medians of one run
    ("alpha1-mp", "mean_step", 0.8),
    ("alpha1-mp", "time_to_threshold", 1.0),
    ("alpha0-mp", "mean_step", 1.1),
    ("alpha1-mp", "floor", 0.9),  # issue 25: at least 90% of the train-step floor ...
    ("alpha1-mp", "mean_step", 1.0),  # ... and no slower than the plain loop
]
"""``floor``: the plain loop's mean train seconds per step / the variant's s/step (1: training
never waits for rollouts); a lower bound, unlike the other ratios (upper bounds)."""
PLOT = RESULTS_DIR / "learning.png"


say = sayer("learning-bench")


def _quiet() -> None:
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
    quiet_transformers()


def job_config(config: str, *, run_dir: str, steps: int | None, sampling_seed: int | None = None):
    """The config every variant starts from: the file, under ``run_dir``, step budget set;
    ``sampling_seed`` overrides the seed of the generation engine's sampler
    (``actors.generate.args.seed``, which the plain loop reads too)."""
    import msgspec

    from rollart.config import ActorConfig, RunConfig, load
    from rollart.app.launch import with_overrides

    cfg = load(config, RunConfig)
    tr = {"eval_groups": 1}
    if steps:
        tr["steps"] = steps
    cfg = with_overrides(cfg, run_dir=run_dir, trainer=tr)
    if sampling_seed is not None:
        gen = cfg.actors.get("generate", ActorConfig())
        gen = msgspec.structs.replace(gen, args={**gen.args, "seed": sampling_seed})
        cfg = msgspec.structs.replace(cfg, actors={**cfg.actors, "generate": gen})
    return with_overrides(cfg, trainer={"keep_weights": cfg.trainer.steps + 10})


# -- one variant, in a child process ---------------------------------------------------------
MAIN_STARTED: list[float] = []
"""perf_counter() when the rollart Trainer's loop started (set in the child)."""
TRAINERS: list = []
"""The rollart Trainer of the child's run (its ``nodes``: the last heartbeat of each node)."""


def occupancy(heartbeats) -> dict | None:
    """Engine occupancy over every generate replica, from the nodes' last heartbeats
    (``<replica>.engine.*``, see ``BatchedEngine.stats``): calls, rows per call, requests
    left waiting when a call was cut (both weighted by calls), KV-cache reuse."""
    reps: dict[str, dict[str, float]] = {}
    for hb in heartbeats:
        for k, v in (hb.stats or {}).items():
            if ".engine." in k:
                name, stat = k.split(".engine.", 1)
                reps.setdefault(name, {})[stat] = float(v)
    calls = sum(r.get("batches", 0.0) for r in reps.values())
    if not calls:
        return None
    tot = {k: sum(r.get(k, 0.0) for r in reps.values())
           for k in ("rows", "busy_s", "kv_reused_tokens", "kv_prefilled_tokens")}
    waiting = sum(r.get("mean_waiting", 0.0) * r.get("batches", 0.0) for r in reps.values())
    out = {"engine_calls": int(calls), "rows_per_call": round(tot["rows"] / calls, 2),
           "waiting_when_cut": round(waiting / calls, 2), "engine_busy_s": round(tot["busy_s"], 2)}
    seen = tot["kv_reused_tokens"] + tot["kv_prefilled_tokens"]
    if seen:
        out["kv_reused_share"] = round(tot["kv_reused_tokens"] / seen, 3)
    return out


def _record_cpu_time() -> None:
    """Add ``cpu_s`` to each metrics record the rollart Trainer writes: this process's CPU
    seconds from the trainer loop's start to the end of the step's ``train_step`` (the point
    where ``wall_s`` is taken). A few clock reads per step; nothing else changes."""
    from rollart.actors.trainer.actor import Trainer
    from rollart.actors.trainer.files import RunFiles
    from rollart.engines.torch_trainer import TorchTrainBackend

    main, write, step = Trainer.main, RunFiles.write_metrics, TorchTrainBackend.train_step

    async def timed_main(self) -> None:
        TRAINERS.append(self)
        self._bench_cpu0 = time.process_time()
        MAIN_STARTED.append(time.perf_counter())
        await main(self)

    def timed_step(self, *a, **k):
        out = step(self, *a, **k)
        self._bench_cpu_end = time.process_time()
        return out

    def timed_write(self, metrics: dict) -> None:  # self: the trainer's RunFiles
        tr = TRAINERS[0] if TRAINERS else None
        end = getattr(getattr(tr, "backend", None), "_bench_cpu_end", None)
        if end is not None:
            metrics["cpu_s"] = end - tr._bench_cpu0
        write(self, metrics)

    Trainer.main, RunFiles.write_metrics = timed_main, timed_write
    TorchTrainBackend.train_step = timed_step


def _telemetry(cfg, exporter: str | None, run_path: Path):
    """What ``rollart run`` sets up for the config's ``tracing:`` section, with its exporter
    set to ``exporter`` (None: the config's own, which is ``none`` for the quickstart)."""
    import msgspec

    from rollart.telemetry.tracing import setup_tracing

    tr = cfg.tracing if exporter is None else msgspec.structs.replace(cfg.tracing, exporter=exporter)
    stops = [setup_tracing(tr, "rollart-run", run_path)]
    try:
        from rollart.telemetry.otel_metrics import setup_metrics
    except ImportError:
        pass
    else:
        stops.append(setup_metrics(tr, "rollart-run", run_path))
    return lambda: [stop() for stop in reversed(stops)]


def child(variant: str, config: str, workdir: str, steps: int | None, tag: str,
          sampling_seed: int | None = None) -> int:
    """Run one variant; write ``<workdir>/<tag>/result.json`` (history + weights folder)."""
    _quiet()
    import logging

    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    spec = VARIANTS[variant]
    cfg = job_config(config, run_dir=workdir, steps=steps, sampling_seed=sampling_seed)
    out_dir = Path(workdir) / tag
    out_dir.mkdir(parents=True, exist_ok=True)
    t0 = time.perf_counter()
    if spec["alpha"] is None:
        from plain_loop import run_plain

        def show(rec: dict) -> None:
            say(f"  {variant} step {rec['step']:3d} wall {rec['wall_s']:7.1f}s "
                f"gen {rec['gen_s']:.2f}s train {rec['train_s']:.2f}s success {rec['success']:.2f}")

        history = run_plain(cfg, cfg.trainer.steps, show, snapshot_dir=out_dir / "weights",
                            kv_cache=spec.get("kv_cache", True))
        result = {"history": history, "weights": str(out_dir / "weights"), "summary": None}
    else:
        import msgspec
        import yaml

        from rollart.app.run import train
        from rollart.app.launch import with_overrides

        _record_cpu_time()

        run = f"learn-{tag}-{uuid.uuid4().hex[:6]}"
        cfg = with_overrides(cfg, run=run, nats=None, rollout={"alpha": spec["alpha"],
                                                             **spec.get("rollout", {})})
        if "node" in spec:
            cfg = with_overrides(cfg, node=spec["node"])
        if "trainer" in spec:
            cfg = with_overrides(cfg, trainer=spec["trainer"])
        run_path = Path(cfg.run_dir) / run
        run_path.mkdir(parents=True, exist_ok=True)
        (run_path / "config.yaml").write_text(yaml.safe_dump(msgspec.to_builtins(cfg), sort_keys=False))
        try:
            import uvloop

            runner = uvloop.run
        except ImportError:
            import asyncio

            runner = asyncio.run
        nats = "memory" if spec["nats"] == "memory" else None
        stop_telemetry = _telemetry(cfg, spec.get("tracing"), run_path)
        t_call = time.perf_counter()
        try:
            summary = runner(train(cfg, nats=nats, resume=False, quiet=True,
                                   single_process=spec.get("single", True)))
        finally:
            stop_telemetry()
        train_call_s = time.perf_counter() - t_call
        history = [json.loads(line) for line in (run_path / "metrics.jsonl").read_text().splitlines()
                   if line.strip()]
        for h in history:
            h.pop("traj_ids", None)
            h.pop("traj_min_versions", None)
        result = {"history": history, "weights": str(run_path / "weights"), "summary": summary,
                  "occupancy": occupancy(TRAINERS[0].nodes.values()) if TRAINERS else None,
                  "run_path": str(run_path), "train_call_s": train_call_s,
                  "setup_s": MAIN_STARTED[0] - t_call if MAIN_STARTED else None}
    result["process_s"] = time.perf_counter() - t0
    (out_dir / "result.json").write_text(json.dumps(result))
    return 0


# -- machine load while a child runs ----------------------------------------------------------
def _cpu_times() -> tuple[float, float]:
    """(busy, total) jiffies of all CPUs from /proc/stat."""
    with open("/proc/stat") as f:
        vals = [float(x) for x in f.readline().split()[1:]]
    idle = vals[3] + (vals[4] if len(vals) > 4 else 0.0)
    return sum(vals) - idle, sum(vals)


class LoadSampler:
    """Samples the 1-minute load average every few seconds in a thread."""

    def __init__(self, every: float = 5.0) -> None:
        self.every, self.samples = every, []
        self._stop = threading.Event()
        self._t = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        while not self._stop.wait(self.every):
            self.samples.append(os.getloadavg()[0])

    def __enter__(self) -> "LoadSampler":
        self.samples.append(os.getloadavg()[0])
        self._t.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._t.join()


def run_variant(variant: str, args, workdir: str, tag: str, sampling_seed: int | None) -> dict:
    cmd = [sys.executable, str(Path(__file__).resolve()), "--child", variant, "--tag", tag,
           "--config", args.config, "--workdir", workdir]
    if sampling_seed is not None:
        cmd += ["--sampling-seed", str(sampling_seed)]
    if args.steps:
        cmd += ["--steps", str(args.steps)]
    say(f"{tag}: {VARIANTS[variant]['label']}")
    busy0, total0 = _cpu_times()
    t0 = time.perf_counter()
    with LoadSampler() as load:
        proc = subprocess.Popen(cmd, cwd=str(ROOT))
        _, status, rusage = os.wait4(proc.pid, 0)
        proc.returncode = os.waitstatus_to_exitcode(status)
    wall = time.perf_counter() - t0
    busy1, total1 = _cpu_times()
    if proc.returncode != 0:
        raise RuntimeError(f"variant {tag} failed with exit code {proc.returncode}")
    res = json.loads((Path(workdir) / tag / "result.json").read_text())
    ncpu = os.cpu_count() or 1
    machine_busy = (busy1 - busy0) / max(1e-9, total1 - total0) * ncpu  # cores busy, everything
    child_cpu = rusage.ru_utime + rusage.ru_stime
    res["process"] = {
        "wall_s": round(wall, 2),
        "cpu_s": round(child_cpu, 2),
        "cores_used": round(child_cpu / wall, 2),
        "machine_cores_busy": round(machine_busy, 2),
        "others_cores_busy": round(max(0.0, machine_busy - child_cpu / wall), 2),
        "load1_mean": round(sum(load.samples) / len(load.samples), 2),
        "load1_max": round(max(load.samples), 2),
    }
    say(f"{tag}: done in {wall:.1f}s, {child_cpu / wall:.2f} cores of our own, "
        f"others {res['process']['others_cores_busy']:.2f} cores, load {res['process']['load1_mean']}")
    return res


# -- offline greedy evaluation ---------------------------------------------------------------
def deterministic_env(env_cfg) -> bool:
    a = env_cfg.args or {}
    return env_cfg.type == "frozenlake" and not a.get("random_map") and not a.get("slippery")


def greedy_eval(cfg, weights_dir: str, episodes: int) -> dict[int, float]:
    """Greedy success of every saved version (and version 0, the model folder's weights)."""
    from plain_loop import rollout_lockstep

    from rollart.actors.env.chat import ChatFormat
    from rollart.engines.provision import model_dir
    from rollart.engines.torch_engine import TorchGenerationEngine

    md = model_dir(cfg)
    engine = TorchGenerationEngine(md, threads=cfg.model.threads, seed=0)
    chat = ChatFormat.load(md)
    env_cfg = cfg.envs[cfg.rollout.env]
    tasks = [(f"eval-{i}", -1, 10**6 + i) for i in range(episodes)]
    out: dict[int, float] = {}
    files = sorted(Path(weights_dir).glob("v*.safetensors"))
    for v, f in [(0, None)] + [(int(f.stem[1:]), f) for f in files]:
        if f is not None:
            engine.load_weights(f, v)
        res = rollout_lockstep(engine, chat, env_cfg, tasks, greedy=True, eval=True)
        out[v] = sum(r.success for r in res) / len(res)
    return out


def _mean(xs: list[float]) -> float | None:
    xs = [x for x in xs if x is not None]
    return round(sum(xs) / len(xs), 3) if xs else None


def analyse(variant: str, res: dict, success: dict[int, float], steps: int) -> dict:
    """One run: time to the threshold (first hit and sustained), step times, breakdown."""
    hist = res["history"]
    wall = {int(h["version"]): float(h["wall_s"]) for h in hist}
    cpu = {int(h["version"]): float(h["cpu_s"]) for h in hist if "cpu_s" in h}
    versions = sorted(v for v in success if v > 0)
    first = next((v for v in versions if success[v] >= THRESHOLD), None)
    sustained = None
    for i, v in enumerate(versions):
        if all(success[u] >= THRESHOLD for u in versions[i:]):
            sustained = v
            break
    n = len(hist)
    last_wall = float(hist[-1]["wall_s"]) if hist else None

    def mean(key: str) -> float | None:
        return _mean([float(h[key]) for h in hist if key in h])

    out = {
        "steps_run": n,
        "step_budget": steps,
        "reached": first is not None,
        "first_version": first,
        "time_to_threshold_s": round(wall[first], 2) if first is not None else None,
        "cpu_to_threshold_s": round(cpu[first], 2) if first in cpu else None,
        "sustained_version": sustained,
        "time_to_sustained_s": round(wall[sustained], 2) if sustained is not None else None,
        "total_wall_s": round(last_wall, 2) if last_wall is not None else None,
        "mean_step_s": round(last_wall / n, 3) if n else None,
        "cpu_per_step_s": round(float(hist[-1]["cpu_s"]) / n, 3) if n and "cpu_s" in hist[-1] else None,
        "tree_cpu_per_step_s": round(res["process"]["cpu_s"] / n, 3)
        if n and res.get("process") else None,
        "occupancy": res.get("occupancy") or plain_occupancy(hist),
        "greedy_success": {str(v): success[v] for v in sorted(success)},
        "wall_s": {str(v): round(wall[v], 3) for v in sorted(wall)},
        "train_success": [round(float(h["success"]), 4) for h in hist],
        "process": res.get("process"),
        "process_s": round(res.get("process_s", 0.0), 2),
    }
    if not VARIANTS[variant].get("single", True):  # the trainer process's CPU is not all of it
        out["cpu_to_threshold_s"] = out["cpu_per_step_s"] = None
    if VARIANTS[variant]["alpha"] is None:
        out["breakdown"] = {"gen_s": mean("gen_s"), "train_s": mean("train_s"),
                            "sync_s": mean("sync_s_before")}
    else:
        # wall_s[k] - wall_s[k-1] = wait_s[k] + train_s[k] + the checkpoint and publish of
        # step k-1 (+ the metrics write); the remainder is that overhead.
        over = [float(b["wall_s"]) - float(a["wall_s"]) - float(b["wait_s"]) - float(b["train_s"])
                for a, b in zip(hist, hist[1:])]
        out["breakdown"] = {
            "wait_s": mean("wait_s"), "train_s": mean("train_s"), "ckpt_publish_s": _mean(over),
            "traj_generate_s": mean("traj_generate_s"), "traj_step_s": mean("traj_step_s"),
            "traj_reset_s": mean("traj_reset_s"), "staleness": mean("staleness"),
            "ctx_tokens": mean("ctx_tokens"), "gen_tokens": mean("gen_tokens"),
            "first_wait_s": round(float(hist[0]["wait_s"]), 3) if hist else None,
        }
        summ = res.get("summary") or {}
        out["in_run_final_eval"] = {k: summ.get(k) for k in ("version", "greedy_success", "trajectories")}
        if res.get("setup_s") is not None and summ.get("wall_s") is not None and last_wall:
            # train(): bus + Node start (actor setup) | steps | after the last step: final
            # greedy eval and the node's drain (both inside summary["wall_s"]), bus close, plot.
            out["after_steps"] = {
                "train_call_s": round(res["train_call_s"], 2),
                "setup_s": round(res["setup_s"], 2),
                "after_last_step_s": round(res["train_call_s"] - res["setup_s"] - last_wall, 2),
            }
    return out


def plain_occupancy(hist: list[dict]) -> dict | None:
    """The plain loop's engine calls (one per turn, every live row) from its step records."""
    calls = sum(int(h.get("engine_calls", 0)) for h in hist)
    if not calls:
        return None
    return {"engine_calls": calls,
            "rows_per_call": round(sum(int(h["engine_rows"]) for h in hist) / calls, 2),
            "waiting_when_cut": 0.0}


def _median(xs: list[float | None]) -> float | None:
    """Median with "not reached" (None) counted as infinitely late; None if that is the median."""
    vals = sorted(math.inf if x is None else x for x in xs)
    if not vals:
        return None
    k = len(vals)
    m = vals[k // 2] if k % 2 else (vals[k // 2 - 1] + vals[k // 2]) / 2
    return None if math.isinf(m) else round(m, 2)


def combine(variant: str, reps: list[dict]) -> dict:
    """The repeats of one variant: medians, every value, and the first repeat's details."""
    out = {
        "label": VARIANTS[variant]["label"],
        "repeats": len(reps),
        "time_to_threshold_s": _median([r["time_to_threshold_s"] for r in reps]),
        "cpu_to_threshold_s": _median([r["cpu_to_threshold_s"] for r in reps])
        if all(r["time_to_threshold_s"] is None or r["cpu_to_threshold_s"] is not None for r in reps)
        else None,
        "first_version": _median([r["first_version"] for r in reps]),
        "time_to_sustained_s": _median([r["time_to_sustained_s"] for r in reps]),
        "mean_step_s": _median([r["mean_step_s"] for r in reps]),
        "cpu_per_step_s": _median([r["cpu_per_step_s"] for r in reps]),
        "tree_cpu_per_step_s": _median([r["tree_cpu_per_step_s"] for r in reps]),
        "occupancy": {k: _mean([(r["occupancy"] or {}).get(k) for r in reps])
                      for k in (reps[0]["occupancy"] or {})},
        "total_wall_s": _median([r["total_wall_s"] for r in reps]),
        "steps_run": reps[0]["steps_run"],
        "all_times_to_threshold_s": [r["time_to_threshold_s"] for r in reps],
        "all_first_versions": [r["first_version"] for r in reps],
        "all_mean_step_s": [r["mean_step_s"] for r in reps],
        "breakdown": {k: _mean([r["breakdown"].get(k) for r in reps]) for k in reps[0]["breakdown"]},
        "process": {k: _mean([(r["process"] or {}).get(k) for r in reps])
                    for k in (reps[0]["process"] or {})},
        "runs": reps,
    }
    if "after_steps" in reps[0]:
        out["after_steps"] = {k: _mean([r.get("after_steps", {}).get(k) for r in reps])
                              for k in reps[0]["after_steps"]}
    return out


# -- report -----------------------------------------------------------------------------------
def plot(variants: dict, path: Path) -> Path:
    """Sampled success of each step's batch against the wall time of that step (one line per
    run, one colour per variant), a dot where the run's policy first reached greedy 0.9."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 4.5), dpi=110)
    for i, (name, v) in enumerate(variants.items()):
        colour = f"C{i}"
        for k, run in enumerate(v["runs"]):
            walls = [run["wall_s"][ver] for ver in sorted(run["wall_s"], key=int)]
            ys = run["train_success"][: len(walls)]
            if not ys:
                continue
            ax.plot(walls[: len(ys)], ys, color=colour, alpha=0.75, lw=1.2,
                    label=v["label"] if k == 0 else None)
            if run["time_to_threshold_s"] is not None:
                ax.plot([run["time_to_threshold_s"]], [THRESHOLD], "o", color=colour, ms=5)
    ax.axhline(THRESHOLD, color="grey", ls="--", lw=0.8)
    ax.set_xlabel("wall time since the first step (s)")
    ax.set_ylabel("success of the step's sampled batch")
    ax.set_ylim(-0.05, 1.05)
    ax.set_title(f"Learning against wall time (every run; dot: first greedy success >= {THRESHOLD})")
    ax.legend(fontsize=8, loc="lower right")
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path)
    plt.close(fig)
    return path


def machine_info() -> dict:
    return machine("torch", "transformers", "nats-py", "rollart")


def _fmt_t(x: float | None) -> str:
    return "not reached" if x is None else f"{x:.1f}"


def _fmt_n(x: float | None, digits: int) -> str:
    return "?" if x is None else f"{x:.{digits}f}"


def _fmt_v(x: float | None) -> str:
    return "–" if x is None else f"{x:.3g}"


def readme_section(results: dict) -> str:
    job, reps = results["job"], results["job"]["repeats"]
    rows = []
    for name, r in results["variants"].items():
        ratio = {} if name == "plain" else (results["ratios_vs_plain"].get(name) or {})
        p, occ = r.get("process") or {}, r.get("occupancy") or {}
        t, at = _fmt_t(r["time_to_threshold_s"]), _fmt_v(r["first_version"])
        if reps > 1:
            t += " (" + ", ".join(_fmt_t(x) for x in r["all_times_to_threshold_s"]) + ")"
            at += " (" + ", ".join(_fmt_v(x) for x in r["all_first_versions"]) + ")"
        rows.append([r["label"], t, at, _fmt_t(r["cpu_to_threshold_s"]),
                     _fmt_t(r["time_to_sustained_s"]), f"{r['mean_step_s']:.2f}",
                     _fmt_v(r.get("tree_cpu_per_step_s")), ratio.get("time_to_threshold"),
                     ratio.get("mean_step"), ratio.get("cpu_per_step"),
                     f"{_fmt_n(p.get('cores_used'), 2)} / {_fmt_n(p.get('others_cores_busy'), 2)}",
                     None if occ.get("rows_per_call") is None else f"{occ['rows_per_call']:.1f}"])
    targets = "; ".join(f"{k.replace('mean_step', 's/step').replace('time_to_threshold', 'time to 0.9')}: {t}"
                        for k, t in (results["target"] or {}).items())
    return render("learning", config=job["config"], threshold=THRESHOLD, summary=job["summary"],
                  steps=job["steps"],
                  what=(f"median of {reps} runs per variant (each in brackets)" if reps > 1
                        else "one run each"),
                  targets=f"Targets (against the plain loop): {targets}. " if targets else "",
                  machine=describe_machine(results["machine"]), date=results["timestamp"][:10],
                  table=table(["variant", "time to 0.9 (s)", "at version", "CPU to 0.9 (s)",
                               "sustained (s)", "s/step", "CPU s/step (tree)", "time vs plain",
                               "s/step vs plain", "CPU s/step vs plain", "cores: ours / others",
                               "engine rows per call"], rows))


def job_summary(cfg) -> str:
    r, t, mt = cfg.rollout, cfg.trainer, cfg.model.tiny
    env = cfg.envs[r.env]
    return (f"tiny model h{mt.hidden_size} l{mt.num_layers} v{mt.vocab_size}, {cfg.model.threads} "
            f"torch thread(s); {env.type} {env.args}, max_turns {env.max_turns}; "
            f"{r.batch_groups} groups x {r.group_size}, temperature {env.sampling.temperature:g}; "
            f"{t.advantage}, lr {t.lr:g}, clip {t.clip_low}/{t.clip_high}, agg {t.agg}, "
            f"is_cap {t.is_cap}, entropy {t.entropy_coef:g}, kl {t.kl_coef:g}, "
            f"checkpoint_every {t.checkpoint_every}, weights via {t.weights}")


def judge(out: dict) -> tuple[dict, dict]:
    """Ratios of every variant against the plain loop, and the verdict of each target."""
    ratios, target = {}, {}
    base = out.get("plain")
    for name, r in out.items():
        if base is None:
            break
        tt = (round(r["time_to_threshold_s"] / base["time_to_threshold_s"], 2)
              if r["time_to_threshold_s"] and base["time_to_threshold_s"] else None)
        train = (base.get("breakdown") or {}).get("train_s")
        ratios[name] = {"time_to_threshold": tt,
                        "mean_step": round(r["mean_step_s"] / base["mean_step_s"], 2),
                        "floor": round(train / r["mean_step_s"], 2) if train and r["mean_step_s"] else None,
                        "cpu_per_step": round(r["tree_cpu_per_step_s"] / base["tree_cpu_per_step_s"], 2)
                        if r["tree_cpu_per_step_s"] and base["tree_cpu_per_step_s"] else None}
    for name, what, limit in TARGETS:
        if name not in ratios:
            continue
        x = ratios[name][what]
        key = f"{name} {what}"
        if what == "floor" and x is not None:
            key = f"{name} train-step floor"
            target[key] = f"{x:.0%} >= {limit:.0%} ({'pass' if x >= limit else 'fail'})"
        elif x is not None:
            key = f"{key} {limit}x" if key in target else key
            target[key] = f"{x}x <= {limit}x ({'pass' if x <= limit else 'fail'})"
        elif what == "time_to_threshold" and out[name]["time_to_threshold_s"] is None:
            target[key] = "not reached (fail)"
        else:
            target[key] = "plain loop did not reach 0.9 (n/a)"
    return ratios, target


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--config", default="configs/quickstart.yaml")
    add_run_flags(p, "smoke run: 3 steps")
    p.add_argument("--steps", type=int, default=None, help="step budget (default trainer.steps)")
    p.add_argument("--variants", default=",".join(DEFAULT_VARIANTS),
                   help=f"comma-separated, from {', '.join(VARIANTS)}")
    p.add_argument("--repeats", type=int, default=1,
                   help="rounds of all variants (order reversed every other round); medians reported")
    p.add_argument("--same-seed", action="store_true",
                   help="every repeat with the config's sampling seed (default: repeat k samples "
                        "with seed k; the plain loop is deterministic for a given seed)")
    p.add_argument("--eval-episodes", type=int, default=None,
                   help="greedy episodes per version (default 1 on a deterministic env, else 16)")
    p.add_argument("--keep", default=None, help="keep the run folders here instead of a temp dir")
    p.add_argument("--render", default=None, metavar="RESULTS_JSON",
                   help="only rewrite the README section from a saved results file")
    p.add_argument("--child", default=None, help=argparse.SUPPRESS)
    p.add_argument("--tag", default=None, help=argparse.SUPPRESS)
    p.add_argument("--workdir", default=None, help=argparse.SUPPRESS)
    p.add_argument("--sampling-seed", type=int, default=None, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.child:
        return child(args.child, args.config, args.workdir, args.steps, args.tag or args.child,
                     args.sampling_seed)
    if args.render:
        results = json.loads(Path(args.render).read_text())
        results["ratios_vs_plain"], results["target"] = judge(results["variants"])
        replace_section("learning", readme_section(results))
        say(f"rewrote the learning section of the README from {args.render}")
        return 0
    if args.quick and not args.steps:
        args.steps = 3
    variants = [x.strip() for x in args.variants.split(",") if x.strip()]
    unknown = [x for x in variants if x not in VARIANTS]
    if unknown:
        p.error(f"unknown variants {unknown}; allowed: {', '.join(VARIANTS)}")
    write = writes(args)
    _quiet()

    cfg_mtime = os.path.getmtime(args.config)
    results: dict = {
        "benchmark": "learning",
        "timestamp": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "quick": args.quick,
        "machine": machine_info(),
    }
    tmp_ctx = tempfile.TemporaryDirectory(prefix="rollart-learning-") if not args.keep else None
    workdir = args.keep or tmp_ctx.name
    Path(workdir).mkdir(parents=True, exist_ok=True)
    try:
        from rollart.engines.provision import model_dir

        cfg = job_config(args.config, run_dir=workdir, steps=args.steps)
        t0 = time.perf_counter()
        md = model_dir(cfg)  # built once; every variant finds it under <workdir>/_models
        say(f"model folder {md} ready in {time.perf_counter() - t0:.1f}s; step budget "
            f"{cfg.trainer.steps}; variants {variants} x {args.repeats}")
        det = deterministic_env(cfg.envs[cfg.rollout.env])
        episodes = args.eval_episodes or (1 if det else 16)
        results["job"] = {
            "config": args.config,
            "config_mtime": time.strftime("%Y-%m-%dT%H:%M:%S%z", time.localtime(cfg_mtime)),
            "steps": cfg.trainer.steps,
            "repeats": args.repeats,
            "sampling_seeds": "the config's in every repeat" if args.same_seed or args.repeats == 1
            else f"repeat k samples with seed k (actors.generate.args.seed), k = 0..{args.repeats - 1}",
            "summary": job_summary(cfg),
            "threshold": THRESHOLD,
            "eval_episodes": episodes,
            "eval_note": (f"The map is fixed and not slippery, so greedy decoding is deterministic "
                          f"and {episodes} episode per version gives its greedy success exactly."
                          if det and episodes == 1 else
                          f"{episodes} greedy episodes (seeds 1000000+) per version."),
        }
        runs: dict[str, list[dict]] = {n: [] for n in variants}
        order = []
        for k in range(args.repeats):
            for name in in_turn(variants, k):
                tag = name if args.repeats == 1 else f"{name}-r{k}"
                order.append(tag)
                seed = None if args.same_seed or k == 0 else k
                runs[name].append(run_variant(name, args, workdir, tag, seed))
        results["order"] = order
        results["machine"]["loadavg_end"] = [round(x, 2) for x in os.getloadavg()]
        say("offline greedy evaluation of every saved version")
        out = {}
        for name in variants:
            reps = []
            for res in runs[name]:
                t0 = time.perf_counter()
                succ = greedy_eval(cfg, res["weights"], episodes)
                a = analyse(name, res, succ, cfg.trainer.steps)
                reps.append(a)
                say(f"{name}: {len(succ)} versions evaluated in {time.perf_counter() - t0:.1f}s; "
                    f"time to {THRESHOLD}: {_fmt_t(a['time_to_threshold_s'])} s "
                    f"(v{a['first_version']}), {a['mean_step_s']} s/step")
            out[name] = combine(name, reps)
    finally:
        if tmp_ctx is not None:
            tmp_ctx.cleanup()
    results["variants"] = out
    if write:
        try:
            results["plot"] = str(plot(out, PLOT).relative_to(ROOT))
        except Exception as e:  # noqa: BLE001 - a missing plot never loses the numbers
            say(f"no plot: {e!r}")
    ratios, target = judge(out)
    results["ratios_vs_plain"] = ratios
    results["target"] = target
    results["config_changed_during_run"] = os.path.getmtime(args.config) != cfg_mtime
    finish(results, write, RESULTS, "learning", readme_section, say)
    for name, t in target.items():
        say(f"target {name}: {t}")
    if results["config_changed_during_run"]:
        say(f"warning: {args.config} changed during the run")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

"""CPU time per turn of a real quickstart run: per process, and per hop inside each process.

::

    python benchmarks/cpu_per_turn.py                  # full run (about 4 minutes); rewrites its README section
    python benchmarks/cpu_per_turn.py --quick          # smoke run (a few steps); prints JSON, writes nothing
    python benchmarks/cpu_per_turn.py --baseline "before: <rev>"   # a full run kept as the "before" columns
    python benchmarks/cpu_per_turn.py --label "after: <what changed>"  # a full run shown next to it
    python benchmarks/cpu_per_turn.py --layouts mp --steps 14 --rate 100 --keep

What runs: ``rollart run`` of ``configs/quickstart.yaml`` (the real command line,
:func:`rollart.app.cli.main`, in a child process of this script) with ``trainer.steps``
set to ``--steps``, in these layouts (``--layouts``):

- ``mp``: the default ``rollart run``: an embedded ``nats-server``, the trainer and the
  scheduler in the head process, generation and the envs (with reward) in child node
  processes (this host's default ``node.local_processes``: one child on <= 2 cores, whose
  turns call the engine in-process, ``rollout.local_calls``; env steps ``executor: inline``
  as the packaged quickstart has them);
- ``mp2``: the default before that: generation in one child, envs and reward in another,
  env steps on threads, every turn through nats-server;
- ``mp1-bus``: one child, env steps inline, ``rollout.local_calls: false``;
- ``memory``: ``--nats memory``, every actor in one process on the in-process bus.

**Window.** Setup (model, tokenizer, engine, the first steps' warm-up) and the end (final
evaluation, drain) are left out: the window opens when the trainer's ``metrics.jsonl`` has
``--warm`` rows and closes when it has ``steps - 1``. Over the window this script reads each
process's CPU time (user + system, its own threads, not its children) with psutil, and the
turns: the head process (patched only in this benchmark: a core subscription on
``rollout.completed`` added next to the run's bus, see :func:`_head`) records the time and the
turn count of every completed trajectory, so *turns* = the turns of the trajectories completed
inside the window, including those of groups the trainer then skips (their turns were
generated and stepped too). CPU per turn = a process's CPU in the window / those turns.

**Per hop.** Each Python process of the run carries a small CPU-weighted stack sampler
(:mod:`cpu_sampler`: a daemon thread reading ``sys._current_frames()`` at ``--rate`` Hz and
each thread's CPU clock, adding the CPU a thread used since the previous tick to the stack
it is in now). It is started only by this benchmark, through a ``sitecustomize.py`` in a
temporary folder put first on ``PYTHONPATH`` with ``ROLLART_CPU_SAMPLER`` set (the child
nodes inherit both), and samples only between the window's start and stop files; nothing in
rollart imports it. Why not py-spy: it installs (``pip install py-spy``) and attaches here
(root), but its ``record`` counted blocked threads as running (a thread in ``queue.get`` and
the uvloop loop in ``epoll_wait`` gave 100% "active" samples, while ``py-spy dump`` called them
idle), so its samples could not say where CPU goes, and ``--native``, which would show the
waits, must stop the process at every sample and managed ~10 samples a second. Weighting by
the thread's CPU clock makes waiting (epoll, the GIL, a queue) weigh nothing and charges time
in C (msgspec, torch, tokenizers) to the Python frame that called it. The main thread (the
event loop) is sampled by a ``SIGPROF`` handler instead, and its garbage collections are timed
by ``gc.callbacks`` (see :mod:`cpu_sampler`). A worker thread's CPU found at its wait point (a
job shorter than a tick) is spread over the worker threads' busy stacks (:func:`hops_of`).
CPU of threads with no Python stack (torch's own threads, threads that started and ended
between two ticks) is the process's CPU less its Python threads' ("native threads"); the
sampler's own CPU is reported apart and not counted.

Each stack is mapped to one hop by :func:`hop_of`: from the innermost frame outward,
the first frame that a rule names decides; libraries that are not a hop by themselves (torch,
transformers, numpy, contextlib, functools, ...) defer to the rollart frame that called them,
so torch under the engine is *engine forward* and torch under the trainer is *train step*. A
stack's CPU goes to its hop. Hops marked ``plumbing`` are
the per-turn cost of the architecture (encode, publish, bus client, actor runtime, service
client, EnvManager loop, batching, chat encoding, tracing/logging, heartbeats, asyncio);
engine forward, train step, env step and the per-step weight/checkpoint work are reported
apart. nats-server is a Go binary: its CPU is one row, counted as plumbing.

The JSON goes to stdout; the full run writes ``benchmarks/results/cpu_per_turn.json`` and the
section of ``benchmarks/README.md`` between ``<!-- cpu_per_turn:begin -->`` and
``<!-- cpu_per_turn:end -->``. ``--baseline LABEL`` stores the run as the "before" columns; a
later full run without it keeps that baseline and shows it next to its own numbers.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import platform
import shutil
import subprocess
import sys
import tempfile
import time
from collections import Counter, defaultdict
from pathlib import Path

from cpu_sampler import write_sitecustomize
from common import RESULTS as RESULTS_DIR, ROOT, describe_machine, render, sayer, store, table

RESULTS = RESULTS_DIR / "cpu_per_turn.json"
LAYOUTS = {"mp": "default `rollart run` of the packaged quickstart: embedded nats-server, the roles "
                 "of this host's default `node.local_processes` in child processes (one child "
                 "for generate, env and reward on <= 2 cores), local calls, env steps inline",
           "mp2": "the default before issue 25's placement: generate in one child, env and reward "
                  "in another, env steps on threads, every turn through nats-server",
           "mp1-bus": "one child for generate, env and reward, env steps inline, "
                      "`rollout.local_calls: false` (every turn through nats-server)",
           "memory": "`--nats memory`: every actor in one process"}
LAYOUT_CONFIG = {"mp2": {"node": {"local_processes": [["generate"], ["env", "reward"]]},
                         "envs": {"main": {"executor": "thread"}},
                         "rollout": {"local_calls": False}},
                 "mp1-bus": {"node": {"local_processes": [["generate", "env", "reward"]]},
                             "rollout": {"local_calls": False}}}


say = sayer("cpu_per_turn")


# -- hops ------------------------------------------------------------------------------------
# (hop, plumbing?) in the order the tables list them.
HOPS = [
    ("engine forward", False), ("train step", False), ("weights + checkpoints (per step)", False),
    ("env step", False),
    ("chat encoding", True), ("encode (msgspec)", True), ("decode (msgspec + checks)", True),
    ("bus: publish / request", True), ("bus: receive / fetch / ack", True), ("bus: memory", True),
    ("actor runtime (consume, serve, reply)", True), ("service client (generate/reward calls)", True),
    ("EnvManager turn loop", True), ("LLMProxy (admit, versions)", True), ("batching", True),
    ("scheduler + admission", True), ("trainer bookkeeping (ledger, batches)", True),
    ("tracing / logging / metrics", True), ("heartbeats / progress", True),
    ("asyncio / event loop (incl. uvloop's C: epoll, sockets)", True),
    ("garbage collection (main thread)", True), ("other", True),
    ("native threads (no Python stack)", False), ("benchmark probe", False),
]
PLUMBING = {h for h, p in HOPS if p}
ASYNCIO = "asyncio / event loop (incl. uvloop's C: epoll, sockets)"

# Files (path under rollart/) -> hop, the first prefix that matches (a file before its folder).
# A function-name rule (below) wins over its file's hop.
_ROLLART_FILES = {
    "engines/torch_engine.py": "engine forward", "engines/kv_cache.py": "engine forward",
    "engines/choice_trie.py": "engine forward", "engines/tiny.py": "engine forward",
    "engines/base.py": "engine forward", "engines/vllm_engine.py": "engine forward",
    "engines/torch_trainer.py": "train step", "engines/train_backends.py": "train step",
    "engines/trainer_ranks.py": "train step", "engines/lora.py": "train step",
    "actors/trainer/batch.py": "train step", "algos/": "train step",
    "engines/torch_weights.py": "weights + checkpoints (per step)",
    "engines/weight_": "weights + checkpoints (per step)",
    "engines/digest.py": "weights + checkpoints (per step)",
    "actors/trainer/publish.py": "weights + checkpoints (per step)",
    "actors/trainer/checkpoint": "weights + checkpoints (per step)",
    "actors/trainer/files.py": "weights + checkpoints (per step)",
    "envs/": "env step",
    "actors/env/chat.py": "chat encoding",
    "messages/checks.py": "decode (msgspec + checks)",
    "bus/memory": "bus: memory",
    "actors/kernel/runtime.py": "actor runtime (consume, serve, reply)",
    "actors/kernel/base.py": "actor runtime (consume, serve, reply)",
    "actors/kernel/service.py": "actor runtime (consume, serve, reply)",
    "actors/kernel/run_end.py": "actor runtime (consume, serve, reply)",
    "node/": "actor runtime (consume, serve, reply)",
    "actors/kernel/service_client.py": "service client (generate/reward calls)",
    "actors/env/": "EnvManager turn loop", "actors/kernel/cancelled.py": "EnvManager turn loop",
    "actors/kernel/payloads.py": "EnvManager turn loop", "config/placement.py": "EnvManager turn loop",
    "actors/generate/": "LLMProxy (admit, versions)",
    "actors/kernel/policy": "LLMProxy (admit, versions)",
    "actors/kernel/replica_pins.py": "LLMProxy (admit, versions)",
    "actors/kernel/batching.py": "batching", "engines/batched.py": "batching",
    "actors/scheduler/": "scheduler + admission", "actors/groups/admission.py": "scheduler + admission",
    "actors/kernel/pool_watch.py": "heartbeats / progress",
    "actors/kernel/progress.py": "heartbeats / progress",
    "actors/trainer/": "trainer bookkeeping (ledger, batches)",
    "actors/groups/": "trainer bookkeeping (ledger, batches)",
    "actors/kernel/records.py": "trainer bookkeeping (ledger, batches)",
    "telemetry/progress.py": "heartbeats / progress", "telemetry/hardware.py": "heartbeats / progress",
    "telemetry/": "tracing / logging / metrics",
    "app/local_nodes.py": "heartbeats / progress",
}
# Libraries that are a hop by themselves: a folder or file in the frame's path -> hop.
_LIBS = {
    "asyncio/": ASYNCIO, "selectors.py": ASYNCIO, "threading.py": ASYNCIO, "concurrent/": ASYNCIO,
    "queue.py": ASYNCIO, "uvloop/": ASYNCIO, "weakref": ASYNCIO,
    "tokenizers/": "chat encoding",
    "logging/": "tracing / logging / metrics", "opentelemetry/": "tracing / logging / metrics",
    "psutil/": "heartbeats / progress",
    "gymnasium/": "env step", "<garbage collection>": "garbage collection (main thread)",
    "safetensors/": "weights + checkpoints (per step)",
}
_NATS_SEND = ("publish", "request", "send", "flush", "_flusher", "_pending")


def _path_of(frame: str) -> tuple[str, str]:
    """``func (path)`` or ``func (path:line)`` -> (func, path)."""
    func, _, rest = frame.rpartition(" (")
    path = rest[:-1] if rest.endswith(")") else rest
    head, _, line = path.rpartition(":")
    return func, head if line.isdigit() else path


def _classify(func: str, path: str) -> str | None:
    p = path.replace("\\", "/")
    i = p.find("rollart/")
    name = func.rsplit(".", 1)[-1]
    if i != -1:
        rel = p[i + len("rollart/"):]
        if rel.startswith("bus/codec.py"):
            return "encode (msgspec)" if "encode" in name else "decode (msgspec + checks)"
        if "heartbeat" in name or "progress" in name:
            return "heartbeats / progress"
        if rel.startswith("bus/nats") or rel.startswith("bus/base.py") or rel.startswith("bus/auth.py"):
            return ("bus: publish / request" if any(k in name for k in _NATS_SEND)
                    else "bus: receive / fetch / ack")
        for prefix, hop in _ROLLART_FILES.items():
            if rel.startswith(prefix):
                return hop
        return "other"
    if p.startswith("nats/") or "/nats/" in p:
        return "bus: publish / request" if any(k in name for k in _NATS_SEND) else "bus: receive / fetch / ack"
    for prefix, hop in _LIBS.items():
        if p.startswith(prefix) or f"/{prefix}" in p:
            return hop
    return None  # defer to the caller


def hop_of(stack: str) -> str:
    """The hop of one folded stack (outermost frame first, ``;``-separated)."""
    if "hooked.<locals>.on_done (" in stack:  # this benchmark's subscription, in the head
        return "benchmark probe"
    for frame in reversed(stack.split(";")):
        func, path = _path_of(frame)
        hop = _classify(func, path)
        if hop is not None:
            return hop
    return "other"


# Where a thread other than the main one waits for work. The sampler thread needs the GIL to
# look, so a job shorter than a tick (an engine call, a to_thread call) is often over when it
# looks, and its CPU lands on the wait: that CPU is spread over the busy stacks of the
# process's threads other than the main one.
_IDLE = (("_worker", "concurrent/futures/thread.py"), ("Condition.wait", "threading.py"),
         ("Event.wait", "threading.py"), ("Queue.get", "queue.py"), ("SimpleQueue.get", "queue.py"))


def _idle(stack: str) -> bool:
    func, path = _path_of(stack.rsplit(";", 1)[-1])
    return any(func == f and path.endswith(p) for f, p in _IDLE)


def hops_of(stacks_us: dict[str, int]) -> tuple[Counter, int]:
    """CPU microseconds per hop of one process's folded stacks, and how many of them were
    found at a worker thread's wait point and spread over the other threads' busy stacks."""
    by_thread: dict[str, dict[str, int]] = defaultdict(dict)
    for stack, us in stacks_us.items():
        head, _, rest = stack.partition(";")
        by_thread[head if head.startswith("thread:") else ""][stack] = us
    hops: Counter = Counter()
    others = {s: us for t, stacks in by_thread.items() if not t.endswith(":MainThread")
              for s, us in stacks.items()}
    for t, stacks in by_thread.items():
        if t.endswith(":MainThread"):
            for s, us in stacks.items():
                hops[hop_of(s)] += us
    # spread over the busy stacks of every thread but the main one: a pool's threads share
    # their jobs, and one whose jobs were all shorter than a tick has only its wait to show
    idle = sum(us for s, us in others.items() if _idle(s))
    busy = sum(others.values()) - idle
    scale = 1.0 + idle / busy if idle and busy else 1.0
    for s, us in others.items():
        if scale != 1.0 and _idle(s):
            continue
        hops[hop_of(s)] += int(us * scale)
    return hops, idle if scale != 1.0 else 0


# -- the head process (a child of this script) ----------------------------------------------
def _head(args) -> int:
    """``rollart run`` in this process, with one addition: every ``rollout.completed`` on the
    run's bus is timestamped with its turn count into ``--turns-out``."""
    import rollart.app.run as run_mod
    from rollart import messages as m
    from rollart.app.cli import main
    from rollart.bus.codec import decode

    rows: list[tuple[float, int]] = []
    orig = run_mod.open_bus

    @contextlib.asynccontextmanager
    async def hooked(cfg, nats, overrides=None):
        async with orig(cfg, nats, overrides) as bus:
            async def on_done(req) -> None:
                try:
                    rows.append((time.time(), len(decode(m.RolloutCompleted, req.data).turns)))
                except Exception:  # noqa: BLE001 - a reference to the object store: unknown
                    rows.append((time.time(), -1))
            sub = await bus.subscribe(m.subject(cfg.run, "rollout.completed"), on_done)
            try:
                yield bus
            finally:
                with contextlib.suppress(Exception):
                    await sub.unsubscribe()

    run_mod.open_bus = hooked
    argv = ["run", args.head, "--quiet"] + (["--nats", "memory"] if args.layout == "memory" else [])
    try:
        return main(argv)
    finally:
        Path(args.turns_out).write_text(json.dumps(rows))


# -- one layout --------------------------------------------------------------------------------
def _label(p) -> str:
    try:
        cmd = p.cmdline()
    except Exception:  # noqa: BLE001
        return "?"
    if cmd and os.path.basename(cmd[0]).startswith("nats-server"):
        return "nats-server"
    if "--roles" in cmd:
        return "node: " + cmd[cmd.index("--roles") + 1]
    if "--head" in cmd:
        return "head (every actor)" if "memory" in cmd else "head (trainer, scheduler)"
    return os.path.basename(cmd[0]) if cmd else "?"


def _cpu(p) -> float | None:
    try:
        t = p.cpu_times()
        return t.user + t.system
    except Exception:  # noqa: BLE001 - gone
        return None


def _metrics_rows(path: Path) -> int:
    try:
        return sum(1 for line in path.read_text().splitlines() if line.strip())
    except OSError:
        return 0


def run_layout(layout: str, args, tmp: Path) -> dict:
    import psutil
    import yaml

    raw = yaml.safe_load((ROOT / "configs" / "quickstart.yaml").read_text())
    raw["run"] = f"cpt-{layout}"
    raw["run_dir"] = str(tmp / "runs")
    raw["trainer"]["steps"] = args.steps
    raw["trainer"]["eval_groups"] = 1
    for section, keys in LAYOUT_CONFIG.get(layout, {}).items():
        if section == "envs":
            for env, env_keys in keys.items():
                raw["envs"][env].update(env_keys)
        else:
            raw.setdefault(section, {}).update(keys)
    cfg_path = tmp / f"{layout}.yaml"
    cfg_path.write_text(yaml.safe_dump(raw, sort_keys=False))
    metrics = tmp / "runs" / raw["run"] / "metrics.jsonl"
    turns_out = tmp / f"turns-{layout}.json"
    ctl = tmp / f"ctl-{layout}"
    ctl.mkdir()
    site = tmp / "site"
    site.mkdir(exist_ok=True)
    write_sitecustomize(str(site))
    env = dict(os.environ, PYTHONUNBUFFERED="1", TOKENIZERS_PARALLELISM="false")
    if not args.no_profile:
        env.update(ROLLART_CPU_SAMPLER=str(ctl), ROLLART_CPU_SAMPLER_HZ=str(args.rate),
                   PYTHONPATH=os.pathsep.join([str(site), *filter(None, [env.get("PYTHONPATH")])]))
    log = open(tmp / f"head-{layout}.log", "wb")  # noqa: SIM115
    cmd = [sys.executable, str(Path(__file__).resolve()), "--head", str(cfg_path), "--layout", layout,
           "--turns-out", str(turns_out)]
    t_start = time.time()
    proc = subprocess.Popen(cmd, cwd=str(tmp), stdout=log, stderr=subprocess.STDOUT, env=env)
    head = psutil.Process(proc.pid)
    end_rows = args.steps - 1
    window: dict = {}
    procs: dict[int, psutil.Process] = {}
    try:
        while proc.poll() is None:
            n = _metrics_rows(metrics)
            if "t0" not in window and n >= args.warm:
                procs = {p.pid: p for p in [head, *head.children(recursive=True)]}
                (ctl / "start").touch()
                window["t0"] = time.time()
                window["cpu0"] = {pid: _cpu(p) for pid, p in procs.items()}
                window["labels"] = {pid: _label(p) for pid, p in procs.items()}
                window["rows0"] = n
                say(f"{layout}: window opens at step {n} ({window['t0'] - t_start:.1f}s after start); "
                    f"processes: {', '.join(window['labels'].values())}")
            if "t0" in window and "t1" not in window and n >= end_rows:
                (ctl / "stop").touch()
                window["t1"] = time.time()
                window["cpu1"] = {pid: _cpu(p) for pid, p in procs.items()}
                window["rows1"] = n
                say(f"{layout}: window closes at step {n} ({window['t1'] - window['t0']:.1f}s)")
            time.sleep(0.05)
    finally:
        if proc.poll() is None:
            proc.wait()
        log.close()
    if proc.returncode != 0 or "t1" not in window:
        tail = (tmp / f"head-{layout}.log").read_text(errors="replace")[-3000:]
        raise RuntimeError(f"{layout}: the run failed (exit {proc.returncode}) or never reached the "
                           f"window's end:\n{tail}")
    rows = json.loads(turns_out.read_text())
    in_win = [t for ts, t in rows if window["t0"] <= ts < window["t1"]]
    turns = sum(t for t in in_win if t > 0)
    wall = window["t1"] - window["t0"]
    steps = window["rows1"] - window["rows0"]
    sampled = {}
    for f in ctl.glob("*.json"):
        d = json.loads(f.read_text())
        sampled[d["pid"]] = d
    out: dict = {"layout": layout, "description": LAYOUTS[layout], "window_s": round(wall, 2),
                 "window_steps": steps, "turns": turns, "trajectories": len(in_win),
                 "turns_per_step": round(turns / max(1, steps), 1),
                 "unknown_turn_counts": sum(1 for t in in_win if t < 0),
                 "rate_hz": None if args.no_profile else args.rate, "processes": []}
    total_cpu = profiler = 0.0
    hop_ms: dict[str, float] = defaultdict(float)
    for pid, label in window["labels"].items():
        c0, c1 = window["cpu0"].get(pid), window["cpu1"].get(pid)
        if c0 is None or c1 is None:
            continue
        cpu = c1 - c0
        row: dict = {"process": label, "pid": pid}
        d = sampled.get(pid)
        if d is not None:  # the sampler's own thread is not the process's work
            cpu -= d["sampler_cpu_s"]
            profiler += d["sampler_cpu_s"]
            row["sampler_cpu_s"] = round(d["sampler_cpu_s"], 3)
            row["sampler_ticks_per_s"] = round(d["ticks"] / max(1e-9, d["span_s"]), 1)
            hops, spread = hops_of(d["stacks_us"])
            row["spread_from_waits_cpu_s"] = round(spread / 1e6, 3)
            native = d["process_cpu_s"] - d["sampler_cpu_s"] - d["threads_cpu_s"]
            if native > 0:
                hops["native threads (no Python stack)"] += int(native * 1e6)
            scale = cpu / max(1e-9, sum(hops.values()) / 1e6)  # the sampler's span ~ the window
            row["sampled_cpu_s"] = round(sum(hops.values()) / 1e6, 3)
            row["hops_ms_per_turn"] = {}
            for h in [h for h, _ in HOPS]:
                if hops.get(h):
                    ms = hops[h] / 1e6 * scale / turns * 1e3
                    row["hops_ms_per_turn"][h] = round(ms, 4)
                    hop_ms[h] += ms
        elif label == "nats-server":
            hop_ms["nats-server"] += cpu / turns * 1e3
        total_cpu += cpu
        row.update(cpu_s=round(cpu, 3), cores=round(cpu / wall, 3),
                   ms_per_turn=round(cpu / turns * 1e3, 4) if turns else None)
        out["processes"].append(row)
    out["profiler_cpu_s"] = round(profiler, 3)
    out["cpu_s"] = round(total_cpu, 2)
    out["cpu_per_step_s"] = round(total_cpu / max(1, steps), 3)
    out["ms_per_turn"] = round(total_cpu / turns * 1e3, 4) if turns else None
    if hop_ms:
        out["hops_ms_per_turn"] = {h: round(v, 4) for h, v in sorted(hop_ms.items(), key=lambda kv: -kv[1])}
        plumb = sum(v for h, v in hop_ms.items() if h in PLUMBING or h == "nats-server")
        out["plumbing_ms_per_turn"] = round(plumb, 4)
        out["not_plumbing_ms_per_turn"] = {h: round(hop_ms[h], 4) for h, p in HOPS if not p and h in hop_ms}
    return out


# -- README --------------------------------------------------------------------------------
def _fmt(v) -> str:
    return "" if v is None else f"{v:.3f}"


def readme_section(res: dict) -> str:
    """One table: ms of CPU per turn by hop (rows) and layout (columns), then the totals."""
    cur = res["current"]
    layouts = cur["layouts"]
    rows = []
    for h in [h for h, _ in HOPS] + ["nats-server"]:
        cells = [c.get("hops_ms_per_turn", {}).get(h) for c in layouts.values()]
        if any(x is not None for x in cells):
            mark = "" if (h in PLUMBING or h == "nats-server") else " (not plumbing)"
            rows.append([h + mark, *(_fmt(x) or None for x in cells)])
    rows.append(["**plumbing**", *(_fmt(c.get("plumbing_ms_per_turn")) or None for c in layouts.values())])
    rows.append(["all processes", *(_fmt(c["ms_per_turn"]) for c in layouts.values())])
    rows.append(["target plumbing <= 0.5", *(None if c.get("plumbing_ms_per_turn") is None else
                                            "met" if c["plumbing_ms_per_turn"] <= 0.5 else "**not met**"
                                            for c in layouts.values())])
    rows.append(["turns in the window", *(c["turns"] for c in layouts.values())])
    return render("cpu_per_turn", label=cur["label"], steps=cur["steps"],
                  machine=describe_machine(cur), date=cur["when"][:10],
                  table=table(["hop (ms CPU per turn)", *layouts], rows))


def _git_rev() -> str:
    try:
        rev = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True,
                             text=True, timeout=10).stdout.strip()
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=ROOT,
                               capture_output=True, text=True, timeout=10).stdout.strip()
        return rev + ("+changes" if dirty else "")
    except Exception:  # noqa: BLE001
        return "unknown"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="a few steps, prints JSON, writes nothing")
    ap.add_argument("--layouts", default="mp,mp2,mp1-bus,memory",
                    help="comma-separated: " + ", ".join(LAYOUTS))
    ap.add_argument("--steps", type=int, default=None, help="trainer.steps (default 14, quick 5)")
    ap.add_argument("--warm", type=int, default=None, help="metrics rows before the window opens (default 3, quick 2)")
    ap.add_argument("--rate", type=int, default=250, help="sampler ticks per second")
    ap.add_argument("--no-profile", action="store_true", help="per-process CPU only (no sampler)")
    ap.add_argument("--baseline", metavar="LABEL", default=None,
                    help="store this full run as the 'before' columns, with this label")
    ap.add_argument("--label", default=None, help="label of this run (default: the git rev)")
    ap.add_argument("--keep", action="store_true", help="keep the temporary run folders")
    ap.add_argument("--head", help=argparse.SUPPRESS)
    ap.add_argument("--layout", help=argparse.SUPPRESS)
    ap.add_argument("--turns-out", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.head:
        return _head(args)
    args.steps = args.steps or (5 if args.quick else 14)
    args.warm = args.warm or (2 if args.quick else 3)
    if args.steps - 1 <= args.warm:
        ap.error("--steps must be at least --warm + 2")
    layouts = [x for x in args.layouts.split(",") if x]
    for x in layouts:
        if x not in LAYOUTS:
            ap.error(f"unknown layout {x!r}: {', '.join(LAYOUTS)}")
    run = {"label": args.baseline or args.label or _git_rev(), "rev": _git_rev(),
           "when": time.strftime("%Y-%m-%dT%H:%M:%S%z"), "steps": args.steps, "warm": args.warm,
           "cpus": os.cpu_count(), "python": platform.python_version(),
           "load_start": round(os.getloadavg()[0], 2), "layouts": {}}
    tmp = Path(tempfile.mkdtemp(prefix="cpu_per_turn-"))
    try:
        for layout in layouts:
            say(f"{layout}: {args.steps} steps")
            run["layouts"][layout] = run_layout(layout, args, tmp)
            r = run["layouts"][layout]
            say(f"{layout}: {r['turns']} turns, {r['ms_per_turn']} ms CPU per turn in all, plumbing "
                f"{r.get('plumbing_ms_per_turn')} ms")
    finally:
        if args.keep:
            say(f"run folders kept in {tmp}")
        else:
            shutil.rmtree(tmp, ignore_errors=True)
    run["load_end"] = round(os.getloadavg()[0], 2)
    if args.quick:
        print(json.dumps(run, indent=2))
        return 0
    old = json.loads(RESULTS.read_text()) if RESULTS.exists() else {}
    res = {"current": run,  # --baseline: this run is also the "before" later runs compare with
           "baseline": json.loads(json.dumps(run)) if args.baseline else old.get("baseline")}
    store(RESULTS, res, "cpu_per_turn", readme_section(res))
    print(json.dumps(run, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())

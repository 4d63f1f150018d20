"""Rollart at scale on one real nats-server with separate node processes (issue 26, item 3).

::

    python benchmarks/emulate_scale.py            # 2,048 trajectories in flight, 64 generate replicas, 8 nodes
    python benchmarks/emulate_scale.py --quick    # smoke run (< 60 s): 64 trajectories, 2 x 2 replicas; writes nothing

One embedded ``nats-server`` (:class:`rollart.bus.server.EmbeddedServer`, JetStream) and
separate ``python -m rollart.node`` processes, as a cluster would run them:

- 1 head node: the ``RolloutScheduler`` only (no trainer: ``actors.scheduler.args:
  {total_groups: N, bounded: false}``, so every group is admitted at once);
- ``--gen-nodes`` generate nodes (default 4) of ``--replicas`` replicas each (default 16) of
  the real ``LLMProxy`` driving an emulated continuous-batching engine
  (``rollart.emulate.engine:EmulatedLLMProxy``);
- ``--env-nodes`` env nodes (default 3), each one ``EnvManager`` running its share of the
  trajectories (``rollout.concurrency`` = trajectories / env nodes, so all are in flight at
  once) on the emulated env ``rollart.emulate.env:EmulatedEnv``.

The config is ``benchmarks/emulate.py``'s (``base_cfg``, ``e1_env``, ``e1_engine``,
``emulated_model``: E1's env, reset ~N(5, 1), 3-6 steps ~N(10, 2) modelled s, outputs ~200
tokens on the ``h800`` profile) with ``pools: {head, gen, cpu}`` and ``mapping: {generate:
gen, env: cpu, reward: cpu}``; modelled seconds are slept x ``--time-scale``.

What is measured (the benchmark's own process watches the bus, it takes no part in the run):

- CPU seconds of every node process and of nats-server (``/proc/<pid>/stat`` utime + stime,
  read when every worker node is up and the head starts, and when the last trajectory
  completed), per role, per trajectory, per turn;
- trajectories in flight: the sum over env nodes of their ``on_request`` deliveries held,
  from the node heartbeats (each node reports once a second);
- bus latency per hop, from the run's own OpenTelemetry spans (``tracing: {exporter: jsonl,
  sample: --trace-sample}``, one ``traces.jsonl`` shared by the nodes, one host so one
  clock): scheduler -> env (the ``trajectory`` span's ``queue_wait_s``: the request stored in
  JetStream to the EnvManager handling it), env -> generate (the EnvManager's ``generate``
  span start to the replica's ``generate.request`` span start), generate -> env (the
  replica's span end to the ``generate`` span end), and their sum, the round trip minus the
  replica's time (emulated engine and queue included); env -> watcher (a completion's
  ``finished_at`` to its arrival here, core subscription); a tiny probe request/reply round
  trip between this process and a probe child, 20 times a second, alongside;
- bus overhead share of a trajectory's wall time: (scheduler -> env hop + the sum of its
  turns' round trip minus the replica's time) / (that hop + the ``trajectory`` span);
- messages and bytes through nats-server (its monitoring endpoint's ``/varz``).

``--quick`` checks that it runs and that the accounting adds up (completed == admitted, CPU
per role > 0, p50 <= p99), not speed. A full run writes ``benchmarks/results/emulate_scale.json``
and its section of ``benchmarks/README.md`` (``<!-- emulate_scale:begin -->``).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import math
import os
import platform
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path
from typing import Any

from common import HERE, RESULTS, ROOT, render, replace_section, sayer, table  # noqa: F401 - HERE: the tests read it

RESULT_FILE = RESULTS / "emulate_scale.json"
SECTION = "emulate_scale"
PROBE_SUBJECT = "rollart-bench.probe"
CLK_TCK = os.sysconf("SC_CLK_TCK")
BUS_SHARE_TARGET = 0.02
RAY_NOTE = ("not run with this result: `python benchmarks/emulate_scale.py --ray` adds it (ray "
            "is the project's `bench` extra; `pip download ray` fetches ray 2.60.0 here)")


say = sayer("emulate_scale")


class SetupError(RuntimeError):
    """The run could not be set up or did not finish (a clear message, exit status 2)."""


# -- small helpers ------------------------------------------------------------------------
def pct(xs: list[float], q: float) -> float | None:
    """The ``q`` quantile (0..1) of ``xs``, linear between order statistics; None if empty."""
    if not xs:
        return None
    s = sorted(xs)
    k = (len(s) - 1) * q
    lo, hi = math.floor(k), math.ceil(k)
    return s[lo] + (s[hi] - s[lo]) * (k - lo)


def dist_ms(xs_s: list[float], what: str) -> dict[str, Any]:
    """p50 / p90 / p99 / max of seconds ``xs_s``, in milliseconds."""
    out: dict[str, Any] = {"n": len(xs_s), "what": what}
    for name, q in (("p50", 0.5), ("p90", 0.9), ("p99", 0.99), ("max", 1.0)):
        v = pct(xs_s, q)
        out[f"{name}_ms"] = None if v is None else round(v * 1e3, 3)
    return out


def cpu_s(pid: int) -> float | None:
    """utime + stime of process ``pid`` (seconds), None once it is gone."""
    try:
        data = Path(f"/proc/{pid}/stat").read_text()
    except (FileNotFoundError, ProcessLookupError, PermissionError):
        return None
    rest = data[data.rindex(")") + 2:].split()
    return (int(rest[11]) + int(rest[12])) / CLK_TCK


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def varz(port: int) -> dict:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/varz", timeout=5) as r:
        return json.loads(r.read())


def child_env() -> dict[str, str]:
    src = str(ROOT / "src")
    return dict(os.environ, PYTHONPATH=os.pathsep.join(
        [src, str(ROOT)] + [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]),
        PYTHONUNBUFFERED="1")


class Child:
    """One child process (a node, the probe responder), its output in a log file; killed
    with this process whatever way it ends (``PR_SET_PDEATHSIG``) and by :meth:`stop`."""

    def __init__(self, name: str, role: str, argv: list[str], log_dir: Path) -> None:
        from rollart.procs import die_with_parent

        self.name, self.role = name, role
        self.log = log_dir / f"{name}.log"
        self._f = open(self.log, "wb")
        self.proc = subprocess.Popen([sys.executable, *argv], cwd=str(ROOT), env=child_env(),
                                     stdin=subprocess.DEVNULL, stdout=self._f,
                                     stderr=subprocess.STDOUT,
                                     preexec_fn=die_with_parent(signal.SIGKILL))
        self.pid = self.proc.pid

    def output(self, last: int = 30) -> str:
        try:
            lines = self.log.read_text(errors="replace").splitlines()
        except FileNotFoundError:
            return ""
        return "\n".join(lines[-last:])

    def saw(self, needle: str) -> bool:
        try:
            return needle in self.log.read_text(errors="replace")
        except FileNotFoundError:
            return False

    def alive(self) -> bool:
        return self.proc.poll() is None

    def stop(self, wait: float = 10.0) -> None:
        """SIGTERM, then SIGKILL after ``wait`` seconds."""
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(wait)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self._f.close()


def stop_all(children: list[Child], wait: float) -> None:
    """SIGTERM every child at once (nodes drain), SIGKILL what still runs after ``wait`` s."""
    for c in children:
        if c.alive():
            c.proc.terminate()
    end = time.monotonic() + wait
    for c in children:
        try:
            c.proc.wait(max(0.0, end - time.monotonic()))
        except subprocess.TimeoutExpired:
            c.proc.kill()
            c.proc.wait()
        c.stop()


# -- the config ----------------------------------------------------------------------------
def layout(args) -> dict[str, int]:
    per_env = math.ceil(args.trajectories / args.env_nodes)
    return {"nodes": 1 + args.gen_nodes + args.env_nodes, "head_nodes": 1,
            "generate_nodes": args.gen_nodes, "replicas_per_generate_node": args.replicas,
            "generate_replicas": args.gen_nodes * args.replicas, "env_nodes": args.env_nodes,
            "env_concurrency_per_node": per_env}


def write_config(args, run_dir: Path) -> tuple[Path, str, dict]:
    """The run's config (``emulate.py``'s, placed on pools) as a file the nodes load."""
    import msgspec

    import emulate as em
    from rollart.config import RunConfig, convert

    lay = layout(args)
    ns = argparse.Namespace(
        run_dir=run_dir, replicas=args.replicas, max_new_tokens=args.max_new_tokens,
        group_size=args.group_size, batch_groups=args.groups, concurrency=lay["env_concurrency_per_node"],
        seed=args.seed, step_mu=args.step_mu, reset_mu=args.reset_mu, time_scale=args.time_scale,
        profile=args.profile, out_mean=args.out_mean)
    base = em.base_cfg(ns, env_args=em.e1_env(ns, args.step_sigma), mode="trajectory", alpha=0,
                       engine=em.e1_engine(ns), max_turns=8)
    d = msgspec.to_builtins(base)
    d["actors"]["scheduler"] = {"args": {"total_groups": args.groups, "bounded": False}}
    d["actors"]["env"] = {"replicas": 1}
    d["pools"] = {"head": {"description": "scheduler"},
                  "gen": {"description": "emulated GPUs (generate replicas)"},
                  "cpu": {"description": "env managers"}}
    d["mapping"] = {"generate": "gen", "env": "cpu", "reward": "cpu"}
    d["node"] = {**d.get("node", {}), "heartbeat_every": 1.0, "grace": 5.0}
    d["tracing"] = {"exporter": "jsonl" if args.trace_sample > 0 else "none",
                    "sample": args.trace_sample, "metrics_interval_s": 3600.0}
    convert(d, RunConfig)  # the nodes will load it: fail here, with the key, if it is wrong
    path = run_dir / f"{d['run']}.yaml"
    path.write_text(json.dumps(d, indent=1))  # JSON is YAML
    return path, d["run"], d


# -- watching the run ----------------------------------------------------------------------
class Watch:
    """What this process sees on the bus: completions, outcomes, node heartbeats, probes."""

    def __init__(self, run: str, expected: int) -> None:
        self.run, self.expected = run, expected
        self.completed: dict[str, dict] = {}
        self.cancelled = 0
        self.dead: list[str] = []
        self.turns = 0
        self.done = asyncio.Event()
        self.completion_lag_s: list[float] = []
        self.heartbeat_lag_s: list[float] = []
        self.probe_rtt_s: list[float] = []
        self.nodes: dict[str, dict] = {}  # node id -> latest heartbeat summary
        self.env_inflight: dict[str, int] = {}
        self.gen_inflight: dict[str, int] = {}
        self.peak_trajectories = 0
        self.peak_generate = 0
        self.series: list[tuple[float, int, int]] = []
        self.t0 = time.monotonic()
        self.last_completion = 0.0

    def _check_done(self) -> None:
        if len(self.completed) + len(self.dead) + self.cancelled >= self.expected:
            self.done.set()

    async def on_completed(self, req) -> None:
        from rollart import messages as m
        from rollart.bus.codec import decode

        now = time.time()
        try:
            c = decode(m.RolloutCompleted, req.data)
        except Exception:  # noqa: BLE001 - a reference to the object store: count it by header
            self.completed[f"ref{len(self.completed)}"] = {}
            self._check_done()
            return
        if c.traj_id in self.completed:
            return
        if c.finished_at:
            self.completion_lag_s.append(max(0.0, now - c.finished_at))
        self.completed[c.traj_id] = {"turns": len(c.turns), "timings": dict(c.timings),
                                     "stop": c.stop_reason}
        self.turns += len(c.turns)
        self.last_completion = time.monotonic()
        self._check_done()

    async def on_cancelled(self, req) -> None:
        self.cancelled += 1
        self._check_done()

    async def on_dead(self, req) -> None:
        from rollart import messages as m
        from rollart.bus.codec import decode

        try:
            self.dead.append(decode(m.DeadLetter, req.data).reason[:200])
        except Exception:  # noqa: BLE001
            self.dead.append("undecodable dead letter")
        self._check_done()

    async def on_heartbeat(self, req) -> None:
        from rollart import messages as m
        from rollart.bus.codec import decode

        now = time.time()
        try:
            hb = decode(m.NodeHeartbeat, req.data)
        except Exception:  # noqa: BLE001
            return
        self.heartbeat_lag_s.append(max(0.0, now - hb.ts))
        self.nodes[hb.node_id] = {"pid": hb.pid, "roles": list(hb.roles), "pool": hb.pool}
        if "env" in hb.roles:
            self.env_inflight[hb.node_id] = int(sum(v for k, v in hb.stats.items()
                                                    if k.endswith(".on_request.inflight")))
        if "generate" in hb.roles:
            self.gen_inflight[hb.node_id] = int(sum(v for k, v in hb.stats.items()
                                                    if k.endswith(".inflight")))
        tr, gr = sum(self.env_inflight.values()), sum(self.gen_inflight.values())
        self.peak_trajectories = max(self.peak_trajectories, tr)
        self.peak_generate = max(self.peak_generate, gr)
        self.series.append((round(time.monotonic() - self.t0, 2), tr, gr))


async def probe_loop(bus, watch: Watch, hz: float, stop: asyncio.Event) -> None:
    """A tiny request/reply to the probe child, ``hz`` times a second, until ``stop``."""
    from rollart.bus import BusError

    period = 1.0 / hz
    while not stop.is_set():
        t = time.perf_counter()
        try:
            await bus.request(PROBE_SUBJECT, b"p", timeout=5.0)
            watch.probe_rtt_s.append(time.perf_counter() - t)
        except BusError:
            pass
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(stop.wait(), max(0.0, period - (time.perf_counter() - t)))


async def probe_serve(url: str) -> None:
    """The probe child: answer every request on the probe subject until SIGTERM."""
    from rollart.bus.nats import NatsBus

    bus = NatsBus(url, name="rollart-bench-probe")
    await bus.connect()

    async def answer(req) -> None:
        await req.respond(b"ok")

    await bus.subscribe(PROBE_SUBJECT, answer)
    print("probe ready", flush=True)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    loop.add_signal_handler(signal.SIGTERM, stop.set)
    await stop.wait()
    await bus.close()


# -- traces --------------------------------------------------------------------------------
def trace_hops(path: Path) -> dict[str, Any]:
    """Per-hop latencies and each sampled trajectory's bus share, from ``traces.jsonl``."""
    spans: list[dict] = []
    bad = 0
    if path.exists():
        for line in path.read_text().splitlines():
            try:
                spans.append(json.loads(line))
            except json.JSONDecodeError:
                bad += 1
    by_id = {s["span_id"]: s for s in spans}
    kids: dict[str, list[dict]] = {}
    for s in spans:
        if s.get("parent_id"):
            kids.setdefault(s["parent_id"], []).append(s)
    req_hop, reply_hop, round_trip, engine = [], [], [], []
    gen_over: dict[str, float] = {}  # generate span id -> round trip minus the replica's time
    for g in spans:
        if g["name"] != "generate":
            continue
        reqs = [k for k in kids.get(g["span_id"], []) if k["name"] == "generate.request"]
        if len(reqs) != 1:  # retried (or the replica's span is missing): not one clean hop
            continue
        r = reqs[0]
        a = (r["start_ns"] - g["start_ns"]) / 1e9
        b = (g["end_ns"] - r["end_ns"]) / 1e9
        req_hop.append(a)
        reply_hop.append(b)
        round_trip.append(a + b)
        engine.append((r["end_ns"] - r["start_ns"]) / 1e9)
        gen_over[g["span_id"]] = a + b
    queue_wait, shares, traj_wall = [], [], []
    for t in spans:
        if t["name"] != "trajectory" or t.get("parent_id") in by_id:
            continue
        qw = float(t.get("attributes", {}).get("queue_wait_s", 0.0))
        gens = [k for k in kids.get(t["span_id"], []) if k["name"] == "generate"]
        if not gens or any(k["span_id"] not in gen_over for k in gens):
            continue
        wall = qw + (t["end_ns"] - t["start_ns"]) / 1e9
        over = qw + sum(gen_over[k["span_id"]] for k in gens)
        queue_wait.append(qw)
        traj_wall.append(wall)
        shares.append(over / wall if wall > 0 else 0.0)
    return {
        "spans": len(spans), "bad_lines": bad, "trajectories_traced": len(shares),
        "turns_traced": len(round_trip),
        "hops": {
            "scheduler_to_env": dist_ms(queue_wait, "rollout.requested stored in JetStream -> "
                                        "the EnvManager handles it (trajectory span queue_wait_s)"),
            "env_to_generate": dist_ms(req_hop, "EnvManager generate span start -> replica "
                                       "generate.request span start (encode, route, NATS, decode, "
                                       "dispatch)"),
            "generate_to_env": dist_ms(reply_hop, "replica generate.request span end -> "
                                       "EnvManager generate span end (encode, NATS, decode, wake)"),
            "generate_round_trip_minus_replica": dist_ms(round_trip, "the two hops above: a "
                                                         "turn's request/reply minus the replica's "
                                                         "own time"),
        },
        "replica_time": dist_ms(engine, "replica generate.request span (emulated engine queue "
                                "and batch, proxy work)"),
        "trajectory_wall": dist_ms(traj_wall, "scheduler -> env hop + trajectory span"),
        "bus_share": {"n": len(shares), "mean": _r(sum(shares) / len(shares)) if shares else None,
                      "p50": _r(pct(shares, 0.5)), "p99": _r(pct(shares, 0.99)),
                      "max": _r(pct(shares, 1.0))},
    }


def _r(x: float | None, nd: int = 5) -> float | None:
    return None if x is None else round(x, nd)


# -- the run -------------------------------------------------------------------------------
async def run(args) -> dict:
    import emulate as em
    from rollart import messages as m
    from rollart.actors.kernel.run_end import put_run_end
    from rollart.bus.nats import NatsBus
    from rollart.bus.server import EmbeddedServer

    args.run_dir.mkdir(parents=True, exist_ok=True)
    work = Path(tempfile.mkdtemp(prefix="scale-", dir=args.run_dir))
    say(f"emulated model folder (tokenizer only) in {args.run_dir}")
    model = await asyncio.to_thread(em.emulated_model, argparse.Namespace(run_dir=args.run_dir))
    (work / model.name).symlink_to(model)  # base_cfg looks for it in the run's folder
    cfg_path, run_name, cfg = write_config(args, work)
    lay = layout(args)
    trajs = args.groups * args.group_size
    mon = free_port()
    children: list[Child] = []
    server = EmbeddedServer(work / "nats", extra_args=("-m", str(mon)))
    bus = None
    stop_probe = asyncio.Event()
    probe_task = None
    t_setup = time.monotonic()
    try:
        await asyncio.to_thread(server.start)
        url, srv_pid = server.url, server.pid
        say(f"nats-server pid {srv_pid} at {url}; config {cfg_path}")
        probe = Child("probe", "harness", [str(Path(__file__).resolve()), "--probe-serve", url],
                      work)
        children.append(probe)

        def node(name: str, role: str, roles: str, pool: str) -> Child:
            c = Child(name, role, ["-m", "rollart.node", "--config", str(cfg_path), "--roles",
                                   roles, "--pool", pool, "--nats", url, "--log-level",
                                   "WARNING"], work)
            children.append(c)
            return c

        workers = [node(f"gen{i}", "generate", "generate", "gen") for i in range(args.gen_nodes)]
        workers += [node(f"env{i}", "env", "env", "cpu") for i in range(args.env_nodes)]
        watch = Watch(run_name, trajs)
        bus = NatsBus(url, name="rollart-bench-scale-watch")
        await bus.connect()
        for name, fn in (("rollout.completed", watch.on_completed),
                         ("rollout.cancelled", watch.on_cancelled), ("dead", watch.on_dead),
                         ("node.heartbeat", watch.on_heartbeat)):
            await bus.subscribe(m.subject(run_name, name), fn)
        await wait_for(lambda: all(c.saw("serving") for c in workers) and probe.saw("probe ready"),
                       children, args.start_timeout, "every worker node to start")
        # every replica has announced itself (its progress reports name it)
        await wait_for(lambda: sum(1 for n in watch.nodes.values() if "generate" in n["roles"])
                       >= args.gen_nodes and sum(1 for n in watch.nodes.values()
                                                  if "env" in n["roles"]) >= args.env_nodes,
                       children, args.start_timeout, "a heartbeat from every worker node")
        setup_s = time.monotonic() - t_setup
        say(f"{len(workers)} worker nodes up in {setup_s:.1f} s; starting the head (scheduler): "
            f"{trajs} trajectories, {lay['generate_replicas']} generate replicas")
        head = node("head", "scheduler", "scheduler", "head")
        t_head = time.monotonic()
        # the window opens once the head serves: its start-up (imports, config, connecting)
        # is reported apart; its admission starts as it prints the line (a few ms may be missed)
        await wait_for(lambda: head.saw("serving"), children, args.start_timeout,
                       "the head node to start", step=0.005)
        cpu0 = {c.pid: cpu_s(c.pid) for c in [*workers, head]}
        cpu0[srv_pid] = cpu_s(srv_pid)
        head_startup = {"wall_s": round(time.monotonic() - t_head, 2),
                        "cpu_s": round(cpu0[head.pid] or 0.0, 3)}
        own0 = time.process_time()
        v0 = varz(mon)
        watch.t0 = time.monotonic()
        t0 = time.monotonic()
        probe_task = asyncio.ensure_future(probe_loop(bus, watch, args.probe_hz, stop_probe))
        await wait_for(lambda: watch.done.is_set(), children, args.timeout,
                       f"all {trajs} trajectories to complete",
                       progress=lambda: f"{len(watch.completed)}/{trajs} completed, "
                                        f"{sum(watch.env_inflight.values())} in flight")
        wall = watch.last_completion - t0 if watch.last_completion else time.monotonic() - t0
        cpu1 = {pid: cpu_s(pid) for pid in cpu0}
        own = time.process_time() - own0
        v1 = varz(mon)
        stop_probe.set()
        await probe_task
        say(f"done in {wall:.1f} s: {len(watch.completed)} completed, {len(watch.dead)} dead; "
            "ending the run (nodes drain and flush their spans)")
        await put_run_end(bus, run_name, m.RunEnd(stage="ended", ts=time.time()))
        t_drain = time.monotonic()
        nodes = [c for c in children if c.role != "harness"]
        with contextlib.suppress(SetupError):
            await wait_for(lambda: all(not c.alive() for c in nodes), [], args.drain_timeout,
                           "every node to drain and exit")
        drain_s = time.monotonic() - t_drain
        exits = {c.name: c.proc.poll() for c in nodes}
    finally:
        stop_probe.set()
        if probe_task is not None and not probe_task.done():
            probe_task.cancel()
        if bus is not None:
            with contextlib.suppress(Exception):
                await bus.close()
        stop_all(children, wait=8.0)
        server.stop()
    hops = trace_hops(work / run_name / "traces.jsonl")
    # -- the accounting ----------------------------------------------------------------
    role_names = {"scheduler": "scheduler (head node)", "env": "env (EnvManager nodes)",
                  "generate": "generate (LLMProxy nodes, emulated engine)",
                  "nats-server": "nats-server"}
    procs = [(c.name, c.role, c.pid) for c in children if c.role != "harness"]
    procs.append(("nats-server", "nats-server", srv_pid))
    roles: dict[str, dict] = {}
    n_done = len(watch.completed)
    turns = watch.turns
    for name, role, pid in procs:
        a, b = cpu0.get(pid), cpu1.get(pid)
        if a is None or b is None:
            raise SetupError(f"{name} (pid {pid}) exited before its CPU time was read")
        r = roles.setdefault(role, {"label": role_names[role], "processes": 0, "cpu_s": 0.0})
        r["processes"] += 1
        r["cpu_s"] += b - a
    total = sum(r["cpu_s"] for r in roles.values())
    for r in roles.values():
        r["cpu_s"] = round(r["cpu_s"], 3)
        r["cores"] = round(r["cpu_s"] / wall, 3) if wall else None
        r["cpu_ms_per_trajectory"] = round(1e3 * r["cpu_s"] / max(1, n_done), 3)
        r["cpu_ms_per_turn"] = round(1e3 * r["cpu_s"] / max(1, turns), 3)
    events = 3 * n_done + 3 * turns
    msgs_in = v1.get("in_msgs", 0) - v0.get("in_msgs", 0)
    msgs_out = v1.get("out_msgs", 0) - v0.get("out_msgs", 0)
    res = {
        "benchmark": SECTION, "quick": args.quick,
        "emulated": ["generation engine (rollart.emulate.engine:EmulatedLLMProxy)",
                     "env (rollart.emulate.env:EmulatedEnv)"],
        "real": ["nats-server (JetStream)", "RolloutScheduler", "EnvManager", "LLMProxy",
                 "node processes (python -m rollart.node)", "bus client (nats-py)"],
        "layout": lay,
        "workload": {"time_scale": args.time_scale, "profile": args.profile,
                     "groups": args.groups, "group_size": args.group_size, "trajectories": trajs,
                     "reset_model_s": [args.reset_mu, args.reset_mu / 5],
                     "step_model_s": [args.step_mu, args.step_sigma], "turns": [3, 6],
                     "out_mean_tokens": args.out_mean, "trace_sample": args.trace_sample,
                     "probe_hz": args.probe_hz},
        "trajectories": {"admitted": trajs, "completed": n_done, "cancelled": watch.cancelled,
                         "dead": len(watch.dead), "dead_reasons": sorted(set(watch.dead))[:5]},
        "turns": turns,
        "wall_s": round(wall, 3),
        "setup_s": round(setup_s, 2), "drain_s": round(drain_s, 2),
        "head_startup": head_startup,
        "node_exit_codes": exits,
        "in_flight": {"peak_trajectories": watch.peak_trajectories,
                      "peak_generate_requests": watch.peak_generate,
                      "how": "sum over env nodes of their on_request deliveries held (generate "
                             "nodes: requests held), from node heartbeats, once a second",
                      "series": watch.series[:: max(1, len(watch.series) // 200)]},
        "events": events,
        "events_per_s": round(events / wall, 1) if wall else None,
        "events_how": "a trajectory's request, reset and completion, and per turn its generate "
                      "request, reply and env step (as E6)",
        "bus": {"messages_in": msgs_in, "messages_out": msgs_out,
                "bytes_in": v1.get("in_bytes", 0) - v0.get("in_bytes", 0),
                "bytes_out": v1.get("out_bytes", 0) - v0.get("out_bytes", 0),
                "messages_in_per_s": round(msgs_in / wall, 1) if wall else None,
                "messages_in_per_turn": round(msgs_in / max(1, turns), 2),
                "how": "nats-server /varz in_msgs / out_msgs between the head's start and the "
                       "last completion (every client: acks, heartbeats, progress reports, "
                       "KV, this watcher and its probe included)"},
        "latency": {**hops["hops"],
                    "env_to_watcher_completion": dist_ms(watch.completion_lag_s,
                                                         "RolloutCompleted.finished_at -> this "
                                                         "process receives it (core subscription "
                                                         "on the JetStream subject)"),
                    "heartbeat": dist_ms(watch.heartbeat_lag_s, "NodeHeartbeat.ts -> this "
                                         "process receives it (core publish)"),
                    "probe_round_trip": dist_ms(watch.probe_rtt_s, "tiny request/reply, this "
                                                "process <-> the probe child, alongside the run")},
        "replica_time": hops["replica_time"],
        "trajectory_wall": hops["trajectory_wall"],
        "bus_share": {**hops["bus_share"], "target": BUS_SHARE_TARGET,
                      "how": "(scheduler -> env hop + sum over its turns of the generate round "
                             "trip minus the replica's time) / (that hop + trajectory span), per "
                             "traced trajectory"},
        "traces": {k: hops[k] for k in ("spans", "bad_lines", "trajectories_traced", "turns_traced")},
        "cpu": {"window_s": round(wall, 3), "roles": roles, "rollart_total_cpu_s": round(total, 3),
                "rollart_total_cores": round(total / wall, 3) if wall else None,
                "rollart_cpu_ms_per_trajectory": round(1e3 * total / max(1, n_done), 3),
                "rollart_cpu_ms_per_turn": round(1e3 * total / max(1, turns), 3),
                "harness_cpu_s": round(own, 3),
                "how": "/proc/<pid>/stat utime + stime of each node process and nats-server, "
                       "from the head printing 'serving' (its start-up apart: head_startup) to "
                       "the last completion"},
        "ray": {"built": False, "note": RAY_NOTE},
        "machine": {"cpus": os.cpu_count(), "host": platform.node(), "python": platform.python_version(),
                    "loadavg_end": [round(x, 2) for x in os.getloadavg()]},
        "processes": [{"name": n, "role": r, "pid": pid} for n, r, pid in procs]
                     + [{"name": c.name, "role": c.role, "pid": c.pid} for c in children
                        if c.role == "harness"],
        "logs": str(work),
    }
    res["accounting_errors"] = check(res)
    return res


async def wait_for(cond, children: list[Child], deadline: float, what: str,
                   progress=None, step: float = 0.05) -> None:
    """Poll ``cond`` until true; a SetupError at the deadline or when a child exits."""
    end = time.monotonic() + deadline
    said = time.monotonic()
    while not cond():
        for c in children:
            if c.role != "harness" and not c.alive():
                raise SetupError(f"{c.name} exited (status {c.proc.poll()}) while waiting for "
                                 f"{what}; its log {c.log}:\n{c.output()}")
        if time.monotonic() > end:
            tails = "\n".join(f"--- {c.name}:\n{c.output(8)}" for c in children)
            raise SetupError(f"timed out after {deadline:g} s waiting for {what}"
                             + (f" ({progress()})" if progress else "") + f"\n{tails}")
        if progress is not None and time.monotonic() - said > 10:
            said = time.monotonic()
            say(progress())
        await asyncio.sleep(step)


def check(res: dict) -> list[str]:
    """What does not add up (empty: the accounting is consistent)."""
    bad = []
    t = res["trajectories"]
    if t["completed"] != t["admitted"]:
        bad.append(f"{t['completed']} completed != {t['admitted']} admitted "
                   f"({t['dead']} dead, {t['cancelled']} cancelled)")
    for role in ("scheduler", "env", "generate", "nats-server"):
        r = res["cpu"]["roles"].get(role)
        if r is None or not r["cpu_s"] > 0:
            bad.append(f"no CPU time measured for {role}")
    for name, d in res["latency"].items():
        if d["n"] and not d["p50_ms"] <= d["p99_ms"] <= d["max_ms"]:
            bad.append(f"{name}: percentiles out of order {d}")
    for name in ("env_to_generate", "generate_to_env", "scheduler_to_env", "probe_round_trip"):
        if not res["latency"][name]["n"]:
            bad.append(f"{name}: no samples")
    if res["turns"] < t["completed"] * 3:
        bad.append(f"{res['turns']} turns for {t['completed']} trajectories of 3-6 turns")
    if res["in_flight"]["peak_trajectories"] > t["admitted"]:
        bad.append("more trajectories in flight than admitted")
    return bad


def sweep_row(r: dict) -> dict:
    """One run's headline numbers (one row of the README's first table)."""
    lat = r["latency"]
    return {
        "time_scale": r["workload"]["time_scale"], "trajectories": r["trajectories"],
        "peak_in_flight": r["in_flight"]["peak_trajectories"], "turns": r["turns"],
        "wall_s": r["wall_s"], "events_per_s": r["events_per_s"],
        "bus_messages_in_per_s": r["bus"]["messages_in_per_s"],
        "latency_ms": {k: {"p50": v["p50_ms"], "p99": v["p99_ms"], "n": v["n"]}
                       for k, v in lat.items()},
        "bus_share": {k: r["bus_share"][k] for k in ("n", "mean", "p50", "p99")},
        "cores": r["cpu"]["rollart_total_cores"],
        "cpu_ms_per_trajectory": r["cpu"]["rollart_cpu_ms_per_trajectory"],
        "roles": {k: {"cpu_ms_per_trajectory": v["cpu_ms_per_trajectory"], "cores": v["cores"]}
                  for k, v in r["cpu"]["roles"].items()},
        "trajectory_wall_p50_s": (r["trajectory_wall"]["p50_ms"] or 0) / 1e3,
    }


# -- the Ray fan-out ---------------------------------------------------------------------------
RAY_CODE = r"""
import asyncio, os, time, random
import ray
from rollart.emulate.engine import EmulatedEngine
from rollart.emulate.env import EmulatedEnv
from rollart.engines.base import GenInput


@ray.remote(num_cpus=0, max_concurrency=100000)
class GenNode:
    def __init__(self, replicas, engine):
        self.engines = [EmulatedEngine(seed=i, name=f"ray-{i}", **engine) for i in range(replicas)]
        self.n = 0

    def pid(self):
        return os.getpid()

    async def generate(self, replica, traj_id, prompt_ids, max_new_tokens):
        t_in = time.time()
        out = await self.engines[replica].generate(
            GenInput(prompt_ids=prompt_ids, max_new_tokens=max_new_tokens, session=traj_id),
            f"{traj_id}#{self.n}")
        self.n += 1
        return {"token_ids": out.token_ids, "logprobs": out.logprobs, "t_in": t_in,
                "t_out": time.time()}


@ray.remote(num_cpus=0, max_concurrency=100000)
class EnvNode:
    def __init__(self, gens, replicas, env_args, max_new_tokens):
        self.gens, self.replicas = gens, replicas
        self.env_args, self.max_new_tokens = env_args, max_new_tokens

    def pid(self):
        return os.getpid()

    async def trajectory(self, traj_id, seed, sent_at):
        t_start = time.time()
        env = EmulatedEnv(**self.env_args)
        obs, _ = await env.reset(seed)
        k = hash(traj_id) % (len(self.gens) * self.replicas)  # one replica per trajectory
        gen, rep = self.gens[k // self.replicas], k % self.replicas
        tokens, hops = [], []
        done = False
        while not done:
            tokens += [10 + (hash(w) % 240) for w in obs.split()]
            t0 = time.time()
            res = await gen.generate.remote(rep, traj_id, tokens, self.max_new_tokens)
            t1 = time.time()
            hops.append((res["t_in"] - t0, t1 - res["t_out"], res["t_out"] - res["t_in"]))
            tokens += res["token_ids"]
            obs, _, done, _, _ = await env.step("x")
        return {"traj_id": traj_id, "turns": len(hops), "hops": hops, "sent_at": sent_at,
                "t_start": t_start, "t_end": time.time(), "tokens": len(tokens)}
"""


def ray_run(args) -> dict:
    """The same fan-out with Ray actors: the driver submits every trajectory at once to
    ``--env-nodes`` env actors; each runs its trajectories (the emulated env, the same E1
    parameters) and calls ``--gen-nodes`` generate actors of ``--replicas`` emulated engines
    each (one replica per trajectory, as rollart's affinity does). One process per actor,
    like rollart's node processes; ``num_cpus=0`` so all fit on this host."""
    import importlib
    import types

    import emulate as em

    if args.ray_path:
        sys.path.append(str(args.ray_path))
        os.environ["PYTHONPATH"] = os.pathsep.join(
            p for p in [os.environ.get("PYTHONPATH", ""), str(ROOT / "src"), str(args.ray_path)] if p)
    os.environ.setdefault("RAY_AUTH_MODE", "disabled")
    try:
        ray = importlib.import_module("ray")
    except ImportError as e:
        raise SetupError(f"--ray needs ray importable ({e}): pip install ray, or --ray-path DIR "
                         "with ray installed there (pip install --target DIR ray)") from None
    ns = argparse.Namespace(step_mu=args.step_mu, reset_mu=args.reset_mu,
                            time_scale=args.time_scale, profile=args.profile,
                            out_mean=args.out_mean)
    env_args = em.e1_env(ns, args.step_sigma)
    engine = em.e1_engine(ns)
    code = types.ModuleType("emulate_scale_ray")
    before = {int(p) for p in os.listdir("/proc") if p.isdigit()}
    t = time.monotonic()
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False, logging_level="ERROR",
             configure_logging=False)
    init_s = time.monotonic() - t
    try:
        exec(compile(RAY_CODE, "emulate_scale_ray", "exec"), code.__dict__)
        gens = [code.GenNode.remote(args.replicas, engine) for _ in range(args.gen_nodes)]
        envs = [code.EnvNode.remote(gens, args.replicas, env_args, args.max_new_tokens)
                for _ in range(args.env_nodes)]
        gen_pids = ray.get([g.pid.remote() for g in gens])
        env_pids = ray.get([e.pid.remote() for e in envs])
        setup_s = time.monotonic() - t
        mine = os.getpid()
        system = [p for p in (int(x) for x in os.listdir("/proc") if x.isdigit())
                  if p not in before and p != mine and p not in gen_pids + env_pids]
        pids = {"generate": gen_pids, "env": env_pids, "ray system": system}
        cpu0 = {p: cpu_s(p) for ps in pids.values() for p in ps}
        own0 = time.process_time()
        n = args.ray_trajectories
        say(f"ray {ray.__version__}: init {init_s:.1f} s, {len(gens)} x {args.replicas} generate "
            f"replicas, {len(envs)} env actors up in {setup_s:.1f} s; {n} trajectories")
        t0 = time.monotonic()
        refs = [envs[i % len(envs)].trajectory.remote(f"g{i // args.group_size}-{i % args.group_size}",
                                                      args.seed * 1_000_000 + i, time.time())
                for i in range(n)]
        out, pending, last = [], list(refs), time.monotonic()
        while pending:
            ready, pending = ray.wait(pending, num_returns=len(pending), timeout=10.0)
            out += ray.get(ready)
            if time.monotonic() - last > 10:
                last = time.monotonic()
                say(f"ray: {len(out)}/{n} completed")
            if time.monotonic() - t0 > args.timeout:
                raise SetupError(f"ray: {len(out)}/{n} trajectories after {args.timeout:g} s")
        wall = time.monotonic() - t0
        cpu1 = {p: cpu_s(p) for p in cpu0}
        own = time.process_time() - own0
    finally:
        ray.shutdown()
    turns = sum(r["turns"] for r in out)
    roles = {}
    for role, ps in pids.items():
        c = sum((cpu1[p] or 0.0) - (cpu0[p] or 0.0) for p in ps
                if cpu0.get(p) is not None and cpu1.get(p) is not None)
        roles[role] = {"processes": len(ps), "cpu_s": round(c, 3), "cores": round(c / wall, 3),
                       "cpu_ms_per_trajectory": round(1e3 * c / max(1, len(out)), 3),
                       "cpu_ms_per_turn": round(1e3 * c / max(1, turns), 3)}
    total = sum(r["cpu_s"] for r in roles.values())
    qw = [max(0.0, r["t_start"] - r["sent_at"]) for r in out]
    req = [h[0] for r in out for h in r["hops"]]
    rep = [h[1] for r in out for h in r["hops"]]
    rtt = [h[0] + h[1] for r in out for h in r["hops"]]
    shares = []
    for r, q in zip(out, qw):
        w = q + (r["t_end"] - r["t_start"])
        shares.append((q + sum(h[0] + h[1] for h in r["hops"])) / w if w > 0 else 0.0)
    edges = sorted([(r["t_start"], 1) for r in out] + [(r["t_end"], -1) for r in out])
    peak = cur = 0
    for _, d in edges:
        cur += d
        peak = max(peak, cur)
    return {
        "installable": True, "built": True, "version": ray.__version__,
        "layout": {"env_actors": args.env_nodes, "generate_actors": args.gen_nodes,
                   "replicas_per_generate_actor": args.replicas},
        "time_scale": args.time_scale, "trajectories": {"admitted": n, "completed": len(out)},
        "peak_in_flight": peak, "turns": turns, "wall_s": round(wall, 3),
        "init_s": round(init_s, 2), "setup_s": round(setup_s, 2),
        "events_per_s": round((3 * len(out) + 3 * turns) / wall, 1),
        "latency": {
            "scheduler_to_env": dist_ms(qw, "driver .remote() -> the env actor's method starts"),
            "env_to_generate": dist_ms(req, "env actor before the call -> generate actor method starts"),
            "generate_to_env": dist_ms(rep, "generate actor method returns -> env actor has the result"),
            "generate_round_trip_minus_replica": dist_ms(rtt, "the two hops above")},
        "bus_share": {"n": len(shares), "mean": _r(sum(shares) / len(shares)) if shares else None,
                      "p50": _r(pct(shares, 0.5)), "p99": _r(pct(shares, 0.99)),
                      "max": _r(pct(shares, 1.0))},
        "cpu": {"roles": roles, "total_cpu_s": round(total, 3), "total_cores": round(total / wall, 3),
                "cpu_ms_per_trajectory": round(1e3 * total / max(1, len(out)), 3),
                "cpu_ms_per_turn": round(1e3 * total / max(1, turns), 3),
                "driver_cpu_s": round(own, 3)},
        "differences": "the env actor builds prompt ids from the observation's words (no chat "
                       "template or tokenizer, which rollart's EnvManager runs); no durable "
                       "work queue, acks, heartbeats, progress reports, retries or tracing: "
                       "Ray's object store and actor calls only",
        "machine": {"cpus": os.cpu_count(), "loadavg_end": [round(x, 2) for x in os.getloadavg()]},
    }


# -- the README section ----------------------------------------------------------------------
def section(res: dict) -> str:
    """The README section: a row per time scale (and per kept run), and Ray's when it ran."""
    lay, w = res["layout"], res["workload"]
    sweep = res.get("sweep") or [sweep_row(res)]
    runs = [(f"rollart x{r['time_scale']:g}", r) for r in sweep] + [
        (f"rollart x{r['time_scale']:g}, {r['trajectories']['admitted']} traj. (another run)", r)
        for r in res.get("other_runs", [])]
    hops = ("scheduler_to_env", "env_to_generate", "generate_to_env",
            "generate_round_trip_minus_replica")

    def hop(d: dict, p50: str = "p50", p99: str = "p99") -> str:
        return f"{d[p50]:.1f} / {d[p99]:.1f}" if d.get("n", 1) else None

    def share(sh: dict) -> str:
        return f"{_pc(sh['p50'])} / {_pc(sh['mean'])} / {_pc(sh['p99'])}"

    rows = [[label, f"{r['trajectories']['completed']} / {r['trajectories']['admitted']}",
             r["peak_in_flight"], f"{r['wall_s']:.1f}", *(hop(r["latency_ms"][k]) for k in hops),
             hop(r["latency_ms"]["probe_round_trip"]), share(r["bus_share"]),
             f"{r['cpu_ms_per_trajectory']:g} ({r['cores']:g})"] for label, r in runs]
    ray = res.get("ray") or {}
    if ray.get("built"):
        rows.append([f"Ray {ray['version']} x{ray['time_scale']:g}",
                     f"{ray['trajectories']['completed']} / {ray['trajectories']['admitted']}",
                     ray["peak_in_flight"], f"{ray['wall_s']:.1f}",
                     *(hop(ray["latency"][k], "p50_ms", "p99_ms") for k in hops), None,
                     share(ray["bus_share"]),
                     f"{ray['cpu']['cpu_ms_per_trajectory']:g} ({ray['cpu']['total_cores']:g})"])
    met = {q: ", ".join(label for label, r in runs if r["bus_share"][q] is not None
                        and r["bus_share"][q] < BUS_SHARE_TARGET) or "no scale" for q in ("mean", "p99")}
    mi = res["machine"]
    return render(SECTION, nodes=lay["nodes"], generate_nodes=lay["generate_nodes"],
                  replicas=lay["generate_replicas"], env_nodes=lay["env_nodes"],
                  profile=w["profile"], trajectories=w["trajectories"],
                  table=table(["run", "trajectories (done / admitted)", "peak in flight", "wall s",
                               "scheduler -> env", "env -> generate", "generate -> env",
                               "round trip minus replica", "probe round trip",
                               "bus share p50 / mean / p99", "CPU ms per traj. (cores)"], rows),
                  target=f"{BUS_SHARE_TARGET:.0%}", mean_met=met["mean"], p99_met=met["p99"],
                  machine=f"{mi['cpus']} cpu, load at the end {mi['loadavg_end'][0]:.2f}",
                  setup_s=f"{res['setup_s']:g}", drain_s=f"{res['drain_s']:g}")


def _pc(x: float | None) -> str:
    return "n/a" if x is None else f"{100 * x:.2f}%"


# -- command line --------------------------------------------------------------------------
def parse(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        description="Rollart at scale on one nats-server with separate node processes: a "
                    "scheduler head, generate nodes of emulated GPU replicas, env nodes of "
                    "emulated envs; reports trajectories in flight, events/s, bus latency per "
                    "hop, CPU per role and the bus's share of a trajectory's time.",
        epilog="A full run writes benchmarks/results/emulate_scale.json and its section of "
               "benchmarks/README.md; --quick writes nothing.")
    p.add_argument("--quick", action="store_true",
                   help="smoke run (< 60 s): 64 trajectories, 2 generate nodes x 2 replicas, "
                        "1 env node; writes nothing")
    p.add_argument("--groups", type=int, default=None,
                   help="groups admitted, all at once (default 256; quick 8)")
    p.add_argument("--group-size", type=int, default=8, help="trajectories per group (default 8)")
    p.add_argument("--gen-nodes", type=int, default=None,
                   help="generate node processes (default 4; quick 2)")
    p.add_argument("--replicas", type=int, default=None,
                   help="generate replicas per generate node (default 16; quick 2)")
    p.add_argument("--env-nodes", type=int, default=None,
                   help="env node processes (default 3; quick 1)")
    p.add_argument("--time-scale", default=None, metavar="S[,S...]",
                   help="wall seconds per modelled second; several (comma-separated) run one "
                        "after the other, the first is the headline (default 1,0.5,0.25: real "
                        "time, then 2x and 4x faster; quick 0.05)")
    p.add_argument("--profile", default="h800", help="emulated GPU profile (default h800)")
    p.add_argument("--step-mu", type=float, default=10.0, help="mean env step, modelled s (default 10)")
    p.add_argument("--step-sigma", type=float, default=2.0, help="env step sigma, modelled s (default 2)")
    p.add_argument("--reset-mu", type=float, default=5.0, help="mean env reset, modelled s (default 5)")
    p.add_argument("--out-mean", type=float, default=200.0, help="mean output tokens (default 200)")
    p.add_argument("--max-new-tokens", type=int, default=4096)
    p.add_argument("--trace-sample", type=float, default=None,
                   help="share of trajectories traced for the hop latencies (default 0.1; quick 1)")
    p.add_argument("--probe-hz", type=float, default=20.0,
                   help="probe request/replies a second alongside the run (default 20)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--timeout", type=float, default=None,
                   help="seconds the trajectories may take, once the head starts (default 900; quick 120)")
    p.add_argument("--start-timeout", type=float, default=180.0,
                   help="seconds the worker nodes may take to start (default 180)")
    p.add_argument("--drain-timeout", type=float, default=60.0,
                   help="seconds the nodes may take to drain and exit at the end (default 60)")
    p.add_argument("--run-dir", type=Path,
                   default=Path(tempfile.gettempdir()) / "rollart-emulate",
                   help="where the emulated model folder, the config, logs and the nats store go")
    p.add_argument("--no-write", action="store_true", help="print the JSON only")
    p.add_argument("--from-results", action="store_true",
                   help="rewrite the README section from benchmarks/results/emulate_scale.json")
    p.add_argument("--ray", action="store_true",
                   help="run the same fan-out with Ray actors instead (--ray-trajectories, the "
                        "first time scale) and put it into the results file and the README "
                        "section of the last full run")
    p.add_argument("--ray-trajectories", type=int, default=None,
                   help="trajectories of the Ray fan-out (default 1000; quick 64)")
    p.add_argument("--ray-path", type=Path, default=None,
                   help="a folder with ray installed (pip install --target DIR ray) added after "
                        "this environment's packages, for the driver and Ray's workers")
    p.add_argument("--add-run", action="append", metavar="FILE",
                   help="with --from-results: add the JSON another full run printed (--no-write) "
                        "as a row of its own (run-to-run spread, another trajectory count)")
    p.add_argument("--probe-serve", metavar="URL", help=argparse.SUPPRESS)
    a = p.parse_args(argv)
    q = a.quick
    for key, full, quick in (("groups", 256, 8), ("gen_nodes", 4, 2), ("replicas", 16, 2),
                             ("env_nodes", 3, 1), ("time_scale", "1,0.5,0.25", "0.05"),
                             ("trace_sample", 0.1, 1.0), ("timeout", 900.0, 120.0),
                             ("ray_trajectories", 1000, 64)):
        if getattr(a, key) is None:
            setattr(a, key, quick if q else full)
    for key in ("groups", "group_size", "gen_nodes", "replicas", "env_nodes"):
        if getattr(a, key) < 1:
            p.error(f"--{key.replace('_', '-')} must be >= 1")
    try:
        a.time_scales = [float(x) for x in str(a.time_scale).split(",") if x.strip()]
    except ValueError:
        p.error(f"--time-scale: {a.time_scale!r} is not a comma-separated list of numbers")
    if not a.time_scales or not all(x > 0 for x in a.time_scales):
        p.error("--time-scale must be > 0")
    a.time_scale = a.time_scales[0]
    if not 0 <= a.trace_sample <= 1:
        p.error("--trace-sample must be in [0, 1]")
    if not a.probe_hz > 0:
        p.error("--probe-hz must be > 0")
    a.trajectories = a.groups * a.group_size
    return a


def main(argv: list[str] | None = None) -> int:
    args = parse(argv)
    if args.probe_serve:
        asyncio.run(probe_serve(args.probe_serve))
        return 0
    if args.from_results:
        res = json.loads(RESULT_FILE.read_text())
        for f in args.add_run or []:
            other = json.loads(Path(f).read_text())
            res.setdefault("other_runs", []).append(dict(sweep_row(other), logs=other.get("logs")))
        if args.add_run:
            RESULT_FILE.write_text(json.dumps(res, indent=1) + "\n")
        replace_section(SECTION, section(res))
        return 0

    def on_term(signum, frame):  # SIGTERM unwinds like Ctrl-C: the nodes are stopped
        raise KeyboardInterrupt

    if args.ray:
        try:
            rr = ray_run(args)
        except SetupError as e:
            print(f"emulate_scale: error: {e}", file=sys.stderr)
            return 2
        print(json.dumps(rr, indent=1))
        if not args.quick and not args.no_write:
            if not RESULT_FILE.exists():
                print(f"emulate_scale: no {RESULT_FILE} to add the Ray run to: run the rollart "
                      "benchmark first", file=sys.stderr)
                return 2
            res = json.loads(RESULT_FILE.read_text())
            res["ray"] = rr
            RESULT_FILE.write_text(json.dumps(res, indent=1) + "\n")
            replace_section(SECTION, section(res))
        return 0

    old = signal.signal(signal.SIGTERM, on_term)
    try:
        runs = []
        for ts in args.time_scales:
            a = argparse.Namespace(**vars(args))
            a.time_scale = ts
            say(f"time scale x{ts:g}")
            runs.append(asyncio.run(run(a)))
        res = runs[0]
        res["sweep"] = [sweep_row(r) for r in runs]
        res["accounting_errors"] = [f"x{r['workload']['time_scale']:g}: {e}" for r in runs
                                    for e in r["accounting_errors"]]
    except SetupError as e:
        print(f"emulate_scale: error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("emulate_scale: interrupted; node processes stopped", file=sys.stderr)
        return 130
    finally:
        signal.signal(signal.SIGTERM, old)
    if not args.quick and not args.no_write:
        RESULTS.mkdir(exist_ok=True)
        RESULT_FILE.write_text(json.dumps(res, indent=1) + "\n")
        replace_section(SECTION, section(res))
    print(json.dumps(res, indent=1))
    if res["accounting_errors"]:
        print("accounting does not add up:\n  " + "\n  ".join(res["accounting_errors"]),
              file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""What a sandbox costs: start, warm acquire, executions, against a plain subprocess.

::

    python benchmarks/sandbox.py            # full run: prints JSON, writes results/ and README
    python benchmarks/sandbox.py --quick    # smoke run (< 20 s); prints JSON, writes nothing

One process, the configured backend (``sandbox.backend``, bubblewrap by default), side by side:

- **cold start**: ``rollart.sandbox.start()`` (spawn bwrap, namespaces, the supervisor's
  first answer), then closed; p50/p99 over ``--starts``;
- **warm acquire**: ``SandboxPool(warm=2).acquire()`` with the pool refilled (what an env's
  reset waits for when the host keeps sandboxes warm), p50/p99;
- **executions**: ``true`` and ``python3 -c pass`` run one after another in one sandbox, in
  turn with the same commands by a plain ``subprocess.run`` without isolation (both see the
  same load), ``--seconds`` each (one stream: at most one core busy); per execution p50 and
  executions per second, and the sandbox's overhead per execution;
- **env init share** (synthetic episodes): an episode takes a sandbox, then runs ``--steps``
  ``python3 -c pass`` in it; the share of the episode spent getting its sandbox, with a warm
  pool and without one (every sandbox a cold start), beside the paper's 15% of a healthy step.
"""

from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
import time
from pathlib import Path

from common import RESULTS, add_run_flags, begin, describe_machine, finish, render, sayer, table, writes

from rollart import sandbox
from rollart.config import SandboxConfig

NAME = "sandbox"
say = sayer(NAME)
PAPER_ENV_INIT = 0.15


def pct(xs: list[float], q: float) -> float:
    s = sorted(xs)
    return s[min(len(s) - 1, int(q * len(s)))]


def stats_ms(xs: list[float]) -> dict:
    return {"n": len(xs), "p50_ms": round(1e3 * pct(xs, 0.5), 3), "p99_ms": round(1e3 * pct(xs, 0.99), 3),
            "mean_ms": round(1e3 * sum(xs) / len(xs), 3)}


def cold_starts(cfg: SandboxConfig, n: int) -> dict:
    times = []
    for _ in range(n):
        sb = sandbox.start(cfg)
        times.append(sb.started_s)
        sb.close()
    return stats_ms(times)


def warm_acquires(cfg: SandboxConfig, n: int) -> dict:
    pool = sandbox.SandboxPool(cfg, warm=2)
    try:
        if not pool.wait_ready(timeout=60):
            raise RuntimeError(f"the pool did not warm up in 60 s: {pool.snapshot()}")
        times = []
        for _ in range(n):
            pool.wait_ready(timeout=60)  # refilled: this acquire is a warm one
            t0 = time.perf_counter()
            sb = pool.acquire()
            times.append(time.perf_counter() - t0)
            pool.release(sb)
        snap = pool.snapshot()
    finally:
        pool.close()
    return {**stats_ms(times), "warm_hits": snap["warm_hits"], "cold_starts": snap["cold_starts"]}


def interleaved(runs: dict, seconds: float) -> dict[str, dict]:
    """Each of ``runs`` (name -> a call) in turn, one call at a time, for ``seconds`` in all (at
    least 5 rounds): both sides of a comparison see the same load on a shared machine."""
    times: dict[str, list[float]] = {k: [] for k in runs}
    end = time.perf_counter() + seconds
    while time.perf_counter() < end or len(times[next(iter(runs))]) < 5:
        for k, run in runs.items():
            t0 = time.perf_counter()
            run()
            times[k].append(time.perf_counter() - t0)
    return {k: {**stats_ms(v), "per_s": round(len(v) / sum(v), 1)} for k, v in times.items()}


def compare_executions(cfg: SandboxConfig, seconds: float) -> dict:
    python = "/usr/bin/python3" if Path("/usr/bin/python3").exists() else sys.executable
    cmds = {"true": (["true"], ["true"]),
            "python3 -c pass": ([python, "-c", "pass"], ["python3", "-c", "pass"])}
    out = {}
    with sandbox.start(cfg) as sb:
        for name, (plain_argv, inside) in cmds.items():
            def in_sandbox(a=inside):
                r = sb.run(a, timeout=30)
                assert r.exit_code == 0, r

            d = interleaved({"sandbox": in_sandbox,
                             "subprocess": lambda a=plain_argv: subprocess.run(a, check=True)},
                            2 * seconds)
            boxed, plain = d["sandbox"], d["subprocess"]
            out[name] = {"sandbox": boxed, "subprocess": plain,
                         "overhead_ms": round(boxed["p50_ms"] - plain["p50_ms"], 3),
                         "ratio": round(boxed["p50_ms"] / plain["p50_ms"], 2)}
            say(f"{name}: sandbox {boxed['per_s']}/s, plain subprocess {plain['per_s']}/s")
    return out


def episodes(cfg: SandboxConfig, warm: int, n: int, steps: int) -> dict:
    pool = sandbox.SandboxPool(cfg, warm=warm)
    init = total = 0.0
    try:
        if warm:
            pool.wait_ready(timeout=60)
        for _ in range(n):
            if warm:
                pool.wait_ready(timeout=60)  # a host between episodes: its pool refilled
            t0 = time.perf_counter()
            sb = pool.acquire()
            t1 = time.perf_counter()
            for _ in range(steps):
                sb.run(["python3", "-c", "pass"], timeout=30)
            t2 = time.perf_counter()
            pool.release(sb)
            init += t1 - t0
            total += t2 - t0
        snap = pool.snapshot()
    finally:
        pool.close()
    return {"episodes": n, "steps": steps, "env_init_share": round(init / total, 4),
            "init_ms": round(1e3 * init / n, 3), "episode_ms": round(1e3 * total / n, 3),
            "warm_hits": snap["warm_hits"], "cold_starts": snap["cold_starts"]}


class CodeStepsEnv:
    """The shape of a code task on an env host: ``reset`` takes a sandbox from the host's pool
    and writes the task's file into it, each ``step`` runs it (``steps`` of them)."""

    uses_sandbox = True
    instruction = "Say anything."

    def __init__(self, steps: int = 4) -> None:
        self.steps, self.n, self.sb = steps, 0, None

    def reset(self, seed):
        self.sb = sandbox.pool().acquire()
        self.sb.write("main.py", f"print({seed})")
        return "ready", {}

    def step(self, action):
        self.n += 1
        r = self.sb.run(["python3", "main.py"], timeout=30)
        return r.stdout.decode(), float(r.ok), self.n >= self.steps, False, {}

    def close(self):
        if self.sb is not None:
            sandbox.pool().release(self.sb)


async def rollout_share(model: Path, warm: int, trajectories: int, steps: int) -> dict:
    """Trajectories of :class:`CodeStepsEnv` through a real EnvManager and generate replica (the
    tiny model, a MemoryBus), two at a time: env init's share of their time (``reset``, which
    includes taking the sandbox, against all of ``timings``)."""
    import uuid

    from rollart import messages as m
    from rollart.actors.env.manager import EnvManager
    from rollart.actors.generate.proxy import LLMProxy
    from rollart.bus import ConsumerSpec
    from rollart.bus.codec import decode, encode
    from rollart.bus.memory import MemoryBus
    from rollart.config import ActorConfig, RunConfig, convert
    from rollart.node import Node

    cfg = convert({"run": f"sbx{uuid.uuid4().hex[:8]}", "model": {"path": str(model), "threads": 1},
                   "envs": {"main": {"type": "sandbox:CodeStepsEnv", "max_turns": steps,
                                     "args": {"steps": steps}}},
                   "sandbox": {"warm": warm},
                   "rollout": {"group_size": 2, "batch_groups": 1, "concurrency": 2}}, RunConfig)
    bus = MemoryBus()
    await bus.connect()
    env = EnvManager.from_config(cfg, ActorConfig(), pool="default")
    gen = LLMProxy.from_config(cfg, ActorConfig(), pool="default")
    done = []
    try:
        async with Node(bus, [env, gen], heartbeat_every=0, grace=1):
            for i in range(trajectories):
                msg = m.RolloutRequested(traj_id=f"t{i}", group_id=f"g{i // 2}", env="main", seed=i)
                await bus.publish(m.subject(cfg.run, "rollout.requested", "default"), encode(msg),
                                  msg_id=msg.traj_id)
            c = await bus.pull_consumer(m.stream_name(cfg.run, m.SUBJECTS["rollout.completed"].stream),
                                        ConsumerSpec(durable="probe", filter_subject=m.subject(
                                            cfg.run, "rollout.completed")))
            end = time.monotonic() + 600
            while len(done) < trajectories and time.monotonic() < end:
                for d in await c.fetch(trajectories - len(done), timeout=0.5):
                    done.append(decode(m.RolloutCompleted, d.data))
                    await d.ack()
            snap = sandbox.pool().snapshot()
    finally:
        await bus.close()
    if len(done) < trajectories:
        raise RuntimeError(f"{len(done)} of {trajectories} trajectories completed in 600 s")
    reset = sum(d.timings.get("reset", 0.0) for d in done)
    total = sum(sum(d.timings.values()) for d in done)
    return {"trajectories": len(done), "steps": steps, "env_init_share": round(reset / total, 4),
            "reset_ms": round(1e3 * reset / len(done), 3),
            "trajectory_ms": round(1e3 * total / len(done), 3),
            "warm_hits": snap["warm_hits"], "cold_starts": snap["cold_starts"]}


def rollout_shares(trajectories: int, steps: int) -> dict:
    import asyncio
    import tempfile

    from rollart.engines.tiny import build_tiny_model

    with tempfile.TemporaryDirectory(prefix="rollart-bench-sandbox-") as tmp:
        model = build_tiny_model(Path(tmp) / "model", seed=0)
        return {label: asyncio.run(rollout_share(model, warm, trajectories, steps))
                for label, warm in (("warm", 2), ("cold", 0))}


def readme_section(res: dict) -> str:
    c, w, x, e = res["cold_start"], res["warm_acquire"], res["executions"], res["env_init"]
    rows = [["cold start (spawn to ready), p50 / p99", f"{c['p50_ms']:.1f} / {c['p99_ms']:.1f} ms",
             None, None],
            ["warm acquire (pool refilled), p50 / p99", f"{w['p50_ms']:.3f} / {w['p99_ms']:.3f} ms",
             None, None]]
    for name, d in x.items():
        rows.append([f"`{name}`: one execution p50, executions/s (one stream)",
                     f"{d['sandbox']['p50_ms']:.1f} ms, {d['sandbox']['per_s']:,.0f}/s",
                     f"{d['subprocess']['p50_ms']:.1f} ms, {d['subprocess']['per_s']:,.0f}/s",
                     f"{d['overhead_ms']:+.1f} ms ({d['ratio']}x)"])
    share = table(["pool", "sandbox per episode (ms)", "episode (ms)", "env init share", "paper"],
                  [[label, f"{d['init_ms']:.2f}", f"{d['episode_ms']:.1f}",
                    f"{100 * d['env_init_share']:.1f}%", f"{100 * PAPER_ENV_INIT:.0f}%"]
                   for label, d in (("warm (2 ready)", e["warm"]), ("none (cold starts)", e["cold"]))])
    ro = res["rollout"]
    rollout = table(["pool", "warm / cold acquires", "reset per trajectory (ms)", "trajectory (ms)",
                     "env init share", "paper"],
                    [[label, f"{d['warm_hits']} / {d['cold_starts']}", f"{d['reset_ms']:.1f}",
                      f"{d['trajectory_ms']:.0f}", f"{100 * d['env_init_share']:.1f}%",
                      f"{100 * PAPER_ENV_INIT:.0f}%"]
                     for label, d in (("warm (2 ready)", ro["warm"]), ("none (cold starts)", ro["cold"]))])
    cfg = res["config"]
    return render(NAME, backend=res["backend"], starts=cfg["starts"], seconds=cfg["seconds"],
                  episodes=cfg["episodes"], steps=cfg["steps"], trajectories=cfg["trajectories"],
                  rollout=rollout,
                  table=table(["measurement", "sandbox", "plain subprocess", "overhead"], rows),
                  share=share, machine=describe_machine(res["machine"]), date=res["timestamp"][:10])


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    add_run_flags(p, "smoke run (< 20 s): 8 starts, 0.5 s per execution loop, 6 episodes, "
                  "2 trajectories")
    p.add_argument("--starts", type=int, default=None, help="cold starts and warm acquires "
                   "(default 200, --quick 8)")
    p.add_argument("--seconds", type=float, default=None,
                   help="seconds of each execution loop (default 5, --quick 0.5)")
    p.add_argument("--episodes", type=int, default=None, help="synthetic episodes per pool "
                   "(default 100, --quick 6)")
    p.add_argument("--trajectories", type=int, default=None, help="trajectories through an "
                   "EnvManager per pool (default 40, --quick 2)")
    p.add_argument("--steps", type=int, default=4, help="executions per episode or trajectory")
    args = p.parse_args(argv)
    args.starts = args.starts or (8 if args.quick else 200)
    args.seconds = args.seconds or (0.5 if args.quick else 5.0)
    args.episodes = args.episodes or (6 if args.quick else 100)
    args.trajectories = args.trajectories or (2 if args.quick else 40)
    res = begin(NAME, args, ("starts", "seconds", "episodes", "trajectories", "steps"))
    cfg = SandboxConfig()
    res["backend"] = cfg.backend
    if cfg.backend == "bwrap" and shutil.which("bwrap") is None:
        res["skipped"] = "bubblewrap ('bwrap') is not installed (apt-get install bubblewrap)"
        say(res["skipped"] + ": nothing measured, nothing written")
        print(json.dumps(res, indent=2))
        return 0
    try:
        say(f"{args.starts} cold starts")
        res["cold_start"] = cold_starts(cfg, args.starts)
        say(f"cold start p50 {res['cold_start']['p50_ms']} ms; {args.starts} warm acquires")
        res["warm_acquire"] = warm_acquires(cfg, args.starts)
        say(f"warm acquire p50 {res['warm_acquire']['p50_ms']} ms; executions")
        res["executions"] = compare_executions(cfg, args.seconds)
        say(f"{args.episodes} synthetic episodes with a warm pool and without")
        res["env_init"] = {"warm": episodes(cfg, 2, args.episodes, args.steps),
                           "cold": episodes(cfg, 0, args.episodes, args.steps),
                           "paper": PAPER_ENV_INIT}
        say(f"{args.trajectories} trajectories through an EnvManager, with a warm pool and without")
        res["rollout"] = rollout_shares(args.trajectories, args.steps)
    finally:
        sandbox.shutdown()
    return finish(res, writes(args), RESULTS / f"{NAME}.json", NAME, readme_section, say)


if __name__ == "__main__":
    raise SystemExit(main())

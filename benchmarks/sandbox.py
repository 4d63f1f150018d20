"""What a sandbox costs: start, warm acquire, executions, against a plain subprocess.

::

    python benchmarks/sandbox.py            # full run: prints JSON, writes results/ and README
    python benchmarks/sandbox.py --quick    # smoke run (< 20 s); prints JSON, writes nothing

One process, the configured backend (``sandbox.backend``, bubblewrap by default), side by side:

- **cold start**: ``rollart.sandbox.start()`` (spawn bwrap, namespaces, the supervisor's
  first answer), then closed; p50/p99 over ``--starts``;
- **warm acquire**: ``SandboxPool(warm=2).acquire()`` with the pool refilled (what an env's
  reset waits for when the host keeps sandboxes warm), p50/p99;
- **executions**: ``true`` and ``python3 -c pass`` run one after another in one sandbox for
  ``--seconds`` each (one stream: at most one core busy), against the same commands by a plain
  ``subprocess.run`` without isolation; per execution p50 and executions per second, and the
  sandbox's overhead per execution;
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


def executions(run, seconds: float) -> dict:
    times = []
    end = time.perf_counter() + seconds
    while time.perf_counter() < end or len(times) < 5:
        t0 = time.perf_counter()
        run()
        times.append(time.perf_counter() - t0)
    return {**stats_ms(times), "per_s": round(len(times) / sum(times), 1)}


def compare_executions(cfg: SandboxConfig, seconds: float) -> dict:
    python = "/usr/bin/python3" if Path("/usr/bin/python3").exists() else sys.executable
    cmds = {"true": ["true"], "python3 -c pass": [python, "-c", "pass"]}
    out = {}
    with sandbox.start(cfg) as sb:
        for name, argv in cmds.items():
            inside = argv if name == "true" else ["python3", "-c", "pass"]

            def in_sandbox(a=inside):
                r = sb.run(a, timeout=30)
                assert r.exit_code == 0, r

            plain = executions(lambda a=argv: subprocess.run(a, check=True), seconds)
            boxed = executions(in_sandbox, seconds)
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
                     f"+{d['overhead_ms']:.1f} ms ({d['ratio']}x)"])
    share = table(["pool", "sandbox per episode (ms)", "episode (ms)", "env init share", "paper"],
                  [[label, f"{d['init_ms']:.2f}", f"{d['episode_ms']:.1f}",
                    f"{100 * d['env_init_share']:.1f}%", f"{100 * PAPER_ENV_INIT:.0f}%"]
                   for label, d in (("warm (2 ready)", e["warm"]), ("none (cold starts)", e["cold"]))])
    cfg = res["config"]
    return render(NAME, backend=res["backend"], starts=cfg["starts"], seconds=cfg["seconds"],
                  episodes=cfg["episodes"], steps=cfg["steps"],
                  table=table(["measurement", "sandbox", "plain subprocess", "overhead"], rows),
                  share=share, machine=describe_machine(res["machine"]), date=res["timestamp"][:10])


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    add_run_flags(p, "smoke run (< 20 s): 10 starts, 1 s per execution loop, 10 episodes")
    p.add_argument("--starts", type=int, default=None, help="cold starts and warm acquires "
                   "(default 200, --quick 10)")
    p.add_argument("--seconds", type=float, default=None,
                   help="seconds of each execution loop (default 5, --quick 1)")
    p.add_argument("--episodes", type=int, default=None, help="synthetic episodes per pool "
                   "(default 100, --quick 10)")
    p.add_argument("--steps", type=int, default=4, help="executions per synthetic episode")
    args = p.parse_args(argv)
    args.starts = args.starts or (10 if args.quick else 200)
    args.seconds = args.seconds or (1.0 if args.quick else 5.0)
    args.episodes = args.episodes or (10 if args.quick else 100)
    res = begin(NAME, args, ("starts", "seconds", "episodes", "steps"))
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
    finally:
        sandbox.shutdown()
    return finish(res, writes(args), RESULTS / f"{NAME}.json", NAME, readme_section, say)


if __name__ == "__main__":
    raise SystemExit(main())

"""``rollart``: run, rollout, node, top, report, config."""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import logging
import sys
import time
from pathlib import Path

import msgspec

from rollart import messages as m
from rollart.config import ConfigError, RunConfig, load

log = logging.getLogger("rollart")


@contextlib.asynccontextmanager
async def open_bus(cfg: RunConfig, nats: str | None):
    """The bus a command runs on: ``memory``, a NATS URL, or an embedded server (default)."""
    url = nats or cfg.nats
    if url == "memory":
        from rollart.bus.memory import MemoryBus

        bus = MemoryBus()
        await bus.connect()
        try:
            yield bus
        finally:
            await bus.close()
        return
    server = None
    if not url:
        from rollart.bus.server import EmbeddedServer

        server = EmbeddedServer(Path(cfg.run_dir) / cfg.run / "nats")
        server.start()  # in this thread: the server gets SIGTERM when it exits
        url = server.url
        log.info("embedded nats-server at %s", url)
    from rollart.bus.nats import NatsBus

    bus = NatsBus(url, name=f"rollart-{cfg.run}")
    try:
        await bus.connect()
        yield bus
    finally:
        await bus.close()
        if server is not None:
            await asyncio.to_thread(server.stop)


def _quiet_libraries() -> None:
    try:
        from transformers.utils import logging as hf_logging

        hf_logging.disable_progress_bar()
        hf_logging.set_verbosity_error()
    except ImportError:
        pass


# -- rollart rollout ---------------------------------------------------------------


def summarize(results: list[m.RolloutCompleted], wall_s: float) -> dict:
    n = len(results) or 1
    stages = ("reset", "generate", "step", "reward", "wait")
    return {
        "trajectories": len(results),
        "success_rate": sum(r.success for r in results) / n,
        "mean_reward": sum(r.reward for r in results) / n,
        "mean_turns": sum(len(r.turns) for r in results) / n,
        "mean_tokens": sum(len(r.token_ids) for r in results) / n,
        "generated_tokens": sum(sum(r.response_mask) for r in results),
        "stop_reasons": {s: sum(r.stop_reason == s for r in results)
                         for s in sorted({r.stop_reason for r in results})},
        "mean_stage_s": {s: sum(r.timings.get(s, 0.0) for r in results) / n for s in stages},
        "wall_s": wall_s,
    }


async def rollout_main(args) -> int:
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    from rollart.launch import rollout_actors
    from rollart.node import Node

    cfg = load(args.config, RunConfig)
    if args.run:
        cfg = msgspec.structs.replace(cfg, run=m.check_token("run", args.run))
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    async with open_bus(cfg, args.nats) as bus:
        sched, actors = rollout_actors(cfg, groups=args.groups, bounded=False, keep_results=True,
                                       greedy=args.greedy, eval=True, env=args.env,
                                       prefix=f"e{int(time.time())}-")
        if args.weights:
            for a in actors:
                if a.role == "generate":
                    a.initial_weights = args.weights
        t0 = time.perf_counter()
        with Progress(TextColumn("[bold]rollout"), BarColumn(), MofNCompleteColumn(),
                      TextColumn("{task.fields[info]}"), TimeElapsedColumn(),
                      disable=args.quiet) as bar:
            task = bar.add_task("groups", total=args.groups, info="")
            async with Node(bus, actors, heartbeat_every=0):
                while not sched.all_done.is_set():
                    with contextlib.suppress(TimeoutError):
                        await asyncio.wait_for(sched.all_done.wait(), 0.25)
                    res = sched.results
                    ok = sum(r.success for r in res) / max(1, len(res))
                    bar.update(task, completed=sched.groups_settled,
                               info=f"success {ok:.2f}  trajectories {len(res)}")
        wall = time.perf_counter() - t0
    with out.open("w") as f:
        for r in sched.results:
            f.write(json.dumps(msgspec.to_builtins(r)) + "\n")
    summary = summarize(sched.results, wall) | {"outcomes": sched.summary(), "out": str(out)}
    print(json.dumps(summary, indent=2))
    return 0


# -- rollart run -----------------------------------------------------------------------


async def evaluate(bus, cfg: RunConfig, version: int, groups: int, proxies) -> dict:
    """Greedy success of the policy ``version`` on ``groups`` fresh groups."""
    from rollart.launch import rollout_actors
    from rollart.node import Node

    deadline = time.monotonic() + 60
    while any(p.version < version for p in proxies) and time.monotonic() < deadline:
        await asyncio.sleep(0.05)
    sched, _ = rollout_actors(cfg, groups=groups, bounded=False, keep_results=True, greedy=True,
                              eval=True, prefix=f"eval{version}-")
    async with Node(bus, [sched], heartbeat_every=0):
        await sched.all_done.wait()
    res = sched.results
    return {"version": version, "greedy_success": sum(r.success for r in res) / max(1, len(res)),
            "greedy_reward": sum(r.reward for r in res) / max(1, len(res)), "trajectories": len(res)}


async def train(cfg: RunConfig, *, nats: str | None, resume: bool, quiet: bool = False) -> dict:
    """Run the whole training job of ``cfg`` on one host; returns the final summary."""
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    from rollart.launch import training_actors
    from rollart.node import Node
    from rollart.telemetry.report import plot

    run_path = Path(cfg.run_dir) / cfg.run
    async with open_bus(cfg, nats) as bus:
        sched, trainer, actors = training_actors(cfg, resume=resume)
        with Progress(TextColumn("[bold]train"), BarColumn(), MofNCompleteColumn(),
                      TextColumn("{task.fields[info]}"), TimeElapsedColumn(), disable=quiet) as bar:
            task = bar.add_task("steps", total=cfg.trainer.steps, info="starting")

            def on_step(mt: dict) -> None:
                split = " ".join(f"{k[5:-2]} {mt[k]:.2f}" for k in ("traj_generate_s", "traj_step_s"))
                bar.update(task, completed=mt["step"], info=(
                    f"v{mt['version']} reward {mt['reward']:.2f} success {mt['success']:.2f} "
                    f"tok/s {mt['gen_tokens'] / max(1e-9, mt['train_s'] + mt['wait_s']):.0f} "
                    f"stale {mt['staleness']:.1f} | per traj {split} | train {mt['train_s']:.2f}s "
                    f"wait {mt['wait_s']:.2f}s"))

            trainer.on_step = on_step
            t0 = time.perf_counter()
            async with Node(bus, actors, heartbeat_every=cfg.node.heartbeat_every,
                            grace=cfg.node.grace, handle_signals=True) as node:
                done = asyncio.ensure_future(trainer.finished.wait())
                stop = asyncio.ensure_future(node.wait())
                await asyncio.wait({done, stop}, return_when=asyncio.FIRST_COMPLETED)
                stop.cancel()
                interrupted = not done.done()
                done.cancel()
                final = {}
                if not interrupted:
                    sched.total_groups = sched.admitted  # no more training rollouts
                    proxies = [a for a in actors if a.role == "generate"]
                    final = await evaluate(bus, cfg, trainer.version, cfg.trainer.eval_groups, proxies)
            wall = time.perf_counter() - t0
    summary = {"run": cfg.run, "steps": trainer.version, "wall_s": wall,
               "interrupted": interrupted, **final}
    if trainer.history:
        summary["plot"] = str(await asyncio.to_thread(plot, run_path))
    (run_path / "summary.json").write_text(json.dumps(summary, indent=2))
    return summary


async def run_main(args) -> int:
    import yaml

    if args.resume:
        run_path = Path(args.resume)
        cfg = load(run_path / "config.yaml", RunConfig)
        cfg = msgspec.structs.replace(cfg, run_dir=str(run_path.parent))
    else:
        cfg = load(args.config, RunConfig)
        if args.run:
            cfg = msgspec.structs.replace(cfg, run=m.check_token("run", args.run))
        if args.steps:
            cfg = msgspec.structs.replace(cfg, trainer=msgspec.structs.replace(cfg.trainer, steps=args.steps))
        run_path = Path(cfg.run_dir) / cfg.run
        if run_path.exists() and any(run_path.iterdir()):
            raise ValueError(f"run folder {run_path} exists: continue it with "
                             f"`rollart run --resume {run_path}` or pick another --run name")
        run_path.mkdir(parents=True, exist_ok=True)
        (run_path / "config.yaml").write_text(yaml.safe_dump(msgspec.to_builtins(cfg), sort_keys=False))
    summary = await train(cfg, nats=args.nats, resume=bool(args.resume), quiet=args.quiet)
    print(json.dumps(summary, indent=2))
    return 130 if summary["interrupted"] else 0


async def top_main(args) -> int:
    from rollart.bus.nats import NatsBus
    from rollart.telemetry.monitor import top

    async with NatsBus(args.nats, name="rollart-top") as bus:
        try:
            await top(bus, m.check_token("run", args.run), duration=args.duration)
        except asyncio.CancelledError:
            pass
    return 0


async def report_main(args) -> int:
    from rollart.telemetry.report import plot, table

    print(table(args.run_dir, every=args.every))
    print(f"plot: {plot(args.run_dir)}")
    return 0


# -- argument parsing ----------------------------------------------------------------


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="rollart", description=(
        "Async, event-driven RL training for LLM agents over NATS JetStream. Without --nats "
        "every command starts an embedded nats-server under the run folder."))
    p.add_argument("--log-level", default="WARNING", help="logging level (default WARNING)")
    sub = p.add_subparsers(dest="cmd", required=True, metavar="COMMAND")

    t = sub.add_parser("run", help="train: every role on this host (the main job)",
                       description="Train the policy of CONFIG on one host: embedded nats-server "
                                   "(or --nats), all roles in-process. Writes runs/<run>/.")
    t.add_argument("config", nargs="?", help="run config (YAML)")
    t.add_argument("--nats", default=None, help="NATS URL, or 'memory' for the in-process bus")
    t.add_argument("--resume", default=None, metavar="RUN_DIR", help="continue a stopped run")
    t.add_argument("--run", default=None, help="override the run name")
    t.add_argument("--steps", type=int, default=None, help="override trainer.steps")
    t.add_argument("--quiet", action="store_true", help="no progress bar")
    t.set_defaults(fn=run_main)

    tp = sub.add_parser("top", help="live subject-level view of a run",
                        description="Message rates per subject, nodes, policy version and "
                                    "replicas, trajectory outcomes and time split.")
    tp.add_argument("--nats", required=True, help="NATS URL of the run's server")
    tp.add_argument("--run", required=True, help="run name")
    tp.add_argument("--duration", type=float, default=None, help="stop after N seconds")
    tp.set_defaults(fn=top_main)

    rp = sub.add_parser("report", help="table and plot of a run folder")
    rp.add_argument("run_dir", help="runs/<run>")
    rp.add_argument("--every", type=int, default=1, help="print every N-th step")
    rp.set_defaults(fn=report_main)

    r = sub.add_parser("rollout", help="roll out the current policy; write one JSON line per trajectory",
                       description="Run the configured envs with the current policy (also how "
                                   "you evaluate one) and print a summary.")
    r.add_argument("config", help="run config (YAML)")
    r.add_argument("--groups", type=int, default=4, help="groups to roll out (default 4)")
    r.add_argument("--out", default="rollouts.jsonl", help="output JSONL (default rollouts.jsonl)")
    r.add_argument("--nats", default=None, help="NATS URL, or 'memory' for the in-process bus")
    r.add_argument("--env", default=None, help="env name of the config (default rollout.env)")
    r.add_argument("--greedy", action="store_true", help="greedy decoding")
    r.add_argument("--weights", default=None, help="safetensors file to load into the policy")
    r.add_argument("--run", default=None, help="override the run name")
    r.add_argument("--quiet", action="store_true", help="no progress bar")
    r.set_defaults(fn=rollout_main)

    n = sub.add_parser("node", help="run some roles on this host (python -m rollart.node)",
                       add_help=False)
    n.set_defaults(fn=None)

    c = sub.add_parser("config", help="check a config, or print every key with its meaning")
    c.add_argument("config", nargs="?", help="config to check")
    c.add_argument("--doc", action="store_true", help="print all keys with documentation")
    c.set_defaults(fn=config_main)
    return p


async def config_main(args) -> int:
    from rollart.config import describe

    if args.doc or not args.config:
        print(describe(RunConfig))
        return 0
    cfg = load(args.config, RunConfig)
    print(f"{args.config}: ok (run={cfg.run}, envs={sorted(cfg.envs)}, "
          f"mode={cfg.rollout.mode}, alpha={cfg.rollout.alpha})")
    return 0


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["node"]:
        from rollart.node import main as node_main

        return node_main(argv[1:])
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.cmd == "run" and not (args.config or args.resume):
        parser.error("rollart run needs CONFIG or --resume RUN_DIR")
    logging.basicConfig(level=args.log_level.upper(),
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    _quiet_libraries()
    try:
        import uvloop

        runner = uvloop.run
    except ImportError:
        runner = asyncio.run
    try:
        return runner(args.fn(args))
    except (ConfigError, ValueError) as e:
        print(f"rollart: error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130

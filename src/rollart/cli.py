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


SECRETS_NOTE = ("secrets come only from files or environment variables (nats.password_env, "
                "nats.token_env), never from the command line")


def add_nats_args(p: argparse.ArgumentParser, *, url_help: str, required: bool = False) -> None:
    """``--nats URL`` and the credential flags (``--user``, ``--password-file``, ``--token-file``,
    ``--creds``, ``--tls-ca``) that override the config's ``nats:`` section on this host
    (:func:`nats_overrides` reads them back)."""
    p.add_argument("--nats", default=None, required=required, metavar="URL", help=url_help)
    g = p.add_argument_group(
        "NATS credentials", "override the config's nats: section on this host (one shared config "
        f"serves every host; each passes its own credential); {SECRETS_NOTE}")
    g.add_argument("--user", default=None, metavar="NAME",
                   help="user name (its password: --password-file, or the config's password_file / "
                        "password_env)")
    g.add_argument("--password-file", default=None, metavar="FILE",
                   help="file holding the password of --user (first line)")
    g.add_argument("--token-file", default=None, metavar="FILE", help="file holding an auth token")
    g.add_argument("--creds", default=None, metavar="FILE", help="NATS credentials file (JWT and NKey seed)")
    g.add_argument("--tls-ca", default=None, metavar="FILE",
                   help="CA certificate (PEM) that signed the server's certificate: connect with TLS")


def nats_overrides(args: argparse.Namespace) -> dict:
    """The NATS flags of ``args`` (:func:`add_nats_args`, and a node's ``--listen`` /
    ``--server-config``) as overrides for :func:`rollart.bus.auth.resolve`."""
    return {"url": getattr(args, "nats", None), "user": getattr(args, "user", None),
            "password_file": getattr(args, "password_file", None),
            "token_file": getattr(args, "token_file", None), "creds_file": getattr(args, "creds", None),
            "tls_ca": getattr(args, "tls_ca", None), "listen": getattr(args, "listen", None),
            "server_config": getattr(args, "server_config", None)}


@contextlib.asynccontextmanager
async def open_bus(cfg: RunConfig, nats: str | None, overrides: dict | None = None):
    """The bus a command runs on: ``memory``, a NATS URL, or an embedded server (default;
    listening on ``nats.listen``, started with ``nats.server_config``). ``overrides``: the
    command line's NATS flags (:func:`nats_overrides`); ``nats`` wins over their ``url``."""
    from rollart.bus.auth import bus_from_config, resolve

    ns = resolve(cfg, {**(overrides or {}), **({"url": nats} if nats else {})})
    if ns.url == "memory":
        from rollart.bus.memory import MemoryBus

        bus = MemoryBus()
        await bus.connect()
        try:
            yield bus
        finally:
            await bus.close()
        return
    server = bus = None
    if not ns.joins:
        from rollart.bus.server import EmbeddedServer

        host, port = ns.listen_address()
        server = EmbeddedServer(Path(cfg.run_dir) / cfg.run / "nats", host, port,
                                config_file=ns.server_config)
        server.start()  # in this thread: the server gets SIGTERM when it exits
        log.info("embedded nats-server at %s", server.url)
    try:
        bus = bus_from_config(ns, url=server.url if server else None, name=f"rollart-{cfg.run}",
                              local=server is not None, replicas=cfg.node.stream_replicas)
        await bus.connect()
        yield bus
    finally:
        if bus is not None:
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


# -- configs: a path, or the name of one shipped with the package ----------------------


def packaged_configs() -> dict[str, Path]:
    """The example configs shipped inside the package (``rollart/configs/*.yaml``) by name."""
    from importlib.resources import files

    folder = files("rollart") / "configs"
    if not folder.is_dir():
        return {}
    return {p.name[:-5]: Path(str(p)) for p in folder.iterdir() if p.name.endswith(".yaml")}


def resolve_config(name: str) -> Path:
    """The config file ``name`` means: a file that exists wins; else the packaged config of
    that name (``quickstart``, ``quickstart.yaml`` or ``configs/quickstart.yaml``), even when
    a folder of that name is in the way (``runs/quickstart``'s parent, a report folder)."""
    p = Path(name)
    if p.is_file():
        return p
    known = packaged_configs()
    stem = p.name.removesuffix(".yaml")
    if str(p.parent) in (".", "configs") and stem in known:
        log.info("config %s: the packaged %s", name, known[stem])
        return known[stem]
    if p.is_dir():
        raise ConfigError(f"config {name} is a folder, not a YAML file; packaged configs (give "
                          f"the name): {', '.join(sorted(known)) or 'none'}")
    raise ConfigError(f"config file {name} does not exist; packaged configs (give the name): "
                      f"{', '.join(sorted(known)) or 'none'}")


def _claim_run_folder(cfg: RunConfig) -> tuple[RunConfig, Path]:
    """Create the folder of a new run: ``<run_dir>/<run>``, or ``<run>-2``, ``-3``, ... when
    that one is taken (an empty folder is reused); returns ``cfg`` with the run name chosen."""
    root, base = Path(cfg.run_dir), cfg.run
    root.mkdir(parents=True, exist_ok=True)
    n = 1
    while True:
        name = base if n == 1 else f"{base}-{n}"
        path = root / name
        try:
            path.mkdir()  # atomic: two runs started at once never share a folder
            break
        except FileExistsError:
            if path.is_dir() and not any(path.iterdir()):
                break
            n += 1
    if name != base:
        print(f"rollart run: {root / base} exists, so this run is {name} ({path}/); continue "
              f"the old one with `rollart run --resume {root / base}`", file=sys.stderr, flush=True)
    else:
        print(f"rollart run: run {name} ({path}/)", file=sys.stderr, flush=True)
    return msgspec.structs.replace(cfg, run=name), path


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


@contextlib.asynccontextmanager
async def _scratch_bus(cfg: RunConfig, nats: str | None, overrides: dict | None = None):
    """``open_bus`` for a rollout: an embedded server keeps its store in a temporary folder
    (removed after), so a rollout writes nothing but its ``--out`` file."""
    import tempfile

    with tempfile.TemporaryDirectory(prefix="rollart-rollout-") as store:
        async with open_bus(msgspec.structs.replace(cfg, run_dir=store), nats, overrides) as bus:
            yield bus


async def rollout_main(args) -> int:
    import uuid

    from rich.progress import (
        BarColumn,
        MofNCompleteColumn,
        Progress,
        TextColumn,
        TimeElapsedColumn,
    )

    from rollart.launch import rollout_actors
    from rollart.node import Node

    cfg = load(resolve_config(args.config), RunConfig)
    base = m.check_token("run", args.run) if args.run else cfg.run
    # its own run name (subjects, streams): never a training run's folder, queue or stream
    cfg = msgspec.structs.replace(cfg, run=f"{base}-rollout-{uuid.uuid4().hex[:6]}")
    await _check_envs(cfg, [args.env] if args.env else None)  # a broken env fails now
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    async with _scratch_bus(cfg, args.nats, nats_overrides(args)) as bus:
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
            async with Node(bus, actors, heartbeat_every=0, events_max_age=cfg.node.events_max_age,
                            events_max_bytes=cfg.node.events_max_bytes):
                while not sched.all_done.is_set():
                    with contextlib.suppress(TimeoutError):
                        await asyncio.wait_for(sched.all_done.wait(), 0.25)
                    res = sched.results
                    ok = sum(r.success for r in res) / max(1, len(res))
                    bar.update(task, completed=sched.groups_settled,
                               info=f"success {ok:.2f}  trajectories {len(res)}")
        wall = time.perf_counter() - t0
    lines = "".join(json.dumps(msgspec.to_builtins(r)) + "\n" for r in sched.results)
    await asyncio.to_thread(out.write_text, lines)
    summary = summarize(sched.results, wall) | {"run": cfg.run, "outcomes": sched.summary(),
                                                 "out": str(out)}
    print(json.dumps(summary, indent=2))
    return 0


# -- rollart run -----------------------------------------------------------------------


async def evaluate(bus, cfg: RunConfig, version: int, groups: int, proxies) -> dict:
    """Greedy success of the policy ``version`` on ``groups`` fresh groups
    (:func:`rollart.launch.evaluate`)."""
    from rollart.launch import evaluate as _evaluate

    return await _evaluate(bus, cfg, version, groups, proxies)


async def train(cfg: RunConfig, *, nats: str | None, resume: bool, quiet: bool = False,
                overrides: dict | None = None, single_process: bool = False) -> dict:
    """Run the whole training job of ``cfg`` on one host; returns the final summary.
    ``overrides``: the command line's NATS flags (:func:`nats_overrides`). On a nats-server
    the roles of ``node.local_processes`` run in child processes (:mod:`rollart.local_nodes`);
    ``single_process`` (implied by the in-process bus) keeps every role in this one."""
    from rich.progress import Progress, TextColumn

    from rollart.launch import drive_training, training_actors
    from rollart.local_nodes import local_processes
    from rollart.node import Node
    from rollart.telemetry.progress import StepClock, step_line

    total = cfg.trainer.steps
    async with contextlib.AsyncExitStack() as stack:
        bus = await stack.enter_async_context(open_bus(cfg, nats, overrides))
        if not bus.url.startswith("memory"):  # how to watch it, once, at any log level
            print(f"rollart run: nats-server at {bus.url}; watch it with: "
                  f"rollart top --nats {bus.url} --run {cfg.run}", flush=True)
            from rollart.bus.auth import has_credentials

            if has_credentials(getattr(bus, "auth", {})):
                print("rollart run: (rollart top needs credentials too: --user and "
                      "--password-file, --token-file, --creds, --tls-ca)", flush=True)
        local = await stack.enter_async_context(local_processes(
            cfg, bus, nats=nats, overrides=overrides, single_process=single_process))
        sched, trainer, actors = training_actors(cfg, resume=resume)
        if local is not None:  # their roles are served by the child processes
            actors = [a for a in actors if a.role not in local.roles]
        live = not quiet and sys.stdout.isatty()  # a bar; piped: one line per step
        with Progress(TextColumn("{task.fields[info]}"), disable=not live) as bar:
            task = bar.add_task("steps", total=total, info=f"train: starting ({total} steps)")
            clock = StepClock()

            def on_step(mt: dict) -> None:
                clock.step(int(mt["step"]))
                eta, elapsed = clock.eta(total), clock.elapsed()
                if not live:
                    if not quiet:
                        print(step_line(mt, total, eta_s=eta, elapsed_s=elapsed), flush=True)
                    return
                width = bar.console.width - 1
                bw = 10 if width >= 70 else 0  # the fields first, a bar where it fits
                text = step_line(mt, total, eta_s=eta, elapsed_s=elapsed,
                                 width=width - (bw + 1 if bw else 0))
                k = min(bw, round(bw * mt["step"] / max(1, total)))
                graphic = f"[green]{'━' * k}[/][bright_black]{'━' * (bw - k)}[/] " if bw else ""
                bar.update(task, completed=mt["step"], info=graphic + text)

            trainer.on_step = on_step
            t0 = time.perf_counter()
            async with Node(bus, actors, heartbeat_every=cfg.node.heartbeat_every,
                            grace=cfg.node.grace, handle_signals=True,
                            events_max_age=cfg.node.events_max_age,
                            events_max_bytes=cfg.node.events_max_bytes,
                            bus_outage_max=cfg.node.bus_outage_max) as node:
                if local is not None:
                    local.attach(node)
                summary = await drive_training(
                    bus, cfg, node, trainer, sched, t0=t0,
                    proxies=[a for a in actors if a.role == "generate"])
                if local is not None and not summary["interrupted"]:
                    local.run_ended()
                if node.stop_reason:  # the bus was lost for longer than node.bus_outage_max
                    summary["bus_lost"] = node.stop_reason
            if local is not None and local.failure:  # a child process kept dying
                summary["failed"] = local.failure
                path = Path(cfg.run_dir) / cfg.run / "summary.json"
                await asyncio.to_thread(path.write_text, json.dumps(summary, indent=2))
            return summary


async def _check_envs(cfg: RunConfig, names: list[str] | None = None) -> None:
    """Import, construct and reset every env of ``cfg`` (or ``names``; see rollart.envs.check);
    raises a ConfigError naming the env when one is broken, or saying what ``proxy.engine``
    needs that is not installed."""
    from rollart.engines import missing_for
    from rollart.envs.check import check_envs_async

    if (why := missing_for(cfg.proxy.engine)) is not None:
        raise ConfigError(why)
    _check_engine_args(cfg)
    await check_envs_async(cfg, names)


def _check_engine_args(cfg: RunConfig) -> None:
    """``proxy.engine_args`` of the torch engine: a ConfigError naming an unknown key."""
    if cfg.proxy.engine == "torch":
        from rollart.engines import TORCH_ENGINE_ARGS

        bad = sorted(set(cfg.proxy.engine_args) - TORCH_ENGINE_ARGS)
        if bad:
            raise ConfigError(f"proxy.engine_args.{bad[0]}: not an argument of the torch engine "
                              f"(it takes {', '.join(sorted(TORCH_ENGINE_ARGS))})")


def _checkpoint_version(run_path: Path) -> int | None:
    """The policy version of a run folder's checkpoint (None: no checkpoint yet)."""
    p = run_path / "checkpoints" / "latest.pt"
    if not p.exists():
        return None
    import torch

    state = torch.load(p, map_location="cpu", weights_only=False, mmap=True)
    return int(state["backend"]["version"])


def _set_config_steps(path: Path, steps: int) -> None:
    """Record a new ``trainer.steps`` in a run's config.yaml (atomically)."""
    import yaml

    raw = yaml.safe_load(path.read_text()) or {}
    raw.setdefault("trainer", {})["steps"] = steps
    tmp = path.with_suffix(".tmp")
    tmp.write_text(yaml.safe_dump(raw, sort_keys=False))
    tmp.replace(path)


async def run_main(args) -> int:
    import yaml

    if args.resume:
        run_path = Path(args.resume)
        if not (run_path / "config.yaml").exists():
            raise ConfigError(f"{run_path} is not a run folder (it has no config.yaml): start a "
                              f"run with `rollart run CONFIG`")
        cfg = load(run_path / "config.yaml", RunConfig)
        if args.steps:  # "up to N steps in all"
            cfg = msgspec.structs.replace(cfg, trainer=msgspec.structs.replace(cfg.trainer, steps=args.steps))
        version = await asyncio.to_thread(_checkpoint_version, run_path)
        if version is not None and version >= cfg.trainer.steps:  # touch nothing, start nothing
            print(f"rollart run: {run_path} is finished: its checkpoint is at version {version} "
                  f"and trainer.steps is {cfg.trainer.steps}; nothing to do (train further with "
                  f"`rollart run --resume {run_path} --steps N`)", flush=True)
            return 0
        await _check_envs(cfg)
        if args.steps:  # a later plain --resume keeps the new target
            _set_config_steps(run_path / "config.yaml", args.steps)
        cfg = msgspec.structs.replace(cfg, run_dir=str(run_path.parent))
    else:
        cfg = load(resolve_config(args.config), RunConfig)
        if args.run:
            cfg = msgspec.structs.replace(cfg, run=m.check_token("run", args.run))
        if args.steps:
            cfg = msgspec.structs.replace(cfg, trainer=msgspec.structs.replace(cfg.trainer, steps=args.steps))
        await _check_envs(cfg)  # before the run folder exists: a broken env fails in seconds
        cfg, run_path = _claim_run_folder(cfg)  # a name that is taken gets a fresh suffix
        (run_path / "config.yaml").write_text(yaml.safe_dump(msgspec.to_builtins(cfg), sort_keys=False))
    from rollart.telemetry.tracing import setup_tracing

    stop_tracing = setup_tracing(cfg, "rollart-run", run_path)  # exporter none: nothing
    from rollart.telemetry.otel_metrics import setup_metrics

    stop_metrics = setup_metrics(cfg, "rollart-run", run_path)
    try:
        summary = await train(cfg, nats=args.nats, resume=bool(args.resume), quiet=args.quiet,
                              overrides=nats_overrides(args), single_process=args.single_process)
    finally:
        await asyncio.to_thread(stop_metrics)  # a last export
        await asyncio.to_thread(stop_tracing)  # flushes the spans still buffered
    print(json.dumps(summary, indent=2))
    if summary.get("bus_lost"):
        print(f"rollart run: {summary['bus_lost']}", file=sys.stderr)
        return 4
    if summary.get("failed"):
        print(f"rollart run: stopped: {summary['failed']}", file=sys.stderr)
        return 3
    return 130 if summary["interrupted"] else 0


async def top_main(args) -> int:
    from rollart.bus.auth import bus_from_config
    from rollart.telemetry.monitor import top

    cfg = load(resolve_config(args.config), RunConfig) if args.config else None
    once = args.once or args.json
    duration = args.duration if args.duration is not None or not once else TOP_ONCE_WINDOW
    async with bus_from_config(None, name="rollart-top", overrides=nats_overrides(args)) as bus:
        try:
            mon = await top(bus, m.check_token("run", args.run), duration=duration, config=cfg,
                            once=once)
        except asyncio.CancelledError:
            return 0
    if args.json:
        from rollart.telemetry.queues import snapshot

        print(json.dumps(snapshot(mon), indent=1, default=str), flush=True)
    elif once:
        from rich.console import Console

        Console().print(mon.render())
    return 0


TOP_ONCE_WINDOW = 6.0
"""Seconds ``rollart top --once`` listens before its snapshot: a heartbeat interval
(``node.heartbeat_every``, 5 s by default) and a little more, so every live node is in it."""


async def report_main(args) -> int:
    from rollart.telemetry.report import report

    if not (Path(args.run_dir) / "metrics.jsonl").exists():
        raise ConfigError(f"{args.run_dir}: no metrics.jsonl here; give a run folder (runs/<run>)")
    text, files = await asyncio.to_thread(report, args.run_dir, args.out, every=args.every)
    print(text)
    for path in files.values():
        print(f"wrote {path}")
    if not (Path(args.run_dir) / "traces.jsonl").exists():
        print("(no traces.jsonl: run with `tracing: {exporter: jsonl}` for gantt.png and steps.png)")
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
                                   "(or --nats); the trainer and scheduler in this process, "
                                   "generation and envs in child processes (node.local_processes"
                                   "). Writes runs/<run>/.")
    t.add_argument("config", nargs="?",
                   help="run config: a YAML path, or the name of a packaged one (quickstart)")
    add_nats_args(t, url_help="NATS URL to join (default: the config's nats, else an embedded "
                              "server), or 'memory' for the in-process bus")
    t.add_argument("--resume", default=None, metavar="RUN_DIR",
                   help="continue a stopped run from its checkpoint (a finished run: says so, "
                        "exits 0 and changes nothing)")
    t.add_argument("--run", default=None,
                   help="override the run name (one that is taken gets a suffix: NAME-2, ...)")
    t.add_argument("--steps", type=int, default=None, metavar="N",
                   help="train up to N steps in all (overrides trainer.steps); with --resume: "
                        "continue up to N total steps, recorded in the run's config.yaml")
    t.add_argument("--single-process", action="store_true",
                   help="host every role in this one process instead of starting child "
                        "processes for generation and envs (node.local_processes; "
                        "--nats memory implies it): simpler to debug, but generation and "
                        "training share one core")
    t.add_argument("--quiet", action="store_true", help="no progress bar")
    t.set_defaults(fn=run_main)

    tp = sub.add_parser("top", help="live subject-level view of a run",
                        description="Message rates per subject, nodes, policy version and "
                                    "replicas, trajectory outcomes and time split; each JetStream "
                                    "consumer's pending, ack pending, redelivered and rates; alpha "
                                    "headroom; dead letters by reason.")
    add_nats_args(tp, required=True, url_help="NATS URL of the run's server")
    tp.add_argument("--run", required=True, help="run name")
    tp.add_argument("--duration", type=float, default=None, help="stop after N seconds")
    tp.add_argument("--config", default=None, help="the run's config: lists the pools its mapping "
                                                   "and route need that have no live node, and "
                                                   "gives what alpha allows (the headroom)")
    tp.add_argument("--once", action="store_true",
                    help=f"print one snapshot and exit: listen --duration seconds (default "
                         f"{TOP_ONCE_WINDOW:g}: a heartbeat interval), poll JetStream at its start "
                         f"and end")
    tp.add_argument("--json", action="store_true",
                    help="with --once (implied): the snapshot as one JSON object, for scripts")
    tp.set_defaults(fn=top_main)

    rp = sub.add_parser("report", help="table, plots and figures of a run folder",
                        description="Summary table (first, best, last and every 10th step, then "
                                    "the final greedy evaluation) and a plot of a finished or "
                                    "running run; writes report.txt, report.png and report.md "
                                    "(never the run's own learning.png), and figures: "
                                    "staleness.png (histogram of how many policy versions behind "
                                    "the trained samples were) and, when the run has a "
                                    "traces.jsonl (config: tracing: {exporter: jsonl}), "
                                    "gantt.png (a trajectory Gantt: env init, env step, "
                                    "generate queued/engine, reward, waiting, over wall time with "
                                    "the policy versions) and steps.png (trainer step bars: "
                                    "get_batch/train/checkpoint/publish seconds, and how "
                                    "trajectory time split).")
    rp.add_argument("run_dir", help="runs/<run>")
    rp.add_argument("--every", type=int, default=None, metavar="N",
                    help="list every N-th step (default 10, more for long runs; 1: all)")
    rp.add_argument("--out", default=None, metavar="DIR",
                    help="folder for the report's files (default: the run folder)")
    rp.set_defaults(fn=report_main)

    r = sub.add_parser("rollout", help="roll out the current policy; write one JSON line per trajectory",
                       description="Run the configured envs with the current policy (also how "
                                   "you evaluate one) and print a summary.")
    r.add_argument("config", help="run config: a YAML path, or the name of a packaged one")
    r.add_argument("--groups", type=int, default=4, help="groups to roll out (default 4)")
    r.add_argument("--out", default="rollouts.jsonl", help="output JSONL (default rollouts.jsonl)")
    add_nats_args(r, url_help="NATS URL to join (default: the config's nats, else an embedded "
                              "server), or 'memory' for the in-process bus")
    r.add_argument("--env", default=None, help="env name of the config (default rollout.env)")
    r.add_argument("--greedy", action="store_true", help="greedy decoding")
    r.add_argument("--weights", default=None, help="safetensors file to load into the policy")
    r.add_argument("--run", default=None,
                   help="base of the run name: the rollout runs as RUN-rollout-<id>, never in a "
                        "training run's folder, and writes only --out")
    r.add_argument("--quiet", action="store_true", help="no progress bar")
    r.set_defaults(fn=rollout_main)

    n = sub.add_parser("node", help="run some roles on this host (python -m rollart.node)",
                       add_help=False)
    n.set_defaults(fn=None)

    c = sub.add_parser("config", help="check a config, or print every key with its meaning")
    c.add_argument("config", nargs="?", help="config to check: a YAML path or a packaged name")
    c.add_argument("--dump", nargs="?", const="", default=None, metavar="FILE",
                   help="write a copy of CONFIG to edit (default ./<name>.yaml; '-': stdout)")
    c.add_argument("--doc", action="store_true", help="print all keys with documentation")
    c.add_argument("--static", action="store_true",
                   help="do not import, construct or reset the envs (only validate the YAML)")
    c.set_defaults(fn=config_main)
    from rollart.deploy.cli import register as register_cluster
    from rollart.security.cli import register as register_secure

    register_secure(sub)
    register_cluster(sub)
    from rollart.telemetry.nodes import register as register_nodes

    register_nodes(sub)
    from rollart.telemetry.tap import register as register_tap

    register_tap(sub)
    return p


def _dump_config(name: str, dest: str) -> int:
    """``rollart config NAME --dump [FILE]``: a copy of a config (comments kept) to edit."""
    src = resolve_config(name)
    text = src.read_text()
    if dest == "-":
        sys.stdout.write(text)
        return 0
    out = Path(dest or src.name)
    if out.exists():
        raise ConfigError(f"{out} exists: give another FILE (rollart config {name} --dump FILE)")
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(text)
    print(f"wrote {out} (a copy of {src}): edit it, then `rollart run {out}`")
    return 0


async def config_main(args) -> int:
    if args.doc or not args.config:
        from rollart.config.doc import document

        print(document(RunConfig), end="")
        return 0
    if args.dump is not None:
        return _dump_config(args.config, args.dump)
    cfg = load(resolve_config(args.config), RunConfig)
    _check_engine_args(cfg)
    if not args.static:
        await _check_envs(cfg)
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
    if args.cmd == "config" and args.dump is not None and not args.config:
        parser.error("rollart config --dump needs CONFIG: a path or a packaged name "
                     f"({', '.join(sorted(packaged_configs()))})")
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


if __name__ == "__main__":  # python -m rollart.cli
    raise SystemExit(main())

"""``rollart run``: train on one host (the main job), or ``--resume`` a stopped run."""

from __future__ import annotations

import asyncio
import contextlib
import json
import sys
import time
from pathlib import Path

import msgspec
import yaml
from rich.progress import Progress, TextColumn

from rollart import messages as m
from rollart.actors.kernel.run_end import mark_running
from rollart.app.args import nats_overrides, open_bus
from rollart.app.configs import check_run_config, resolve_config
from rollart.app.launch import below_expected_line, checkpoint_version, drive_training
from rollart.app.local_nodes import local_processes
from rollart.bus.auth import has_credentials
from rollart.config import ConfigError, RunConfig, load
from rollart.node import Node, training_actors
from rollart.telemetry.otel_metrics import setup_metrics
from rollart.telemetry.progress import StepClock, step_line
from rollart.telemetry.tracing import setup_tracing


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


async def train(cfg: RunConfig, *, nats: str | None, resume: bool, quiet: bool = False,
                overrides: dict | None = None, single_process: bool = False) -> dict:
    """Run the whole training job of ``cfg`` on one host; returns the final summary.
    ``overrides``: the command line's NATS flags (:func:`nats_overrides`). On a nats-server
    the roles of ``node.local_processes`` run in child processes (:mod:`rollart.app.local_nodes`);
    ``single_process`` (implied by the in-process bus) keeps every role in this one."""
    total = cfg.trainer.steps
    async with contextlib.AsyncExitStack() as stack:
        bus = await stack.enter_async_context(open_bus(cfg, nats, overrides))
        if not bus.url.startswith("memory"):  # how to watch it, once, at any log level
            print(f"rollart run: nats-server at {bus.url}; watch it with: "
                  f"rollart top --nats {bus.url} --run {cfg.run}", flush=True)
            if has_credentials(getattr(bus, "auth", {})):
                print("rollart run: (rollart top needs credentials too: --user and "
                      "--password-file, --token-file, --creds, --tls-ca)", flush=True)
        await mark_running(bus, cfg.run)  # before any node starts: an earlier end is over
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
            if local is not None:  # the first step's clock starts once the children are up
                trainer.before_training = local.started
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


def _set_config_steps(path: Path, steps: int) -> None:
    """Record a new ``trainer.steps`` in a run's config.yaml (atomically)."""
    raw = yaml.safe_load(path.read_text()) or {}
    raw.setdefault("trainer", {})["steps"] = steps
    tmp = path.with_suffix(".tmp")
    tmp.write_text(yaml.safe_dump(raw, sort_keys=False))
    tmp.replace(path)


async def run_main(args) -> int:
    if args.resume:
        if getattr(args, "init_from", None):
            raise ConfigError("--init-from starts a new run; a resumed run keeps its config's "
                              "trainer.init_from")
        run_path = Path(args.resume)
        if not (run_path / "config.yaml").exists():
            raise ConfigError(f"{run_path} is not a run folder (it has no config.yaml): start a "
                              f"run with `rollart run CONFIG`")
        cfg = load(run_path / "config.yaml", RunConfig)
        if args.steps:  # "up to N steps in all"
            cfg = msgspec.structs.replace(cfg, trainer=msgspec.structs.replace(cfg.trainer, steps=args.steps))
        version = await asyncio.to_thread(checkpoint_version, run_path)
        if version is not None and version >= cfg.trainer.steps:  # touch nothing, start nothing
            print(f"rollart run: {run_path} is finished: its checkpoint is at version {version} "
                  f"and trainer.steps is {cfg.trainer.steps}; nothing to do (train further with "
                  f"`rollart run --resume {run_path} --steps N`)", flush=True)
            return 0
        await check_run_config(cfg)
        if args.steps:  # a later plain --resume keeps the new target
            _set_config_steps(run_path / "config.yaml", args.steps)
        cfg = msgspec.structs.replace(cfg, run_dir=str(run_path.parent))
    else:
        cfg = load(resolve_config(args.config), RunConfig)
        if args.run:
            cfg = msgspec.structs.replace(cfg, run=m.check_token("run", args.run))
        if args.steps:
            cfg = msgspec.structs.replace(cfg, trainer=msgspec.structs.replace(cfg.trainer, steps=args.steps))
        if getattr(args, "init_from", None):  # the SFT model: recorded in config.yaml for --resume
            cfg = msgspec.structs.replace(cfg, trainer=msgspec.structs.replace(
                cfg.trainer, init_from=args.init_from))
        await check_run_config(cfg)  # before the run folder exists: a broken env fails in seconds
        cfg, run_path = _claim_run_folder(cfg)  # a name that is taken gets a fresh suffix
        (run_path / "config.yaml").write_text(yaml.safe_dump(msgspec.to_builtins(cfg), sort_keys=False))
    stop_tracing = setup_tracing(cfg, "rollart-run", run_path)  # exporter none: nothing
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
    if summary.get("below_expected"):  # it ran to the end: exit 0, and say it did not learn
        print(f"rollart run: {below_expected_line(summary['below_expected'])}", file=sys.stderr)
    return 130 if summary["interrupted"] else 0

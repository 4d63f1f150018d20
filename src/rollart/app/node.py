"""``python -m rollart.node``: host the actors of some roles on this machine.

Without ``--nats`` it starts the embedded nats-server and prints its URL for other nodes.
The node that hosts the trainer ends the run as ``rollart run`` does
(:func:`rollart.app.launch.drive_training`); every other node drains and exits once the
end of the run is published, unless ``--serve`` keeps it up.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import sys
import time
from collections.abc import Sequence
from pathlib import Path

import msgspec

from rollart import messages as m
from rollart.actors.kernel.run_end import ended_already, mark_running, wait_run_end
from rollart.aio import first_of, retry
from rollart.app.args import add_nats_args, event_loop_runner, nats_overrides, quiet_libraries
from rollart.app.configs import resolve_config
from rollart.app.launch import (below_expected_line, checkpoint_version, drive_training,
                                wait_for_peers, write_config)
from rollart.bus import Bus, BusError
from rollart.bus.auth import AuthError, resolve
from rollart.bus.connect import bus_from_config
from rollart.bus.server import EmbeddedServer
from rollart.bus.server_config import check_listen
from rollart.config import ConfigError, RunConfig, load
from rollart.envs.check import check_envs_async
from rollart.node import BUILTIN_ROLES, Node, build_actors, own_process_gc
from rollart.telemetry.otel_metrics import setup_metrics
from rollart.telemetry.tracing import setup_tracing

log = logging.getLogger(__name__)


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m rollart.node",
        description="Run the actors of some roles on this host. Without --nats, start an "
                    "embedded nats-server and print its URL so other nodes can join.",
    )
    p.add_argument("--config", required=True,
                   help="run config: a YAML path, or the name of a packaged one (quickstart)")
    p.add_argument("--roles", required=True,
                   help=f"comma-separated roles: {', '.join(BUILTIN_ROLES)} or pkg.module:Class")
    p.add_argument("--pool", default="default", help="pool this host joins (default: default)")
    add_nats_args(p, url_help="NATS URL to join (default: the config's nats, else start an "
                              "embedded server)")
    p.add_argument("--listen", default=None, metavar="HOST[:PORT]",
                   help="address the embedded server listens on (default: nats.listen, 127.0.0.1); "
                        "0.0.0.0:4222 lets other hosts join and needs --server-config with users")
    p.add_argument("--server-config", default=None, metavar="FILE",
                   help="nats-server config (users, TLS) the embedded server starts with; make one "
                        "with `rollart secure init DIR --host NAME` (DIR/server.conf)")
    p.add_argument("--run", default=None, help="override the config's run name")
    p.add_argument("--log-level", default="INFO", help="logging level (default INFO)")
    p.add_argument("--rank", type=int, default=None, metavar="R",
                   help="with --roles trainer: be trainer rank R (1..trainer.world_size-1) of the "
                        "run's trainer, joining rank 0 at trainer.master (or --master); it never "
                        "touches the bus")
    p.add_argument("--master", default=None, metavar="HOST:PORT",
                   help="with --rank: rank 0's rendezvous address (default: trainer.master)")
    p.add_argument("--site", default=None, metavar="NAME",
                   help="the site (leaf node) this host is at: its generators read each policy "
                        "version from the site's weight relay (--roles relay) when one is up")
    p.add_argument("--serve", action="store_true",
                   help="stay up when the run ends (for the next run); by default a node drains "
                        "and exits 0 once the host of the trainer has published the end of the run")
    return p


async def _amain(args) -> int:
    cfg = load(resolve_config(args.config), RunConfig)
    if args.run:
        cfg = msgspec.structs.replace(cfg, run=m.check_token("run", args.run))
    ns = resolve(cfg, nats_overrides(args))  # this host's flags over the config's nats section
    if ns.url == "memory":
        raise ValueError("a node needs a nats-server: --nats memory (the in-process bus) is for "
                         "`rollart run`; give a NATS URL, or none to start an embedded server")
    if ns.joins and (args.listen or args.server_config):
        raise ValueError("--listen and --server-config are for the embedded server, which a node "
                         "joining a URL (--nats or nats.url) does not start")
    if not ns.joins:  # before loading anything: an insecure listen address fails now
        check_listen(ns.listen_address()[0], ns.server_config)
    roles = [r.strip() for r in args.roles.split(",") if r.strip()]
    if "env" in roles:  # a broken env fails this node now, not every trajectory later
        await check_envs_async(cfg)
    resume = False
    if "trainer" in roles:  # the head: a run folder with a checkpoint is continued
        run_path = Path(cfg.run_dir) / cfg.run
        if cfg.trainer.checkpoint_store == "object" and ns.joins:
            await _fetch_checkpoint(ns, cfg, run_path)
        version = await asyncio.to_thread(checkpoint_version, run_path)
        if version is not None and version >= cfg.trainer.steps:
            print(f"rollart node: run {cfg.run} is finished: its checkpoint ({run_path}) is at "
                  f"version {version} and trainer.steps is {cfg.trainer.steps}; nothing to do "
                  f"(train further with a larger trainer.steps, or start a new run with --run)",
                  flush=True)
            return 0
        if version is not None:
            resume = True
            print(f"rollart node: run {cfg.run} continues from its checkpoint at version "
                  f"{version} ({run_path}); a fresh run needs another --run name", flush=True)
    head_args = {"trainer": {"resume": True}, "scheduler": {"resume": True}} if resume else {}
    if args.site:  # the site's generators read from its relay; the relay serves the site
        head_args.update(generate={"site": m.check_token("site", args.site)},
                         relay={"site": args.site})
    elif "relay" in roles:
        raise ValueError("--roles relay needs --site NAME: the site whose generators it serves")
    actors = build_actors(cfg, roles, m.check_token("pool", args.pool), args=head_args)
    stop_tracing = setup_tracing(cfg, f"rollart-node:{','.join(roles)}", Path(cfg.run_dir) / cfg.run)
    stop_metrics = setup_metrics(cfg, f"rollart-node:{','.join(roles)}", Path(cfg.run_dir) / cfg.run)
    server = bus = None
    if not ns.joins:
        host, port = ns.listen_address()
        server = EmbeddedServer(Path(cfg.run_dir) / cfg.run / "nats", host, port,
                                config_file=ns.server_config)
        server.start()
        print(f"rollart node: embedded nats-server at {server.url}", flush=True)
    rc = 0
    try:
        bus = bus_from_config(ns, url=server.url if server else None,
                              name=f"rollart-node-{args.pool}", local=server is not None,
                              replicas=cfg.node.stream_replicas)
        await _connect_patiently(bus, cfg.rollout.service_wait)
        if any(a.role == "trainer" for a in actors):  # the run folder, as `rollart run` writes it
            write_config(cfg)
            await mark_running(bus, cfg.run)  # an earlier end of the run is over
        elif not args.serve and (ended := await ended_already(bus, cfg.run)) is not None:
            print(f"rollart node: run {cfg.run} ended at step {ended.version} before this node "
                  f"started; exiting (to continue it, start its head node first; --serve keeps "
                  f"a node up across runs)", flush=True)
            return 0
        async with Node(bus, actors, grace=cfg.node.grace, pool=args.pool,
                        heartbeat_every=cfg.node.heartbeat_every, handle_signals=True,
                        events_max_age=cfg.node.events_max_age,
                        events_max_bytes=cfg.node.events_max_bytes,
                        bus_outage_max=cfg.node.bus_outage_max) as node:
            print(f"rollart node: {node.node_id} serving {', '.join(roles)} "
                  f"(run={cfg.run}, pool={args.pool})", flush=True)
            if server is not None:
                print(f"rollart node: other nodes join with --nats {server.public_url}; watch the "
                      f"run with: rollart top --nats {server.public_url} --run {cfg.run}", flush=True)
            rc = await _until_end(bus, cfg, node, serve=args.serve, embedded=server is not None)
            if node.stop_reason:  # the bus was lost for longer than node.bus_outage_max
                print(f"rollart node: {node.stop_reason}", flush=True)
                rc = 4
        print("rollart node: drained", flush=True)
    finally:
        if bus is not None:
            await bus.close()
        if server is not None:
            server.stop()
        await asyncio.to_thread(stop_metrics)  # a last export
        await asyncio.to_thread(stop_tracing)  # flushes the spans still buffered
    return rc


async def _connect_patiently(bus: Bus, wait_s: float) -> None:
    """Connect, waiting quietly (one line) for a server that is not up yet: a node may be
    started before the head node whose embedded server it joins."""
    t0, said = time.monotonic(), False

    def waiting(e: BaseException, attempt: int) -> None:
        nonlocal said
        if not said:
            said = True
            print(f"rollart node: waiting for the nats-server at {bus.url} (up to "
                  f"{wait_s:.0f}s): is the head node started?", flush=True)

    try:
        # AuthError: refused (credentials, TLS): the server is up, and waiting will not help
        await retry(bus.connect, retry_on=BusError, fatal=AuthError,
                    what=f"connecting to {bus.url}", deadline=wait_s, base=1.0, cap=1.0,
                    quiet=True, on_error=waiting)
    except AuthError:
        raise
    except BusError as e:
        raise ValueError(f"no nats-server at {bus.url} after {time.monotonic() - t0:.0f}s "
                         f"(rollout.service_wait): {e}") from e
    if said:
        print(f"rollart node: connected to {bus.url}", flush=True)


async def _until_end(bus: Bus, cfg, node: Node, *, serve: bool, embedded: bool) -> int:
    """Serve until the run ends (or SIGTERM, or forever with ``serve``); the exit status.

    The node that hosts the trainer drives the end of the run exactly as ``rollart run``
    does (:func:`rollart.app.launch.drive_training`): final evaluation, ``summary.json``, the
    plot, then the end of the run in KV, on which every other node drains and exits.
    """
    trainer = next((a for a in node.actors if a.role == "trainer"), None)
    if trainer is not None:
        sched = next((a for a in node.actors
                      if a.role == "scheduler" and getattr(a, "bounded", False)), None)
        summary = await drive_training(bus, cfg, node, trainer, sched, pool=node.pool,
                                       proxies=[a for a in node.actors if a.role == "generate"])
        if summary["interrupted"]:
            return 0
        result = (f"; greedy success {summary['greedy_success']:.2f}"
                  if "greedy_success" in summary else "")
        print(f"rollart node: run {cfg.run} ended at step {summary['steps']}{result}; "
              f"{Path(cfg.run_dir) / cfg.run / 'summary.json'}", flush=True)
        if summary.get("failed"):
            print(f"rollart node: run stopped: {summary['failed']}", flush=True)
        elif summary.get("below_expected"):
            print(f"rollart node: {below_expected_line(summary['below_expected'])}", flush=True)
        if serve:
            print("rollart node: serving until SIGTERM (--serve)", flush=True)
            await node.wait()
        elif embedded:  # the other nodes drain through this server: let them
            hb = cfg.node.heartbeat_every
            left = await wait_for_peers(bus, cfg.run, node.node_id, heartbeat_every=hb,
                                        deadline=2 * cfg.node.grace + 3 * hb + 5,
                                        known=dict(trainer.nodes))
            if left:
                log.warning("%d node(s) of run %s still up; stopping the nats-server anyway",
                            left, cfg.run)
        return 3 if summary.get("failed") else 0
    if serve:
        await node.wait()
        return 0
    end = asyncio.ensure_future(wait_run_end(bus, cfg.run))
    # first_of cancels the watch until it has ended: Python 3.11's wait_for (in nats-py's
    # requests) can swallow a cancel that lands as the reply arrives, and the watch would
    # then wait on forever (seen when SIGTERM came while it was being set up on a loaded host).
    await first_of(end, node.wait())
    if not end.cancelled() and end.exception() is None:
        rec = end.result()
        why = f" (stopped: {rec.stopped})" if rec.stopped else ""
        print(f"rollart node: run {cfg.run} ended at step {rec.version}{why}; draining", flush=True)
    return 0


async def _fetch_checkpoint(ns, cfg, run_path: Path) -> None:
    """``trainer.checkpoint_store: object``: a head whose run folder has no checkpoint takes
    the one in the run's object store (the head moved to this host)."""
    # deferred: a node that hosts no trainer imports nothing of the trainer role
    from rollart.actors.trainer.checkpoint_store import fetch_checkpoint
    from rollart.actors.trainer.files import RunFiles

    files = RunFiles(run_path)
    if files.has_checkpoint():  # before any connection: the usual case, the head's own
        return
    bus = bus_from_config(ns, name="rollart-node-checkpoint", replicas=cfg.node.stream_replicas)
    await _connect_patiently(bus, cfg.rollout.service_wait)
    try:
        if await fetch_checkpoint(bus, cfg.run, files):
            print(f"rollart node: took run {cfg.run}'s checkpoint from the object store "
                  f"(trainer.checkpoint_store: object) into {run_path}", flush=True)
    finally:
        await bus.close()


def _rank_main(args) -> int:
    """``--roles trainer --rank R``: trainer rank R (:mod:`rollart.app.trainer_rank`)."""
    # deferred: only a trainer rank (--rank) needs them; its module starts torch ranks
    from rollart.app.trainer_rank import run_rank
    from rollart.engines.provision import model_dir

    try:
        cfg = load(resolve_config(args.config), RunConfig)
        master = args.master or cfg.trainer.master
        if args.roles.strip() != "trainer" or args.rank < 1 or not master:
            raise ValueError("--rank R needs --roles trainer, R >= 1 and rank 0's address "
                             "(trainer.master in the config, or --master HOST:PORT)")
        local_model = str(model_dir(cfg))
    except (ConfigError, ValueError) as e:
        print(f"rollart node: error: {e}", file=sys.stderr, flush=True)
        return 2
    print(f"rollart node: trainer rank {args.rank} of {cfg.trainer.world_size} joining {master}",
          flush=True)
    return run_rank(args.rank, master, model_dir=local_model)


def main(argv: Sequence[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    logging.basicConfig(level=args.log_level.upper(),
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    quiet_libraries()  # no third-party progress bars in node logs
    own_process_gc()  # the collector tuned once the node is set up (freeze_setup_objects)
    if args.rank is not None:
        return _rank_main(args)
    run = event_loop_runner()
    try:
        return run(_amain(args))
    except (ConfigError, ValueError) as e:
        print(f"rollart node: error: {e}", file=sys.stderr, flush=True)
        return 2
    except KeyboardInterrupt:  # before the node handles signals itself (connecting, loading)
        return 130


if __name__ == "__main__":
    raise SystemExit(main())

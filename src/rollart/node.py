"""Node: hosts actors on a bus. Embeddable, and the body of ``python -m rollart.node``.

::

    async with Node(bus, [RewardService(run="r1")]) as node:
        await node.wait()          # until SIGTERM / node.stop() / an actor fails

``start`` (``__aenter__``) returns once every consumer and service is bound. Exit drains:
stop fetching, let in-flight handlers finish within ``grace`` seconds, nak the rest.
The node never closes a bus it was given; the CLI entry point does (``drain``).
"""

from __future__ import annotations

import asyncio
import logging
import os
import signal
import socket
import time
import uuid
from collections.abc import Sequence

from rollart import messages as m
from rollart.actors.base import Actor
from rollart.actors.runtime import ConsumerLoop, Service
from rollart.bus import Bus, BusTimeout, StreamSpec
from rollart.bus.codec import encode

log = logging.getLogger(__name__)


CLUSTER_WAIT_S = 120.0
"""Seconds :func:`ensure_run_streams` waits for a cluster's JetStream (replicas > 1)."""


async def ensure_run_streams(bus: Bus, run: str, *, events_max_age: float | None = None,
                             events_max_bytes: int | None = None, update: bool = True,
                             replicas: int | None = None) -> None:
    """Create the run's event stream and work-queue stream, or update them (idempotent).

    ``replicas``: copies of each stream in a nats-server cluster (``node.stream_replicas``;
    None: the bus's ``replicas``, which :func:`rollart.bus.auth.bus_from_config` sets from it).

    The events stream gets the age and size limits (``node.events_max_age`` /
    ``node.events_max_bytes``; None: their defaults, 0: no limit). The work queue needs none:
    an acked request leaves it, and admission bounds the rest. ``update=False`` (a node
    without the trainer: under ``rollart secure`` permissions only the trainer may change a
    stream) creates a missing stream but leaves an existing one as it is, with a warning
    when its settings differ from this host's config.

    With replicas > 1 (a cluster) a JetStream API that does not answer yet (the cluster has no
    leader until a majority of its servers is up) is asked again for up to
    ``CLUSTER_WAIT_S`` seconds: the nodes that host the servers may start one by one."""
    if events_max_age is None or events_max_bytes is None:
        from rollart.config.schema import NodeConfig

        d = NodeConfig()
        events_max_age = d.events_max_age if events_max_age is None else events_max_age
        events_max_bytes = d.events_max_bytes if events_max_bytes is None else events_max_bytes
    if replicas is None:
        replicas = getattr(bus, "replicas", 1)
    for kind in ("events", "work"):
        limits = {"max_age": events_max_age, "max_bytes": events_max_bytes} if kind == "events" else {}
        spec = StreamSpec(name=m.stream_name(run, kind), subjects=m.stream_subjects(run, kind),
                          retention=m.STREAM_RETENTION[kind], replicas=replicas, **limits)
        deadline = time.monotonic() + CLUSTER_WAIT_S
        while True:
            try:
                same = await bus.ensure_stream(spec, update=update)
                break
            except BusTimeout as e:
                if replicas <= 1 or time.monotonic() > deadline:
                    raise
                log.info("%s; waiting for the nats-server cluster to elect a JetStream leader "
                         "(a majority of its servers must be up)", e)
                await asyncio.sleep(0.5)
        if not same:
            log.warning("stream %s exists with settings other than this host's config "
                        "(node.events_max_age / events_max_bytes / stream_replicas, or another "
                        "rollart version): "
                        "left as it is; the trainer's host sets them", m.stream_name(run, kind))


class Node:
    def __init__(self, bus: Bus, actors: Sequence[Actor], *, grace: float = 10.0,
                 heartbeat_every: float = 5.0, node_id: str | None = None,
                 pool: str = "default", handle_signals: bool = False,
                 events_max_age: float | None = None, events_max_bytes: int | None = None,
                 bus_outage_max: float = 600.0):
        if not actors:
            raise ValueError("a Node needs at least one actor")
        self.bus = bus
        self.actors = list(actors)
        self.grace = grace
        self.heartbeat_every = heartbeat_every
        self.pool = pool
        self.node_id = node_id or f"{socket.gethostname()}-{os.getpid()}-{uuid.uuid4().hex[:4]}"
        self.handle_signals = handle_signals
        self.events_limits = {"events_max_age": events_max_age, "events_max_bytes": events_max_bytes}
        """The events stream's limits (``node.events_*``; None: the defaults), set at start."""
        self.bus_outage_max = bus_outage_max
        """Seconds without the bus before the node stops by itself (``node.bus_outage_max``;
        0: never)."""
        self.stop_reason: str | None = None
        """Why the node stopped by itself (the bus was lost for too long); None otherwise."""
        self.loops: list[ConsumerLoop] = []
        self.services: list[Service] = []
        self._tg: asyncio.TaskGroup | None = None
        self._stop = asyncio.Event()
        """Set by :meth:`stop`: stop fetching new work."""
        self._stop_mains = asyncio.Event()
        """Set once in-flight work and services are drained: stop the actors' mains."""
        self._loop_tasks: list[asyncio.Task] = []
        self._started = False

    # -- lifecycle ---------------------------------------------------------------
    async def __aenter__(self) -> "Node":
        await self.start()
        return self

    async def __aexit__(self, et, exc, tb) -> None:
        await self.stop_and_drain(exc)

    async def start(self) -> None:
        if not self.bus.connected:
            await self.bus.connect()
        for run in sorted({a.run for a in self.actors}):
            await ensure_run_streams(self.bus, run, **self.events_limits)
        bound = [(a, a.handlers()) for a in self.actors]  # validates settings before binding
        for actor, handlers in bound:
            actor.bus = self.bus
            await actor.setup()
            for h in handlers:
                if h.settings.kind == "consume":
                    d = m.SUBJECTS[h.settings.subject]
                    loop = ConsumerLoop(self.bus, actor, h, m.stream_name(actor.run, d.stream))
                    await loop.bind()
                    self.loops.append(loop)
                else:
                    svc = Service(self.bus, actor, h)
                    await svc.bind()
                    self.services.append(svc)
        self._tg = asyncio.TaskGroup()
        await self._tg.__aenter__()
        for loop in self.loops:
            self._loop_tasks.append(
                self._tg.create_task(loop.run(self.grace), name=f"consume:{loop.h.subject}"))
        for actor in self.actors:
            if actor.overrides_main():
                self._tg.create_task(self._run_main(actor), name=f"main:{actor.name}")
        if self.heartbeat_every > 0:
            self._tg.create_task(self._heartbeats(), name="heartbeat")
        if self.bus_outage_max > 0:
            self._tg.create_task(self._watch_bus(), name="bus-watchdog")
        if self.handle_signals:
            loop = asyncio.get_running_loop()
            for sig in (signal.SIGTERM, signal.SIGINT):
                loop.add_signal_handler(sig, self._on_signal, sig)
        self._started = True
        log.info("node %s started: %d consumers, %d services", self.node_id,
                 len(self.loops), len(self.services))

    def _on_signal(self, sig: int) -> None:
        """First SIGINT/SIGTERM: drain. A second one while draining: stop hard, at once."""
        if self._stop.is_set():
            log.warning("second %s while draining: exiting now", signal.Signals(sig).name)
            os._exit(128 + sig)
        log.info("%s: draining (send it again to stop at once)", signal.Signals(sig).name)
        self.stop()

    def stop(self) -> None:
        """Ask the node to drain and return from :meth:`wait` (signal-safe)."""
        self._stop.set()
        for loop in self.loops:
            loop.stop()
        for actor in self.actors:
            try:
                actor.draining()
            except Exception:  # noqa: BLE001 - a hook must not stop the drain
                log.exception("draining hook of %s failed", actor.name)

    async def wait(self) -> None:
        """Block until :meth:`stop` is called (SIGTERM does, with ``handle_signals``)."""
        await self._stop.wait()

    async def stop_and_drain(self, exc: BaseException | None = None) -> None:
        if not self._started:
            return
        self._started = False
        self.stop()
        assert self._tg is not None
        try:
            # 1. no new work; in-flight handlers finish within grace while the services
            #    and mains they call (batchers, engines) are still up
            if self._loop_tasks and exc is None:
                await asyncio.wait(self._loop_tasks, timeout=self.grace + 5.0)
            # 2. then the services (their own in-flight requests get the grace too)
            for svc in self.services:
                await svc.stop(self.grace)
            # 3. then the actors' mains
            self._stop_mains.set()
            await self._tg.__aexit__(type(exc) if exc else None, exc, None)
        finally:
            if self.handle_signals:
                loop = asyncio.get_running_loop()
                for sig in (signal.SIGTERM, signal.SIGINT):
                    loop.remove_signal_handler(sig)
            for actor in self.actors:
                try:
                    await actor.teardown()
                except Exception:  # noqa: BLE001 - teardown must not hide the drain
                    log.exception("teardown of %s failed", actor.name)
        log.info("node %s drained: %s", self.node_id, self.outcomes() or "no handlers")

    def outcomes(self) -> str:
        """One phrase per handler: ``echo.on_request acked 9, nak'ed 0, dead 0``."""
        parts = [f"{x.actor.name}.{x.h.name} acked {x.stats.acked}, nak'ed {x.stats.naked}, "
                 f"dead {x.stats.dead}" for x in [*self.loops, *self.services]]
        return "; ".join(parts)

    # -- background tasks ------------------------------------------------------
    async def _run_main(self, actor: Actor) -> None:
        main = asyncio.ensure_future(actor.main())
        stop = asyncio.ensure_future(self._stop_mains.wait())
        try:
            await asyncio.wait({main, stop}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            stop.cancel()
            if not main.done():
                main.cancel()
                try:
                    await main
                except asyncio.CancelledError:
                    pass
        if main.done() and not main.cancelled() and main.exception() is not None:
            raise main.exception()

    def stats(self) -> dict[str, float]:
        out: dict[str, float] = {}
        for loop in self.loops:
            out.update(loop.stats.as_dict(f"{loop.actor.name}.{loop.h.name}"))
        for svc in self.services:
            out.update(svc.stats.as_dict(f"{svc.actor.name}.{svc.h.name}"))
        for a in self.actors:  # an actor's own numbers (the LLMProxy: engine occupancy)
            hook = getattr(a, "node_stats", None)
            if callable(hook):
                try:
                    out.update(hook())
                except Exception:  # noqa: BLE001 - statistics never stop a heartbeat
                    log.debug("%s.node_stats failed", a.name, exc_info=True)
        return out

    async def _watch_bus(self) -> None:
        """Stop the node once the bus has been without its server for ``bus_outage_max``
        seconds (nats-py reconnects forever; past the limit a node is only waiting)."""
        every = min(1.0, max(0.05, self.bus_outage_max / 10))
        while not self._stop_mains.is_set():
            outage = getattr(self.bus, "outage_s", 0.0)
            if outage > self.bus_outage_max and not self._stop.is_set():
                self.stop_reason = (f"lost the nats-server at {self.bus.url} for {outage:.0f} s "
                                    f"(node.bus_outage_max): stopping")
                log.error("node %s %s", self.node_id, self.stop_reason)
                self.stop()
                return
            try:
                await asyncio.wait_for(self._stop_mains.wait(), every)
            except TimeoutError:
                pass

    async def _heartbeats(self) -> None:
        from rollart.telemetry.hardware import host_hardware, host_load

        runs = sorted({a.run for a in self.actors})
        roles = sorted({a.role for a in self.actors})
        pools = sorted({a.pool for a in self.actors})
        pools = [] if pools == [self.pool] else pools
        hardware = await asyncio.to_thread(host_hardware)  # once: it does not change
        while not self._stop_mains.is_set():
            stats = self.stats()
            hb = m.NodeHeartbeat(node_id=self.node_id, host=socket.gethostname(), pid=os.getpid(),
                                 pool=self.pool, roles=roles, ts=time.time(), stats=stats,
                                 hardware=hardware, load=host_load(), versions=self._versions(),
                                 pools=pools, in_flight=int(sum(
                                     v for k, v in stats.items() if k.endswith(".inflight"))))
            for run in runs:
                try:
                    await self.bus.publish_core(m.subject(run, "node.heartbeat"), encode(hb))
                except Exception as e:  # noqa: BLE001 - a missed heartbeat is not fatal
                    log.debug("heartbeat failed: %s", e)
            try:
                await asyncio.wait_for(self._stop_mains.wait(), self.heartbeat_every)
            except TimeoutError:
                pass

    def _versions(self) -> dict[str, int]:
        """Actor name -> the policy version it holds, for actors with an int ``version``."""
        out: dict[str, int] = {}
        for a in self.actors:
            try:
                v = getattr(a, "version", None)
            except Exception:  # noqa: BLE001 - e.g. an engine not loaded yet
                continue
            if isinstance(v, int) and not isinstance(v, bool) and v >= 0:
                out[a.name] = v
        return out


# -- python -m rollart.node ------------------------------------------------------

BUILTIN_ROLES = {
    "env": "rollart.actors.env_manager:EnvManager",
    "generate": "rollart.actors.llm_proxy:LLMProxy",
    "reward": "rollart.actors.reward:RewardService",
    "trainer": "rollart.actors.trainer:Trainer",
    "scheduler": "rollart.actors.scheduler:RolloutScheduler",
}


def resolve(path: str) -> type:
    """Import ``pkg.module:Name``."""
    import importlib

    mod, sep, attr = path.partition(":")
    if not sep or not attr:
        raise ValueError(f"{path!r} is not an import path of the form 'pkg.module:Name'")
    try:
        return getattr(importlib.import_module(mod), attr)
    except (ImportError, AttributeError) as e:
        raise ValueError(f"cannot import {path!r}: {e}") from e


def build_actors(cfg, roles: Sequence[str], pool: str) -> list[Actor]:
    """Instantiate the actors of ``roles`` from a RunConfig, each in its pool: the node's
    ``pool``, or with ``pools`` declared the one ``mapping`` gives the role (see
    :func:`rollart.launch.role_pool`; a pool the mapping does not give the role is an error)."""
    from rollart.config import ActorConfig
    from rollart.launch import role_pool

    actors: list[Actor] = []
    for role in roles:
        acfg = cfg.actors.get(role, ActorConfig())
        path = acfg.type or BUILTIN_ROLES.get(role) or (role if ":" in role else None)
        if path is None:
            raise ValueError(
                f"unknown role {role!r}: built-in roles are {sorted(BUILTIN_ROLES)}; "
                f"or give actors.{role}.type = 'pkg.module:Class' in the config"
            )
        cls = resolve(path)
        if not (isinstance(cls, type) and issubclass(cls, Actor)):
            raise ValueError(f"{path} is not an Actor subclass")
        role_in = role_pool(cfg, role, pool)
        for i in range(acfg.replicas):
            actors.append(cls.from_config(cfg, acfg, pool=role_in, index=i))
    return actors


def _parser():
    import argparse

    p = argparse.ArgumentParser(
        prog="python -m rollart.node",
        description="Run the actors of some roles on this host. Without --nats, start an "
                    "embedded nats-server and print its URL so other nodes can join.",
    )
    p.add_argument("--config", required=True, help="run config (YAML)")
    p.add_argument("--roles", required=True,
                   help=f"comma-separated roles: {', '.join(BUILTIN_ROLES)} or pkg.module:Class")
    p.add_argument("--pool", default="default", help="pool this host joins (default: default)")
    from rollart.cli import add_nats_args

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
    p.add_argument("--serve", action="store_true",
                   help="stay up when the run ends (for the next run); by default a node drains "
                        "and exits 0 once the host of the trainer has published the end of the run")
    return p


async def _amain(args) -> int:
    import msgspec

    from rollart.bus.auth import bus_from_config, resolve
    from rollart.bus.server import EmbeddedServer, check_listen
    from rollart.cli import nats_overrides
    from rollart.config import RunConfig, load

    cfg = load(args.config, RunConfig)
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
        from rollart.envs.check import check_envs_async

        await check_envs_async(cfg)
    actors = build_actors(cfg, roles, m.check_token("pool", args.pool))
    from pathlib import Path

    from rollart.telemetry.tracing import setup_tracing

    stop_tracing = setup_tracing(cfg, f"rollart-node:{','.join(roles)}", Path(cfg.run_dir) / cfg.run)
    from rollart.telemetry.otel_metrics import setup_metrics

    stop_metrics = setup_metrics(cfg, f"rollart-node:{','.join(roles)}", Path(cfg.run_dir) / cfg.run)
    server = bus = None
    if not ns.joins:
        from pathlib import Path

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
            from rollart.launch import write_config

            write_config(cfg)
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
    from rollart.bus import BusError
    from rollart.bus.auth import AuthError

    t0, said = time.monotonic(), False
    while True:
        try:
            await bus.connect()
            break
        except AuthError:
            raise  # refused (credentials, TLS): the server is up, and waiting will not help
        except BusError as e:
            waited = time.monotonic() - t0
            if waited > wait_s:
                raise ValueError(f"no nats-server at {bus.url} after {waited:.0f}s "
                                 f"(rollout.service_wait): {e}") from e
            if not said:
                said = True
                print(f"rollart node: waiting for the nats-server at {bus.url} (up to "
                      f"{wait_s:.0f}s): is the head node started?", flush=True)
            await asyncio.sleep(1.0)
    if said:
        print(f"rollart node: connected to {bus.url}", flush=True)


async def _until_end(bus: Bus, cfg, node: Node, *, serve: bool, embedded: bool) -> int:
    """Serve until the run ends (or SIGTERM, or forever with ``serve``); the exit status.

    The node that hosts the trainer drives the end of the run exactly as ``rollart run``
    does (:func:`rollart.launch.drive_training`): final evaluation, ``summary.json``, the
    plot, then the end of the run in KV, on which every other node drains and exits.
    """
    from pathlib import Path

    from rollart.actors.run_end import wait_run_end

    trainer = next((a for a in node.actors if a.role == "trainer"), None)
    if trainer is not None:
        from rollart.launch import drive_training, wait_for_peers

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
    stop = asyncio.ensure_future(node.wait())
    try:
        await asyncio.wait({end, stop}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        stop.cancel()
        # Cancel until it ends: Python 3.11's wait_for (in nats-py's requests) can swallow a
        # cancel that lands as the reply arrives, and the watch would then wait on forever
        # (seen when SIGTERM came while the watch was being set up on a loaded host).
        while not end.done():
            end.cancel()
            await asyncio.wait({end}, timeout=1.0)
    if not end.cancelled() and end.exception() is None:
        rec = end.result()
        why = f" (stopped: {rec.stopped})" if rec.stopped else ""
        print(f"rollart node: run {cfg.run} ended at step {rec.version}{why}; draining", flush=True)
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    from rollart.config import ConfigError

    args = _parser().parse_args(argv)
    logging.basicConfig(level=args.log_level.upper(),
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    from rollart.cli import _quiet_libraries

    _quiet_libraries()  # no third-party progress bars in node logs
    try:
        import uvloop

        run = uvloop.run
    except ImportError:
        run = asyncio.run
    try:
        return run(_amain(args))
    except (ConfigError, ValueError) as e:
        print(f"rollart node: error: {e}", flush=True)
        return 2
    except KeyboardInterrupt:  # before the node handles signals itself (connecting, loading)
        return 130


if __name__ == "__main__":
    raise SystemExit(main())

"""Node: hosts actors on a bus. Embeddable; ``python -m rollart.node`` (its entry point is
:mod:`rollart.app.node`) runs one from a config.

::

    async with Node(bus, [RewardService(run="r1")]) as node:
        await node.wait()          # until SIGTERM / node.stop() / an actor fails

``start`` (``__aenter__``) returns once every consumer and service is bound. Exit drains:
stop fetching, let in-flight handlers finish within ``grace`` seconds, nak the rest.
The node never closes a bus it was given; the CLI entry point does (``drain``).
:mod:`rollart.node.build` turns a config into the actors a node hosts.
"""

from __future__ import annotations

import asyncio
import gc
import logging
import os
import signal
import socket
import time
import uuid
from collections.abc import Sequence

from rollart import messages as m
from rollart.actors.kernel.base import Actor
from rollart.actors.kernel.runtime import ConsumerLoop
from rollart.actors.kernel.service import Service
from rollart.aio import first_of, retry
from rollart.bus import Bus, BusTimeout, StreamSpec
from rollart.bus.codec import encode
from rollart.config import NodeConfig
from rollart.node.build import BUILTIN_ROLES, build_actors, resolve, rollout_actors, training_actors
from rollart.telemetry.hardware import host_hardware, host_load

log = logging.getLogger(__name__)

__all__ = ["BUILTIN_ROLES", "CLUSTER_WAIT_S", "Node", "build_actors", "ensure_run_streams",
           "resolve", "rollout_actors", "training_actors"]


CLUSTER_WAIT_S = 120.0
"""Seconds :func:`ensure_run_streams` waits for a cluster's JetStream (replicas > 1)."""
BUSY_SERVER_WAIT_S = 120.0
"""Seconds :func:`ensure_run_streams` asks a single server again whose JetStream API timed
out (a busy host). 30 s was not enough twice in CI (`tests/security/test_secure_run.py`: a
node of a 4-node TLS run gave up while the head's own node took 6-12 s to start)."""


async def ensure_run_streams(bus: Bus, run: str, *, events_max_age: float | None = None,
                             events_max_bytes: int | None = None, update: bool = True,
                             replicas: int | None = None) -> None:
    """Create the run's event stream and work-queue stream, or update them (idempotent).

    ``replicas``: copies of each stream in a nats-server cluster (``node.stream_replicas``;
    None: the bus's ``replicas``, which :func:`rollart.bus.connect.bus_from_config` sets from it).

    The events stream gets the age and size limits (``node.events_max_age`` /
    ``node.events_max_bytes``; None: their defaults, 0: no limit). The work queue needs none:
    an acked request leaves it, and admission bounds the rest. ``update=False`` (a node
    without the trainer: under ``rollart secure`` permissions only the trainer may change a
    stream) creates a missing stream but leaves an existing one as it is, with a warning
    when its settings differ from this host's config.

    With replicas > 1 (a cluster) a JetStream API that does not answer yet (the cluster has no
    leader until a majority of its servers is up) is asked again for up to
    ``CLUSTER_WAIT_S`` seconds: the nodes that host the servers may start one by one. A
    single server that times out is asked again for ``BUSY_SERVER_WAIT_S``."""
    if events_max_age is None or events_max_bytes is None:
        d = NodeConfig()
        events_max_age = d.events_max_age if events_max_age is None else events_max_age
        events_max_bytes = d.events_max_bytes if events_max_bytes is None else events_max_bytes
    if replicas is None:
        replicas = getattr(bus, "replicas", 1)
    for kind in ("events", "work"):
        limits = {"max_age": events_max_age, "max_bytes": events_max_bytes} if kind == "events" else {}
        spec = StreamSpec(name=m.stream_name(run, kind), subjects=m.stream_subjects(run, kind),
                          retention=m.STREAM_RETENTION[kind], replicas=replicas, **limits)
        cluster = replicas > 1
        # a cluster may have no leader yet; a single server may be too busy to answer
        # within the API's timeout (seen on a loaded 2-core host): both are asked again
        # (creating a stream that exists with the same settings is a no-op)
        same = await retry(lambda: bus.ensure_stream(spec, update=update), retry_on=BusTimeout,
                           what=f"creating stream {spec.name}",
                           deadline=CLUSTER_WAIT_S if cluster else BUSY_SERVER_WAIT_S,
                           base=0.5, cap=0.5 if cluster else 2.0, quiet=True,
                           on_error=_waiting_for_leader if cluster else _waiting_for_server)
        if not same:
            log.warning("stream %s exists with settings other than this host's config "
                        "(node.events_max_age / events_max_bytes / stream_replicas, or another "
                        "rollart version): "
                        "left as it is; the trainer's host sets them", m.stream_name(run, kind))


def _waiting_for_server(e: BaseException, attempt: int) -> None:
    if attempt == 1:
        log.warning("%s; the nats-server is slow to answer: asking again for up to %.0f s",
                    e, BUSY_SERVER_WAIT_S)
    elif attempt % 10 == 0:
        log.warning("%s; still no answer after %d attempts", e, attempt)


def _waiting_for_leader(e: BaseException, attempt: int) -> None:
    if attempt == 1:
        log.info("%s; waiting for the nats-server cluster to elect a JetStream leader "
                 "(a majority of its servers must be up)", e)


_frozen = False
_freeze_wanted = False
YOUNG_GC_THRESHOLD = 10_000
"""Allocations between two young collections once a node runs (CPython's default is 700):
each turn allocates thousands of short-lived containers (token lists, messages, tasks) that
reference counting frees anyway; a young collection every 700 walks the live ones again."""


def own_process_gc() -> None:
    """Let :func:`freeze_setup_objects` act in this process: called by the entry points that
    own their process (``rollart`` and ``python -m rollart.node``), never by a service that
    embeds a node, whose collector settings are its own."""
    global _freeze_wanted
    _freeze_wanted = True


def freeze_setup_objects() -> None:
    """Once per process that asked for it (:func:`own_process_gc`), when its first node has
    set its actors up: collect, then move every
    object alive now (modules, the model, the tokenizer, configs; ~380k in a node of the
    quickstart) to the collector's permanent generation (:func:`gc.freeze`). Without it each
    full collection walks them all again, ~0.2 s of CPU every few seconds in the env and
    trainer processes, more than every other per-turn cost but the engine's. Young
    collections then run every :data:`YOUNG_GC_THRESHOLD` allocations. Only the cyclic
    collector's walks change: reference counting frees frozen objects as before (garbage
    cycles among the frozen objects, if any, are never collected)."""
    global _frozen
    if _frozen or not _freeze_wanted or not gc.isenabled():
        return
    _frozen = True
    gc.collect()
    gc.freeze()
    young, *older = gc.get_threshold()
    if 0 < young < YOUNG_GC_THRESHOLD:
        gc.set_threshold(YOUNG_GC_THRESHOLD, *older)


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
        freeze_setup_objects()
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

    @property
    def stopping(self) -> bool:
        """Whether :meth:`stop` was called (by a caller, a signal, or a bus lost too long)."""
        return self._stop.is_set()

    def ended_consumers(self) -> list[str]:
        """The names (``consume:<subject>``) of the consumer loops that ended (all, once drained)."""
        return [t.get_name() for t in self._loop_tasks if t.done()]

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
        await first_of(main, self._stop_mains.wait())  # stopped: main is cancelled and has ended
        if not main.cancelled() and main.exception() is not None:
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
                                     v for k, v in stats.items() if k.endswith(".inflight"))),
                                 server=self.bus.server_name)
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

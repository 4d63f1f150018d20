"""Which pools the run's config needs, and a watch that says when one has no live node.

A role mapped to a pool (``mapping``) or a route to a pool (``route``) sends its work to that
pool's subjects; with no node of the pool up, the work waits in the stream (nothing is lost)
until one joins. :class:`PoolWatch` (started by the scheduler when ``pools`` is declared)
follows the run's node heartbeats and logs once, as a WARNING, when a needed pool has had no
live node for more than two heartbeat intervals, and once, as INFO, when a node of it is back.
``rollart nodes`` and ``rollart top`` report the same from :func:`pool_needs`.
"""

from __future__ import annotations

import asyncio
import logging
import time
from typing import Any

from rollart import messages as m
from rollart.actors.kernel.runtime import decode_core
from rollart.config.placement import mapped_pools

log = logging.getLogger(__name__)


def pool_needs(cfg: Any) -> dict[str, list[str]]:
    """Pool -> what needs it (``mapping.generate``, ``route[0] (prompt_tokens_gt=2048 -> big)``),
    from a RunConfig's ``mapping`` and ``route``, in config order. Empty without ``pools``."""
    needs: dict[str, list[str]] = {}
    if not getattr(cfg, "pools", None):
        return needs
    for role in cfg.mapping:
        for p in mapped_pools(cfg.mapping, role):
            needs.setdefault(p, []).append(f"mapping.{role}")
    for i, rule in enumerate(cfg.route):
        needs.setdefault(rule.pool, []).append(f"route[{i}] ({rule.describe()})")
    return needs


def node_pools(hb: m.NodeHeartbeat) -> list[str]:
    """The pools a node serves: its actors' pools, else its ``pool``."""
    return list(hb.pools) or [hb.pool]


def missing_pools(needs: dict[str, list[str]], live: list[m.NodeHeartbeat]) -> dict[str, list[str]]:
    """The needed pools no heartbeat of ``live`` serves, with what needs them."""
    served = {p for hb in live for p in node_pools(hb)}
    return {p: why for p, why in needs.items() if p not in served}


class PoolWatch:
    """Follow the heartbeats of ``run``; log when a pool of ``needs`` has no live node.

    A node is live while its last heartbeat is at most ``3 * heartbeat_every`` seconds old
    (by arrival time here, so clocks of other hosts do not matter). A pool is reported
    missing once it has had no live node for ``2 * heartbeat_every`` seconds since the watch
    started (or since its last node went silent); once per absence, and its return once."""

    def __init__(self, bus, run: str, needs: dict[str, list[str]], heartbeat_every: float,
                 *, name: str = "scheduler") -> None:
        self.bus = bus
        self.run = run
        self.needs = dict(needs)
        self.every = heartbeat_every
        self.name = name
        self.seen: dict[str, tuple[float, m.NodeHeartbeat]] = {}
        """Node id -> (arrival time, monotonic; its last heartbeat)."""
        self.missing: set[str] = set()
        """Pools reported missing and not back yet."""
        self._last_live: dict[str, float] = dict.fromkeys(self.needs, time.monotonic())
        """Pool -> when it last had a live node (the watch's start before it had one)."""
        self.changed = asyncio.Event()

    def on_heartbeat(self, hb: m.NodeHeartbeat, now: float | None = None) -> None:
        self.seen[hb.node_id] = (time.monotonic() if now is None else now, hb)
        if len(self.seen) > 1024:  # forget the longest silent
            del self.seen[min(self.seen, key=lambda k: self.seen[k][0])]
        self.check(now)

    def live(self, now: float | None = None) -> list[m.NodeHeartbeat]:
        now = time.monotonic() if now is None else now
        return [hb for t, hb in self.seen.values() if now - t <= 3 * self.every]

    def served(self, now: float | None = None) -> set[str]:
        """The pools with a live node now."""
        return {p for hb in self.live(now) for p in node_pools(hb)}

    def check(self, now: float | None = None) -> None:
        """Log the pools that went missing or came back since the last check."""
        now = time.monotonic() if now is None else now
        served = {p for hb in self.live(now) for p in node_pools(hb)}
        for pool, why in self.needs.items():
            if pool in served:
                self._last_live[pool] = now
                if pool in self.missing:
                    self.missing.discard(pool)
                    nodes = sorted(hb.node_id for hb in self.live(now) if pool in node_pools(hb))
                    log.info("%s: pool %s has a live node again (%s); its queued work goes on",
                             self.name, pool, ", ".join(nodes))
                    self.changed.set()
            elif pool not in self.missing and now - self._last_live[pool] > 2 * self.every:
                self.missing.add(pool)
                log.warning("%s: pool %s has no live node (needed by %s): its work waits in the "
                            "stream until a node of pool %s joins (python -m rollart.node "
                            "--pool %s ...)", self.name, pool, "; ".join(why), pool, pool)
                self.changed.set()

    async def run_forever(self) -> None:
        """Watch until cancelled. Bus errors are logged and retried, never raised."""
        async def on_hb(req) -> None:
            hb = decode_core(m.NodeHeartbeat, req)
            if hb is not None:  # junk on a core subject is counted and dropped
                self.on_heartbeat(hb)

        delay = 1.0
        while True:
            try:
                sub = await self.bus.subscribe(m.subject(self.run, "node.heartbeat"), on_hb)
            except Exception as e:  # noqa: BLE001 - the watch must never stop its actor
                log.warning("%s: cannot follow node heartbeats (%s); retrying in %.0fs",
                            self.name, e, delay)
                await asyncio.sleep(delay)
                delay = min(2 * delay, 60.0)
                continue
            try:
                while True:
                    await asyncio.sleep(max(0.05, self.every / 2))
                    try:
                        self.check()
                    except Exception:  # noqa: BLE001 - a report must not stop the scheduler
                        log.exception("%s: pool check failed", self.name)
            finally:
                try:
                    await sub.unsubscribe()
                except Exception:  # noqa: BLE001 - the bus may be gone
                    pass


def make_watch(bus, cfg: Any, *, name: str = "scheduler") -> PoolWatch | None:
    """A :class:`PoolWatch` for a RunConfig (``pools``, ``mapping``, ``route``,
    ``node.heartbeat_every``); None when there is nothing to watch (no pools, or heartbeats
    off)."""
    needs = pool_needs(cfg)
    every = float(cfg.node.heartbeat_every)
    if not needs or every <= 0:
        return None
    return PoolWatch(bus, cfg.run, needs, every, name=name)


async def run_watch(watch: PoolWatch) -> None:
    """Run ``watch`` until cancelled. Never raises but CancelledError."""
    try:
        await watch.run_forever()
    except asyncio.CancelledError:
        raise
    except Exception:  # noqa: BLE001 - the scheduler goes on without the watch
        log.exception("%s: the pool watch stopped", watch.name)


async def watch_pools(bus, cfg: Any, *, name: str = "scheduler") -> None:
    """Run a :class:`PoolWatch` for a RunConfig (:func:`make_watch`) until cancelled; returns at
    once when there is nothing to watch. Never raises but CancelledError."""
    try:
        watch = make_watch(bus, cfg, name=name)
    except Exception:  # noqa: BLE001 - the scheduler goes on without the watch
        log.exception("%s: the pool watch did not start", name)
        return
    if watch is not None:
        await run_watch(watch)

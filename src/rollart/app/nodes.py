"""``rollart nodes``: who is alive in a run.

Listens to the run's node heartbeats (``rollart.<run>.node.heartbeat``) for a window of two
heartbeat intervals and prints each node: host, pool(s), roles, hardware, load, the policy
version each generator holds, and the age of its last heartbeat. With ``--config``, the pools
its ``mapping`` and ``route`` name that have no live node are listed too (their work waits in
the stream until a node of the pool joins).

Sites (``rollart cluster sites``): each node's ``site`` is the name of the nats-server it is
connected to (a site's leaf server is named after the site, the hub's is ``hub``). With
``--hub-monitor URL`` (the hub's monitoring port) the sites' leaf links are listed from the
hub's ``/leafz``: connected or not, round-trip time, messages and bytes each way since the
link came up.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
import time
import urllib.request

import msgspec
from rich.console import Console
from rich.markup import escape
from rich.table import Table

from rollart import messages as m
from rollart.actors.kernel.pool_watch import missing_pools, node_pools, pool_needs
from rollart.actors.kernel.runtime import decode_core
from rollart.app.args import add_nats_args, nats_overrides
from rollart.app.configs import resolve_config
from rollart.bus.connect import bus_from_config
from rollart.config import ConfigError, RunConfig, load
from rollart.telemetry.hardware import describe_hardware, describe_versions

DEFAULT_EVERY = 5.0
"""``node.heartbeat_every``'s default: the window without ``--config`` is two of them (+1 s)."""


def register(subparsers) -> argparse.ArgumentParser:
    """Add ``nodes`` to a ``add_subparsers()`` object."""
    p = subparsers.add_parser(
        "nodes", help="who is alive: each node's host, pools, roles, hardware, load, policy versions",
        description="Listen to the node heartbeats of a run for two heartbeat intervals and list "
                    "the nodes: host, pool(s), roles, CPUs, memory, GPUs, load, the policy "
                    "version each generator holds, and the age of the last heartbeat. With "
                    "--config, also the pools its mapping and route need that have no live node. "
                    "Exits 1 when no heartbeat arrived.")
    add_nats_args(p, url_help="NATS URL of the run's server (default: the --config's nats)")
    p.add_argument("--run", default=None, help="run name (default: the --config's run)")
    p.add_argument("--config", default=None, metavar="CONFIG",
                   help="the run's config: its pools, mapping and route say which pools need a "
                        "live node; its node.heartbeat_every sets the default --wait")
    p.add_argument("--wait", type=float, default=None, metavar="S",
                   help="seconds to listen (default: 2 x node.heartbeat_every + 1, i.e. 11)")
    p.add_argument("--hub-monitor", default=None, metavar="URL",
                   help="the hub's monitoring URL (http://hub:8222, `rollart cluster sites`): "
                        "list each site's leaf link (connected, RTT, bytes each way)")
    p.add_argument("--json", action="store_true", help="print a JSON list of the nodes (with "
                   "--hub-monitor: {\"nodes\": [...], \"sites\": {site: link}})")
    p.set_defaults(fn=nodes_main)
    return p


async def listen(bus, run: str, wait: float) -> list[tuple[float, m.NodeHeartbeat]]:
    """The last heartbeat of each node heard within ``wait`` seconds, with its arrival time
    (``time.time()``), by pool then node id."""
    seen: dict[str, tuple[float, m.NodeHeartbeat]] = {}

    async def on_hb(req) -> None:
        hb = decode_core(m.NodeHeartbeat, req)
        if hb is not None:
            seen[hb.node_id] = (time.time(), hb)
            if len(seen) > 4096:
                del seen[min(seen, key=lambda k: seen[k][0])]

    sub = await bus.subscribe(m.subject(m.check_token("run", run), "node.heartbeat"), on_hb)
    try:
        await asyncio.sleep(wait)
    finally:
        await sub.unsubscribe()
    return sorted(seen.values(), key=lambda x: (x[1].pool, x[1].node_id))


def as_dict(hb: m.NodeHeartbeat, now: float) -> dict:
    """A heartbeat as JSON-ready data, with ``age_s`` (by the sender's clock)."""
    d = msgspec.to_builtins(hb)
    d["age_s"] = round(max(0.0, now - hb.ts), 2)
    return d


def render_table(beats: list[m.NodeHeartbeat], run: str, now: float):
    """A rich table of nodes (``rollart nodes``)."""
    t = Table(title=f"run {escape(run)}: {len(beats)} live node(s)")
    for col in ("node", "host", "site", "pool", "roles", "hardware", "load", "versions",
                "in flight", "age s"):
        t.add_column(col, justify="right" if col in ("load", "in flight", "age s") else "left",
                     overflow="fold")
    for hb in beats:
        t.add_row(escape(hb.node_id), escape(hb.host), escape(hb.server),
                  escape(",".join(node_pools(hb))),
                  escape(",".join(hb.roles)), escape(describe_hardware(hb.hardware)),
                  f"{hb.load:.2f}", escape(describe_versions(hb.versions)), str(hb.in_flight),
                  f"{max(0.0, now - hb.ts):.1f}")
    return t


def leaf_links(monitor_url: str, timeout: float = 5.0) -> dict[str, dict]:
    """The hub's ``/leafz``: site (leaf server name) -> ``{rtt, in_msgs, out_msgs, in_bytes,
    out_bytes}`` (in: from the site to the hub). Blocking: call it in a thread. A
    :class:`~rollart.config.ConfigError` naming the URL when it cannot be read."""
    url = monitor_url.rstrip("/")
    if not url.startswith(("http://", "https://")):
        raise ConfigError(f"--hub-monitor {monitor_url!r}: give the hub's monitoring URL, "
                          "http://HOST:PORT (its config's http: setting)")
    try:
        with urllib.request.urlopen(url + "/leafz", timeout=timeout) as r:  # noqa: S310 - http(s) only
            data = json.load(r)
    except (OSError, ValueError) as e:
        raise ConfigError(f"--hub-monitor {monitor_url}: cannot read /leafz there ({e}); is it "
                          "the hub's monitoring port (http: in hub.conf)?") from None
    return {leaf.get("name", "?"): {k: leaf.get(k) for k in (
        "rtt", "in_msgs", "out_msgs", "in_bytes", "out_bytes")} for leaf in data.get("leafs") or []}


def render_sites(links: dict[str, dict], beats: list[m.NodeHeartbeat]):
    """A rich table of the sites: the hub's leaf links, and sites the nodes name that are
    not linked now."""
    t = Table(title=f"sites: {len(links)} linked to the hub")
    for col in ("site", "link", "rtt", "nodes", "in msgs", "in bytes", "out msgs", "out bytes"):
        t.add_column(col, justify="left" if col in ("site", "link") else "right")
    named = {hb.server for hb in beats if hb.server}
    for site in sorted(set(links) | (named - {"hub"})):
        n = sum(hb.server == site for hb in beats)
        link = links.get(site)
        if link is None:
            t.add_row(escape(site), "[red]not connected", "", str(n), "", "", "", "")
            continue
        t.add_row(escape(site), "connected", escape(str(link["rtt"])), str(n),
                  *(str(link[k]) for k in ("in_msgs", "in_bytes", "out_msgs", "out_bytes")))
    return t


def missing_lines(needs: dict[str, list[str]], declared: dict, beats: list[m.NodeHeartbeat]) -> list[str]:
    """``pool big: no live node (needed by mapping.generate; route[0] (...))`` for each needed
    pool without a live node, then declared pools nothing needs and no node serves."""
    lines = [f"pool {p}: no live node (needed by {'; '.join(why)}); its work waits in the stream"
             for p, why in missing_pools(needs, beats).items()]
    served = {p for hb in beats for p in node_pools(hb)}
    lines += [f"pool {p}: no live node (declared; nothing maps or routes to it)"
              for p in declared if p not in needs and p not in served]
    return lines


async def nodes_main(args) -> int:
    cfg = load(resolve_config(args.config), RunConfig) if args.config else None
    run = args.run or (cfg.run if cfg is not None else None)
    if not run:
        raise ConfigError("rollart nodes needs --run NAME (or --config, whose run it takes)")
    run = m.check_token("run", run)
    every = cfg.node.heartbeat_every if cfg is not None else DEFAULT_EVERY
    wait = args.wait if args.wait is not None else 2 * (every or DEFAULT_EVERY) + 1
    if wait <= 0:
        raise ConfigError(f"--wait must be > 0 seconds (it is {wait:g})")
    async with bus_from_config(cfg, name="rollart-nodes", overrides=nats_overrides(args)) as bus:
        if not args.json:
            print(f"rollart nodes: listening to the heartbeats of run {run} for {wait:g}s ...",
                  file=sys.stderr, flush=True)
        heard = await listen(bus, run, wait)
    links = await asyncio.to_thread(leaf_links, args.hub_monitor) if args.hub_monitor else None
    if not heard:
        print(f"rollart nodes: no heartbeat of run {run} in {wait:g}s on {m.subject(run, 'node.heartbeat')}: "
              f"no node of this run is up (or --run/--nats name another run or server, or the "
              f"nodes beat less often than --wait: node.heartbeat_every; 0 turns heartbeats off)",
              file=sys.stderr)
        return 1
    now = time.time()
    beats = [hb for _, hb in heard]
    lines = missing_lines(pool_needs(cfg), cfg.pools if cfg is not None else {}, beats)
    if args.json:
        out = [as_dict(hb, now) for hb in beats]
        print(json.dumps(out if links is None else {"nodes": out, "sites": links}, indent=2))
        for line in lines:
            print(f"rollart nodes: {line}", file=sys.stderr)
        return 0
    piped = not sys.stdout.isatty() and "COLUMNS" not in os.environ
    con = Console(width=200 if piped else None)  # a pipe (grep, a file) gets whole lines
    con.print(render_table(beats, run, now))
    if links is not None:
        con.print(render_sites(links, beats))
    for line in lines:
        con.print(f"[yellow]{escape(line)}")
    if cfg is None:
        pools = sorted({p for hb in beats for p in hb.pools or [hb.pool]})
        con.print(f"pools with a live node: {escape(', '.join(pools))} (give --config to see "
                  f"which pools its mapping and route need)")
    return 0

"""What ``rollart top`` reads from the JetStream API and the run's KV, besides the messages.

Each refresh (never faster than once a second, in its own task: off the actors' paths) it
asks the server for the run's streams and every consumer of them: ``num_pending``,
``num_ack_pending``, ``num_redelivered``, ``num_waiting``, and from two polls the rate a
consumer delivers and acks at (the change of its delivered and ack-floor stream sequences
per second). It reads the training scheduler's admission counts from KV
(``scheduler.g.admitted`` / ``.issued``), which with the trainer's ledger summary and the
run's ``rollout.alpha`` / ``batch_groups`` give the α headroom: admission lets a group in
while ``admitted - lost < (v + alpha + 1) * batch_groups``
(:func:`rollart.actors.groups.ledger.admissible`). A bus error never stops top: it is kept in
:attr:`RunMonitor.js_error` and shown.
"""

from __future__ import annotations

import time
from typing import Any

import msgspec
from rich.markup import escape
from rich.table import Table

from rollart import messages as m
from rollart.actors.groups.admission import TRAINING_PREFIX, issued_key
from rollart.actors.kernel.pool_watch import node_pools
from rollart.bus import BusError

RunMonitor = Any
"""A :class:`rollart.app.monitor.RunMonitor` (which imports this module to render)."""

STREAM_KINDS = tuple(m.STREAM_RETENTION)
"""The run's streams: ``events`` (limits) and ``work`` (work queue)."""
CONSUMER_FIELDS = ("num_pending", "num_ack_pending", "num_redelivered", "num_waiting",
                   "delivered_stream_seq", "ack_floor_stream_seq")


async def poll_jetstream(bus: Any, mon: RunMonitor, now: float | None = None) -> None:
    """One poll: stream and consumer info of the run's streams, and the scheduler's KV
    counts, into ``mon``. Never raises a :class:`BusError`: the first one is kept in
    ``mon.js_error`` (empty once a poll goes through)."""
    errors = []
    for kind in STREAM_KINDS:
        name = m.stream_name(mon.run, kind)
        try:
            mon.streams[kind] = await bus.stream_info(name)
            infos = await bus.consumers_info(name)
        except BusError as e:  # not created yet, or the server is away: shown, and retried
            errors.append(f"{kind} stream {name}: {e}")
            continue
        t = time.monotonic() if now is None else now
        record_consumers(mon, kind, infos, t)
    try:
        if mon.kv is None:
            mon.kv = await bus.key_value(m.kv_bucket(mon.run))
        for what, key in (("admitted", f"scheduler.{TRAINING_PREFIX}.admitted"),
                          ("issued", issued_key(TRAINING_PREFIX))):
            e = await mon.kv.get(key)
            if e is not None and not e.deleted and e.value and e.value.isdigit():
                mon.scheduler[what] = int(e.value)
    except BusError as e:
        errors.append(f"kv {m.kv_bucket(mon.run)}: {e}")
    mon.js_error = "; ".join(errors)


def record_consumers(mon: RunMonitor, kind: str, infos: list[dict], now: float) -> None:
    """Keep the consumers of stream ``kind`` as polled at ``now`` (monotonic), with the rates
    since the previous poll (None on the first)."""
    fresh = {}
    for info in infos:
        key = (kind, info["name"])
        row = {"stream": m.stream_name(mon.run, kind), "kind": kind, "name": info["name"],
               "filter_subject": info.get("filter_subject", "")}
        row.update({k: int(info.get(k) or 0) for k in CONSUMER_FIELDS})
        prev = mon.consumer_prev.get(key)
        if prev is not None and now - prev[0] > 0:
            dt = now - prev[0]
            # a stream recreated meanwhile starts again from 0: no rate, not a negative one
            row["delivered_per_s"] = max(0.0, (row["delivered_stream_seq"] - prev[1]) / dt)
            row["acked_per_s"] = max(0.0, (row["ack_floor_stream_seq"] - prev[2]) / dt)
        else:
            row["delivered_per_s"] = row["acked_per_s"] = None
        mon.consumer_prev[key] = (now, row["delivered_stream_seq"], row["ack_floor_stream_seq"])
        fresh[key] = row
    for key in [k for k in mon.consumers if k[0] == kind and k not in fresh]:
        del mon.consumers[key]  # deleted consumers go
        mon.consumer_prev.pop(key, None)
    mon.consumers.update(fresh)


def alpha_headroom(mon: RunMonitor) -> dict:
    """Admitted groups against what α allows (the scheduler's rule,
    :func:`rollart.actors.groups.ledger.admissible`): ``live = admitted - lost``,
    ``allowed = (v + alpha + 1) * batch_groups`` at the ledger's version ``v``, ``headroom =
    allowed - live`` (0: admission waits for the next step). ``alpha``, ``allowed`` and
    ``headroom`` are None without the run's config (``rollart top --config``)."""
    lg = mon.ledger
    version = lg.version if lg is not None else None
    lost = lg.lost if lg is not None else 0
    admitted, issued = mon.scheduler.get("admitted"), mon.scheduler.get("issued")
    out: dict[str, Any] = {"version": version, "admitted": admitted, "issued": issued,
                           "lost": lost, "live": None if admitted is None else admitted - lost,
                           "alpha": None, "batch_groups": None, "allowed": None, "headroom": None}
    r = mon.rollout
    if r is not None:
        out["alpha"], out["batch_groups"] = r.alpha, r.batch_groups
        out["allowed"] = (max(0, version or 0) + r.alpha + 1) * r.batch_groups
        if out["live"] is not None:
            out["headroom"] = out["allowed"] - out["live"]
    return out


def replica_versions(mon: RunMonitor) -> dict[str, dict]:
    """Policy version per generation replica: from its last ``policy.loaded`` (since top
    started) and the ``versions`` of its node's heartbeats, whichever says more."""
    out: dict[str, dict] = {}
    for name, pl in mon.loaded.items():
        out[name] = {"version": pl.version, "pool": pl.pool, "node": None, "source": "policy.loaded",
                     "load_s": pl.load_s, "error": pl.error}
    for hb in mon.nodes.values():
        for name, v in hb.versions.items():
            if name not in out and not name.startswith("generate"):
                continue  # the trainer's and the scheduler's versions are not replicas'
            row = out.setdefault(name, {"version": v, "pool": hb.pool, "node": hb.node_id,
                                        "source": "heartbeat", "load_s": None, "error": ""})
            row["node"] = hb.node_id
            if v > row["version"]:
                row["version"], row["source"] = v, "heartbeat"
    latest = mon.policy.version if mon.policy is not None else None
    for row in out.values():
        row["behind"] = None if latest is None else max(0, latest - row["version"])
    return dict(sorted(out.items()))


def nodes_by_pool(mon: RunMonitor, now: float | None = None) -> dict[str, list[str]]:
    """Pool -> the live nodes serving it (a node of several pools is under each)."""
    out: dict[str, list[str]] = {}
    for hb in mon.live_nodes(now):
        for p in node_pools(hb):
            out.setdefault(p, []).append(hb.node_id)
    return {p: sorted(ids) for p, ids in sorted(out.items())}


def snapshot(mon: RunMonitor, now: float | None = None) -> dict:
    """Everything top shows, as JSON-ready builtins (``rollart top --once --json``)."""
    now = time.monotonic() if now is None else now
    wall = time.time()
    lg = mon.ledger
    live = {hb.node_id for hb in mon.live_nodes(now)}
    return {
        "run": mon.run,
        "ts": wall,
        "progress": mon.progress(),
        "totals": mon.totals(),
        "ledger": msgspec.to_builtins(lg) if lg is not None else None,
        "run_end": msgspec.to_builtins(mon.run_end) if mon.run_end is not None else None,
        "streams": {k: dict(v) for k, v in mon.streams.items()},
        "consumers": [mon.consumers[k] for k in sorted(mon.consumers)],
        "dead_letters": {"by_reason": dict(sorted(mon.dead_by_reason.items())),
                         "seen": sum(mon.dead_by_reason.values()),
                         "recent": list(mon.dead_reasons),
                         "total": lg.dead if lg is not None else None},
        "alpha": alpha_headroom(mon),
        "policy": {"version": mon.policy.version if mon.policy is not None else None,
                   "replicas": replica_versions(mon)},
        "pools": nodes_by_pool(mon, now),
        "pool_warnings": mon.pool_report(now),
        "nodes": [{"node_id": hb.node_id, "host": hb.host, "pool": hb.pool, "pools": node_pools(hb),
                   "roles": list(hb.roles), "load": hb.load, "versions": dict(hb.versions),
                   "in_flight": hb.in_flight, "age_s": round(wall - hb.ts, 3),
                   "live": hb.node_id in live}
                  for hb in sorted(mon.nodes.values(), key=lambda h: (h.pool, h.node_id))],
        "subjects": {name: {"msgs": st.count, "msgs_per_s": st.rate(now), "bytes": st.bytes}
                     for name, st in sorted(mon.subjects.items())},
        "outcomes": dict(sorted(mon.outcomes.items())),
        "stop_reasons": dict(sorted(mon.stops.items())),
        "env_init_share": mon.env_init_share(),
        "sandboxes": mon.sandboxes(now),
        "undecodable": mon.undecodable,
        "errors": [e for e in (mon.js_error, mon.bus_error) if e],
    }


def _rate(x: float | None) -> str:
    return "-" if x is None else f"{x:.1f}"


def renderables(mon: RunMonitor, now: float | None = None) -> list:
    """The α, replica, pool and dead-letter lines and the consumer table of the live view
    (above the subjects, which may run past the bottom of a small terminal)."""
    cons = Table(title="consumers (JetStream)", expand=True)
    for col in ("stream", "consumer", "pending", "ack pending", "redelivered", "waiting",
                "delivered/s", "acked/s"):
        cons.add_column(col, justify="left" if col in ("stream", "consumer") else "right")
    for key in sorted(mon.consumers):
        c = mon.consumers[key]
        cons.add_row(c["kind"], escape(c["name"]), str(c["num_pending"]), str(c["num_ack_pending"]),
                     str(c["num_redelivered"]), str(c["num_waiting"]),
                     _rate(c["delivered_per_s"]), _rate(c["acked_per_s"]))
    out: list = []
    a = alpha_headroom(mon)
    if a["admitted"] is not None or a["version"] is not None:
        live = "-" if a["live"] is None else str(a["live"])
        if a["allowed"] is None:
            line = (f"α headroom: {live} groups live (admitted {a['admitted']}, lost {a['lost']}) "
                    f"at v{a['version']}; allowed unknown (give --config)")
        else:
            line = (f"α headroom: {a['headroom'] if a['headroom'] is not None else '-'} groups "
                    f"({live} live of {a['allowed']} allowed = (v{a['version'] or 0} + α {a['alpha']} "
                    f"+ 1) x {a['batch_groups']}; admitted {a['admitted']}, lost {a['lost']})")
        out.append(escape(line))
    reps = replica_versions(mon)
    if reps:
        out.append("replicas: " + escape(", ".join(
            f"{n} v{r['version']}" + (f" ({r['behind']} behind)" if r["behind"] else "")
            for n, r in reps.items())))
    pools = nodes_by_pool(mon, now)
    if pools:
        out.append("pools: " + escape("; ".join(f"{p}: {len(ids)} node(s)" for p, ids in pools.items())))
    if mon.dead_by_reason:
        out.append("dead letters by reason (since top started): " + escape(", ".join(
            f"{k} {v}" for k, v in sorted(mon.dead_by_reason.items(), key=lambda kv: -kv[1]))))
    if mon.js_error:
        out.append(f"[red]JetStream: {escape(mon.js_error)}")
    return [*out, cons]

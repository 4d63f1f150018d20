"""``rollart top``: a live, subject-level view of a run.

Subscribes to ``rollart.<run>.>`` and decodes each message by the subject table of
:mod:`rollart.messages`: message rates per subject, node heartbeats, the policy version
and which replicas loaded it, trajectory outcomes with reward and time split (those since
top started). Step, ETA and totals since the run started come from the run's state: the
trainer's ledger summary and the end of the run in KV, and the streams' info. Each JetStream
consumer's backlog and drain rate, the α headroom and the dead letters by reason come from
:mod:`rollart.app.queues`.
"""

from __future__ import annotations

import asyncio
import time
from collections import defaultdict, deque
from dataclasses import dataclass, field

from rich.console import Group
from rich.live import Live
from rich.markup import escape
from rich.table import Table

from rollart import messages as m
from rollart.actors.groups.ledger import reason_kind, watch_summary
from rollart.actors.kernel.pool_watch import missing_pools, node_pools, pool_needs
from rollart.actors.kernel.records import watch_record
from rollart.app.queues import poll_jetstream, renderables
from rollart.bus import BusError
from rollart.bus.codec import DecodeError, decode
from rollart.telemetry.hardware import describe_hardware, describe_versions
from rollart.telemetry import sandboxes as sandbox_stats
from rollart.telemetry.progress import fmt_duration


@dataclass
class SubjectStats:
    count: int = 0
    bytes: int = 0
    recent: deque = field(default_factory=lambda: deque(maxlen=2048))

    def rate(self, now: float, window: float = 5.0) -> float:
        return sum(1 for t in self.recent if now - t <= window) / window


class RunMonitor:
    """Aggregates what flows on a run's subjects; feed it with :meth:`observe`."""

    def __init__(self, run: str, needs: dict[str, list[str]] | None = None, rollout=None):
        self.run = run
        self.rollout = rollout
        """The run's RolloutConfig (from top's ``--config``): its ``alpha`` and
        ``batch_groups`` give the α headroom; None: what α allows is unknown."""
        self.consumers: dict[tuple[str, str], dict] = {}
        """(stream kind, durable) -> its consumer info as last polled, with rates
        (:mod:`rollart.app.queues`)."""
        self.consumer_prev: dict[tuple[str, str], tuple[float, int, int]] = {}
        self.scheduler: dict[str, int] = {}
        """The training scheduler's KV counts: ``admitted``, ``issued``."""
        self.dead_by_reason: dict[str, int] = defaultdict(int)
        """Dead letters seen since top started, by the kind of their reason (before ':')."""
        self.js_error = ""
        """The last poll's JetStream/KV error (empty once a poll goes through)."""
        self.kv = None
        self.subjects: dict[str, SubjectStats] = defaultdict(SubjectStats)
        self.nodes: dict[str, m.NodeHeartbeat] = {}
        self.node_seen: dict[str, float] = {}
        """Node id -> arrival (monotonic) of its last heartbeat."""
        self.node_every: dict[str, float] = {}
        """Node id -> seconds between its last two heartbeats (its heartbeat interval)."""
        self.needs = dict(needs or {})
        """Pool -> what needs it (:func:`rollart.actors.kernel.pool_watch.pool_needs` of the run's
        config, when top was given it); empty: pools are judged from heartbeats alone."""
        self.policy: m.PolicyPublished | None = None
        self.loaded: dict[str, m.PolicyLoaded] = {}
        self.outcomes: dict[str, int] = defaultdict(int)
        self.stops: dict[str, int] = defaultdict(int)
        """Completions seen by ``stop_reason`` (``max_time``: cut by ``max_trajectory_s``)."""
        self.stage_s: dict[str, float] = defaultdict(float)
        self.rewards: deque = deque(maxlen=256)
        self.successes: deque = deque(maxlen=256)
        self.dead_reasons: deque = deque(maxlen=5)
        self.undecodable = 0
        self.ledger: m.LedgerSummary | None = None
        """The trainer's group ledger (KV), with what it waits for when it stalls, and the
        run's progress since it started: step, pace, totals."""
        self.run_end: m.RunEnd | None = None
        """The end of the run (KV), once its training is over."""
        self.streams: dict[str, dict] = {}
        self.bus_error = ""
        """The last error of a KV watch (retried): e.g. no node has made the run's bucket yet."""
        """Stream info of the run's ``events`` and ``work`` streams (what they hold)."""

    def progress(self, now: float | None = None) -> str:
        """Step, ETA and elapsed time of the run, from the trainer's published progress
        (so since the run started, whenever top was started)."""
        lg = self.ledger
        if lg is None or not lg.steps_total:
            return "no progress published by the trainer yet"
        now = time.time() if now is None else now
        parts = [f"step {lg.version}/{lg.steps_total}"]
        end = self.run_end
        if end is not None and end.ts >= lg.started_at:  # not an earlier process's end
            if end.stage != "ended":
                parts.append("training done, final evaluation")
            elif end.stopped:
                parts.append(f"run stopped: {end.stopped}")
            else:
                res = end.result.get("greedy_success")
                parts.append("run ended" + (f", greedy success {res:.2f}" if res is not None else ""))
        elif lg.version >= lg.steps_total:
            parts.append("training done")
        else:
            eta = (lg.steps_total - lg.version) * lg.step_s if lg.step_s > 0 else None
            parts.append(f"ETA {fmt_duration(eta)}")
        if lg.started_at:
            parts.append(f"elapsed {fmt_duration(now - lg.started_at)}")
        if lg.last_step_s:
            parts.append(f"last step {lg.last_step_s:.2f}s")
        return ", ".join(parts)

    def totals(self) -> str:
        """What the run did since it started: from the trainer's ledger and the streams."""
        parts = []
        lg = self.ledger
        if lg is not None:
            parts.append(f"trained {lg.trajectories} trajectories in {lg.trained} groups, "
                         f"{lg.lost} groups lost, {lg.dead} dead letters")
        ev, work = self.streams.get("events"), self.streams.get("work")
        if ev is not None:
            parts.append(f"{ev.get('last_seq', ev.get('messages', 0))} events")
        if work is not None:
            parts.append(f"{work.get('messages', 0)} requests queued")
        return "; ".join(parts) or "-"

    def observe(self, subject: str, data: bytes, now: float | None = None) -> None:
        now = time.monotonic() if now is None else now
        d = m.lookup(subject)
        # a per-replica subject (generate.direct.<pool>.<replica>): one row per pool, not per replica
        key = f"{subject.rsplit('.', 1)[0]}.*" if d is not None and d.per_replica else subject
        st = self.subjects[key]
        st.count += 1
        st.bytes += len(data)
        st.recent.append(now)
        if d is None:
            return
        try:
            msg = decode(d.type, data)
            m.validate(msg)
        except (DecodeError, m.Invalid):
            try:  # a completion too large for one message: a reference to the object store
                msg = decode(m.PayloadRef, data)
                m.validate(msg)
            except (DecodeError, m.Invalid):  # junk (invalid values too): counted, never kept
                self.undecodable += 1
                return
        if isinstance(msg, m.NodeHeartbeat):
            if msg.node_id in self.node_seen:
                self.node_every[msg.node_id] = max(0.05, now - self.node_seen[msg.node_id])
            self.nodes[msg.node_id] = msg
            self.node_seen[msg.node_id] = now
            if len(self.nodes) > 1024:  # forget the longest silent
                old = min(self.node_seen, key=self.node_seen.__getitem__)
                for d in (self.nodes, self.node_seen, self.node_every):
                    d.pop(old, None)
        elif isinstance(msg, m.PolicyPublished):
            if self.policy is None or msg.version >= self.policy.version:
                self.policy = msg
        elif isinstance(msg, m.PolicyLoaded):
            self.loaded[msg.replica] = msg
        elif isinstance(msg, m.RolloutCompleted):
            self.outcomes["completed"] += 1
            if len(self.stops) < 64 or msg.stop_reason in self.stops:  # junk must not grow it
                self.stops[msg.stop_reason or "-"] += 1
            self.rewards.append(msg.reward)
            self.successes.append(float(msg.success))
            for k, v in msg.timings.items():
                self.stage_s[k] += v
        elif isinstance(msg, m.PayloadRef) and msg.type == "RolloutCompleted":
            self.outcomes["completed"] += 1  # the summary the reference carries: no timings
            if len(self.stops) < 64 or msg.stop_reason in self.stops:
                self.stops[msg.stop_reason or "-"] += 1
            self.rewards.append(msg.reward)
            self.successes.append(float(msg.success))
        elif isinstance(msg, m.RolloutCancelled):
            self.outcomes["cancelled"] += 1
        elif isinstance(msg, m.DeadLetter):
            self.outcomes["dead"] += 1
            self.dead_reasons.append(msg.reason[:100])
            if len(self.dead_by_reason) < 256 or reason_kind(msg.reason) in self.dead_by_reason:
                self.dead_by_reason[reason_kind(msg.reason)] += 1
            else:  # junk reasons must not grow the table without end
                self.dead_by_reason["other"] += 1

    def live_nodes(self, now: float | None = None) -> list[m.NodeHeartbeat]:
        """Nodes whose last heartbeat came within three of their intervals (5 s until two
        have come)."""
        now = time.monotonic() if now is None else now
        return [hb for nid, hb in self.nodes.items()
                if now - self.node_seen.get(nid, now) <= 3 * max(1.0, self.node_every.get(nid, 5.0))]

    def pool_report(self, now: float | None = None) -> list[str]:
        """Pools without a live node: those the config's mapping and route need (when top
        has the config), else those whose nodes have all gone silent since top started."""
        live = self.live_nodes(now)
        if self.needs:
            return [f"pool {p}: no live node (needed by {'; '.join(why)}); its work waits"
                    for p, why in missing_pools(self.needs, live).items()]
        served = {p for hb in live for p in node_pools(hb)}
        gone = sorted({p for hb in self.nodes.values() for p in node_pools(hb)} - served)
        return [f"pool {p}: no live node (its nodes went silent)" for p in gone]

    def sandboxes(self, now: float | None = None) -> str:
        """The env hosts' sandbox pools from the live heartbeats (:mod:`rollart.telemetry.
        sandboxes`): warm and cold acquires with their p50/p99, start p50/p99, start failures,
        sandboxes ready and lent, sandbox failures; empty when no host used a sandbox."""
        return sandbox_stats.describe(sandbox_stats.summary(hb.stats for hb in self.live_nodes(now)))

    def sites(self, now: float | None = None) -> str:
        """Each site's live nodes and how far its generators' policy lags the current one
        (a node's site: the nats-server it is connected to, ``rollart cluster sites``); empty
        when no node names its server."""
        live = [hb for hb in self.live_nodes(now) if hb.server]
        ver = self.policy.version if self.policy else None
        out = []
        for site in sorted({hb.server for hb in live}):
            here = [hb for hb in live if hb.server == site]
            held = [v for hb in here if "generate" in hb.roles for v in hb.versions.values()]
            part = f"{site}: {len(here)} node(s)"
            if held:
                part += f", generators at v{min(held)}"
                if ver is not None:
                    part += f" ({max(0, ver - min(held))} behind)"
            out.append(part)
        return "; ".join(out)

    def env_init_share(self) -> float | None:
        """Env init's share of the trajectory time seen (its ``reset`` timing: building the env
        and its sandbox, and the reset); None before a completion came."""
        total = sum(self.stage_s.values())
        return self.stage_s.get("reset", 0.0) / total if total > 0 else None

    def render(self):
        """A rich renderable of the current state."""
        now = time.monotonic()
        subj = Table(title=f"run {self.run}: subjects (since top started)", expand=True)
        for col in ("subject", "msgs", "msgs/s (5s)", "KiB"):
            subj.add_column(col, justify="left" if col == "subject" else "right")
        for name, st in sorted(self.subjects.items()):
            subj.add_row(escape(name.removeprefix(f"{m.PREFIX}.{self.run}.")), str(st.count),
                         f"{st.rate(now):.1f}", f"{st.bytes / 1024:.1f}")
        nodes = Table(title="nodes", expand=True)
        for col in ("node", "pool", "roles", "hardware", "load", "versions", "age s", "in flight"):
            nodes.add_column(col, overflow="fold")
        wall = time.time()
        for hb in sorted(self.nodes.values(), key=lambda h: (h.pool, h.node_id)):
            inflight = hb.in_flight or sum(v for k, v in hb.stats.items() if k.endswith(".inflight"))
            nodes.add_row(escape(hb.node_id), escape(",".join(node_pools(hb))),
                          escape(",".join(hb.roles)), escape(describe_hardware(hb.hardware)),
                          f"{hb.load:.2f}", escape(describe_versions(hb.versions)),
                          f"{wall - hb.ts:.1f}", f"{inflight:.0f}")
        n = max(1, len(self.rewards))
        total = sum(self.stage_s.values()) or 1.0
        split = "  ".join(f"{k} {100 * v / total:.0f}%" for k, v in sorted(self.stage_s.items()))
        ver = self.policy.version if self.policy else 0
        lagging = [r for r, x in self.loaded.items() if x.version < ver]
        summary = Table.grid(padding=(0, 2))
        summary.add_row("progress", escape(self.progress()), "run totals", self.totals())
        summary.add_row("policy", f"v{ver}", "replicas", f"{len(self.loaded)} ({len(lagging)} behind)")
        summary.add_row("outcomes seen", ", ".join(f"{k} {v}" for k, v in sorted(self.outcomes.items())) or "-",
                        "recent reward / success",
                        f"{sum(self.rewards) / n:.3f} / {sum(self.successes) / n:.2f}")
        summary.add_row("trajectory time", split or "-", "undecodable", str(self.undecodable))
        share = self.env_init_share()
        summary.add_row("stop reasons", ", ".join(f"{k} {v}" for k, v in sorted(self.stops.items()))
                        or "-", "env init", "-" if share is None else
                        f"{100 * share:.1f}% of trajectory time (paper: 15% of a healthy step)")
        if sandboxes := self.sandboxes(now):
            summary.add_row("sandboxes", escape(sandboxes), "", "")
        if sites := self.sites(now):
            summary.add_row("sites", escape(sites), "", "")
        if self.ledger is not None:
            lg = self.ledger
            summary.add_row("groups", f"trained {lg.trained}, lost {lg.lost}",
                            "failed in a row", str(lg.failed_streak))
        parts = [summary, *renderables(self, now), subj, nodes]
        parts += [f"[yellow]{escape(line)}" for line in self.pool_report(now)]
        if self.ledger is not None and self.ledger.stopped:
            parts.append(f"[bold red]run stopped: {escape(self.ledger.stopped)}")
        elif self.ledger is not None and self.ledger.waiting:
            parts.append(f"[yellow]{escape(self.ledger.waiting)}")
        if self.dead_reasons:
            parts.append("last dead letters: " + escape(" | ".join(self.dead_reasons)))
        return Group(*parts)


async def top(bus, run: str, *, refresh: float = 1.0, duration: float | None = None,
              config=None, once: bool = False) -> RunMonitor:
    """Show the live view until interrupted (or ``duration`` seconds). ``config``: the
    run's RunConfig, whose mapping and route say which pools need a live node and what α
    allows. ``once``: show nothing; listen ``duration`` seconds (``refresh`` if None), poll
    JetStream at the start and the end (so the consumer rates span the window) and return
    the monitor (``rollart top --once`` prints its snapshot)."""
    mon = RunMonitor(run, needs=pool_needs(config) if config is not None else None,
                     rollout=config.rollout if config is not None else None)

    async def on_msg(req) -> None:
        mon.observe(req.subject, req.data)

    async def watch_ledger() -> None:
        async for summary in watch_summary(bus, run):
            mon.ledger = summary

    async def watch_end() -> None:
        kv = await bus.key_value(m.kv_bucket(run))
        async for e in kv.watch(m.RUN_END_KEY):
            if e.deleted or not e.value:
                continue
            try:
                mon.run_end = decode(m.RunEnd, e.value)
            except DecodeError:
                pass

    async def patiently(watch) -> None:
        """Run a watcher again while the bus says no: before the first node has made the
        run's KV bucket (a monitor may not create it), or while the server is away."""
        delay = 1.0
        while True:
            try:
                return await watch()
            except BusError as e:
                mon.bus_error = str(e)
                await asyncio.sleep(delay)
                delay = min(2 * delay, 10.0)

    async def watch_policy() -> None:
        async for pub in watch_record(bus, run, m.POLICY_KEY, m.PolicyPublished,
                                      what="policy record", validate=True):
            if mon.policy is None or pub.version >= mon.policy.version:
                mon.policy = pub

    async def poll_once() -> None:
        try:  # streams, consumers, the scheduler's counts: a failure is shown, never fatal
            await poll_jetstream(bus, mon)
        except Exception as e:  # noqa: BLE001 - e.g. a reply of an unexpected shape
            mon.js_error = f"{type(e).__name__}: {e}"

    async def poll_streams() -> None:
        while True:
            await poll_once()
            await asyncio.sleep(max(1.0, refresh))

    async def show() -> None:
        if once:
            await asyncio.sleep(refresh if duration is None else duration)
            await poll_once()
            return
        end = None if duration is None else time.monotonic() + duration
        with Live(mon.render(), refresh_per_second=4) as live:
            while end is None or time.monotonic() < end:
                await asyncio.sleep(refresh)
                live.update(mon.render())

    sub = await bus.subscribe(f"{m.PREFIX}.{m.check_token('run', run)}.>", on_msg)
    try:
        async with asyncio.TaskGroup() as tg:
            if once:
                await poll_once()  # the first of the two polls the rates come from
            watchers = [tg.create_task(patiently(watch_ledger)), tg.create_task(patiently(watch_end)),
                        tg.create_task(patiently(watch_policy)),
                        *([] if once else [tg.create_task(poll_streams())])]
            await show()
            for w in watchers:
                w.cancel()
    finally:
        await sub.unsubscribe()
    return mon

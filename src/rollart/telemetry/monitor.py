"""``rollart top``: a live, subject-level view of a run.

Subscribes to ``rollart.<run>.>`` and decodes each message by the subject table of
:mod:`rollart.messages`: message rates per subject, node heartbeats, the policy version
and which replicas loaded it, trajectory outcomes with reward and time split.
"""

from __future__ import annotations

import time
from collections import defaultdict, deque
from dataclasses import dataclass, field

from rollart import messages as m
from rollart.bus.codec import DecodeError, decode


@dataclass
class SubjectStats:
    count: int = 0
    bytes: int = 0
    recent: deque = field(default_factory=lambda: deque(maxlen=2048))

    def rate(self, now: float, window: float = 5.0) -> float:
        return sum(1 for t in self.recent if now - t <= window) / window


class RunMonitor:
    """Aggregates what flows on a run's subjects; feed it with :meth:`observe`."""

    def __init__(self, run: str):
        self.run = run
        self.subjects: dict[str, SubjectStats] = defaultdict(SubjectStats)
        self.nodes: dict[str, m.NodeHeartbeat] = {}
        self.policy: m.PolicyPublished | None = None
        self.loaded: dict[str, m.PolicyLoaded] = {}
        self.outcomes: dict[str, int] = defaultdict(int)
        self.stage_s: dict[str, float] = defaultdict(float)
        self.rewards: deque = deque(maxlen=256)
        self.successes: deque = deque(maxlen=256)
        self.dead_reasons: deque = deque(maxlen=5)
        self.undecodable = 0

    def observe(self, subject: str, data: bytes, now: float | None = None) -> None:
        now = time.monotonic() if now is None else now
        st = self.subjects[subject]
        st.count += 1
        st.bytes += len(data)
        st.recent.append(now)
        d = m.lookup(subject)
        if d is None:
            return
        try:
            msg = decode(d.type, data)
        except DecodeError:
            self.undecodable += 1
            return
        if isinstance(msg, m.NodeHeartbeat):
            self.nodes[msg.node_id] = msg
        elif isinstance(msg, m.PolicyPublished):
            if self.policy is None or msg.version >= self.policy.version:
                self.policy = msg
        elif isinstance(msg, m.PolicyLoaded):
            self.loaded[msg.replica] = msg
        elif isinstance(msg, m.RolloutCompleted):
            self.outcomes["completed"] += 1
            self.rewards.append(msg.reward)
            self.successes.append(float(msg.success))
            for k, v in msg.timings.items():
                self.stage_s[k] += v
        elif isinstance(msg, m.RolloutCancelled):
            self.outcomes["cancelled"] += 1
        elif isinstance(msg, m.DeadLetter):
            self.outcomes["dead"] += 1
            self.dead_reasons.append(msg.reason[:100])

    def render(self):
        """A rich renderable of the current state."""
        from rich.console import Group
        from rich.table import Table

        now = time.monotonic()
        subj = Table(title=f"run {self.run}: subjects", expand=True)
        for col in ("subject", "msgs", "msgs/s (5s)", "KiB"):
            subj.add_column(col, justify="left" if col == "subject" else "right")
        for name, st in sorted(self.subjects.items()):
            subj.add_row(name.removeprefix(f"{m.PREFIX}.{self.run}."), str(st.count),
                         f"{st.rate(now):.1f}", f"{st.bytes / 1024:.1f}")
        nodes = Table(title="nodes", expand=True)
        for col in ("node", "pool", "roles", "age s", "in flight"):
            nodes.add_column(col)
        wall = time.time()
        for hb in self.nodes.values():
            inflight = sum(v for k, v in hb.stats.items() if k.endswith(".inflight"))
            nodes.add_row(hb.node_id, hb.pool, ",".join(hb.roles), f"{wall - hb.ts:.1f}", f"{inflight:.0f}")
        n = max(1, len(self.rewards))
        total = sum(self.stage_s.values()) or 1.0
        split = "  ".join(f"{k} {100 * v / total:.0f}%" for k, v in sorted(self.stage_s.items()))
        ver = self.policy.version if self.policy else 0
        lagging = [r for r, x in self.loaded.items() if x.version < ver]
        summary = Table.grid(padding=(0, 2))
        summary.add_row("policy", f"v{ver}", "replicas", f"{len(self.loaded)} ({len(lagging)} behind)")
        summary.add_row("outcomes", ", ".join(f"{k} {v}" for k, v in sorted(self.outcomes.items())) or "-",
                        "recent reward / success",
                        f"{sum(self.rewards) / n:.3f} / {sum(self.successes) / n:.2f}")
        summary.add_row("trajectory time", split or "-", "undecodable", str(self.undecodable))
        parts = [summary, subj, nodes]
        if self.dead_reasons:
            parts.append("last dead letters: " + " | ".join(self.dead_reasons))
        return Group(*parts)


async def top(bus, run: str, *, refresh: float = 1.0, duration: float | None = None) -> RunMonitor:
    """Show the live view until interrupted (or ``duration`` seconds)."""
    import asyncio

    from rich.live import Live

    mon = RunMonitor(run)

    async def on_msg(req) -> None:
        mon.observe(req.subject, req.data)

    sub = await bus.subscribe(f"{m.PREFIX}.{m.check_token('run', run)}.>", on_msg)
    end = None if duration is None else time.monotonic() + duration
    try:
        with Live(mon.render(), refresh_per_second=4) as live:
            while end is None or time.monotonic() < end:
                await asyncio.sleep(refresh)
                live.update(mon.render())
    finally:
        await sub.unsubscribe()
    return mon

"""The env hosts' sandbox pools, summed from their heartbeats: one reading for ``rollart top``
(:meth:`~rollart.app.monitor.RunMonitor.sandboxes`) and for each step's row of
``metrics.jsonl`` (the trainer keeps every node's last heartbeat), so the step-time report
shows what top showed.

A node's heartbeat carries its process's pool as ``sandbox.<stat>`` (counts since the
process started, latencies over its recent sandboxes) and each EnvManager's or reward
replica's ``<name>.sandbox_failures`` (:mod:`rollart.actors.kernel.sandboxes`). Counts are
summed over hosts; a latency is the worst host's.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping

COUNTS = ("warm_hits", "cold_starts", "start_failures", "died_idle", "ready", "lent")
LATENCIES = ("start_p50_s", "start_p99_s", "acquire_p50_s", "acquire_p99_s")


def summary(stats: Iterable[Mapping[str, float]]) -> dict[str, float]:
    """``sandbox_<count>``, ``sandbox_<latency>`` and ``sandbox_failures`` over the nodes'
    heartbeat ``stats``; ``{}`` when no host took, started or failed a sandbox."""
    out: dict[str, float] = {}
    for st in stats:
        for k, v in st.items():
            if k.endswith(".sandbox_failures"):
                out["sandbox_failures"] = out.get("sandbox_failures", 0.0) + v
            elif k.startswith("sandbox."):
                name = k[len("sandbox."):]
                if name in LATENCIES:
                    out[f"sandbox_{name}"] = max(out.get(f"sandbox_{name}", 0.0), v)
                elif name in COUNTS:
                    out[f"sandbox_{name}"] = out.get(f"sandbox_{name}", 0.0) + v
    used = any(out.get(f"sandbox_{k}") for k in ("warm_hits", "cold_starts", "ready",
                                                  "start_failures")) or out.get("sandbox_failures")
    return out if used else {}


def describe(s: Mapping[str, float]) -> str:
    """One line of a :func:`summary` (``""`` for an empty one)."""
    if not s:
        return ""

    def ms(key: str) -> str:
        return f"{1e3 * s[key]:.0f}" if key in s else "-"

    def n(key: str) -> str:
        return f"{s.get(key, 0.0):.0f}"

    return (f"{n('sandbox_warm_hits')} warm / {n('sandbox_cold_starts')} cold acquires "
            f"(p50 {ms('sandbox_acquire_p50_s')} ms, p99 {ms('sandbox_acquire_p99_s')} ms), "
            f"start p50 {ms('sandbox_start_p50_s')} ms p99 {ms('sandbox_start_p99_s')} ms, "
            f"{n('sandbox_start_failures')} start failures, {n('sandbox_ready')} ready, "
            f"{n('sandbox_lent')} lent, {n('sandbox_failures')} sandbox failures")

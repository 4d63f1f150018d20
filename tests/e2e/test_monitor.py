"""The monitor sees what flows on a run's subjects, decoded by the subject table."""

from __future__ import annotations

import asyncio
import time

from rollart.app.monitor import RunMonitor
from tests.e2e.test_rollout import make_cfg, run_groups


async def test_monitor_counts_a_rollout(bus, tiny_model):
    # generation on the bus (an LLMProxy in the EnvManager's own process is otherwise called
    # without it: rollout.local_calls, whose turns no subject shows)
    cfg = make_cfg(tiny_model, group_size=2, local_calls=False)
    mon = RunMonitor(cfg.run)

    async def on_msg(req):
        mon.observe(req.subject, req.data)

    sub = await bus.subscribe(f"rollart.{cfg.run}.>", on_msg)
    sched, _ = await run_groups(bus, cfg, groups=2)
    end = time.monotonic() + 5
    while mon.outcomes.get("completed", 0) < 4 and time.monotonic() < end:
        await asyncio.sleep(0.02)
    await sub.unsubscribe()
    assert mon.outcomes["completed"] == 4
    assert mon.subjects[f"rollart.{cfg.run}.rollout.requested.default"].count == 4
    # each turn on the pool's queue group or, after a trajectory's first, on the replica's own
    # subject (rollout.affinity), which the monitor counts as one row per pool
    assert not [s for s in mon.subjects if ".generate.direct.default." in s and not s.endswith(".*")]
    assert (mon.subjects[f"rollart.{cfg.run}.generate.request.default"].count
            + mon.subjects[f"rollart.{cfg.run}.generate.direct.default.*"].count) >= 4
    assert mon.subjects[f"rollart.{cfg.run}.generate.direct.default.*"].count > 0, "affinity on"
    assert mon.stage_s["generate"] > 0
    mon.observe(f"rollart.{cfg.run}.rollout.completed", b"junk")
    assert mon.undecodable == 1
    from rich.console import Console

    Console(file=open("/dev/null", "w")).print(mon.render())


async def test_local_calls_leave_no_generate_subject(memory_bus_only, tiny_model):
    cfg = make_cfg(tiny_model, group_size=2)  # rollout.local_calls: on by default
    mon = RunMonitor(cfg.run)

    async def on_msg(req):
        mon.observe(req.subject, req.data)

    sub = await memory_bus_only.subscribe(f"rollart.{cfg.run}.>", on_msg)
    sched, _ = await run_groups(memory_bus_only, cfg, groups=2)
    await sub.unsubscribe()
    assert sched.summary()["completed"] == 4
    assert not [s for s in mon.subjects if ".generate." in s], list(mon.subjects)
    assert mon.stage_s["generate"] > 0  # the turns' own timings still say where time went

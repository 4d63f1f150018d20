"""The collector tuning of a node's process (:func:`rollart.node.freeze_setup_objects`): only
in a process whose entry point owns it (``rollart run``, ``python -m rollart.node``), never in
a service that embeds a node. Each case in a fresh interpreter: the setting is per process."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap

import pytest

SCRIPT = textwrap.dedent("""
    import asyncio, gc, json, sys
    from rollart.actors.reward.actor import RewardService
    from rollart.bus.memory import MemoryBus
    from rollart.node import Node, own_process_gc
    if sys.argv[1] == "owned":
        own_process_gc()
    async def main():
        bus = MemoryBus()
        before = gc.get_freeze_count()
        async with Node(bus, [RewardService(run="gc")], heartbeat_every=0):
            pass
        print(json.dumps({"before": before, "frozen": gc.get_freeze_count(),
                          "young": gc.get_threshold()[0]}))
    asyncio.run(main())
""")


@pytest.mark.parametrize("mode", ["owned", "embedded"])
def test_a_node_tunes_the_collector_only_in_a_process_it_owns(mode):
    out = subprocess.run([sys.executable, "-c", SCRIPT, mode], capture_output=True, text=True,
                         timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    got = json.loads(out.stdout.strip().splitlines()[-1])
    assert got["before"] == 0
    if mode == "owned":
        assert got["frozen"] > 1000 and got["young"] >= 10_000, got
    else:
        assert got["frozen"] == 0 and got["young"] == 700, got

"""A node whose nats-server is gone for longer than ``node.bus_outage_max`` stops by itself:
one clear message, exit status 4, no traceback, no hang. A shorter outage is ridden out.

Each test starts its own server (never the session one) and a real ``python -m rollart.node``.
"""

from __future__ import annotations

import asyncio
import re
import time
from pathlib import Path

import pytest

from rollart.bus.server import EmbeddedServer
from tests.child_output import NodeProcess, ReadProcess

OUTAGE_MAX = 3.0


def _start_node(tmp_path: Path, url: str) -> NodeProcess:
    cfg = tmp_path / "run.yaml"
    cfg.write_text(
        "run: outagetest\n"
        f"run_dir: {tmp_path / 'runs'}\n"
        f"node: {{grace: 2, heartbeat_every: 0.5, bus_outage_max: {OUTAGE_MAX}}}\n"
    )
    return NodeProcess(cfg, "reward", "--nats", url)


def _reported_outage(text: str, who: str) -> float:
    """The seconds without the server that the stop message names."""
    found = re.search(rf"{who}: lost the nats-server at \S+ for (\d+) s", text)
    assert found, text
    return float(found.group(1))


async def test_node_stops_after_bus_outage_max(tmp_path):
    server = EmbeddedServer(tmp_path / "nats").start()
    out = _start_node(tmp_path, server.url)
    try:
        await out.line_with("serving reward", 60)
        server.kill()
        t0 = time.monotonic()
        rc = await out.exit_code(OUTAGE_MAX + 60)  # a bound on a hang, not a measurement
        took = time.monotonic() - t0
    finally:
        out.kill()
        server.stop()
    text = out.output()
    assert rc == 4, text
    assert took >= OUTAGE_MAX, (took, text)
    assert _reported_outage(text, "rollart node") >= round(OUTAGE_MAX), text
    line = f"rollart node: lost the nats-server at {server.url} for"
    assert text.count(line) == 1, text
    assert "(node.bus_outage_max): stopping" in text
    assert "Traceback" not in text, text
    assert "close failed" not in text, text  # closing the dead connection is quiet too
    assert "rollart node: drained" in text


async def test_short_outage_does_not_stop_the_node(tmp_path):
    server = EmbeddedServer(tmp_path / "nats").start()
    out = _start_node(tmp_path, server.url)
    try:
        await out.line_with("serving reward", 60)
        server.kill()
        await out.line_with("disconnected; reconnecting", 60)
        server.restart()
        await out.line_with("reconnected", 60)
        # past the limit as measured from the kill, and a bit more: still up
        deadline = time.monotonic() + OUTAGE_MAX + 2
        while time.monotonic() < deadline:
            assert out.proc.poll() is None, out.output()
            await asyncio.sleep(0.1)
        assert "bus_outage_max" not in out.output(), out.output()
        # a second outage gets the whole allowance again (the first one's clock was reset)
        server.kill()
        t0 = time.monotonic()
        rc = await out.exit_code(OUTAGE_MAX + 60)
        took = time.monotonic() - t0
    finally:
        out.kill()
        server.stop()
    text = out.output()
    assert rc == 4, text
    assert took >= OUTAGE_MAX, (took, text)
    assert _reported_outage(text, "rollart node") >= round(OUTAGE_MAX), text
    assert "Traceback" not in text, text


@pytest.mark.slow
async def test_rollart_run_stops_after_bus_outage_max(tmp_path, tiny_model):
    """``rollart run`` on a server that dies: its node stops the same way, the run says why
    and exits 4."""
    server = EmbeddedServer(tmp_path / "nats").start()
    cfg = tmp_path / "run.yaml"
    cfg.write_text(
        f"run: outagerun\nrun_dir: {tmp_path / 'runs'}\nmodel: {{path: '{tiny_model}'}}\n"
        f"node: {{heartbeat_every: 0.5, grace: 2, bus_outage_max: {OUTAGE_MAX}}}\n"
        "envs: {main: {type: frozenlake, max_turns: 4}}\n"
        "rollout: {group_size: 4, batch_groups: 2, alpha: 1}\n"
        "trainer: {steps: 200, eval_groups: 1}\n")
    out = ReadProcess(["-m", "rollart", "run", str(cfg), "--nats", server.url], cwd=tmp_path,
                      name="rollart run")
    try:
        await out.line_with("step 1/200", 180)
        server.kill()
        t0 = time.monotonic()
        rc = await out.exit_code(OUTAGE_MAX + 90)
        took = time.monotonic() - t0
    finally:
        out.kill()
        server.stop()
    text = out.output()
    assert rc == 4, text
    assert took >= OUTAGE_MAX, (took, text)
    assert f"rollart run: lost the nats-server at {server.url} for" in text, text
    assert _reported_outage(text, "rollart run") >= round(OUTAGE_MAX), text

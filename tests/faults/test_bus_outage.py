"""A node whose nats-server is gone for longer than ``node.bus_outage_max`` stops by itself:
one clear message, exit status 4, no traceback, no hang. A shorter outage is ridden out.

Each test starts its own server (never the session one) and a real ``python -m rollart.node``.
"""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from rollart.bus.server import EmbeddedServer

ROOT = Path(__file__).resolve().parents[2]
OUTAGE_MAX = 3.0


def _start_node(tmp_path: Path, url: str) -> subprocess.Popen:
    cfg = tmp_path / "run.yaml"
    cfg.write_text(
        "run: outagetest\n"
        f"run_dir: {tmp_path / 'runs'}\n"
        f"node: {{grace: 2, heartbeat_every: 0.5, bus_outage_max: {OUTAGE_MAX}}}\n"
    )
    env = dict(os.environ, PYTHONPATH=f"{ROOT}{os.pathsep}{os.environ.get('PYTHONPATH', '')}")
    return subprocess.Popen(
        [sys.executable, "-m", "rollart.node", "--config", str(cfg), "--roles", "reward",
         "--nats", url],
        cwd=tmp_path, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
    )


class _Output:
    """The node's merged stdout/stderr, read on a thread as it comes."""

    def __init__(self, proc: subprocess.Popen) -> None:
        self.proc, self.lines = proc, []
        self._reader = asyncio.ensure_future(asyncio.to_thread(self._read))

    def _read(self) -> None:
        for line in self.proc.stdout:
            self.lines.append(line)

    @property
    def text(self) -> str:
        return "".join(self.lines)

    async def wait_for(self, needle: str, deadline: float) -> float:
        """Seconds until ``needle`` appeared in the output."""
        t0 = time.monotonic()
        while needle not in self.text:
            if time.monotonic() - t0 > deadline or (self.proc.poll() is not None and self._reader.done()):
                raise AssertionError(f"node never printed {needle!r}; output:\n{self.text}")
            await asyncio.sleep(0.05)
        return time.monotonic() - t0

    async def finish(self, deadline: float) -> int:
        rc = await asyncio.to_thread(self.proc.wait, deadline)
        await asyncio.wait_for(self._reader, 5)
        return rc


def _stop(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        proc.kill()
        proc.wait()


async def test_node_stops_after_bus_outage_max(tmp_path):
    server = EmbeddedServer(tmp_path / "nats").start()
    proc = _start_node(tmp_path, server.url)
    out = _Output(proc)
    try:
        await out.wait_for("serving reward", 60)
        server.kill()
        t0 = time.monotonic()
        rc = await out.finish(OUTAGE_MAX + 20)
        took = time.monotonic() - t0
    finally:
        _stop(proc)
        server.stop()
    text = out.text
    assert rc == 4, text
    assert OUTAGE_MAX <= took < OUTAGE_MAX + 8, (took, text)
    line = f"rollart node: lost the nats-server at {server.url} for"
    assert text.count(line) == 1, text
    assert "(node.bus_outage_max): stopping" in text
    assert "Traceback" not in text, text
    assert "close failed" not in text, text  # closing the dead connection is quiet too
    assert "rollart node: drained" in text


async def test_short_outage_does_not_stop_the_node(tmp_path):
    server = EmbeddedServer(tmp_path / "nats").start()
    proc = _start_node(tmp_path, server.url)
    out = _Output(proc)
    try:
        await out.wait_for("serving reward", 60)
        server.kill()
        await out.wait_for("disconnected; reconnecting", 10)
        server.restart()
        await out.wait_for("reconnected", 10)
        # past the limit as measured from the kill, and a bit more: still up
        deadline = time.monotonic() + OUTAGE_MAX + 2
        while time.monotonic() < deadline:
            assert proc.poll() is None, out.text
            await asyncio.sleep(0.1)
        assert "bus_outage_max" not in out.text, out.text
        # a second outage gets the whole allowance again (the first one's clock was reset)
        server.kill()
        t0 = time.monotonic()
        rc = await out.finish(OUTAGE_MAX + 20)
        took = time.monotonic() - t0
    finally:
        _stop(proc)
        server.stop()
    assert rc == 4, out.text
    assert OUTAGE_MAX <= took < OUTAGE_MAX + 8, (took, out.text)
    assert "Traceback" not in out.text, out.text


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
    env = dict(os.environ, PYTHONPATH=f"{ROOT}{os.pathsep}{os.environ.get('PYTHONPATH', '')}")
    proc = subprocess.Popen([sys.executable, "-m", "rollart", "run", str(cfg), "--nats", server.url],
                            cwd=tmp_path, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True)
    out = _Output(proc)
    try:
        await out.wait_for("step 1/200", 180)
        server.kill()
        t0 = time.monotonic()
        rc = await out.finish(OUTAGE_MAX + 30)
        took = time.monotonic() - t0
    finally:
        _stop(proc)
        server.stop()
    assert rc == 4, out.text
    assert OUTAGE_MAX <= took < OUTAGE_MAX + 15, (took, out.text)
    assert f"rollart run: lost the nats-server at {server.url} for" in out.text, out.text

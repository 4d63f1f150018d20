"""Stateless services that are away, late or killed never fail a trajectory.

Real ``python -m rollart.node`` processes on one nats-server: an env node whose generate
pool starts 15 s later, and a generate replica killed with SIGKILL while it holds requests.
"""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from rollart import messages as m
from rollart.bus.codec import decode, encode
from rollart.bus.nats import NatsBus
from rollart.bus.server import EmbeddedServer
from tests.actors.sample_actors import collect, new_run

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[2]


class NodeProc:
    """A node process whose output is read by a thread (so its pipe never fills)."""

    def __init__(self, cfg: Path, roles: str, url: str, name: str):
        env = dict(os.environ, PYTHONPATH=f"{ROOT}{os.pathsep}{os.environ.get('PYTHONPATH', '')}")
        self.name = name
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "rollart.node", "--config", str(cfg), "--roles", roles,
             "--nats", url], cwd=cfg.parent, env=env, stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT, text=True)
        self.lines: list[str] = []
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        for line in self.proc.stdout:
            self.lines.append(line)

    def saw(self, needle: str) -> bool:
        return any(needle in line for line in list(self.lines))

    async def wait_for(self, needle: str, deadline: float = 60.0) -> float:
        end = time.monotonic() + deadline
        while not self.saw(needle):
            if self.proc.poll() is not None or time.monotonic() > end:
                raise AssertionError(f"{self.name} never printed {needle!r}:\n{self.output()}")
            await asyncio.sleep(0.05)
        return time.monotonic()

    def output(self) -> str:
        return "".join(self.lines[-60:])

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(15)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()


def write_cfg(path: Path, run: str, tiny_model, **generate) -> Path:
    gen = ""
    if generate:
        args = ", ".join(f"{k}: {v}" for k, v in generate.pop("args", {}).items())
        gen = f"actors:\n  generate: {{type: '{generate['type']}', args: {{{args}}}}}\n"
    path.write_text(
        f"run: {run}\n"
        f"run_dir: {path.parent / 'runs'}\n"
        "node: {grace: 5, heartbeat_every: 1}\n"
        f"model: {{path: '{tiny_model}'}}\n"
        "envs: {main: {type: frozenlake, max_turns: 4}}\n"
        "rollout: {generate_timeout: 60, service_wait: 120, replica_timeout: 3}\n" + gen)
    return path


async def submit(bus, run: str, n: int) -> set[str]:
    ids = set()
    for i in range(n):
        tid = f"t{i}"
        msg = m.RolloutRequested(traj_id=tid, group_id=f"g{i // 2}", env="main", seed=i,
                                 index_in_group=i % 2)
        await bus.publish(m.subject(run, "rollout.requested", "default"), encode(msg), msg_id=tid)
        ids.add(tid)
    return ids


@pytest.fixture
def server(tmp_path):
    with EmbeddedServer(tmp_path / "nats") as srv:
        yield srv


async def test_a_generate_node_started_15s_after_the_env_node(tmp_path, server, tiny_model):
    run = new_run()
    cfg = write_cfg(tmp_path / "run.yaml", run, tiny_model)
    nodes = [NodeProc(cfg, "env", server.url, "env node")]
    try:
        bus = NatsBus(server.url)
        await bus.connect()
        try:
            t_env = await nodes[0].wait_for("serving env")
            ids = await submit(bus, run, 4)
            await nodes[0].wait_for("wait for a generate replica", deadline=30)
            await asyncio.sleep(max(0.0, t_env + 15.0 - time.monotonic()))  # the outage itself
            nodes.append(NodeProc(cfg, "generate", server.url, "generate node"))
            done = await collect(bus, run, "rollout.completed", len(ids), deadline=60)
            dead = await collect(bus, run, "dead", 1, deadline=0.5)
        finally:
            await bus.close()
        assert not dead, [d.reason for d in dead]
        assert {d.traj_id for d in done} == ids, nodes[0].output()
        assert all(d.attempt == 1 for d in done), "trajectories waited; none was re-run"
        assert nodes[0].saw("generate replicas in pool 'default' answer again")
    finally:
        for node in nodes:
            node.stop()


async def test_requests_on_a_killed_generate_replica_finish_on_another(tmp_path, server, tiny_model):
    run = new_run()
    cfg = write_cfg(tmp_path / "run.yaml", run, tiny_model)
    slow = write_cfg(tmp_path / "slow.yaml", run, tiny_model,
                     type="tests.faults.slow_proxy:SlowProxy", args={"delay": 45})
    victim = NodeProc(slow, "generate", server.url, "victim")
    nodes = [victim, NodeProc(cfg, "generate", server.url, "survivor"),
             NodeProc(cfg, "env", server.url, "env node")]
    try:
        for node in nodes:
            await node.wait_for("serving")
        bus = NatsBus(server.url)
        await bus.connect()
        try:
            claims: dict[str, list[str]] = {}

            async def on_progress(msg) -> None:
                p = decode(m.ServiceProgress, msg.data)
                claims[p.replica] = p.request_ids

            sub = await bus.subscribe(m.subject(run, "service.progress"), on_progress)
            ids = await submit(bus, run, 6)
            await victim.wait_for("batch of", deadline=30)
            replica = next(x for x in victim.lines if "batch of" in x).split()[2].rstrip(":")
            end = time.monotonic() + 10
            while not claims.get(replica):  # its report says it holds requests
                assert time.monotonic() < end, f"{replica} never reported its requests: {claims}"
                await asyncio.sleep(0.05)
            await sub.unsubscribe()
            victim.proc.kill()  # SIGKILL
            t_kill = time.monotonic()
            done = await collect(bus, run, "rollout.completed", len(ids), deadline=45)
            took = time.monotonic() - t_kill
            dead = await collect(bus, run, "dead", 1, deadline=0.5)
        finally:
            await bus.close()
        assert not dead, [d.reason for d in dead]
        assert {d.traj_id for d in done} == ids, nodes[2].output()
        assert took < 15.0, f"requests held by the killed replica took {took:.1f}s (generate_timeout 60)"
        assert nodes[2].saw(f"replica {replica} (pool 'default') silent for"), nodes[2].output()
    finally:
        for node in nodes:
            node.stop()

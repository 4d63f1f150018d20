"""Stateless services that are away, late or killed never fail a trajectory.

Real ``python -m rollart.node`` processes on one nats-server: an env node whose generate
pool starts 15 s later, and a generate replica killed with SIGKILL while it holds requests.
"""

from __future__ import annotations

import asyncio
import time
from pathlib import Path

import pytest

from rollart import messages as m
from rollart.bus.codec import decode, encode
from rollart.bus.nats import NatsBus
from rollart.bus.server import EmbeddedServer
from tests.actors.sample_actors import all_stored, collect, new_run
from tests.child_output import NodeProcess
from tests.waiting import until

pytestmark = pytest.mark.slow



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
        "rollout: {generate_timeout: 600, service_wait: 120, replica_timeout: 3}\n" + gen)
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
    nodes = [NodeProcess(cfg, "env", "--nats", server.url, name="env node")]
    try:
        bus = NatsBus(server.url)
        await bus.connect()
        try:
            await nodes[0].line_with("serving env")
            t_env = time.monotonic()
            ids = await submit(bus, run, 4)
            await nodes[0].line_with("wait for a generate replica", deadline=60)
            await asyncio.sleep(max(0.0, t_env + 15.0 - time.monotonic()))  # the outage itself
            nodes.append(NodeProcess(cfg, "generate", "--nats", server.url, name="generate node"))
            done = await collect(bus, run, "rollout.completed", len(ids), deadline=60)
            # every outcome is in: read what the dead stream holds, never wait for nothing
            dead = await all_stored(bus, run, "dead")
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
    victim = NodeProcess(slow, "generate", "--nats", server.url, name="victim")
    nodes = [victim, NodeProcess(cfg, "generate", "--nats", server.url, name="survivor"),
             NodeProcess(cfg, "env", "--nats", server.url, name="env node")]
    try:
        for node in nodes:
            await node.line_with("serving")
        bus = NatsBus(server.url)
        await bus.connect()
        try:
            claims: dict[str, list[str]] = {}

            async def on_progress(msg) -> None:
                p = decode(m.ServiceProgress, msg.data)
                claims[p.replica] = p.request_ids

            sub = await bus.subscribe(m.subject(run, "service.progress"), on_progress)
            ids = await submit(bus, run, 6)
            line = await victim.line_with("batch of", deadline=60)
            replica = line.split()[2].rstrip(":")
            await until(lambda: claims.get(replica), deadline=30, step=0.05,  # it holds requests
                        what=f"{replica} to report its requests", state=lambda: claims)
            await sub.unsubscribe()
            victim.kill()  # SIGKILL
            # no attempt times out here (generate_timeout 600 s): the survivor serves them
            # because the env node noticed the killed replica's silence (replica_timeout 3 s)
            done = await collect(bus, run, "rollout.completed", len(ids), deadline=180)
            # every outcome is in: read what the dead stream holds, never wait for nothing
            dead = await all_stored(bus, run, "dead")
        finally:
            await bus.close()
        assert not dead, [d.reason for d in dead]
        assert {d.traj_id for d in done} == ids, nodes[2].output()
        assert nodes[2].saw(f"replica {replica} (pool 'default') silent for"), nodes[2].output()
    finally:
        for node in nodes:
            node.stop()

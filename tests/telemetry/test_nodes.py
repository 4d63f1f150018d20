"""Who is alive: node heartbeats carry hardware, load and policy versions; ``rollart nodes``
lists them; the scheduler's pool watch says when a needed pool has no live node, and when
one joins (the work that waited then goes on)."""

from __future__ import annotations

import asyncio
import json
import logging
import os
import sys
import time
import types
from dataclasses import dataclass
from pathlib import Path

import pytest

from rollart import messages as m
from rollart.actors.kernel.base import Actor
from rollart.actors.kernel.pool_watch import PoolWatch, pool_needs, watch_pools
from rollart.actors.kernel.runtime import decode_core
from rollart.bus.codec import DecodeError, decode, encode
from rollart.config import ActorConfig, RunConfig
from rollart.config.placement import PoolConfig, RouteRule
from rollart.config.schema import NodeConfig
from rollart.node import Node
from rollart.telemetry.hardware import _gpus, describe_hardware, describe_versions
from rollart.app.monitor import RunMonitor
from tests.actors.sample_actors import EchoEnv, new_run
from tests.waiting import until

ROOT = Path(__file__).resolve().parents[2]
EVERY = 0.2


@dataclass(kw_only=True, eq=False)
class Holder(Actor):
    """An actor that holds a policy version (as a generate replica does)."""

    role = "generate"
    version: int = 0


async def heartbeats(bus, run: str):
    got: dict[str, m.NodeHeartbeat] = {}

    async def on_hb(req) -> None:
        hb = decode_core(m.NodeHeartbeat, req)
        if hb is not None:
            got[hb.node_id] = hb

    return got, await bus.subscribe(m.subject(run, "node.heartbeat"), on_hb)


def placed_cfg(run: str) -> RunConfig:
    return RunConfig(run=run, pools={"big": PoolConfig(), "cpu": PoolConfig()},
                     mapping={"generate": "big", "env": "cpu", "reward": "cpu"},
                     route=[RouteRule(pool="big")], node=NodeConfig(heartbeat_every=EVERY))


async def test_heartbeats_carry_hardware_load_and_versions(nats_bus):
    run = new_run()
    got, sub = await heartbeats(nats_bus, run)
    actors = [Holder(run=run, pool="big", name="gen-0", version=3),
              Holder(run=run, pool="small", name="gen-1", version=2), EchoEnv(run=run, pool="big")]
    try:
        async with Node(nats_bus, actors, heartbeat_every=EVERY, pool="big", node_id="n1"):
            await until(lambda: "n1" in got, what="a heartbeat", deadline=30)
    finally:
        await sub.unsubscribe()
    hb = got["n1"]
    assert hb.hardware["cpus"] >= 1 and hb.hardware["mem_gib"] > 0
    assert "gpus" not in hb.hardware  # this process does not use CUDA
    assert hb.load >= 0.0
    assert hb.versions == {"gen-0": 3, "gen-1": 2}
    assert hb.pools == ["big", "small"] and hb.roles == ["echo", "generate"]
    assert hb.in_flight == 0
    m.validate(hb)
    assert "cpu" in describe_hardware(hb.hardware)
    assert describe_versions(hb.versions) == "gen-0 v3, gen-1 v2"
    assert describe_versions({f"g{i}": i for i in range(5)}) == "v0-v4 (5 actors)"


def test_old_heartbeats_decode_and_junk_is_refused():
    import msgspec

    class Old(msgspec.Struct, kw_only=True):  # a heartbeat of a node before these fields
        node_id: str
        host: str
        pid: int
        pool: str
        roles: list[str]
        ts: float
        stats: dict[str, float] = {}

    hb = decode(m.NodeHeartbeat, encode(Old(node_id="n", host="h", pid=1, pool="p", roles=["env"],
                                            ts=time.time())))
    assert hb.hardware == {} and hb.versions == {} and hb.load == 0.0 and hb.pools == []
    base = dict(node_id="n", host="h", pid=1, pool="p", roles=["env"], ts=time.time())
    for bad in ({"load": float("nan")}, {"versions": {"g": -1}}, {"hardware": {"cpus": -1}},
                {"hardware": {f"k{i}": 1 for i in range(40)}}, {"pools": ["x" * 100]}):
        with pytest.raises((DecodeError, m.Invalid)):  # what a receiver refuses
            m.validate(decode(m.NodeHeartbeat, encode(m.NodeHeartbeat(**base, **bad))))


def test_gpus_only_when_cuda_is_already_in_use(monkeypatch):
    props = [types.SimpleNamespace(name="NVIDIA H200", total_memory=140 * 2**30)] * 2

    cuda = types.SimpleNamespace(is_initialized=lambda: False, device_count=lambda: 2,
                                 get_device_properties=lambda i: props[i])
    monkeypatch.setitem(sys.modules, "torch", types.SimpleNamespace(cuda=cuda))
    assert _gpus() == {}  # CUDA not started by this process: a heartbeat never starts it
    cuda.is_initialized = lambda: True
    assert _gpus() == {"gpus": "NVIDIA H200 x 2", "gpu_mem_gib": 140.0}
    monkeypatch.delitem(sys.modules, "torch")
    assert _gpus() == {}


async def _rollart(*args: str) -> tuple[int, str, str]:
    """``python -m rollart ARGS`` as a subprocess, without blocking this loop (the nodes in
    this process must go on beating)."""
    p = await asyncio.create_subprocess_exec(sys.executable, "-m", "rollart", *args, cwd=ROOT,
                                             env={**os.environ, "COLUMNS": "200"},
                                             stdout=asyncio.subprocess.PIPE,
                                             stderr=asyncio.subprocess.PIPE)
    out, err = await asyncio.wait_for(p.communicate(), 120)
    return p.returncode, out.decode(), err.decode()


async def test_rollart_nodes_lists_two_nodes_in_two_pools(nats_server, nats_bus, tmp_path):
    run = new_run()
    got, sub = await heartbeats(nats_bus, run)
    big = Node(nats_bus, [Holder(run=run, pool="big", name="gen-big", version=4)],
               heartbeat_every=EVERY, pool="big", node_id="node-big")
    cpu = Node(nats_bus, [EchoEnv(run=run, pool="cpu")], heartbeat_every=EVERY, pool="cpu",
               node_id="node-cpu")
    cfg = tmp_path / "run.yaml"
    cfg.write_text(f"run: {run}\npools: {{big: {{}}, cpu: {{}}, small: {{}}}}\n"
                   "mapping: {generate: [big, small], env: cpu, reward: cpu}\n"
                   f"node: {{heartbeat_every: {EVERY}}}\n")
    try:
        async with big, cpu:
            await until(lambda: {"node-big", "node-cpu"} <= set(got), what="both nodes beating", deadline=30)
            (rc, out, err), (rc2, text, _) = await asyncio.gather(
                _rollart("nodes", "--nats", nats_server.url, "--run", run, "--json", "--wait", "1.5"),
                _rollart("nodes", "--nats", nats_server.url, "--config", str(cfg), "--wait", "1.5"))
    finally:
        await sub.unsubscribe()
    assert rc == 0, err
    nodes = {n["node_id"]: n for n in json.loads(out)}
    assert set(nodes) == {"node-big", "node-cpu"}
    assert nodes["node-big"]["pool"] == "big" and nodes["node-big"]["roles"] == ["generate"]
    assert nodes["node-big"]["versions"] == {"gen-big": 4}
    assert nodes["node-cpu"]["pool"] == "cpu" and nodes["node-cpu"]["roles"] == ["echo"]
    assert nodes["node-cpu"]["hardware"]["cpus"] >= 1 and nodes["node-cpu"]["age_s"] < 5
    assert rc2 == 0
    assert "node-big" in text and "node-cpu" in text
    assert "pool small: no live node (needed by mapping.generate)" in " ".join(text.split())
    assert "pool big:" not in text and "pool cpu:" not in text

    rc, out, err = await _rollart("nodes", "--nats", nats_server.url, "--run", new_run(),
                                  "--wait", "0.3")
    assert rc == 1 and "no heartbeat" in err and out == ""


async def test_pool_watch_logs_a_missing_pool_once_and_its_return(nats_bus, caplog):
    caplog.set_level(logging.INFO, logger="rollart.actors.kernel.pool_watch")
    run = new_run()
    cfg = placed_cfg(run)
    assert pool_needs(cfg) == {"big": ["mapping.generate", "route[0] (default -> big)"],
                               "cpu": ["mapping.env", "mapping.reward"]}
    watch = PoolWatch(nats_bus, run, pool_needs(cfg), EVERY)
    task = asyncio.create_task(watch.run_forever())

    def said(level: int, text: str) -> list[str]:
        return [r.getMessage() for r in caplog.records
                if r.levelno == level and text in r.getMessage()]

    try:
        async with Node(nats_bus, [EchoEnv(run=run, pool="cpu")], heartbeat_every=EVERY,
                        pool="cpu", node_id="cpu-1"):
            await until(lambda: said(logging.WARNING, "pool big has no live node"),
                        what="the warning for pool big", deadline=30)
            n = {"beats": 0}
            seen_at = watch.seen["cpu-1"][0]

            def more_beats() -> bool:  # five more heartbeats of the cpu node, five more checks
                nonlocal seen_at
                if watch.seen["cpu-1"][0] != seen_at:
                    seen_at = watch.seen["cpu-1"][0]
                    n["beats"] += 1
                return n["beats"] >= 5

            await until(more_beats, what="more heartbeats", deadline=30)
            assert len(said(logging.WARNING, "pool big")) == 1
            msg = said(logging.WARNING, "pool big")[0]
            assert "mapping.generate" in msg and "route[0]" in msg and "waits in the stream" in msg
            assert not said(logging.WARNING, "pool cpu")
            async with Node(nats_bus, [Holder(run=run, pool="big", name="gen")],
                            heartbeat_every=EVERY, pool="big", node_id="big-1"):
                await until(lambda: said(logging.INFO, "pool big has a live node again"),
                            what="the return of pool big", deadline=30)
                assert "big" not in watch.missing
    finally:
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
    assert len(said(logging.INFO, "pool big has a live node again")) == 1
    assert len(said(logging.WARNING, "pool big")) == 1


async def test_scheduler_work_waits_for_a_pool_and_goes_on_when_it_joins(nats_bus, caplog):
    """The scheduler's watch logs the env pool without a node; the requests it admitted wait
    in the stream and are served once a node of that pool joins."""
    from rollart.actors.scheduler.actor import RolloutScheduler

    caplog.set_level(logging.INFO, logger="rollart.actors.kernel.pool_watch")
    run = new_run()
    cfg = placed_cfg(run)
    sched = RolloutScheduler.from_config(cfg, ActorConfig(), pool="head")
    assert sched.run_cfg is cfg

    def said(level: int, text: str) -> bool:
        return any(r.levelno == level and text in r.getMessage() for r in caplog.records)

    async with Node(nats_bus, [sched], heartbeat_every=EVERY, pool="head"):
        await until(lambda: said(logging.WARNING, "pool cpu has no live node"),
                    what="the scheduler's warning for pool cpu", deadline=30)
        assert sched.admitted > 0 and sched.groups_done == 0
        env = EchoEnv(run=run, pool="cpu")
        async with Node(nats_bus, [env], heartbeat_every=EVERY, pool="cpu"):
            await until(lambda: said(logging.INFO, "pool cpu has a live node again"),
                        what="the return of pool cpu", deadline=30)
            await until(lambda: sched.groups_done > 0, what="queued work served", deadline=30)
    assert env.calls


async def test_watch_pools_without_pools_returns_at_once(nats_bus):
    await asyncio.wait_for(watch_pools(nats_bus, RunConfig(run=new_run())), 1.0)


def test_monitor_shows_hardware_versions_and_pools_without_a_node():
    from rich.console import Console

    run = "r1"
    mon = RunMonitor(run, needs={"big": ["mapping.generate"], "cpu": ["mapping.env"]})
    hb = m.NodeHeartbeat(node_id="n1", host="h", pid=1, pool="cpu", roles=["env"], ts=time.time(),
                         hardware={"cpus": 8, "mem_gib": 31.2}, load=0.5, versions={"gen": 7})
    from rollart.bus.codec import encode

    mon.observe(m.subject(run, "node.heartbeat"), encode(hb), now=100.0)
    assert mon.pool_report(now=100.5) == [
        "pool big: no live node (needed by mapping.generate); its work waits"]
    con = Console(width=200, record=True, file=open("/dev/null", "w"))
    con.print(mon.render())
    text = con.export_text()
    assert "8 cpu, 31.2 GiB" in text and "gen v7" in text and "pool big: no live node" in text
    assert mon.sites(now=100.5) == ""  # no node names its server: no sites line
    for nid, server, roles, versions in (("g", "gpu", ["generate"], {"gen": 3}),
                                         ("e", "cpu", ["env"], {}),
                                         ("t", "hub", ["trainer"], {"trainer": 5})):
        mon.observe(m.subject(run, "node.heartbeat"), encode(m.NodeHeartbeat(
            node_id=nid, host="h", pid=1, pool="p", roles=roles, ts=time.time(),
            versions=versions, server=server)), now=time.monotonic())
    mon.policy = m.PolicyPublished(version=5, uri="file:///w", digest="sha256:" + "0" * 64)
    assert mon.sites() == ("cpu: 1 node(s); gpu: 1 node(s), generators at v3 "
                                    "(2 behind); hub: 1 node(s)")
    con.print(mon.render())
    assert "generators at v3 (2 behind)" in con.export_text()
    # without the config: a pool whose nodes all went silent
    mon2 = RunMonitor(run)
    mon2.observe(m.subject(run, "node.heartbeat"), encode(hb), now=100.0)
    assert mon2.pool_report(now=101.0) == []
    assert mon2.pool_report(now=200.0) == ["pool cpu: no live node (its nodes went silent)"]

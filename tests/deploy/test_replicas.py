"""node.stream_replicas reaches the streams and buckets; a single server refuses more than one
copy with a message naming the setting; MemoryBus accepts and ignores it."""

from __future__ import annotations

import pytest

from rollart import messages as m
from rollart.bus import BusError, StreamSpec
from rollart.bus.connect import bus_from_config
from rollart.bus.memory import MemoryBus
from rollart.config.schema import NodeConfig, RunConfig
from rollart.node import ensure_run_streams


async def test_single_server_refuses_replicas_naming_the_setting(nats_bus):
    assert nats_bus.replicas == 1
    with pytest.raises(BusError, match="node.stream_replicas"):
        await nats_bus.ensure_stream(StreamSpec(name="REPL3", subjects=("repl3.>",), replicas=3))
    nats_bus.replicas = 3
    try:
        with pytest.raises(BusError, match="node.stream_replicas"):
            await nats_bus.key_value("repl3kv")
        with pytest.raises(BusError, match="node.stream_replicas"):
            await nats_bus.object_store("repl3obj")
    finally:
        nats_bus.replicas = 1
    assert await nats_bus.ensure_stream(StreamSpec(name="REPL1", subjects=("repl1.>",), replicas=1))
    info = await nats_bus._jetstream().stream_info("REPL1")  # white-box: the server's config
    assert info.config.num_replicas == 1
    await nats_bus.delete_stream("REPL1")


async def test_memory_bus_and_run_streams_take_the_bus_replicas():
    bus = MemoryBus()
    await bus.connect()
    try:
        bus.replicas = 3
        await ensure_run_streams(bus, "repl")
        for kind in ("events", "work"):
            assert bus.stream_spec(m.stream_name("repl", kind)).replicas == 3
        await ensure_run_streams(bus, "repl", replicas=1)  # an explicit value wins
        assert bus.stream_spec(m.stream_name("repl", "work")).replicas == 1
        with pytest.raises(BusError, match="replicas"):
            await bus.ensure_stream(StreamSpec(name="BAD", subjects=("bad.>",), replicas=0))
    finally:
        await bus.close()


def test_bus_from_config_sets_replicas():
    cfg = RunConfig(nats="nats://127.0.0.1:4222", node=NodeConfig(stream_replicas=3))
    assert bus_from_config(cfg).replicas == 3
    assert bus_from_config(cfg.nats, replicas=2).replicas == 2
    assert bus_from_config("nats://127.0.0.1:4222").replicas == 1

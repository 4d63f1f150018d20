"""Bounded resources on every bus (issue 8 item 4): a stream's byte limit discards its
oldest messages, the run's events stream gets the configured limits, messages past the
payload limit are refused, and blobs past it travel chunked through the object store.

Parametrized over MemoryBus and NatsBus (a real nats-server from the session fixture).
"""

from __future__ import annotations

import os
import time
import uuid

import pytest

from rollart import messages as m
from rollart.bus import BusError, ConsumerSpec, StreamSpec
from rollart.node import ensure_run_streams


@pytest.fixture
def names():
    tag = uuid.uuid4().hex[:10]
    return f"L{tag}", f"l{tag}"


async def fetch_until(consumer, n, deadline=5.0, batch=50):
    out = []
    end = time.monotonic() + deadline
    while len(out) < n and time.monotonic() < end:
        out += await consumer.fetch(batch, timeout=min(0.5, max(0.05, end - time.monotonic())))
    return out


async def test_max_bytes_discards_the_oldest(bus, names):
    stream, p = names
    await bus.ensure_stream(StreamSpec(name=stream, subjects=(f"{p}.>",), max_bytes=8192))
    seqs = [await bus.publish(f"{p}.a", bytes([i]) * 1000, msg_id=f"{p}-{i}") for i in range(20)]
    info = await bus.stream_info(stream)
    assert 0 < info["bytes"] <= 8192
    assert 5 <= info["messages"] < 20  # ~1 KB each (plus subject, headers, record overhead)
    assert info["last_seq"] == seqs[-1] and info["first_seq"] == seqs[-1] - info["messages"] + 1
    c = await bus.pull_consumer(stream, ConsumerSpec(durable="all", filter_subject=f"{p}.a"))
    got = await fetch_until(c, info["messages"])
    assert [d.stream_seq for d in got] == seqs[-info["messages"]:]  # the newest survive
    assert [d.data[0] for d in got] == list(range(20 - info["messages"], 20))
    assert await c.fetch(10, timeout=0.2) == []


async def test_lowering_max_bytes_trims_at_once(bus, names):
    stream, p = names
    await bus.ensure_stream(StreamSpec(name=stream, subjects=(f"{p}.>",)))
    for i in range(10):
        await bus.publish(f"{p}.a", bytes(1000))
    assert (await bus.stream_info(stream))["messages"] == 10
    await bus.ensure_stream(StreamSpec(name=stream, subjects=(f"{p}.>",), max_bytes=3000))
    info = await bus.stream_info(stream)
    assert 1 <= info["messages"] <= 3 and info["bytes"] <= 3000 and info["last_seq"] == 10
    await bus.ensure_stream(StreamSpec(name=stream, subjects=(f"{p}.>",)))  # 0: no limit again
    for i in range(10):
        await bus.publish(f"{p}.a", bytes(1000))
    assert (await bus.stream_info(stream))["messages"] == info["messages"] + 10


async def test_discarded_messages_are_not_redelivered(bus, names):
    stream, p = names
    await bus.ensure_stream(StreamSpec(name=stream, subjects=(f"{p}.>",), max_bytes=4096))
    c = await bus.pull_consumer(stream, ConsumerSpec(durable="slow", filter_subject=f"{p}.a",
                                                     ack_wait=0.5))
    old = [await bus.publish(f"{p}.a", b"old" + bytes(1000)) for _ in range(2)]
    assert [d.stream_seq for d in await fetch_until(c, 2)] == old  # delivered, never acked
    new = [await bus.publish(f"{p}.a", b"new" + bytes(1000)) for _ in range(6)]
    assert (await bus.stream_info(stream))["first_seq"] > old[-1]  # pushed out
    seen = []
    end = time.monotonic() + 2.0  # past the old deliveries' ack_wait, several times
    while time.monotonic() < end:
        for d in await c.fetch(10, timeout=0.2):
            seen.append(d.stream_seq)
            await d.ack()
    assert not set(seen) & set(old)
    assert set(seen) <= set(new) and seen[-1] == new[-1]


async def test_run_events_stream_gets_its_limits(bus):
    run = f"lim{uuid.uuid4().hex[:8]}"
    await ensure_run_streams(bus, run, events_max_age=3600, events_max_bytes=4096)
    events, work = m.stream_name(run, "events"), m.stream_name(run, "work")
    subject = m.subject(run, "rollout.completed")
    for i in range(10):
        await bus.publish(subject, bytes(1000), msg_id=f"t{i}")
    info = await bus.stream_info(events)
    assert info["bytes"] <= 4096 and info["messages"] < 10 and info["last_seq"] == 10
    assert (await bus.stream_info(work))["messages"] == 0
    if bus.url.startswith("nats"):  # what the server holds (white-box: the raw JetStream context)
        cfg = (await bus._js.stream_info(events)).config
        assert (cfg.max_bytes, cfg.max_age) == (4096, 3600)
        assert (await bus._js.stream_info(work)).config.max_bytes in (-1, None)
        await ensure_run_streams(bus, run)  # the defaults (node.events_max_*)
        from rollart.config.schema import NodeConfig

        cfg = (await bus._js.stream_info(events)).config
        assert (cfg.max_bytes, cfg.max_age) == (NodeConfig().events_max_bytes or -1,
                                               NodeConfig().events_max_age)


async def test_default_limits_reserve_no_store(nats_bus):
    """nats-server reserves a stream's max_bytes up front (against max_file_store, 75% of the
    free disk by default): a default byte cap of several GiB let a server take only a few
    runs ("insufficient storage resources"). The default bounds by age and reserves nothing."""
    for _ in range(12):
        run = f"lim{uuid.uuid4().hex[:8]}"
        await ensure_run_streams(nats_bus, run)
        cfg = (await nats_bus._js.stream_info(m.stream_name(run, "events"))).config  # white-box
        assert cfg.max_bytes in (-1, None) and cfg.max_age > 0


async def test_default_limits_keep_every_message_of_a_normal_run(bus):
    """The defaults are far above what a run holds between checkpoints: nothing is dropped."""
    run = f"lim{uuid.uuid4().hex[:8]}"
    await ensure_run_streams(bus, run)
    for i in range(200):
        await bus.publish(m.subject(run, "rollout.completed"), os.urandom(20_000), msg_id=f"t{i}")
    info = await bus.stream_info(m.stream_name(run, "events"))
    assert (info["messages"], info["first_seq"], info["last_seq"]) == (200, 1, 200)


async def test_messages_past_the_payload_limit_are_refused(bus, names):
    stream, p = names
    await bus.ensure_stream(StreamSpec(name=stream, subjects=(f"{p}.>",)))
    big = bytes(2 * 1024 * 1024)
    with pytest.raises(BusError, match="MaxPayload"):
        await bus.publish(f"{p}.a", big)
    with pytest.raises(BusError, match="MaxPayload"):
        await bus.publish_core(f"{p}.core", big)
    assert (await bus.stream_info(stream))["messages"] == 0
    await bus.publish(f"{p}.a", bytes(512 * 1024))  # under the limit: stored


async def test_object_store_carries_blobs_past_the_payload_limit(bus, names):
    """Weights bigger than a message (nats-server's default max_payload is 1 MB) go through
    the object store, which chunks them."""
    store = await bus.object_store(f"W{names[0]}")
    blob = os.urandom(3 * 1024 * 1024 + 17)
    await store.put("v000001", blob)
    assert await store.get("v000001") == blob
    again = os.urandom(1024 * 1024 + 1)
    await store.put("v000001", again)  # replaced as a whole
    assert await store.get("v000001") == again

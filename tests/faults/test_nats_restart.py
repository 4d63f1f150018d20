"""kill -9 the nats-server and restart it on the same store and port.

Each test has its own server (never the session one). What must hold:
every publish that was acknowledged is delivered afterwards; a consumer loop, a
service subscription and a KV watch resume by themselves; nats-py errors during
the outage surface only as ``BusError``.
"""

from __future__ import annotations

import asyncio
import time

import pytest

from rollart.bus import BusError, ConsumerSpec, Retention, StreamSpec
from rollart.bus.nats import NatsBus
from rollart.bus.server import EmbeddedServer
from tests.waiting import until

pytestmark = pytest.mark.asyncio(loop_scope="session")


@pytest.fixture
def server(tmp_path):
    srv = EmbeddedServer(tmp_path / "nats")
    srv.start()
    try:
        yield srv
    finally:
        srv.stop()


async def publish_until_acked(bus, subject, data, msg_id, deadline=30.0):
    """Retry with backoff (same msg_id) until the server acknowledges."""
    end = time.monotonic() + deadline
    delay = 0.02
    while True:
        try:
            return await bus.publish(subject, data, msg_id=msg_id, timeout=1.0)
        except BusError:
            if time.monotonic() > end:
                raise
            await asyncio.sleep(delay)
            delay = min(delay * 2, 0.5)


async def test_acked_publishes_survive_kill9(server):
    async with NatsBus(server.url) as bus:
        await bus.ensure_stream(StreamSpec(name="RQ", subjects=("rq.>",), retention=Retention.WORKQUEUE))
        consumer = await bus.pull_consumer("RQ", ConsumerSpec(durable="workers", filter_subject="rq.job"))
        acked: list[int] = []
        failures: list[BaseException] = []
        restarted_at: list[int] = []  # len(acked) when the server came back

        async def publisher():
            # Publishes job 0, 1, 2, ... until 30 more were acked after the restart,
            # so the crash always lands while it is busy.
            i = 0
            while not (restarted_at and len(acked) >= restarted_at[0] + 30):
                try:
                    await bus.publish("rq.job", str(i).encode(), msg_id=f"job-{i}", timeout=1.0)
                    acked.append(i)
                    i += 1
                except BusError as err:  # anything else escapes and fails the test
                    failures.append(err)
                    await asyncio.sleep(0.05)  # then retry job i with the same msg_id

        task = asyncio.create_task(publisher())
        await until(lambda: len(acked) >= 40, deadline=10, what="40 acknowledged publishes")
        assert not task.done()
        server.kill()  # while the publisher is mid-flight
        acked_before_kill = set(acked)
        # The first failure is the publish in flight at the crash (lost); the second was
        # sent while disconnected, so nats-py buffers it and the server stores it after
        # the reconnect although the caller saw a timeout: only msg_id dedupes its retry.
        await until(
            lambda: len(failures) >= 2, deadline=10, what="two publishes to fail during the outage",
            state=lambda: f"(acked {len(acked)}, failures {failures}, publisher {task})",
        )
        assert all(isinstance(e, BusError) for e in failures)
        server.start()
        restarted_at.append(len(acked))
        await asyncio.wait_for(task, 60)
        n = len(acked)
        assert acked == list(range(n))

        seen: list[int] = []
        end = time.monotonic() + 20
        while len(set(seen)) < n and time.monotonic() < end:
            for d in await consumer.fetch(100, timeout=0.5):
                seen.append(int(d.data))
                await d.ack()
        assert acked_before_kill <= set(seen), "a publish acknowledged before the crash was lost"
        assert set(seen) == set(range(n))
        # retried publishes carried the same msg_id: each job is stored once
        assert sorted(seen) == list(range(n)), "a retried publish was stored twice"
        assert await consumer.fetch(10, timeout=0.3) == []


async def test_consumer_loop_resumes_after_kill9(server):
    async with NatsBus(server.url) as bus:
        await bus.ensure_stream(StreamSpec(name="EV", subjects=("ev.>",)))
        consumer = await bus.pull_consumer("EV", ConsumerSpec(durable="trainer", filter_subject="ev.done", ack_wait=2))
        received: set[bytes] = set()
        errors: list[BusError] = []
        stop = asyncio.Event()

        async def loop():
            while not stop.is_set():
                try:
                    batch = await consumer.fetch(10, timeout=0.3)
                except BusError as err:  # raw nats-py errors would kill the loop
                    errors.append(err)
                    await asyncio.sleep(0.05)
                    continue
                for d in batch:
                    received.add(d.data)
                    try:
                        await d.ack()
                    except BusError as err:
                        errors.append(err)

        task = asyncio.create_task(loop())
        for i in range(10):
            await bus.publish("ev.done", b"before-%d" % i, msg_id=f"b{i}")
        await until(lambda: len(received) == 10, deadline=10, what="the first 10 deliveries")

        server.kill()
        await until(lambda: not bus.connected, deadline=10, what="the client to notice the crash")
        server.start()
        await until(lambda: bus.connected, deadline=15, what="the client to reconnect by itself")
        for i in range(10):
            await publish_until_acked(bus, "ev.done", b"after-%d" % i, f"a{i}")
        want = {b"before-%d" % i for i in range(10)} | {b"after-%d" % i for i in range(10)}
        await until(lambda: received >= want, deadline=20, what="the loop to get the messages published after the restart")
        assert not task.done(), f"the consumer loop died: {task.exception() if task.done() else ''}"
        stop.set()
        await asyncio.wait_for(task, 5)
        info = await consumer.info()
        assert info["num_pending"] == 0


async def test_service_and_kv_watch_resume_after_kill9(server):
    async with NatsBus(server.url) as bus, NatsBus(server.url) as client:

        async def echo(req):
            await req.respond(b"echo:" + req.data)

        await bus.subscribe("svc.echo", echo, queue="echo")
        assert (await client.request("svc.echo", b"1", timeout=2)).data == b"echo:1"

        kv = await bus.key_value("POLICY")
        await kv.put("version", b"0")
        seen: list[bytes | None] = []

        async def watch():
            async for e in kv.watch("version"):
                seen.append(e.value)

        watcher = asyncio.create_task(watch())
        await until(lambda: seen == [b"0"], deadline=5, what="the current value")

        server.kill()
        server.start()
        await until(lambda: bus.connected and client.connected, deadline=15, what="both clients to reconnect")

        end = time.monotonic() + 15
        while True:
            try:
                reply = await client.request("svc.echo", b"2", timeout=1)
                break
            except BusError:
                if time.monotonic() > end:
                    raise
                await asyncio.sleep(0.05)
        assert reply.data == b"echo:2"

        writer = await client.key_value("POLICY")
        end = time.monotonic() + 15
        while True:
            try:
                await writer.put("version", b"1")
                break
            except BusError:
                if time.monotonic() > end:
                    raise
                await asyncio.sleep(0.05)
        # well under nats-py's own ~10 s heartbeat-based recovery of a lost watcher
        await until(lambda: seen[-1:] == [b"1"], deadline=4, what="the watch to see the write made after the restart")
        assert seen == [b"0", b"1"]
        watcher.cancel()

"""A NatsBus fetch hands over a message as soon as it is there, also while an earlier pull
is still open on the server (the server hands the message to the oldest pull, into the
same inbox).

Measured on a trainer run before the fix: nats-py's ``fetch(n)`` on an empty queue opens
a pull that lingers, and once a message came (handed to it or to an older pull left open
by an earlier fetch) it waited for ``n`` of them or for some pull's status: the last
completion of a step reached the trainer 0.1-0.45 s after it was stored (fetch timeout
0.5 s); in this test, 0.9 s."""

from __future__ import annotations

import asyncio
import json
import time
import uuid

from rollart.bus import ConsumerSpec, StreamSpec
from rollart.bus.nats import NatsBus
from rollart.bus.nats_consumers import NatsPullConsumer


async def test_a_message_is_handed_over_while_an_older_pull_is_open(nats_server):
    tag = uuid.uuid4().hex[:8]
    stream, subject = f"F{tag}", f"f{tag}.a"
    bus, pub = NatsBus(nats_server.url), NatsBus(nats_server.url)
    await bus.connect()
    await pub.connect()
    try:
        await bus.ensure_stream(StreamSpec(name=stream, subjects=(f"f{tag}.>",)))
        c = await bus.pull_consumer(stream, ConsumerSpec(durable="d", filter_subject=subject))
        assert isinstance(c, NatsPullConsumer)
        assert await c.fetch(8, timeout=0.05) == []  # bound, idle
        # what an earlier nats-py fetch leaves behind when a status of another pull ended
        # it: its lingering pull (no ``no_wait``), still open on the server for 1 s
        orphan = {"batch": 10, "expires": 1_000_000_000}
        await bus._client().publish(c._sub._nms, json.dumps(orphan).encode(),
                                    reply=c._sub._deliver)
        fetch_timeout = 2.0

        async def publish_later() -> float:
            await asyncio.sleep(0.1)  # the fetch below is waiting
            await pub.publish(subject, b"x")
            return time.monotonic()

        sent = asyncio.create_task(publish_later())
        got, end = [], time.monotonic() + 2 * fetch_timeout
        while not got and time.monotonic() < end:  # as the actor runtime does: fetch again
            got = await c.fetch(256, timeout=fetch_timeout)
        received = time.monotonic()
        assert [d.data for d in got] == [b"x"]
        lag = received - await sent
        assert lag < 0.25, f"the message waited {lag:.2f}s in a lingering pull"
        await got[0].ack()
    finally:
        await bus.close()
        await pub.close()

"""The bus contract: every implementation must pass every test here.

Parametrized over MemoryBus and NatsBus (a real nats-server from the session fixture).
Each test uses its own stream and subjects, so tests never see each other's messages.
"""

from __future__ import annotations

import asyncio
import dataclasses
import time
import uuid

import pytest

from rollart.bus import (BusError, BusTimeout, ConsumerSpec, DuplicateConflict, NoResponders, Retention,
                         StreamSpec)



@pytest.fixture
def names():
    tag = uuid.uuid4().hex[:10]
    return f"T{tag}", f"t{tag}"


async def _stream(bus, names, retention=Retention.LIMITS):
    stream, prefix = names
    await bus.ensure_stream(StreamSpec(name=stream, subjects=(f"{prefix}.>",), retention=retention))
    return stream, prefix


async def fetch_until(consumer, n, deadline=5.0, batch=10):
    """Fetch until ``n`` deliveries arrived or the deadline passed."""
    out = []
    end = time.monotonic() + deadline
    while len(out) < n and time.monotonic() < end:
        out += await consumer.fetch(batch, timeout=min(0.5, max(0.05, end - time.monotonic())))
    return out


async def test_publish_fetch_ack(bus, names):
    stream, p = await _stream(bus, names)
    seqs = [await bus.publish(f"{p}.a", f"m{i}".encode(), headers={"k": str(i)}) for i in range(3)]
    assert seqs == sorted(seqs) and len(set(seqs)) == 3
    c = await bus.pull_consumer(stream, ConsumerSpec(durable="d1", filter_subject=f"{p}.a"))
    got = await fetch_until(c, 3)
    assert [d.data for d in got] == [b"m0", b"m1", b"m2"]
    assert [d.headers.get("k") for d in got] == ["0", "1", "2"]
    assert [d.stream_seq for d in got] == seqs
    assert all(d.num_delivered == 1 and d.subject == f"{p}.a" for d in got)
    for d in got:
        await d.ack()
    assert await c.fetch(10, timeout=0.3) == []
    info = await c.info()
    assert info["num_pending"] == 0 and info["num_ack_pending"] == 0


async def test_a_delivery_says_when_its_message_was_stored(bus, names):
    """``stored_at`` is the stream's wall-clock time of the message (the queue wait that traces
    record): between the publish's start and end, and the same on a redelivery."""
    stream, p = await _stream(bus, names)
    before = time.time()
    await bus.publish(f"{p}.a", b"x")
    after = time.time()
    c = await bus.pull_consumer(stream, ConsumerSpec(durable="d1", filter_subject=f"{p}.a"))
    (d,) = await fetch_until(c, 1)
    assert before - 0.01 <= d.stored_at <= after + 0.01, (before, d.stored_at, after)
    await d.nak()
    (again,) = await fetch_until(c, 1)
    assert again.num_delivered == 2 and again.stored_at == pytest.approx(d.stored_at, abs=1e-6)
    await again.ack()


async def test_an_idle_durable_with_an_inactive_threshold_is_deleted(bus, names):
    """The server deletes a durable nobody fetched from for ``inactive_threshold`` seconds;
    one that is fetched from, and one without a threshold, stay; the messages stay."""
    stream, p = await _stream(bus, names)
    await bus.publish(f"{p}.a", b"x")
    await bus.pull_consumer(stream, ConsumerSpec(durable="idle", filter_subject=f"{p}.a",
                                                 inactive_threshold=1.0))
    busy = await bus.pull_consumer(stream, ConsumerSpec(durable="busy", filter_subject=f"{p}.a",
                                                        inactive_threshold=1.0))
    await bus.pull_consumer(stream, ConsumerSpec(durable="kept", filter_subject=f"{p}.a"))
    names_now: list[str] = []
    end = time.monotonic() + 20
    while time.monotonic() < end:
        for d in await busy.fetch(1, timeout=0.3):
            await d.ack()
        names_now = sorted(x["name"] for x in await bus.consumers_info(stream))
        if "idle" not in names_now:
            break
    assert names_now == ["busy", "kept"], names_now
    assert (await bus.stream_info(stream))["messages"] == 1


async def test_filter_subject_only_sees_its_subject(bus, names):
    stream, p = await _stream(bus, names)
    await bus.publish(f"{p}.x", b"x")
    await bus.publish(f"{p}.y", b"y")
    c = await bus.pull_consumer(stream, ConsumerSpec(durable="dx", filter_subject=f"{p}.x"))
    got = await fetch_until(c, 2, deadline=1.0)
    assert [d.data for d in got] == [b"x"]


async def test_nak_with_delay_redelivers_after_delay(bus, names):
    stream, p = await _stream(bus, names)
    await bus.publish(f"{p}.a", b"one")
    c = await bus.pull_consumer(stream, ConsumerSpec(durable="d", filter_subject=f"{p}.a", ack_wait=10))
    (d,) = await fetch_until(c, 1)
    t0 = time.monotonic()
    await d.nak(delay=0.6)
    again = await fetch_until(c, 1, deadline=5)
    elapsed = time.monotonic() - t0
    assert len(again) == 1 and again[0].data == b"one" and again[0].num_delivered == 2
    assert elapsed >= 0.45, f"redelivered after {elapsed:.3f}s, before the 0.6s nak delay"
    await again[0].ack()


async def test_nak_without_delay_redelivers_now(bus, names):
    stream, p = await _stream(bus, names)
    await bus.publish(f"{p}.a", b"one")
    c = await bus.pull_consumer(stream, ConsumerSpec(durable="d", filter_subject=f"{p}.a", ack_wait=30))
    (d,) = await fetch_until(c, 1)
    await d.nak()
    again = await fetch_until(c, 1, deadline=3)
    assert len(again) == 1 and again[0].num_delivered == 2


async def test_term_is_never_redelivered(bus, names):
    stream, p = await _stream(bus, names)
    await bus.publish(f"{p}.a", b"bad")
    await bus.publish(f"{p}.a", b"good")
    c = await bus.pull_consumer(stream, ConsumerSpec(durable="d", filter_subject=f"{p}.a", ack_wait=0.3))
    got = await fetch_until(c, 2)
    await got[0].term()
    await got[1].ack()
    # wait past several ack_wait periods: nothing may come back
    assert await fetch_until(c, 1, deadline=1.2) == []


async def test_ack_wait_redelivery(bus, names):
    stream, p = await _stream(bus, names)
    await bus.publish(f"{p}.a", b"slow")
    c = await bus.pull_consumer(stream, ConsumerSpec(durable="d", filter_subject=f"{p}.a", ack_wait=0.4))
    (d,) = await fetch_until(c, 1)
    t0 = time.monotonic()
    again = await fetch_until(c, 1, deadline=5)
    assert len(again) == 1 and again[0].data == b"slow" and again[0].num_delivered == 2
    assert time.monotonic() - t0 >= 0.3
    await again[0].ack()
    await d.ack()  # a late ack on the old delivery is harmless


async def test_in_progress_prevents_redelivery(bus, names):
    stream, p = await _stream(bus, names)
    await bus.publish(f"{p}.a", b"long")
    c = await bus.pull_consumer(stream, ConsumerSpec(durable="d", filter_subject=f"{p}.a", ack_wait=0.5))
    (d,) = await fetch_until(c, 1)
    end = time.monotonic() + 1.6  # > 3 ack_wait periods
    redelivered = []
    while time.monotonic() < end:
        await d.in_progress()
        redelivered += await c.fetch(1, timeout=0.15)
    assert redelivered == []
    await d.ack()
    assert await fetch_until(c, 1, deadline=0.8) == []


async def test_max_deliver_stops_redelivery(bus, names):
    stream, p = await _stream(bus, names)
    await bus.publish(f"{p}.a", b"poison")
    c = await bus.pull_consumer(
        stream, ConsumerSpec(durable="d", filter_subject=f"{p}.a", ack_wait=0.25, max_deliver=2)
    )
    first = await fetch_until(c, 1)
    second = await fetch_until(c, 1, deadline=3)
    assert [d.num_delivered for d in first + second] == [1, 2]
    assert await fetch_until(c, 1, deadline=1.0) == []
    assert (await bus.stream_info(stream))["messages"] == 1  # still stored in a limits stream


async def test_rebind_with_new_ack_wait_updates_the_durable(bus, names):
    """A resumed run with a new ack_wait must get it (not the stored durable's old one)."""
    stream, p = await _stream(bus, names, Retention.WORKQUEUE)
    spec = ConsumerSpec(durable="d", filter_subject=f"{p}.a", ack_wait=30, max_deliver=5,
                        max_ack_pending=100)
    await bus.pull_consumer(stream, spec)
    c = await bus.pull_consumer(
        stream, dataclasses.replace(spec, ack_wait=1, max_deliver=7, max_ack_pending=50))
    await bus.publish(f"{p}.a", b"slow")
    (d,) = await fetch_until(c, 1)
    t0 = time.monotonic()
    again = await fetch_until(c, 1, deadline=10)
    elapsed = time.monotonic() - t0
    assert len(again) == 1 and again[0].num_delivered == 2, "the new ack_wait=1 was not applied"
    assert 0.6 <= elapsed < 8, f"redelivered after {elapsed:.2f}s, want ~1s"
    await again[0].ack()


async def test_new_ack_wait_applies_to_outstanding_deliveries(bus, names):
    stream, p = await _stream(bus, names)
    spec = ConsumerSpec(durable="d", filter_subject=f"{p}.a", ack_wait=30)
    c = await bus.pull_consumer(stream, spec)
    await bus.publish(f"{p}.a", b"held")
    (d,) = await fetch_until(c, 1)
    t0 = time.monotonic()
    await bus.pull_consumer(stream, dataclasses.replace(spec, ack_wait=1))
    again = await fetch_until(c, 1, deadline=10)
    assert len(again) == 1 and again[0].num_delivered == 2
    assert time.monotonic() - t0 < 8
    await again[0].ack()


@pytest.mark.parametrize("change", [{"filter_subject": "b"}, {"deliver_all": False}])
async def test_rebind_with_a_fixed_setting_changed_is_an_error(bus, names, change):
    stream, p = await _stream(bus, names)
    spec = ConsumerSpec(durable="fixed", filter_subject=f"{p}.a")
    await bus.pull_consumer(stream, spec)
    if "filter_subject" in change:
        change = {"filter_subject": f"{p}.{change['filter_subject']}"}
    (setting,) = change
    with pytest.raises(BusError, match=rf"'fixed'.*{setting}"):
        await bus.pull_consumer(stream, dataclasses.replace(spec, **change))
    await bus.pull_consumer(stream, spec)  # the same settings still bind


async def test_dedupe_by_msg_id(bus, names):
    stream, p = await _stream(bus, names)
    s1 = await bus.publish(f"{p}.a", b"x", msg_id="same")
    s2 = await bus.publish(f"{p}.a", b"x", msg_id="same")
    s3 = await bus.publish(f"{p}.a", b"y", msg_id="other")
    assert s1 == s2 and s3 != s1
    assert (await bus.stream_info(stream))["messages"] == 2


async def test_publish_once_tells_a_retry_from_someone_elses_message(bus, names):
    """The same bytes again under a msg id: the first sequence (a retry); other bytes that
    got there first under the id: DuplicateConflict with the stored sequence."""
    stream, p = await _stream(bus, names)
    s1 = await bus.publish_once(f"{p}.a", b"mine", msg_id="out:t1")
    assert await bus.publish_once(f"{p}.a", b"mine", msg_id="out:t1") == s1
    forged = await bus.publish(f"{p}.a", b"forged", msg_id="out:t2")
    with pytest.raises(DuplicateConflict) as ei:
        await bus.publish_once(f"{p}.a", b"mine", msg_id="out:t2")
    assert ei.value.seq == forged and isinstance(ei.value, BusError)
    assert (await bus.stream_info(stream))["messages"] == 2


async def test_workqueue_replicas_share_one_durable(bus, names):
    stream, p = await _stream(bus, names, Retention.WORKQUEUE)
    for i in range(20):
        await bus.publish(f"{p}.job", str(i).encode())
    spec = ConsumerSpec(durable="workers", filter_subject=f"{p}.job", ack_wait=30)
    a = await bus.pull_consumer(stream, spec)
    b = await bus.pull_consumer(stream, spec)
    seen = []
    end = time.monotonic() + 5
    while len(seen) < 20 and time.monotonic() < end:
        for c in (a, b):
            for d in await c.fetch(3, timeout=0.2):
                seen.append(d.data)
                await d.ack()
    assert sorted(seen, key=int) == [str(i).encode() for i in range(20)]
    # acked work is removed from a work-queue stream
    end = time.monotonic() + 3
    while (await bus.stream_info(stream))["messages"] and time.monotonic() < end:
        await asyncio.sleep(0.02)
    assert (await bus.stream_info(stream))["messages"] == 0


async def test_max_ack_pending_backpressure(bus, names):
    stream, p = await _stream(bus, names)
    for i in range(5):
        await bus.publish(f"{p}.a", str(i).encode())
    c = await bus.pull_consumer(
        stream, ConsumerSpec(durable="d", filter_subject=f"{p}.a", max_ack_pending=2, ack_wait=30)
    )
    first = await fetch_until(c, 5, deadline=1.0)
    assert len(first) == 2, "max_ack_pending=2 must hold back the rest"
    for d in first:
        await d.ack()
    rest = await fetch_until(c, 3, deadline=3)
    assert len(rest) == 2
    assert [d.data for d in first + rest] == [b"0", b"1", b"2", b"3"]


async def test_deliver_new_only(bus, names):
    stream, p = await _stream(bus, names)
    await bus.publish(f"{p}.a", b"old")
    c = await bus.pull_consumer(
        stream, ConsumerSpec(durable="d", filter_subject=f"{p}.a", deliver_all=False)
    )
    await bus.publish(f"{p}.a", b"new")
    got = await fetch_until(c, 2, deadline=1.0)
    assert [d.data for d in got] == [b"new"]


async def test_request_reply_and_queue_group_balancing(bus, names):
    _, p = names
    counts = {"a": 0, "b": 0}

    def server(name):
        async def handle(req):
            counts[name] += 1
            await req.respond(name.encode() + b":" + req.data, headers={"replica": name})
        return handle

    subs = [await bus.subscribe(f"{p}.svc", server(n), queue="q") for n in counts]
    replies = await asyncio.gather(
        *[bus.request(f"{p}.svc", str(i).encode(), timeout=5) for i in range(40)]
    )
    assert sorted(int(r.data.split(b":")[1]) for r in replies) == list(range(40))
    assert all(r.data.split(b":")[0].decode() == r.headers.get("replica") for r in replies)
    assert sum(counts.values()) == 40, "each request is handled by exactly one replica"
    assert min(counts.values()) > 0, f"no load balancing: {counts}"
    for s in subs:
        await s.unsubscribe()


async def test_request_timeout_and_no_responders(bus, names):
    _, p = names
    with pytest.raises(NoResponders):
        await bus.request(f"{p}.nobody", b"x", timeout=1)

    async def silent(req):
        return None

    sub = await bus.subscribe(f"{p}.silent", silent)
    t0 = time.monotonic()
    with pytest.raises(BusTimeout):
        await bus.request(f"{p}.silent", b"x", timeout=0.3)
    assert time.monotonic() - t0 < 2
    await sub.unsubscribe()


async def test_publish_core_fanout(bus, names):
    _, p = names
    got = {"a": [], "b": []}

    def sink(name):
        async def handle(req):
            got[name].append(req.data)
        return handle

    subs = [await bus.subscribe(f"{p}.ev.*", sink(n)) for n in got]
    await bus.publish_core(f"{p}.ev.one", b"1")
    end = time.monotonic() + 3
    while not (got["a"] and got["b"]) and time.monotonic() < end:
        await asyncio.sleep(0.01)
    assert got == {"a": [b"1"], "b": [b"1"]}
    for s in subs:
        await s.unsubscribe()


async def test_kv_get_put_watch(bus, names):
    _, p = names
    kv = await bus.key_value(f"KV{p}")
    assert await kv.get("policy_version") is None
    r1 = await kv.put("policy_version", b"0")
    got = await kv.get("policy_version")
    assert got.value == b"0" and got.revision == r1
    seen = []
    done = asyncio.Event()

    async def watch():
        async for e in kv.watch("policy_version"):
            seen.append(e)
            if len(seen) == 3:
                done.set()
                break

    task = asyncio.ensure_future(watch())
    end = time.monotonic() + 3
    while not seen and time.monotonic() < end:
        await asyncio.sleep(0.01)
    assert seen and seen[0].value == b"0", "watch starts with the current value"
    r2 = await kv.put("policy_version", b"1")
    await kv.delete("policy_version")
    await asyncio.wait_for(done.wait(), 5)
    await task
    assert r2 > r1
    assert seen[1].value == b"1" and seen[1].revision == r2
    assert seen[2].deleted
    assert await kv.get("policy_version") is None
    assert await kv.get("other") is None


async def test_kv_watch_sees_every_change_of_a_burst(bus, names):
    """A watch lags the writer; no revision it has not delivered yet may be lost. (With one
    revision kept per key, NATS dropped the middle of put-put-delete about 1% of the time
    under load, and the middle of a 12-put burst every time.)"""
    _, p = names
    kv = await bus.key_value(f"KV{p}")
    await kv.put("k", b"start")
    it = kv.watch("k").__aiter__()
    try:
        first = await asyncio.wait_for(it.__anext__(), 5)
        assert first.value == b"start"
        revs = await asyncio.gather(*[kv.put("k", str(i).encode()) for i in range(12)])
        seen = []
        while not seen or seen[-1].revision < max(revs):
            seen.append(await asyncio.wait_for(it.__anext__(), 5))
        assert [e.revision for e in seen] == sorted(revs)
        assert sorted(int(e.value) for e in seen) == list(range(12))
    finally:
        await it.aclose()


async def test_object_store_blobs(bus, names):
    _, p = names
    store = await bus.object_store(f"OBJ{p}")
    blob = bytes(range(256)) * (3 * 4096)  # 3 MiB
    await store.put("weights-v1", blob)
    assert await store.get("weights-v1") == blob
    await store.put("weights-v1", b"small")
    assert await store.get("weights-v1") == b"small"
    await store.delete("weights-v1")
    with pytest.raises(KeyError):
        await store.get("weights-v1")


async def test_an_object_whose_chunks_vanish_mid_read_fails_instead_of_hanging(nats_bus, names):
    """nats-py's own object read waits forever for a chunk that never comes (a trainer with
    ``keep_weights: 1`` purged the object while a replica read it: the replica then never
    loaded another version). The bus gives up after ``object_stall_s`` without a chunk."""
    from rollart.bus.base import BusTimeout

    _, p = names
    store = await nats_bus.object_store(f"OBJ{p}")
    await store.put("w", bytes(range(256)) * 4096)  # 1 MiB: 8 chunks
    info = await store._obs.get_info("w")  # white-box: nats-py's store, to purge the chunks
    # The chunks go, the meta stays: what a reader that got the meta just before a purge sees.
    await nats_bus._js.purge_stream(f"OBJ_OBJ{p}", subject=f"$O.OBJ{p}.C.{info.nuid}")
    nats_bus.object_stall_s = 0.5
    t0 = time.monotonic()
    with pytest.raises(BusTimeout, match="no chunk"):
        await asyncio.wait_for(store.get("w"), 10)
    assert time.monotonic() - t0 < 5
    await store.delete("w")  # meta gone too: a missing object, at once
    with pytest.raises(KeyError):
        await asyncio.wait_for(store.get("w"), 5)
    await store.put("w", b"again")
    assert await store.get("w") == b"again"


async def test_consumers_info_reports_pending_ack_pending_redelivered(bus, names):
    """``consumers_info`` (what ``rollart top`` shows of each consumer) agrees between the
    buses: published N, fetched k without ack, one acked, one nak'd and redelivered."""
    stream, p = await _stream(bus, names)
    seqs = [await bus.publish(f"{p}.a", f"m{i}".encode()) for i in range(5)]
    await bus.publish(f"{p}.b", b"not for the filter")
    c = await bus.pull_consumer(stream, ConsumerSpec(durable="dq", filter_subject=f"{p}.a", ack_wait=30))

    async def settles(**want):
        """The consumer's info once it shows ``want`` (acks travel asynchronously)."""
        end = time.monotonic() + 5
        while True:
            (info,) = await bus.consumers_info(stream)
            if all(info[k] == v for k, v in want.items()) or time.monotonic() > end:
                assert {k: info[k] for k in want} == want
                return info

    info = await settles(num_pending=5, num_ack_pending=0, num_redelivered=0,
                         delivered_stream_seq=0, ack_floor_stream_seq=0)
    assert info["name"] == "dq" and info["filter_subject"] == f"{p}.a"
    first, second = await fetch_until(c, 2, batch=2)
    await settles(num_pending=3, num_ack_pending=2, num_redelivered=0,
                  delivered_stream_seq=seqs[1])
    await first.ack()
    await second.nak()
    (again,) = await fetch_until(c, 1, batch=1)
    assert again.stream_seq == seqs[1] and again.num_delivered == 2
    await settles(num_pending=3, num_ack_pending=1, num_redelivered=1,
                  delivered_stream_seq=seqs[1], ack_floor_stream_seq=seqs[0])
    await again.ack()
    rest = await fetch_until(c, 3, batch=3)
    for d in rest:
        await d.ack()
    await settles(num_pending=0, num_ack_pending=0, num_redelivered=0,
                  delivered_stream_seq=seqs[4], ack_floor_stream_seq=seqs[4])
    with pytest.raises(BusError):
        await bus.consumers_info(f"{stream}NONE")

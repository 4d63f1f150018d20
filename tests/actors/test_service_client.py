"""ServiceClient and ProgressReporter: missing replicas are waited for, lost ones are
noticed within seconds, stopping ones hand their queued requests back, errors are bounded."""

from __future__ import annotations

import asyncio
import time
from contextlib import asynccontextmanager
from dataclasses import dataclass

import pytest

from rollart import messages as m
from rollart.actors.kernel.base import Actor, Reject, serve
from rollart.actors.kernel.service import ERROR_KIND_HEADER, REPLICA_HEADER
from rollart.actors.kernel import service_client
from rollart.actors.kernel.service_client import ServiceClient
from rollart.actors.kernel.progress import ProgressReporter
from rollart.bus.codec import encode
from rollart.node import Node
from tests.actors.sample_actors import new_run
from tests.waiting import until


FOREVER = 3600.0


@dataclass(kw_only=True, eq=False)
class FakeGen(Actor):
    """A generate replica without an engine. ``mode``: ``ok`` answers after ``delay``;
    ``silent`` takes the request and stops reporting (as if killed); ``noclaim`` reports
    but never lists (nor answers) what it takes (as if it died before its next report);
    ``error`` answers an error; ``held`` answers once ``released`` is set."""

    role = "generate"
    mode: str = "ok"
    delay: float = 0.0
    got: int = 0

    async def setup(self) -> None:
        self.reporter = ProgressReporter(self, "generate.request", every=0.1)
        if self.mode != "noclaim":
            self.progress = self.reporter  # the runtime lists held requests in its reports
        self.frozen = asyncio.Event()
        self.released = asyncio.Event()

    async def teardown(self) -> None:
        self.released.set()  # let hanging handlers end with the node

    async def main(self) -> None:
        while not self.frozen.is_set():
            await self.reporter.report()
            try:
                await asyncio.wait_for(self.frozen.wait(), self.reporter.every)
            except TimeoutError:
                pass
        await asyncio.sleep(FOREVER)

    @serve("generate.request", max_inflight=1)
    async def generate(self, req: m.GenerateRequest) -> m.GenerateResult:
        self.got += 1
        if self.mode in ("noclaim", "held"):
            await self.released.wait()
        if self.mode == "error":
            raise ValueError("prompt too long")
        if self.mode == "silent":
            self.frozen.set()
            await self.released.wait()
        await asyncio.sleep(self.delay)
        return m.GenerateResult(token_ids=[len(req.prompt_ids)], logprobs=[-0.5], version=0,
                                replica=self.name)


@dataclass(kw_only=True, eq=False)
class Caller(Actor):
    role = "caller"


@asynccontextmanager
async def client_on(bus, run: str, **kw):
    actor = Caller(run=run, name="caller")
    actor.bus = bus
    client = ServiceClient(actor, **{"timeout": 30.0, "wait": 30.0, "retries": 2,
                                     "replica_timeout": 0.5, **kw})
    await client.start()
    sweeper = asyncio.ensure_future(client.run())
    try:
        yield client
    finally:
        sweeper.cancel()
        await client.stop()


def gen_req(i: int = 0) -> m.GenerateRequest:
    return m.GenerateRequest(traj_id=f"t{i}", prompt_ids=[1] * (i + 1))


async def test_a_missing_pool_is_waited_for_and_wakes_when_a_replica_reports(bus, monkeypatch):
    # between attempts the client sleeps for an hour: only a replica's report can wake it
    monkeypatch.setattr(service_client, "backoff", lambda *a, **kw: FOREVER)
    run = new_run()
    async with client_on(bus, run, wait=FOREVER) as client:
        call = asyncio.ensure_future(client.call("generate.request", gen_req(2)))
        await until(lambda: client.waits().get(("generate.request", "default"), (0, 0))[1] > 2.5,
                    deadline=30, what="a wait longer than the old retry budget")
        assert not call.done()
        gen = FakeGen(run=run, name="late")
        async with Node(bus, [gen], heartbeat_every=0, grace=0.5):
            res = await asyncio.wait_for(call, 60)
        assert res.token_ids == [3] and res.replica == "late"
        assert client.waits() == {}


async def test_no_replica_until_the_deadline_is_a_service_unavailable_reject(memory_bus_only):
    async with client_on(memory_bus_only, new_run(), wait=1.0, timeout=FOREVER) as client:
        t0 = time.monotonic()
        with pytest.raises(Reject, match=r"^service_unavailable: no generate replica in pool 'default'"
                                         r" answered for t0 for \d+s \(rollout.service_wait\)"):
            await asyncio.wait_for(client.call("generate.request", gen_req(), what=" for t0"), 60)
        assert time.monotonic() - t0 >= 1.0  # it waited ``wait``, and gave up after it


async def test_requests_before_any_replica_leave_no_unretrieved_error(bus):
    # a node that starts before its generate replicas meets "no responders" on each try;
    # every such error is the client's to read (asyncio logged "Future exception was never
    # retrieved" once per try, 517 lines in one quickstart run)
    import gc
    loop = asyncio.get_running_loop()
    unretrieved: list[str] = []
    old = loop.get_exception_handler()
    loop.set_exception_handler(lambda lp, ctx: unretrieved.append(ctx.get("message", "")))
    try:
        run = new_run()
        async with client_on(bus, run, wait=FOREVER) as client:
            call = asyncio.ensure_future(client.call("generate.request", gen_req(1)))
            await until(lambda: client.waits().get(("generate.request", "default"), (0, 0))[1] > 0.5,
                        deadline=30, what="tries without a replica")
            async with Node(bus, [FakeGen(run=run, name="late")], heartbeat_every=0, grace=0.5):
                assert (await asyncio.wait_for(call, 60)).replica == "late"
        gc.collect()
        await asyncio.sleep(0)  # let a collected future's handler call run
    finally:
        loop.set_exception_handler(old)
    assert not [u for u in unretrieved if "never retrieved" in u], unretrieved


@pytest.mark.parametrize("mode", ["silent", "noclaim"])
async def test_a_request_on_a_lost_replica_is_sent_again_within_the_replica_timeout(bus, mode):
    run = new_run()
    bad = FakeGen(run=run, name="bad", mode=mode)
    good = FakeGen(run=run, name="good")
    counts: dict[str, int] = {}

    def count(key: str) -> None:
        counts[key] = counts.get(key, 0) + 1

    # an attempt's own timeout never runs out here: a request the bad replica took comes
    # back only because the client noticed it was lost (within replica_timeout)
    async with client_on(bus, run, timeout=FOREVER, count=count) as client:
        async with Node(bus, [bad], heartbeat_every=0, grace=0.2):
            async with Node(bus, [good], heartbeat_every=0, grace=0.2):
                await until(lambda: len(client.replicas()) == 2, deadline=30,
                            what="both replicas report")
                calls = [asyncio.ensure_future(client.call("generate.request", gen_req(i)))
                         for i in range(6)]

                def bad_took_one() -> bool:
                    # a queue group picks its member at random: six requests may all miss
                    # the bad replica, so one more goes out each poll until it has taken one
                    if bad.got == 0:
                        calls.append(asyncio.ensure_future(
                            client.call("generate.request", gen_req(len(calls)))))
                    return bad.got >= 1

                await until(bad_took_one, deadline=60, step=0.05,
                            what="the bad replica to take a request")
                results = await asyncio.wait_for(asyncio.gather(*calls), 120)
    assert bad.got >= 1, "some request went to the bad replica"
    assert {r.replica for r in results} == {"good"}
    assert counts.get("requests_resent", 0) >= bad.got, counts


async def test_a_stopping_replica_hands_queued_requests_back_at_once(bus):
    run = new_run()
    slow = FakeGen(run=run, name="slow", mode="held")  # answers once released
    fast = FakeGen(run=run, name="fast")
    async with client_on(bus, run) as client:
        slow_node = Node(bus, [slow], heartbeat_every=0, grace=30.0)
        await slow_node.start()
        calls = [asyncio.ensure_future(client.call("generate.request", gen_req(i))) for i in range(3)]
        await until(lambda: slow.got >= 1, deadline=30, what="the slow replica to start one")
        async with Node(bus, [fast], heartbeat_every=0, grace=0.2):
            drain = asyncio.ensure_future(slow_node.stop_and_drain())
            # the queued two move at once: served while the one in flight is still held
            await until(lambda: sum(c.done() for c in calls) >= 2, deadline=60,
                        what="the queued requests to be served elsewhere")
            assert not slow.released.is_set()
            slow.released.set()
            results = await asyncio.wait_for(asyncio.gather(*calls), 60)
            await asyncio.wait_for(drain, 60)
    assert sorted(r.replica for r in results)[:2] == ["fast", "fast"]
    assert slow_node.services[0].stats.naked == 2, "both queued requests were handed back"


async def test_a_stopping_service_answers_unavailable(memory_bus_only):
    bus, run = memory_bus_only, new_run()
    slow = FakeGen(run=run, name="slow", delay=1.0)
    node = Node(bus, [slow], heartbeat_every=0, grace=5.0)
    await node.start()
    subject = m.subject(run, "generate.request", "default")
    reqs = [asyncio.ensure_future(bus.request(subject, encode(gen_req(i)), timeout=10)) for i in range(3)]
    await until(lambda: slow.got >= 1, deadline=30, what="the replica to take a request")
    await node.stop_and_drain()
    reps = await asyncio.gather(*reqs)
    kinds = sorted(r.headers.get(ERROR_KIND_HEADER, "ok") for r in reps)
    assert kinds == ["ok", "unavailable", "unavailable"]


async def test_error_answers_are_retried_then_rejected(memory_bus_only):
    run = new_run()
    bad = FakeGen(run=run, name="bad", mode="error")
    async with client_on(memory_bus_only, run, retries=2) as client:
        async with Node(memory_bus_only, [bad], heartbeat_every=0, grace=0.2):
            with pytest.raises(Reject, match=r"^service_error: generate.request for t0 failed 3 times;"
                                             r" last error: ValueError: prompt too long"):
                await client.call("generate.request", gen_req(), what=" for t0")
    assert bad.got == 3


async def test_progress_reports_list_held_requests(memory_bus_only):
    bus, run = memory_bus_only, new_run()
    seen: list[m.ServiceProgress] = []

    async def on(req):
        from rollart.bus.codec import decode

        seen.append(decode(m.ServiceProgress, req.data))

    sub = await bus.subscribe(m.subject(run, "service.progress"), on)
    a = Caller(run=run, name="gen-0")
    a.bus = bus
    rep = ProgressReporter(a, "generate.request", every=0.05)
    with rep.hold("r1"), rep.hold("r2"):
        await rep.report()
    await rep.report()
    await until(lambda: len(seen) == 2, deadline=30, what="both progress reports")
    await sub.unsubscribe()
    assert seen[0].request_ids == ["r1", "r2"] and seen[1].request_ids == []
    assert seen[0].replica.startswith("gen-0@") and seen[0].pool == "default"


class SlowEngine:
    """An engine whose batches take ``delay`` seconds (in the proxy's worker thread)."""

    version = 0

    def __init__(self, delay: float) -> None:
        self.delay = delay

    def generate(self, inputs):
        from rollart.engines.base import GenOutput

        time.sleep(self.delay)
        return [GenOutput(token_ids=[7], logprobs=[-0.1], finish_reason="stop") for _ in inputs]


async def test_a_stopping_llm_proxy_answers_every_request(memory_bus_only):
    """Nothing it took is left to time out: each request gets a result or `unavailable`."""
    from rollart.actors.generate.proxy import LLMProxy

    bus, run = memory_bus_only, new_run()
    proxy = LLMProxy(run=run, model_dir="unused", engine_obj=SlowEngine(0.5), max_batch=1,
                     gather_ms=0.0)
    node = Node(bus, [proxy], heartbeat_every=0, grace=5.0)
    await node.start()
    subject = m.subject(run, "generate.request", "default")
    reqs = [asyncio.ensure_future(bus.request(subject, encode(gen_req(i)), timeout=30))
            for i in range(3)]
    await until(lambda: proxy.batcher.busy_s > 0 or len(proxy.progress.held) == 3,
                deadline=30, what="the proxy to hold the requests")
    await node.stop_and_drain()
    # each request got its answer (not its 30 s timeout, which would raise here)
    reps = await asyncio.wait_for(asyncio.gather(*reqs), 60)
    for r in reps:
        assert r.headers.get(ERROR_KIND_HEADER) == "unavailable" or set(r.headers) <= {
            REPLICA_HEADER}, r.headers  # a result names only the replica that answered


# -- local calls (rollout.local_calls) --------------------------------------------------
async def _spy(bus, run: str) -> list:
    """Every generate request that crosses the bus (a plain subscription beside the queue group)."""
    seen: list = []

    async def on(req) -> None:
        seen.append(req.subject)

    await bus.subscribe(m.subject(run, "generate.request", "default"), on)
    return seen


async def test_the_only_replica_in_this_process_is_called_without_the_bus(bus):
    run = new_run()
    seen = await _spy(bus, run)
    counts: dict[str, int] = {}
    gen = FakeGen(run=run, name="here")
    async with Node(bus, [gen], heartbeat_every=0, grace=0.5):
        async with client_on(bus, run, local=True,
                             count=lambda k: counts.__setitem__(k, counts.get(k, 0) + 1)) as client:
            res = await client.call("generate.request", gen_req(2))
            assert res.token_ids == [3] and res.replica == "here" and gen.got == 1
            assert counts.get("local_calls") == 1 and seen == []
        async with client_on(bus, run, local=False) as client:  # the switch off: through the bus
            assert (await client.call("generate.request", gen_req(1))).token_ids == [2]
            await until(lambda: len(seen) == 1, deadline=30, what="the request on the bus")
    assert gen.got == 2


async def test_two_replicas_in_this_process_are_balanced_by_the_bus(memory_bus_only):
    bus, run = memory_bus_only, new_run()
    seen = await _spy(bus, run)
    a, b = FakeGen(run=run, name="a"), FakeGen(run=run, name="b")
    async with Node(bus, [a, b], heartbeat_every=0, grace=0.5):
        async with client_on(bus, run, local=True) as client:
            for i in range(4):
                await client.call("generate.request", gen_req(i))
    assert len(seen) == 4 and a.got == b.got == 2  # the MemoryBus hands them round robin


async def test_a_replica_elsewhere_in_the_pool_sends_local_calls_to_the_bus(nats_bus, nats_server):
    # two connections to one nats-server stand for two processes: "there" reports progress
    from rollart.bus.nats import NatsBus

    run = new_run()
    here_bus, there_bus = nats_bus, NatsBus(nats_server.url)
    await there_bus.connect()
    try:
        seen = await _spy(here_bus, run)
        here, there = FakeGen(run=run, name="here"), FakeGen(run=run, name="there")
        async with Node(here_bus, [here], heartbeat_every=0, grace=0.5):
            async with client_on(here_bus, run, local=True) as client:
                assert (await client.call("generate.request", gen_req(0))).replica == "here"
                assert seen == []  # the only replica: the local one
                async with Node(there_bus, [there], heartbeat_every=0, grace=0.5):
                    await until(lambda: ("generate.request", there.reporter.replica)
                                in client.replicas(), deadline=30, what="the other replica's report")
                    for i in range(4):
                        await client.call("generate.request", gen_req(i))
                    await until(lambda: len(seen) == 4, deadline=30, what="4 requests on the bus")
    finally:
        await there_bus.close()


async def test_local_error_answers_are_retried_then_rejected(memory_bus_only):
    run = new_run()
    bad = FakeGen(run=run, name="bad", mode="error")
    async with Node(memory_bus_only, [bad], heartbeat_every=0, grace=0.2):
        async with client_on(memory_bus_only, run, retries=2, local=True) as client:
            with pytest.raises(Reject, match=r"^service_error: generate.request for t0 failed 3 times;"
                                             r" last error: ValueError: prompt too long"):
                await client.call("generate.request", gen_req(), what=" for t0")
    assert bad.got == 3

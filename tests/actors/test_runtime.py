"""Actor runtime over both buses: outcomes, dead letters, heartbeats, services, drain."""

from __future__ import annotations

import asyncio
import time

import pytest

from rollart import messages as m
from rollart.actors.kernel.base import RemoteError
from rollart.node import Node
from tests.actors.sample_actors import EchoEnv, ScoreService, collect, new_run, request



async def test_requests_complete_and_leave_nothing_in_the_work_queue(bus):
    run = new_run()
    actor = EchoEnv(run=run)
    async with Node(bus, [actor], heartbeat_every=0):
        for i in range(10):
            await bus.publish(*request(run, i))
        done = await collect(bus, run, "rollout.completed", 10)
        assert sorted(d.seed for d in done) == list(range(10))
        work = m.stream_name(run, "work")
        end = time.monotonic() + 5
        while (await bus.stream_info(work))["messages"] and time.monotonic() < end:
            await asyncio.sleep(0.02)
        assert (await bus.stream_info(work))["messages"] == 0


async def test_malformed_payload_is_dead_lettered_and_actor_keeps_serving(bus):
    run = new_run()
    async with Node(bus, [EchoEnv(run=run)], heartbeat_every=0):
        subj = m.subject(run, "rollout.requested", "default")
        await bus.publish(subj, b"\xc1 not msgpack")
        await bus.publish(subj, m_encode_wrong_type())
        await bus.publish(*request(run, 7))
        dead = await collect(bus, run, "dead", 2)
        done = await collect(bus, run, "rollout.completed", 1)
    assert [d.seed for d in done] == [7]
    assert len(dead) == 2 and all("malformed payload" in d.reason for d in dead)
    assert dead[0].payload == b"\xc1 not msgpack" and dead[0].subject == subj
    assert dead[0].actor == "echo" and dead[0].stream_seq > 0


def m_encode_wrong_type() -> bytes:
    from rollart.bus.codec import encode

    return encode({"traj_id": 5})  # valid msgpack, missing required fields


async def test_reject_retry_and_exhausted_failures(bus):
    run = new_run()
    actor = EchoEnv(run=run, settings={"on_request": {"max_deliver": 3}})
    async with Node(bus, [actor], heartbeat_every=0):
        await bus.publish(*request(run, 1, env="reject"))
        await bus.publish(*request(run, 2, env="retry"))
        await bus.publish(*request(run, 3, env="fail"))
        done = await collect(bus, run, "rollout.completed", 1)
        dead = await collect(bus, run, "dead", 2, deadline=20)
    assert [d.traj_id for d in done] == ["t2"]
    assert actor.calls["t2"] == 2
    reasons = {d.payload: d.reason for d in dead}
    by_traj = {m_decode(p).traj_id: r for p, r in reasons.items()}
    assert by_traj["t1"] == "env 'reject' is not allowed"
    assert "RuntimeError: boom" in by_traj["t3"] and "failed 3 times" in by_traj["t3"]
    assert actor.calls["t1"] == 1 and actor.calls["t3"] == 3


def m_decode(payload: bytes) -> m.RolloutRequested:
    from rollart.bus.codec import decode

    return decode(m.RolloutRequested, payload)


async def test_long_handler_is_kept_alive_by_heartbeats(bus):
    run = new_run()
    actor = EchoEnv(run=run, delay=1.2, settings={"on_request": {"ack_wait": 0.4}})
    async with Node(bus, [actor], heartbeat_every=0):
        await bus.publish(*request(run, 1))
        done = await collect(bus, run, "rollout.completed", 1)
    assert len(done) == 1
    assert actor.calls["t1"] == 1, "in_progress heartbeats must prevent redelivery"


async def test_service_replies_errors_and_dead_letters(bus):
    run = new_run()
    svc = ScoreService(run=run)
    async with Node(bus, [svc], heartbeat_every=0):
        ok = await svc.request("reward.request",
                               m.RewardRequest(traj_id="a", scorer="match", response="4", answer="4"))
        assert ok.score == 1.0
        with pytest.raises(RemoteError, match="scorer exploded"):
            await svc.request("reward.request",
                              m.RewardRequest(traj_id="b", scorer="explode", response="", answer=""))
        rep = await bus.request(svc.subject("reward.request"), b"garbage", timeout=5)
        assert "malformed payload" in rep.headers["Rollart-Error"]
        dead = await collect(bus, run, "dead", 1)
    assert dead[0].payload == b"garbage"


async def test_drain_finishes_inflight_work(bus):
    run = new_run()
    actor = EchoEnv(run=run)
    node = Node(bus, [actor], heartbeat_every=0, grace=10)
    await node.start()
    for i in range(3):
        await bus.publish(*request(run, 400 + i, env="slow"))  # ~0.4 s each
    end = time.monotonic() + 5
    while len(actor.calls) < 3 and time.monotonic() < end:
        await asyncio.sleep(0.01)
    assert len(actor.calls) == 3
    await node.stop_and_drain()
    done = await collect(bus, run, "rollout.completed", 3, deadline=3)
    assert len(done) == 3
    info = await node.loops[0].consumer.info()
    assert info["num_ack_pending"] == 0 and info["num_pending"] == 0


async def test_bad_settings_name_the_handler(bus):
    with pytest.raises(ValueError, match="unknown handler"):
        EchoEnv(run="x", settings={"nope": {}}).handlers()
    with pytest.raises(ValueError, match="unknown handler setting"):
        EchoEnv(run="x", settings={"on_request": {"ack_wiat": 1}}).handlers()
    with pytest.raises(ValueError, match="not a valid subject token"):
        EchoEnv(run="bad.run")

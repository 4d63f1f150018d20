"""RewardService: rule scorers, a batched model scorer, and replicas joining and leaving."""

from __future__ import annotations

import asyncio

import pytest

from rollart import messages as m
from rollart.actors.kernel.base import RemoteError
from rollart.actors.reward.actor import RewardService, answer_match
from rollart.node import Node
from tests.actors.sample_actors import new_run


def test_answer_match_rules():
    assert answer_match(" 42 ", "42.0", {}) == 1.0
    assert answer_match("41", "42", {}) == 0.0
    assert answer_match("Paris  France", "paris france", {}) == 1.0
    assert answer_match("", "x", {}) == 0.0


def req(i: int, scorer="answer_match", response="4", answer="4", **meta) -> m.RewardRequest:
    return m.RewardRequest(traj_id=f"t{i}", scorer=scorer, response=response, answer=answer,
                           metadata={k: str(v) for k, v in meta.items()})


async def test_reasoning_gym_scorer_and_unknown_scorer(memory_bus_only):
    pytest.importorskip("reasoning_gym")
    from rollart.envs.reasoning import ReasoningGymEnv

    env = ReasoningGymEnv(dataset="basic_arithmetic")
    _, info = env.reset(3)
    meta = {"env_args": '{"dataset": "basic_arithmetic"}', "seed": 3}
    svc = RewardService(run=new_run())
    async with Node(memory_bus_only, [svc], heartbeat_every=0):
        good = await svc.request("reward.request", req(1, "reasoning_gym", str(info["answer"]), "", **meta))
        bad = await svc.request("reward.request", req(2, "reasoning_gym", "nonsense", "", **meta))
        assert good.score == 1.0 and bad.score == 0.0
        with pytest.raises(RemoteError, match="unknown scorer 'nope'"):
            await svc.request("reward.request", req(3, "nope"))


async def test_model_scorer_batches_many_trajectories(memory_bus_only, tiny_model):
    svc = RewardService(run=new_run(), model_path=str(tiny_model), gather_ms=20)
    async with Node(memory_bus_only, [svc], heartbeat_every=0):
        outs = await asyncio.gather(*[
            svc.request("reward.request", req(i, "model_logprob", response="R R D", answer="D" * (1 + i % 3)))
            for i in range(12)])
    assert all(0.0 < o.score <= 1.0 for o in outs)
    assert max(svc.batcher.sizes) > 1, "concurrent requests share one forward pass"
    assert outs[0].score == pytest.approx(outs[3].score, rel=1e-4), "same input, same score in any batch"


async def test_replicas_join_and_leave_while_serving(bus):
    run = new_run()
    a, b = RewardService(run=run, name="reward-a"), RewardService(run=run, name="reward-b")
    client = RewardService(run=run, name="client")  # only used to send requests
    client.bus = bus
    node_a = Node(bus, [a], heartbeat_every=0)
    await node_a.start()
    first = await asyncio.gather(*[client.request("reward.request", req(i)) for i in range(10)])
    assert {r.replica for r in first} == {"reward-a"}
    async with Node(bus, [b], heartbeat_every=0):  # b joins
        mid = await asyncio.gather(*[client.request("reward.request", req(i)) for i in range(40)])
        assert {r.replica for r in mid} == {"reward-a", "reward-b"}
        await node_a.stop_and_drain()  # a leaves
        last = await asyncio.gather(*[client.request("reward.request", req(i)) for i in range(10)])
        assert {r.replica for r in last} == {"reward-b"} and all(r.score == 1.0 for r in last)

"""Trajectories of any length (issue 24 item 4): a ``rollout.completed`` above the server's
max payload travels through the run's trajectory object store under the same msg id; every
consumer sees it as one ordinary message; a missing or corrupt object is dead-lettered with
a reason; ``max_context_tokens`` is checked against what the engine holds."""

from __future__ import annotations

import hashlib
import json
import random
import time
import uuid
from dataclasses import dataclass, field

import pytest

from rollart import messages as m
from rollart.actors.kernel import payloads
from rollart.actors.kernel.base import Actor, consume
from rollart.actors.env.manager import EnvManager
from rollart.actors.generate.proxy import LLMProxy
from rollart.bus import BusError, ConsumerSpec, DuplicateConflict
from rollart.bus.codec import encode
from rollart.config import ActorConfig, RunConfig, convert
from rollart.engines.capacity import check_context
from rollart.node import Node, ensure_run_streams
from tests.actors.sample_actors import collect, new_run, stored
from tests.waiting import until


@dataclass(kw_only=True, eq=False)
class Sink(Actor):
    """A durable consumer of completions (``durable`` in settings: trainer-like, scheduler-like)."""

    role = "sink"
    got: list = field(default_factory=list)

    @consume("rollout.completed", ack_wait=10.0, max_deliver=3)
    async def on_completed(self, msg: m.RolloutCompleted, delivery) -> None:
        self.got.append(msg)


def sink(run: str, durable: str) -> Sink:
    return Sink(run=run, name=durable, settings={"on_completed": {"durable": durable}})


def long_completion(traj_id: str, tokens: int = 200_000, seed: int = 0) -> m.RolloutCompleted:
    rng = random.Random(seed)
    mask = [int(i % 7 == 0) for i in range(tokens)]
    return m.RolloutCompleted(
        traj_id=traj_id, group_id=f"g-{traj_id}", env="main", seed=seed,
        token_ids=[rng.randrange(512) for _ in range(tokens)], response_mask=mask,
        logprobs=[-rng.random() if b else 0.0 for b in mask], reward=1.0, success=True,
        stop_reason="max_context", group_index=3, finished_at=time.time())


async def publisher(bus, run: str) -> Actor:
    await ensure_run_streams(bus, run)
    pub = Actor(run=run, name="env-test")
    pub.bus = bus
    return pub


async def send(pub: Actor, msg: m.RolloutCompleted, msg_id: str | None = None) -> int:
    return await pub.publish_patiently(
        "rollout.completed", msg, msg_id=msg_id or f"out:{msg.traj_id}", once=True, deadline=30,
        inline_max=payloads.inline_limit(pub.bus, None), store_ttl=3600)


async def raw_completions(bus, run: str) -> list:
    c = await bus.pull_consumer(m.stream_name(run, "events"), ConsumerSpec(
        durable=f"raw-{uuid.uuid4().hex[:8]}", filter_subject=m.subject(run, "rollout.completed")))
    got = await c.fetch(16, timeout=2.0)
    for d in got:
        await d.ack()
    return got


async def test_a_completion_above_max_payload_is_one_message_to_every_consumer(bus):
    run = new_run()
    pub = await publisher(bus, run)
    big, small = long_completion("t-big"), long_completion("t-small", tokens=100)
    data = encode(big)
    limit = bus.max_payload or 1 << 20
    assert len(data) > limit, "the test needs a payload above the server's max payload"
    with pytest.raises(BusError, match="(?i)payload"):  # what it would do inline
        await bus.publish(m.subject(run, "rollout.completed"), data, msg_id="inline:t-big")

    seq = await send(pub, big)
    assert await send(pub, big) == seq, "a retried publish is deduplicated (same msg id)"
    await send(pub, small)
    assert await stored(bus, run, "rollout.completed") == 2
    raw = await raw_completions(bus, run)
    by_ref = [d for d in raw if payloads.reference(d.headers)]
    assert len(by_ref) == 1 and len(by_ref[0].data) < 2048, "only the large one goes by reference"
    ref = payloads.decode_ref(by_ref[0].data)
    assert (ref.traj_id, ref.size, ref.tokens) == ("t-big", len(data), 200_000)
    assert ref.bucket == m.traj_bucket(run)

    trainer, scheduler = sink(run, "trainer-like"), sink(run, "scheduler-like")
    async with Node(bus, [trainer, scheduler], heartbeat_every=0, grace=2):
        await until(lambda: len(trainer.got) == 2 and len(scheduler.got) == 2, deadline=30,
                    what="both consumers to get both completions")
    for s in (trainer, scheduler):
        got = {c.traj_id: c for c in s.got}
        assert got["t-big"] == big and got["t-small"] == small, s.name
        assert s.got.count(big) == 1


async def test_other_content_under_the_same_msg_id_is_a_conflict(bus):
    run = new_run()
    pub = await publisher(bus, run)
    await send(pub, long_completion("t-x"))
    with pytest.raises(DuplicateConflict):  # another run of the trajectory: other tokens
        await send(pub, long_completion("t-x", seed=1))
    assert await stored(bus, run, "rollout.completed") == 1


async def test_a_missing_or_corrupt_object_is_dead_lettered_with_a_reason(bus):
    run = new_run()
    pub = await publisher(bus, run)
    refs = {}
    for tid in ("t-corrupt", "t-missing"):
        msg = long_completion(tid, tokens=100_000)
        await send(pub, msg)
        refs[tid] = payloads.object_name(tid, hashlib.sha256(encode(msg)).hexdigest())
    store = await bus.object_store(m.traj_bucket(run))
    blob = bytearray(await store.get(refs["t-corrupt"]))
    blob[len(blob) // 2] ^= 0xFF
    await store.put(refs["t-corrupt"], bytes(blob))
    await store.delete(refs["t-missing"])
    trainer = sink(run, "trainer-like")
    async with Node(bus, [trainer], heartbeat_every=0, grace=2):
        dead = await collect(bus, run, "dead", 2, deadline=30)
    assert trainer.got == [], "a payload that cannot be had never reaches the handler"
    reasons = sorted(d.reason for d in dead)
    assert len(reasons) == 2 and all(r.startswith("payload: ") for r in reasons), reasons
    assert any("does not match the reference's sha256" in r and "t-corrupt" in r for r in reasons)
    assert any("is missing" in r and "t-missing" in r for r in reasons), reasons
    assert all(d.num_delivered == 1 and d.kind == "permanent" for d in dead)
    assert all(d.headers.get(m.PAYLOAD_HEADER) == "object" for d in dead)


async def test_a_reference_to_another_bucket_is_refused(memory_bus_only):
    bus, run = memory_bus_only, new_run()
    await ensure_run_streams(bus, run)
    msg = long_completion("t-w", tokens=10)
    weights = await bus.object_store(m.object_bucket(run))
    await weights.put("w", encode(msg))
    ref = m.PayloadRef(bucket=m.object_bucket(run), name="w", size=len(encode(msg)),
                       sha256=hashlib.sha256(encode(msg)).hexdigest(),
                       type="RolloutCompleted", traj_id="t-w", group_id="g-t-w", group_index=3)
    await bus.publish(m.subject(run, "rollout.completed"), encode(ref),
                      headers={m.PAYLOAD_HEADER: "object"}, msg_id="out:t-w")
    trainer = sink(run, "trainer-like")
    async with Node(bus, [trainer], heartbeat_every=0, grace=2):
        dead = await collect(bus, run, "dead", 1, deadline=20)
    assert trainer.got == [] and "not the run's trajectory store" in dead[0].reason


def run_cfg(tiny_model, **over) -> RunConfig:
    envs = {"main": {"type": "frozenlake", "max_turns": 3, **over.pop("env", {})}}
    return convert({"run": new_run(), "model": {"path": str(tiny_model)}, "envs": envs,
                    "rollout": {"group_size": 2, "batch_groups": 1, **over.pop("rollout", {})},
                    **over}, RunConfig)


async def test_env_manager_sends_completions_through_the_store_end_to_end(nats_bus, tiny_model):
    """``rollout.inline_max_bytes: 0``: every real completion of a real EnvManager goes by
    reference; a durable consumer gets each once, whole."""
    bus = nats_bus
    cfg = run_cfg(tiny_model, rollout={"inline_max_bytes": 0})
    env = EnvManager.from_config(cfg, ActorConfig(), pool="default")
    gen = LLMProxy.from_config(cfg, ActorConfig(), pool="default")
    trainer = sink(cfg.run, "trainer-like")
    assert env.store_ttl == cfg.node.events_max_age
    async with Node(bus, [env, gen, trainer], heartbeat_every=0, grace=2):
        for i in range(2):
            req = m.RolloutRequested(traj_id=f"t{i}", group_id="g0", env="main", seed=i,
                                     index_in_group=i, group_index=0)
            await bus.publish(m.subject(cfg.run, "rollout.requested", "default"), encode(req),
                              msg_id=f"t{i}")
        await until(lambda: len(trainer.got) == 2, deadline=60, what="two completions")
    raw = await raw_completions(bus, cfg.run)
    assert len(raw) == 2 and all(payloads.reference(d.headers) == "object" for d in raw)
    refs = {payloads.decode_ref(d.data).traj_id: payloads.decode_ref(d.data) for d in raw}
    for c in trainer.got:
        assert len(c.token_ids) == refs[c.traj_id].tokens > 0 and c.reward == refs[c.traj_id].reward
        assert len(encode(c)) == refs[c.traj_id].size
    assert sorted(c.traj_id for c in trainer.got) == ["t0", "t1"]


def test_max_context_tokens_is_checked_against_the_engine(tiny_model, tmp_path):
    cfg = run_cfg(tiny_model)
    check_context(cfg, tiny_model)  # 1024 + 32 within the tiny model's 2048 positions
    with pytest.raises(ValueError, match=r"envs\.main\.max_context_tokens = 4096 .*max_position_embeddings"):
        check_context(run_cfg(tiny_model, env={"max_context_tokens": 4096}), tiny_model)
    vllm = run_cfg(tiny_model, proxy={"engine": "vllm", "engine_args": {"max_model_len": 512}})
    with pytest.raises(ValueError, match=r"envs\.main\.max_context_tokens.*proxy\.engine_args\.max_model_len"):
        check_context(vllm, tiny_model)
    # a long-context model (yarn scaling) holds 200k tokens
    folder = tmp_path / "long"
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps({
        "max_position_embeddings": 65536, "rope_scaling": {"rope_type": "yarn", "factor": 4.0}}))
    check_context(run_cfg(tiny_model, env={"max_context_tokens": 200_000}), folder)
    with pytest.raises(ValueError, match="envs.main.max_context_tokens"):
        EnvManager.from_config(run_cfg(tiny_model, env={"max_context_tokens": 4096}),
                               ActorConfig(), pool="default")

"""Trajectories flow end to end on both buses with a real tiny torch engine."""

from __future__ import annotations

import asyncio
import collections

import msgspec
import pytest


from rollart.config import RunConfig, convert
from rollart.node.build import rollout_actors
from rollart.node import Node
from tests.actors.sample_actors import all_stored, collect, new_run



def make_cfg(tiny_model, env: dict | None = None, **rollout) -> RunConfig:
    env = {"type": "frozenlake", "max_turns": 6, **(env or {})}
    ro = {"group_size": 4, "batch_groups": 2, **rollout}
    return convert({"run": new_run(), "model": {"path": str(tiny_model)},
                    "envs": {"main": env}, "rollout": ro}, RunConfig)


async def run_groups(bus, cfg, groups, timeout=120):
    sched, actors = rollout_actors(cfg, groups=groups, bounded=False, keep_results=True)
    async with Node(bus, actors, heartbeat_every=0):
        await asyncio.wait_for(sched.all_done.wait(), timeout)
    return sched, actors


async def outcomes(bus, run, n):
    """Every outcome the run stored (the scheduler is done: all of them are in); at most ``n``
    of each kind is what a test expects."""
    got = [await all_stored(bus, run, k) for k in ("rollout.completed", "rollout.cancelled", "dead")]
    assert all(len(g) <= n for g in got), [len(g) for g in got]
    return tuple(got)


async def test_groups_complete_with_one_outcome_each(bus, tiny_model):
    cfg = make_cfg(tiny_model)
    sched, actors = await run_groups(bus, cfg, groups=3)
    done, cancelled, dead = await outcomes(bus, cfg.run, 13)
    ids = [d.traj_id for d in done]
    assert len(ids) == len(set(ids)) == 12 and not cancelled and not dead
    assert sched.summary()["completed"] == 12
    for d in done:
        assert len(d.token_ids) == len(d.response_mask) == len(d.logprobs) == len(d.token_versions)
        assert d.stop_reason in ("terminated", "truncated", "max_turns")
        assert len(d.turns) >= 1 and d.min_version == d.max_version == 0


async def test_token_bookkeeping_reproduces_the_conversation(memory_bus_only, tiny_model):
    from rollart.actors.env.chat import ChatFormat
    from rollart.envs import make_env

    bus = memory_bus_only
    cfg = make_cfg(tiny_model)
    sched, actors = await run_groups(bus, cfg, groups=1)
    chat = ChatFormat.load(tiny_model)
    action_ids = {chat.encode(a)[0] for a in "LDRU"}
    for d in sched.results:
        # replay the env with the recorded actions to rebuild the conversation as text
        env = make_env("frozenlake", {})
        obs, _ = env.reset(d.seed)
        msgs = [{"role": "system", "content": env.instruction}, {"role": "user", "content": obs}]
        for i, t in enumerate(d.turns):
            msgs.append({"role": "assistant", "content": t.action})
            obs, *_ = env.step(t.action)
            if i + 1 < len(d.turns):
                msgs.append({"role": "user", "content": obs})
        expected = chat.render(msgs, generation_prompt=False)
        got = chat.decode(d.token_ids, skip_special=False)
        assert expected.startswith(got) and len(expected) - len(got) <= len("<|im_end|>\n")
        gen = [t for t, k in zip(d.token_ids, d.response_mask) if k]
        assert len(gen) == len(d.turns), "one generated token per constrained turn"
        assert set(gen) <= action_ids, "the mask covers exactly the generated action tokens"
        assert all(lp < 0 for lp, k in zip(d.logprobs, d.response_mask) if k)
        assert all(lp == 0 for lp, k in zip(d.logprobs, d.response_mask) if not k)


async def test_redundancy_delivers_group_size_and_cancels_the_rest(bus, tiny_model):
    cfg = make_cfg(tiny_model, env={"type": "tests.e2e.faulty_envs:StragglerLake"},
                   group_size=3, redundancy=2)
    sched, _ = await run_groups(bus, cfg, groups=3)
    done, cancelled, dead = await outcomes(bus, cfg.run, 20)
    assert not dead
    per = collections.defaultdict(lambda: [0, 0])
    for d in done:
        per[d.group_id][0] += 1
    for c in cancelled:
        per[c.group_id][1] += 1
    assert len(per) == 3
    for gid, (nd, nc) in per.items():
        assert nd + nc == 5, f"{gid}: every member ends exactly once"
        assert nd >= 3
        assert len(sched.groups[gid].completed) >= 3
    assert {d.traj_id for d in done}.isdisjoint({c.traj_id for c in cancelled})
    assert sum(nc for _, nc in per.values()) >= 1, "redundant members were cancelled"


async def test_reset_failures_are_retried_and_counted(bus, tiny_model):
    cfg = make_cfg(tiny_model, env={"type": "tests.e2e.faulty_envs:FlakyLake", "reset_retries": 3})
    sched, actors = await run_groups(bus, cfg, groups=3)
    env_mgr = next(a for a in actors if a.role == "env")
    assert sched.summary()["completed"] == 12 and sched.summary()["dead"] == 0
    assert env_mgr.stats.get("reset_failures", 0) >= 3


async def test_reset_that_always_fails_is_dead_lettered(memory_bus_only, tiny_model):
    cfg = make_cfg(tiny_model, env={"type": "tests.envs.fake_envs:FailingEnv",
                                    "reset_retries": 1}, group_size=2, on_failed_group="skip")
    sched, _ = await run_groups(memory_bus_only, cfg, groups=1)
    dead = await collect(memory_bus_only, cfg.run, "dead", 2, deadline=2)
    assert len(dead) == 2 and all(d.reason.startswith("env_reset_failed") for d in dead)
    assert sched.summary()["dead"] == 2 and sched.failure is None


async def test_failed_groups_are_replaced_until_the_breaker_stops(memory_bus_only, tiny_model):
    """``on_failed_group: replace`` admits a fresh group per failed one; when every group
    fails, ``fail_after_groups`` in a row end the rollout with the reason."""
    cfg = make_cfg(tiny_model, env={"type": "tests.envs.fake_envs:FailingEnv",
                                    "reset_retries": 0}, group_size=2, fail_after_groups=3)
    sched, _ = await run_groups(memory_bus_only, cfg, groups=1)
    assert sched.admitted == 3 and sched.summary()["dead"] == 6
    assert sched.failure and "the last 3 groups all failed" in sched.failure


async def test_hanging_env_stops_with_env_timeout(bus, tiny_model):
    cfg = make_cfg(tiny_model, env={"type": "tests.e2e.faulty_envs:HangLake", "step_timeout": 0.5},
                   group_size=2)
    sched, _ = await run_groups(bus, cfg, groups=1)
    reasons = {d.stop_reason for d in sched.results}
    assert "env_timeout" in reasons
    for d in sched.results:
        if d.stop_reason == "env_timeout":
            assert len(d.turns) == 1


async def test_proxy_batches_concurrent_trajectories(memory_bus_only, tiny_model):
    cfg = make_cfg(tiny_model, group_size=8, batch_groups=2)
    _, actors = await run_groups(memory_bus_only, cfg, groups=2)
    proxy = next(a for a in actors if a.role == "generate")
    assert max(proxy.batcher.sizes) > 1 and proxy.batcher.mean_batch > 1.5


async def test_batch_mode_runs_in_lock_step(memory_bus_only, tiny_model):
    cfg = make_cfg(tiny_model, mode="batch", group_size=4, batch_groups=2)
    sched, actors = await run_groups(memory_bus_only, cfg, groups=4)
    assert sched.summary()["completed"] == 16
    proxy = next(a for a in actors if a.role == "generate")
    # all 8 first turns of a wave go to the engine as one batch
    assert proxy.batcher.sizes[0] == 8
    # at each barrier every member but the last to arrive waits: most trajectories waited
    waited = [d for d in sched.results if d.timings["wait"] > 0]
    assert len(waited) >= len(sched.results) // 2, [d.timings["wait"] for d in sched.results]


async def test_reward_service_scores_free_text_trajectories(memory_bus_only, tiny_model):
    pytest.importorskip("reasoning_gym")
    env = {"type": "reasoning_gym", "args": {"dataset": "basic_arithmetic"}, "max_turns": 1,
           "action_pattern": r"(\d+)", "scorer": "reasoning_gym", "constrain": False,
           "sampling": {"max_new_tokens": 3}}
    cfg = make_cfg(tiny_model, env=env, group_size=4)
    sched, actors = await run_groups(memory_bus_only, cfg, groups=2)
    reward = next(a for a in actors if a.role == "reward")
    assert sched.summary()["completed"] == 8 and sched.summary()["dead"] == 0
    assert reward.served == 8
    assert all(d.timings["reward"] > 0 and 0.0 <= d.reward <= 1.0 for d in sched.results)


async def test_one_process_run_builds_the_configured_actor_types(memory_bus_only, tiny_model):
    """``actors.<role>.type`` is honoured in one process as a node honours it (it used to be
    ignored there): the custom proxy serves the run; a type that is not a subclass of the
    role's class fails naming the key."""
    from rollart.actors.scheduler.actor import RolloutScheduler
    from rollart.node.build import training_actors
    from tests.faults.slow_proxy import SlowProxy

    cfg = make_cfg(tiny_model)
    cfg = convert({**msgspec.to_builtins(cfg), "actors": {"generate": {
        "type": "tests.faults.slow_proxy:SlowProxy", "args": {"delay": 0}}}}, RunConfig)
    sched, actors = await run_groups(memory_bus_only, cfg, groups=1)
    assert [type(a) for a in actors if a.role == "generate"] == [SlowProxy]
    assert sched.summary()["completed"] == 4
    assert type(sched) is RolloutScheduler
    for role, path in (("scheduler", "tests.faults.slow_proxy:SlowProxy"),
                       ("trainer", "tests.no_such_module:Trainer")):
        bad = convert({**msgspec.to_builtins(cfg), "actors": {role: {"type": path}}}, RunConfig)
        with pytest.raises(ValueError, match=rf"actors\.{role}\.type: "):
            training_actors(bad)

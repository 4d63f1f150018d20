"""Batch mode with more than one EnvManager (issue 8 item 6): a wave runs in lock step on one
EnvManager, so a config with several in-process replicas is rejected, and a wave split
between EnvManagers at run time (several env nodes) fails fast with the reason instead of
every member waiting for the others for ever."""

from __future__ import annotations

import asyncio
import time

import pytest

from rollart import messages as m
from rollart.actors.env.manager import EnvManager
from rollart.actors.env.lockstep import LockStep, WaveIncomplete
from rollart.bus.codec import encode
from rollart.config import ActorConfig, ConfigError, RunConfig, convert
from rollart.node import Node
from tests.actors.sample_actors import collect, new_run
from tests.waiting import until



# -- config ------------------------------------------------------------------------
def test_batch_mode_with_several_env_replicas_is_rejected_naming_the_keys():
    with pytest.raises(ConfigError) as e:
        convert({"rollout": {"mode": "batch"}, "actors": {"env": {"replicas": 2}}}, RunConfig,
                source="run.yaml")
    msg = str(e.value)
    assert msg.startswith("run.yaml: ") and "actors.env.replicas" in msg, msg
    assert "rollout.mode 'batch'" in msg and "(it is 2)" in msg, msg


def test_batch_mode_with_one_env_replica_and_trajectory_mode_with_many_are_accepted():
    convert({"rollout": {"mode": "batch"}, "actors": {"env": {"replicas": 1}}}, RunConfig)
    convert({"rollout": {"mode": "trajectory"}, "actors": {"env": {"replicas": 4}}}, RunConfig)


# -- the barrier -------------------------------------------------------------------
async def test_a_wave_split_between_two_barriers_fails_fast_with_the_reason():
    a, b = LockStep(fill_timeout=0.3, room=lambda: 64), LockStep(fill_timeout=0.3, room=lambda: 64)
    for ls in (a, b):
        for _ in range(2):
            assert ls.join("run:g0", 4)
    results = await asyncio.wait_for(asyncio.gather(  # fast: 0.3 s fill timeouts, not for ever
        a.arrive("run:g0"), a.arrive("run:g0"), b.arrive("run:g0"), b.arrive("run:g0"),
        return_exceptions=True), 30)
    assert all(isinstance(r, WaveIncomplete) for r in results), results
    assert "only 2 reached this EnvManager" in str(results[0]) and "actors.env.replicas" in str(results[0])
    for ls in (a, b):
        ls.leave("run:g0")
        ls.leave("run:g0")
        assert ls.join("run:g0", 4)  # a late member of the failed wave fails too
        with pytest.raises(WaveIncomplete):
            await ls.arrive("run:g0")
        ls.leave("run:g0")
        assert not ls.waves


async def test_a_wave_short_of_room_here_keeps_waiting_for_its_members():
    room = {"n": 0, "asked": 0}

    def no_room() -> int:
        room["asked"] += 1
        return room["n"]

    ls = LockStep(fill_timeout=0.1, room=no_room)
    assert ls.join("w", 2)
    waiter = asyncio.ensure_future(ls.arrive("w"))
    # three fill checks found no room here, so no verdict
    await until(lambda: room["asked"] >= 3, deadline=30, step=0.01, what="the fill check to run")
    await asyncio.sleep(0)
    assert not waiter.done()
    assert ls.join("w", 2)  # the last member, once a slot was free
    await ls.arrive("w")
    await asyncio.wait_for(waiter, 10)


async def test_a_crash_remnant_runs_on_with_the_members_present():
    """Members that finished before a crash never come back: a wave with redelivered members
    stops waiting for them after the fill timeout instead of failing or hanging."""
    ls = LockStep(fill_timeout=0.2, room=lambda: 64)
    assert ls.join("w", 4, redelivered=True)
    assert ls.join("w", 4, redelivered=True)
    t0 = time.monotonic()
    await asyncio.wait_for(asyncio.gather(ls.arrive("w"), ls.arrive("w")), 5)
    assert time.monotonic() - t0 >= 0.15
    await asyncio.wait_for(asyncio.gather(ls.arrive("w"), ls.arrive("w")), 1)  # next phase
    ls.leave("w")
    ls.leave("w")
    assert not ls.waves and ls.join("w", 4) is False


async def test_a_whole_wave_never_times_out():
    ls = LockStep(fill_timeout=0.1, room=lambda: 64)
    for _ in range(3):
        assert ls.join("w", 3)
    await asyncio.sleep(0.3)  # the passage of time is what is tested: 3 fill timeouts go by
    await asyncio.wait_for(asyncio.gather(*(ls.arrive("w") for _ in range(3))), 10)



# -- two EnvManagers on one bus ------------------------------------------------------
async def test_two_env_managers_sharing_a_wave_dead_letter_it_with_the_reason(memory_bus_only, tiny_model):
    bus = memory_bus_only
    cfg = convert({"run": new_run(), "model": {"path": str(tiny_model)},
                   "envs": {"main": {"type": "frozenlake", "max_turns": 3}},
                   "rollout": {"mode": "batch", "group_size": 2, "batch_groups": 2}}, RunConfig)

    def env_manager(i: int) -> EnvManager:
        em = EnvManager.from_config(cfg, ActorConfig(args={"wave_fill_timeout": 0.5}),
                                    pool="default", index=i)
        return em

    async def submit(indices):
        for i in indices:
            req = m.RolloutRequested(traj_id=f"t{i}", group_id=f"g{i // 2}", env="main", seed=i,
                                     index_in_group=i % 2, wave=0, wave_size=4, wave_id=f"{cfg.run}:g0")
            await bus.publish(m.subject(cfg.run, "rollout.requested", "default"), encode(req),
                              msg_id=f"req:{i}")

    a, b = env_manager(0), env_manager(1)
    async with Node(bus, [a], heartbeat_every=0, grace=5) as node_a:
        await submit([0, 1])
        await until(lambda: len(a.running) == 2, deadline=60, what="EnvManager a holding two members")
        for loop in node_a.loops:  # a takes no more: the rest of the wave goes to b
            loop.stop()
        async with Node(bus, [b], heartbeat_every=0, grace=5):
            await submit([2, 3])
            dead = await collect(bus, cfg.run, "dead", 4, deadline=20)
            await until(lambda: not a.running and not b.running, deadline=60, what="both EnvManagers done")
    assert sorted(m.dead_request(d).traj_id for d in dead) == ["t0", "t1", "t2", "t3"], \
        [d.reason for d in dead]
    for d in dead:
        assert d.reason.startswith("config: batch mode: wave ") and "only 2 reached" in d.reason, d.reason
        assert d.num_delivered == 1 and d.kind == "permanent", d
    assert {d.reason.rsplit("(", 1)[-1] for d in dead} == {f"{a.name})", f"{b.name})"}

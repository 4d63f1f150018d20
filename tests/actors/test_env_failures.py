"""EnvManager failure kinds: a permanent failure is dead-lettered at its first delivery with
a kind token; a missing generate or reward pool is waited for, however long it stays away
(up to rollout.service_wait)."""

from __future__ import annotations

import time

import pytest

from rollart import messages as m
from rollart.actors.env.manager import EnvManager
from rollart.actors.generate.proxy import LLMProxy
from rollart.actors.reward.actor import RewardService
from rollart.actors.env.trajectory import Deliveries
from rollart.bus.codec import encode
from rollart.config import ActorConfig, RunConfig, convert
from rollart.node import Node
from tests.actors.sample_actors import all_stored, collect, new_run
from tests.waiting import until

BROKEN = "tests.actors.broken_envs"


def make_cfg(tiny_model, envs: dict | None = None, **rollout) -> RunConfig:
    envs = {"main": {"type": "frozenlake", "max_turns": 3}, **(envs or {})}
    return convert({"run": new_run(), "model": {"path": str(tiny_model)}, "envs": envs,
                    "rollout": {"group_size": 2, "batch_groups": 1, **rollout}}, RunConfig)


def build(cfg: RunConfig, role: str):
    cls = {"env": EnvManager, "generate": LLMProxy, "reward": RewardService}[role]
    return cls.from_config(cfg, ActorConfig(), pool="default")


async def submit(bus, run: str, envs: list[str]) -> list[str]:
    ids = []
    for i, env in enumerate(envs):
        tid = f"t{i}-{env}"
        msg = m.RolloutRequested(traj_id=tid, group_id=f"g{i}", env=env, seed=i)
        await bus.publish(m.subject(run, "rollout.requested", "default"), encode(msg), msg_id=tid)
        ids.append(tid)
    return ids


PERMANENT = {
    "ctor": ({"type": f"{BROKEN}:CtorFails"}, "env_setup: ", "no licence"),
    "ctor_process": ({"type": f"{BROKEN}:CtorFails", "executor": "process"}, "env_setup: ", "no licence"),
    "no_import": ({"type": "tests.actors.broken_import_env:Env"}, "env_setup: ",
                  "rollart_test_package_that_is_not_installed"),
    "no_module": ({"type": "tests.actors.no_such_module:Env"}, "env_setup: ", "not found"),
    "bad_args": ({"type": "frozenlake", "args": {"nope": 1}}, "env_setup: ", "'nope'"),
    "step_shape": ({"type": f"{BROKEN}:ShortStep"}, "env_contract: ", "step() must return"),
    "reset_shape": ({"type": f"{BROKEN}:ObsOnlyReset"}, "env_contract: ", "reset() must return"),
    "reward_type": ({"type": f"{BROKEN}:WordReward"}, "env_contract: ", "reward must be a number"),
}


async def test_permanent_env_failures_are_dead_lettered_at_the_first_delivery(nats_bus, tiny_model):
    cfg = make_cfg(tiny_model, {k: v[0] for k, v in PERMANENT.items()})
    env, gen = build(cfg, "env"), build(cfg, "generate")
    async with Node(nats_bus, [env, gen], heartbeat_every=0, grace=1):
        await submit(nats_bus, cfg.run, [*PERMANENT, "main"])
        dead = await collect(nats_bus, cfg.run, "dead", len(PERMANENT), deadline=60)
        done = await collect(nats_bus, cfg.run, "rollout.completed", 1, deadline=60)
    by_env = {m.dead_request(d).env: d for d in dead}
    assert sorted(by_env) == sorted(PERMANENT), [d.reason for d in dead]
    for name, (_, token, detail) in PERMANENT.items():
        d = by_env[name]
        assert d.reason.startswith(token) and detail in d.reason, (name, d.reason)
        assert d.num_delivered == 1, f"{name} was retried: {d.reason}"
    assert env.stats.get("reset_failures", 0) == 0, "a permanent failure was retried"
    assert [d.env for d in done] == ["main"] and done[0].attempt == 1


async def test_a_generate_pool_that_appears_late_is_waited_for(nats_bus, tiny_model):
    cfg = make_cfg(tiny_model, generate_timeout=60.0, service_wait=120.0)
    env = build(cfg, "env")
    async with Node(nats_bus, [env], heartbeat_every=0, grace=1):
        ids = await submit(nats_bus, cfg.run, ["main", "main"])
        # far beyond the old budget (3 retries 0.2-0.8 s, then ~5 redeliveries)
        await until(lambda: env.services.waits().get(("generate.request", "default"), (0, 0.0))[1] >= 10,
                    deadline=30, what="trajectories waiting 10 s for a generate replica")
        assert env.services.waits()[("generate.request", "default")][0] == 2
        async with Node(nats_bus, [build(cfg, "generate")], heartbeat_every=0, grace=1):
            done = await collect(nats_bus, cfg.run, "rollout.completed", 2, deadline=60)
        dead = await all_stored(nats_bus, cfg.run, "dead")  # the outcomes are in
    assert sorted(d.traj_id for d in done) == sorted(ids) and not dead
    assert all(d.attempt == 1 for d in done), "the trajectory waited; it was not re-run"
    assert env.stats.get("service_waits", 0) == 2


async def test_a_reward_pool_that_appears_late_is_waited_for(memory_bus_only, tiny_model):
    bus = memory_bus_only
    cfg = make_cfg(tiny_model, {"main": {"type": "frozenlake", "max_turns": 2,
                                         "scorer": "answer_match"}})
    env = build(cfg, "env")
    async with Node(bus, [env, build(cfg, "generate")], heartbeat_every=0, grace=1):
        ids = await submit(bus, cfg.run, ["main"])
        await until(lambda: env.services.waits().get(("reward.request", "default"), (0, 0.0))[1] >= 3,
                    deadline=30, what="a trajectory waiting for a reward replica")
        async with Node(bus, [build(cfg, "reward")], heartbeat_every=0, grace=1):
            done = await collect(bus, cfg.run, "rollout.completed", 1, deadline=30)
    assert [d.traj_id for d in done] == ids and done[0].attempt == 1


async def test_no_generate_pool_until_service_wait_is_dead_lettered_once(memory_bus_only, tiny_model):
    bus = memory_bus_only
    cfg = make_cfg(tiny_model, service_wait=1.5)
    async with Node(bus, [build(cfg, "env")], heartbeat_every=0, grace=1):
        t0 = time.monotonic()
        await submit(bus, cfg.run, ["main"])
        dead = await collect(bus, cfg.run, "dead", 1, deadline=20)
        took = time.monotonic() - t0
    assert len(dead) == 1 and dead[0].num_delivered == 1
    assert dead[0].reason.startswith("service_unavailable: no generate replica in pool 'default'")
    # it waited out service_wait, once (num_delivered 1: no redelivery ended it); a lower
    # bound only, which load cannot break
    assert took >= 1.5


@pytest.mark.parametrize("value", [0, -1.0])
def test_service_wait_must_be_positive(value):
    with pytest.raises(Exception, match="service_wait"):
        convert({"rollout": {"service_wait": value}}, RunConfig)


async def test_a_trajectory_waiting_for_a_replica_still_obeys_cancel(memory_bus_only, tiny_model):
    bus = memory_bus_only
    cfg = make_cfg(tiny_model)
    env = build(cfg, "env")
    async with Node(bus, [env], heartbeat_every=0, grace=1):
        ids = await submit(bus, cfg.run, ["main"])
        await until(lambda: env.services.waits().get(("generate.request", "default"), (0, 0.0))[0] == 1,
                    deadline=30, what="the trajectory waiting for a generate replica")
        await bus.publish_core(m.subject(cfg.run, "rollout.cancel"), encode(m.CancelGroup(group_id="g0")))
        cancelled = await collect(bus, cfg.run, "rollout.cancelled", 1, deadline=10)
    assert [c.traj_id for c in cancelled] == ids
    assert env.services.waits() == {}


async def test_a_straggler_is_bounded_by_max_trajectory_s(memory_bus_only, tiny_model):
    """Steps just under step_timeout (never an error) and a step that runs past the limit:
    each trajectory stops with ``max_time`` near ``max_trajectory_s`` and completes with the
    turns it has; its reward is still what its turns add up to (admission's check)."""
    bus = memory_bus_only
    cfg = make_cfg(tiny_model, {
        "slow": {"type": f"{BROKEN}:Straggler", "args": {"step_s": 0.3}, "max_turns": 50,
                 "step_timeout": 0.5, "max_trajectory_s": 1.0},
        "hang": {"type": f"{BROKEN}:Straggler", "args": {"step_s": 5.0}, "max_turns": 50,
                 "step_timeout": 30.0},
    }, max_trajectory_s=1.5)
    env, gen = build(cfg, "env"), build(cfg, "generate")
    t0 = time.monotonic()
    async with Node(bus, [env, gen], heartbeat_every=0, grace=1):
        await submit(bus, cfg.run, ["slow", "hang"])
        done = await collect(bus, cfg.run, "rollout.completed", 2, deadline=60)
    took = time.monotonic() - t0
    by_env = {d.env: d for d in done}
    assert {d.stop_reason for d in done} == {"max_time"}, [(d.env, d.stop_reason) for d in done]
    assert 2 <= len(by_env["slow"].turns) <= 4, len(by_env["slow"].turns)  # ~1.0 s of 0.3 s steps
    assert by_env["hang"].turns == [], "the one step ran into the run default (1.5 s)"
    assert took < 30, f"{took:.1f}s: the 5 s steps x 50 turns were not cut"
    assert env.stats.get("max_time") == 2
    for d in done:  # what the trainer's admission check recomputes from the turns
        assert d.reward == sum(t.reward for t in d.turns), (d.reward, d.turns)


async def test_a_request_delivered_again_while_it_runs_is_not_run_twice(memory_bus_only, tiny_model):
    """A second delivery of a trajectory that this EnvManager is still running (its ack_wait
    ran out on a stalled host, or a copy under another msg id) waits for the running one and
    is acked with it: one completion. Run twice, the trajectory would complete twice with
    other tokens, a conflict that neither trains (a CI run lost one member of a group so)."""
    bus = memory_bus_only
    cfg = make_cfg(tiny_model, {"slow": {"type": f"{BROKEN}:Straggler", "args": {"step_s": 0.2},
                                         "max_turns": 4}})
    env, gen = build(cfg, "env"), build(cfg, "generate")
    req = m.RolloutRequested(traj_id="t0-slow", group_id="g0", env="slow", seed=0)
    async with Node(bus, [env, gen], heartbeat_every=0, grace=1) as node:
        for copy in ("a", "b"):  # two stream messages of one trajectory
            await bus.publish(m.subject(cfg.run, "rollout.requested", "default"), encode(req),
                              msg_id=f"t0-{copy}")
        loop = next(lp for lp in node.loops if lp.actor is env)
        # each outcome is stored before its delivery is acked
        await until(lambda: loop.stats.acked + loop.stats.naked + loop.stats.dead >= 2, deadline=30,
                    what="both deliveries answered")
        done = await all_stored(bus, cfg.run, "rollout.completed")  # stored before any ack
        dead = await all_stored(bus, cfg.run, "dead")
    assert [d.traj_id for d in done] == ["t0-slow"] and not dead, (done, dead)
    assert env.stats.get("delivered_again") == 1, env.stats


async def test_a_stalled_trajectory_redelivered_by_the_server_completes_once(nats_bus, tiny_model):
    """The CI case on a real nats-server: the EnvManager's loop stalls past ``ack_wait`` (an
    inline env step that blocks it, as a loaded host can), no in_progress goes out, the
    server delivers the request again to the same EnvManager while it runs. One completion,
    the request acked, nothing dead-lettered."""
    cfg = make_cfg(tiny_model, {"stall": {"type": f"{BROKEN}:Straggler", "args": {"step_s": 1.6},
                                          "max_turns": 2, "executor": "inline",
                                          "step_timeout": 30.0}}, ack_wait=1.0)
    env, gen = build(cfg, "env"), build(cfg, "generate")
    async with Node(nats_bus, [env, gen], heartbeat_every=0, grace=1) as node:
        await submit(nats_bus, cfg.run, ["stall"])
        loop = next(lp for lp in node.loops if lp.actor is env)
        await until(lambda: env.stats.get("delivered_again", 0) >= 1
                    and loop.stats.acked >= 2 and not len(env.running), deadline=60,
                    what="the redelivery answered with the first run")
        done = await all_stored(nats_bus, cfg.run, "rollout.completed")
        dead = await all_stored(nats_bus, cfg.run, "dead")
    assert [d.traj_id for d in done] == ["t0-stall"] and not dead, (done, dead)


async def test_deliveries_remember_running_and_stored_trajectories_up_to_a_bound():
    d = Deliveries(remember=2)
    assert d.earlier("a") is None  # never seen: run it
    d.begin("a")
    running = d.earlier("a")
    assert running is not None and not running.done()  # runs here: wait for it
    d.end("a", stored=True)
    assert running.result() is True and await d.earlier("a") is True  # stored: ack with it
    d.begin("b")
    d.end("b", stored=False)
    assert d.earlier("b") is None  # ended with no outcome: run it again
    for t in ("c", "d"):
        d.begin(t)
        d.end(t, stored=True)
    assert d.earlier("a") is None and await d.earlier("d") is True  # the oldest forgotten

"""Declarative placement: ``pools``, ``mapping`` and ``route`` pick the pool of each role and
the generation pool of each turn (DESIGN.md §2, hardware affinity)."""

from __future__ import annotations

import asyncio
import collections

import pytest

from rollart import messages as m
from rollart.config import ConfigError, RunConfig, convert
from rollart.config.placement import RouteRule, RouteWhen, Router
from rollart.node.build import role_pool, rollout_actors
from rollart.node import Node, build_actors
from tests.actors.sample_actors import new_run
from tests.waiting import until

LAKE = {"type": "frozenlake", "args": {"map": ["SFFF", "FHFH", "FFFH", "HFFG"], "max_steps": 16},
        "instruction": "FrozenLake", "max_turns": 4}
"""The quickstart env: with the tiny model's chat template the prompt of turn t is
29 + 20 (t - 1) tokens, so turn 1 is short (29) and every later turn is long (>= 49)."""
LONG = 40
"""Route threshold: turn 1 is at most this, every later turn longer."""
POOLS = {"big": {"description": "H800", "tags": ["gpu"]}, "small": {"tags": ["gpu"]},
         "cpu": {"tags": ["cpu"]}}
ROUTED = {"pools": POOLS, "mapping": {"generate": ["big", "small"], "env": "cpu", "reward": "cpu"},
          "route": [{"when": {"prompt_tokens_gt": LONG}, "pool": "big"}, {"pool": "small"}]}


def cfg_of(tiny_model=None, **extra) -> RunConfig:
    # every generate request crosses the bus, where the tests' spy counts them by subject
    # (an in-process replica would otherwise be called directly: rollout.local_calls)
    data = {"run": new_run(), "envs": {"main": dict(LAKE)},
            "rollout": {"group_size": 4, "batch_groups": 2, "local_calls": False}, **extra}
    if tiny_model is not None:
        data["model"] = {"path": str(tiny_model)}
    return convert(data, RunConfig)


# -- the router ------------------------------------------------------------------------------


def rule(pool: str, **when) -> RouteRule:
    return RouteRule(pool=pool, when=RouteWhen(**when) if when else None)


def test_first_matching_rule_wins():
    r = Router([rule("big", prompt_tokens_gt=100), rule("mid", prompt_tokens_gt=10),
                rule("small")], default_pool="small")
    assert r.pick(prompt_tokens=500, turn=1, env="main") == ("big", 0)
    assert r.pick(prompt_tokens=101, turn=1, env="main") == ("big", 0)
    assert r.pick(prompt_tokens=100, turn=1, env="main") == ("mid", 1)  # gt is strict
    assert r.pick(prompt_tokens=5, turn=1, env="main") == ("small", 2)  # the default rule


def test_no_match_goes_to_the_default_pool_with_index_minus_one():
    r = Router([rule("big", prompt_tokens_gt=100)], default_pool="small")
    assert r.pick(prompt_tokens=10, turn=3, env="main") == ("small", -1)
    assert Router([], default_pool="p").pick(prompt_tokens=0, turn=1, env="x") == ("p", -1)


def test_conditions_all_hold_and_env_and_turn_select():
    r = Router([rule("math", env="math", turn_le=2), rule("late", turn_gt=2),
                rule("window", prompt_tokens_gt=10, prompt_tokens_le=20)], default_pool="d")
    assert r.pick(prompt_tokens=0, turn=1, env="math") == ("math", 0)
    assert r.pick(prompt_tokens=0, turn=3, env="math") == ("late", 1)  # turn_le fails
    assert r.pick(prompt_tokens=0, turn=1, env="lake") == ("d", -1)  # env fails
    assert r.pick(prompt_tokens=15, turn=1, env="lake") == ("window", 2)
    assert r.pick(prompt_tokens=21, turn=1, env="lake") == ("d", -1)
    assert rule("big", prompt_tokens_gt=5).describe() == "prompt_tokens_gt=5 -> big"
    assert rule("small").describe() == "default -> small"


# -- config errors name the key ---------------------------------------------------------------


@pytest.mark.parametrize("extra, key", [
    ({**ROUTED, "route": [{"pool": "huge"}]}, "route[0].pool"),
    ({**ROUTED, "mapping": {**ROUTED["mapping"], "generate": []}}, "mapping.generate"),
    ({**ROUTED, "mapping": {"env": "cpu", "reward": "cpu"}, "route": []}, "mapping.generate"),
    ({"mapping": {"generate": "big"}}, "mapping: needs pools"),
    ({**ROUTED, "route": [{"pool": "cpu"}]}, "route[0].pool"),  # not a generation pool
    ({**ROUTED, "mapping": {**ROUTED["mapping"], "env": "gpu9"}}, "mapping.env"),
    ({**ROUTED, "route": [{"when": {"env": "nope"}, "pool": "big"}]}, "route[0].when.env"),
    ({"route": [{"pool": "big"}]}, "route: needs pools"),
])
def test_config_errors_name_the_key(extra, key):
    with pytest.raises((ConfigError, ValueError)) as e:
        cfg_of(**extra)
    assert key in str(e.value), str(e.value)


def test_route_to_non_generation_pool_says_so():
    with pytest.raises((ConfigError, ValueError), match="serves no generation"):
        cfg_of(**{**ROUTED, "route": [{"pool": "cpu"}]})


# -- placement of actors ------------------------------------------------------------------------


def test_node_pool_and_mapping():
    cfg = cfg_of(**ROUTED)
    assert role_pool(cfg, "env", "default") == "cpu"  # the default pool name: first mapped
    assert role_pool(cfg, "generate", "default") == "big"
    assert role_pool(cfg, "generate", "small") == "small"  # an explicit pool the role has
    assert role_pool(cfg, "trainer", "head") == "head"  # unmapped roles keep the node's pool
    with pytest.raises(ValueError, match=r"mapping\.env.*'big'"):
        role_pool(cfg, "env", "big")
    plain = cfg_of()
    assert role_pool(plain, "env", "big") == "big"  # no pools: the node's pool, as before


def test_build_actors_places_roles(tiny_model):
    cfg = cfg_of(tiny_model, **ROUTED)
    env, sched = build_actors(cfg, ["env", "scheduler"], "default")
    assert env.pool == "cpu" and env.reward_pool == "cpu"
    assert env.router.default_pool == "big" and len(env.router.rules) == 2
    assert sched.pool == "default" and sched.env_pool == "cpu"
    with pytest.raises(ValueError, match=r"mapping\.generate.*'cpu'"):
        build_actors(cfg, ["generate"], "cpu")
    plain = build_actors(cfg_of(tiny_model), ["env", "scheduler"], "cpu")
    assert [a.pool for a in plain] == ["cpu", "cpu"]
    assert plain[0].router is None and plain[1].env_pool is None


def test_one_process_run_starts_a_generator_per_pool(tiny_model):
    sched, actors = rollout_actors(cfg_of(tiny_model, **ROUTED), groups=1)
    by_role = collections.defaultdict(list)
    for a in actors:
        by_role[a.role].append(a.pool)
    assert by_role["generate"] == ["big", "small"]
    assert by_role["env"] == ["cpu"] and set(by_role["reward"]) == {"cpu"}
    assert sched.env_pool == "cpu"


# -- runs -------------------------------------------------------------------------------------


async def spy(bus, run: str) -> collections.Counter:
    """Count generate requests by the pool token of their subject (the queue group's, or a
    replica's own: ``generate.direct.<pool>.<replica>``, rollout.affinity)."""
    seen: collections.Counter = collections.Counter()

    async def on(req) -> None:
        seen[req.subject.rsplit(".", 1)[-1]] += 1

    async def on_direct(req) -> None:
        seen[req.subject.rsplit(".", 2)[-2]] += 1

    await bus.subscribe(m.subject(run, "generate.request", ">"), on)
    await bus.subscribe(m.subject(run, "generate.direct", ">"), on_direct)
    return seen


async def test_routed_run_sends_long_prompts_to_big(bus, tiny_model):
    """Env hosts in pool ``cpu`` use generators in ``big`` and ``small``: every turn whose
    prompt is longer than LONG tokens ran in ``big`` (rule 0), every other in ``small``."""
    cfg = cfg_of(tiny_model, **ROUTED)
    sched, actors = rollout_actors(cfg, groups=2, bounded=False, keep_results=True)
    seen = await spy(bus, cfg.run)
    async with Node(bus, actors, heartbeat_every=0):
        await asyncio.wait_for(sched.all_done.wait(), 120)
    assert sched.summary()["completed"] == 8 and sched.summary()["dead"] == 0
    turns = [t for d in sched.results for t in d.turns]
    assert len(turns) > 8
    for t in turns:
        long = t.start > LONG  # a turn's prompt is everything before its first generated token
        assert (t.pool, t.route) == (("big", 0) if long else ("small", 1)), (t.start, t.pool)
    by_pool = collections.Counter(t.pool for t in turns)
    assert by_pool["big"] > 0 and by_pool["small"] > 0
    env = next(a for a in actors if a.role == "env")
    proxies = {a.pool: a for a in actors if a.role == "generate"}
    assert env.pool == "cpu" and set(proxies) == {"big", "small"}
    assert sum(proxies["big"].batcher.sizes) == by_pool["big"]
    assert sum(proxies["small"].batcher.sizes) == by_pool["small"]
    # the spy's copies arrive asynchronously on nats
    await until(lambda: seen["big"] >= by_pool["big"] and seen["small"] >= by_pool["small"],
                deadline=30, what="the spy's copies of every request", state=lambda: seen)
    assert "cpu" not in seen and "default" not in seen


async def test_env_in_cpu_sends_to_the_mapped_generate_pool(memory_bus_only, tiny_model):
    """The README recipe: env nodes in ``cpu``, generation in ``small``; no route rules. The
    EnvManager in pool ``cpu`` asks ``generate.request.small``, never its own pool."""
    bus = memory_bus_only
    cfg = cfg_of(tiny_model, pools={"small": {}, "cpu": {}},
                 mapping={"generate": "small", "env": "cpu", "reward": "cpu"})
    actors = build_actors(cfg, ["scheduler", "env", "generate", "reward"], "default")
    sched = actors[0]
    sched.total_groups, sched.bounded, sched.keep_results = 1, False, True
    assert [a.pool for a in actors] == ["default", "cpu", "small", "cpu"]
    seen = await spy(bus, cfg.run)
    async with Node(bus, actors, heartbeat_every=0):
        await asyncio.wait_for(sched.all_done.wait(), 120)
    turns = [t for d in sched.results for t in d.turns]
    assert sched.summary()["completed"] == 4 and turns
    assert {(t.pool, t.route) for t in turns} == {("small", -1)}
    assert set(seen) == {"small"} and seen["small"] >= len(turns)

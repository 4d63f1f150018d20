"""Envs as users write them: no ``instruction`` attribute, and any gymnasium env by id."""

from __future__ import annotations

import asyncio

import pytest

from rollart.config import RunConfig, convert
from rollart.envs import make_env
from rollart.envs.check import EnvCheckError, check_envs
from rollart.envs.runner import EnvRunner

PLAIN = "tests.envs.plain_envs"
FROZEN = {"type": "gym:FrozenLake-v1", "args": {"is_slippery": False, "actions": ["L", "D", "R", "U"]}}


def cfg_of(envs: dict, model: str | None = None, **rollout) -> RunConfig:
    from tests.actors.sample_actors import new_run

    data = {"run": new_run(), "envs": envs, "rollout": {"group_size": 2, "batch_groups": 1, **rollout}}
    if model is not None:
        data["model"] = {"path": model}
    return convert(data, RunConfig, source="run.yaml")


async def rollout(cfg: RunConfig, groups: int, timeout: float = 120):
    from rollart.bus.memory import MemoryBus
    from rollart.node.build import rollout_actors
    from rollart.node import Node

    bus = MemoryBus()
    await bus.connect()
    try:
        sched, actors = rollout_actors(cfg, groups=groups, bounded=False, keep_results=True)
        async with Node(bus, actors, heartbeat_every=0):
            await asyncio.wait_for(sched.all_done.wait(), timeout)
        return sched
    finally:
        await bus.close()


def system_prompt(tiny_model, d) -> str:
    from rollart.actors.env.chat import ChatFormat

    text = ChatFormat.load(tiny_model).decode(d.token_ids, skip_special=False)
    return text.split("<|im_start|>user", 1)[0]


# -- instruction is optional -------------------------------------------------------------


@pytest.mark.parametrize("executor", ["thread", "process"])
async def test_env_without_instruction_has_an_empty_one(executor):
    async with EnvRunner(f"{PLAIN}:GymStyleEnv", executor=executor, timeout=10) as runner:
        obs, _ = await runner.reset(3)
        assert obs == "Number: 3" and runner.instruction == ""
        assert (await runner.step("O"))[1] == 1.0


def test_instruction_that_is_not_a_string_is_refused():
    with pytest.raises(ValueError, match="'instruction' that is not a string"):
        make_env(f"{PLAIN}:BadInstructionEnv")


def test_env_without_instruction_passes_the_check():
    check_envs(cfg_of({"main": {"type": f"{PLAIN}:GymStyleEnv"},
                       "legal": {"type": f"{PLAIN}:ConstrainedStyleEnv", "executor": "process"}}))


async def test_env_without_instruction_runs_trajectories(tiny_model):
    """Config instruction first, else the env's (absent here: empty); no trajectory fails."""
    envs = {"main": {"type": f"{PLAIN}:ConstrainedStyleEnv", "max_turns": 1},
            "cfg": {"type": f"{PLAIN}:GymStyleEnv", "max_turns": 1, "instruction": "Say E or O.",
                    "sampling": {"max_new_tokens": 4}}}
    sched = await rollout(cfg_of(envs, model=str(tiny_model)), groups=2)
    assert sched.summary()["completed"] == 4 and len(sched.results) == 4
    for d in sched.results:
        assert d.stop_reason == "terminated" and len(d.turns) == 1
        assert "Say E or O." not in system_prompt(tiny_model, d)
    sched = await rollout(cfg_of(envs, model=str(tiny_model), env="cfg"), groups=1)
    assert sched.summary()["completed"] == 2 and len(sched.results) == 2
    assert all("Say E or O." in system_prompt(tiny_model, d) for d in sched.results)


# -- gymnasium by id ---------------------------------------------------------------------


def test_gym_frozenlake_text_and_actions():
    pytest.importorskip("gymnasium")
    env = make_env(FROZEN["type"], FROZEN["args"])
    obs, info = env.reset(0)
    assert obs == "[S]FFF\nFHFH\nFFFH\nHFFG" and info["success"] is False
    assert env.legal_actions() == ["L", "D", "R", "U"]
    assert "L, D, R, U" in env.instruction
    obs, r, term, trunc, info = env.step("x")  # not an action: nothing happens
    assert obs.endswith("[S]FFF\nFHFH\nFFFH\nHFFG") and r == 0 and not term and info["valid_action"] is False
    for a in "RRDDD":
        obs, r, term, trunc, info = env.step(a)
        assert not term and info["valid_action"] and not info["success"]
    obs, r, term, trunc, info = env.step("R")
    assert obs.endswith("HFF[G]") and r == 1.0 and term and info["success"] is True
    with pytest.raises(RuntimeError):
        env.step("R")
    env.close()


def test_gym_index_actions_and_plain_observations():
    pytest.importorskip("gymnasium")
    env = make_env("gym:CartPole-v1")  # no ansi rendering: the observation as numbers
    obs, _ = env.reset(1)
    assert env.legal_actions() == ["0", "1"] and obs.startswith("[") and len(obs.split()) >= 4
    obs2, r, *_ = env.step("1")
    assert r == 1.0 and obs2 != obs
    env.close()
    box = make_env("gym:Pendulum-v1")
    box.reset(0)
    assert box.legal_actions() is None
    assert box.step("0.5")[4]["valid_action"] and not box.step("9")[4]["valid_action"]  # out of range


def test_gym_env_check_names_a_bad_id_and_bad_args():
    pytest.importorskip("gymnasium")
    with pytest.raises(EnvCheckError) as ei:
        check_envs(cfg_of({"main": {"type": "gym:FrozenLak-v1"}}))
    assert str(ei.value).startswith("envs.main.type: env type 'gym:FrozenLak-v1'") \
        and "Did you mean: `FrozenLake`" in str(ei.value)
    with pytest.raises(EnvCheckError, match=r"envs\.main: cannot construct.*is_slipery"):
        check_envs(cfg_of({"main": {"type": "gym:FrozenLake-v1", "args": {"is_slipery": False}}}))
    with pytest.raises(EnvCheckError, match="must name each of the 4 actions"):
        check_envs(cfg_of({"main": {"type": "gym:FrozenLake-v1", "args": {"actions": ["L", "R"]}}}))


async def test_gym_env_by_id_passes_the_check_and_completes_a_rollout(tiny_model):
    pytest.importorskip("gymnasium")
    cfg = cfg_of({"main": {**FROZEN, "max_turns": 8},
                  "proc": {**FROZEN, "executor": "process"}}, model=str(tiny_model))
    check_envs(cfg)
    sched = await rollout(cfg, groups=2)
    assert sched.summary()["completed"] == 4 and len(sched.results) == 4
    for d in sched.results:
        assert d.stop_reason in ("terminated", "truncated", "max_turns") and 1 <= len(d.turns) <= 8
        assert all(t.action in ("L", "D", "R", "U") for t in d.turns)
        assert d.success == (d.reward > 0)
        assert "FrozenLake-v1" in system_prompt(tiny_model, d)

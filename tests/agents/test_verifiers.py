"""Envs of ``type: verifiers:<taskset-id>``: a verifiers taskset defined here
(``verifiers_envs/rollart_vf_tiny.py``) played by verifiers' own episode (its env, ``null``
harness in the subprocess runtime, interception server and rubric) through the real
EnvManager and its endpoint, against the tiny torch engine."""

from __future__ import annotations

import functools
from pathlib import Path

import pytest

from rollart.envs.agent_type import is_agent, resolve_agent
from tests.actors.sample_actors import collect
from tests.agents.test_agent_endpoint import make_cfg
from tests.e2e.test_rollout import run_groups

ENVS = Path(__file__).parent / "verifiers_envs"
TINY = "verifiers:rollart_vf_tiny"


@pytest.fixture
def tiny(monkeypatch):
    """The test taskset, importable by id (verifiers imports ids as top-level modules)."""
    pytest.importorskip("verifiers.v1")
    pytest.importorskip("uvicorn")
    monkeypatch.syspath_prepend(str(ENVS))
    import rollart_vf_tiny

    return rollart_vf_tiny


def test_the_type_names_the_verifiers_agent_or_says_what_is_missing(monkeypatch):
    """Runs with or without verifiers installed."""
    import importlib.util

    from rollart.agents import verifiers_agent
    from rollart.envs import agent_type

    assert is_agent(TINY) and is_agent("agent:a.b:c") and not is_agent("frozenlake")
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *a: None if name == "verifiers" else real(name, *a))
    monkeypatch.setattr(agent_type, "_agents", {})
    with pytest.raises(ValueError, match=r"verifiers is not installed \(pip install verifiers\)"):
        resolve_agent("verifiers:gsm8k")
    with pytest.raises(ValueError, match="use 'verifiers:<taskset-id>'"):
        resolve_agent("verifiers:")
    assert verifiers_agent.module_name("primeintellect/wiki-search@0.1.2") == "wiki_search"


def test_a_config_naming_a_missing_taskset_is_refused(tiny, tiny_model):
    from rollart.envs.check import static_problems

    cfg = make_cfg(tiny_model, {"type": "verifiers:no-such-taskset"})
    problems = static_problems("main", cfg.envs["main"])
    assert problems and problems[0].startswith("envs.main.type") and "no module 'no_such_taskset'" in problems[0]
    cfg = make_cfg(tiny_model, {"type": "verifiers:tests.agents"})
    assert "not a taskset id" in static_problems("main", cfg.envs["main"])[0]
    assert not static_problems("main", make_cfg(tiny_model, {"type": TINY}).envs["main"])
    fn = resolve_agent(TINY)
    assert isinstance(fn, functools.partial) and fn.keywords == {"env_id": "rollart_vf_tiny"}


async def test_a_verifiers_taskset_s_episodes_are_the_trajectories(memory_bus_only, tiny_model, tiny):
    """Each trajectory is the task ``seed % num_tasks``, its reward the rubric's score of
    the reply the endpoint generated, and only the generated tokens are trained."""
    from rollart.actors.env.chat import ChatFormat

    args = {"env_args": {"num_tasks": 3}, "max_tokens": 6, "threshold": 0.2}
    cfg = make_cfg(tiny_model, {"type": TINY, "args": args}, seed=4)
    sched, actors = await run_groups(memory_bus_only, cfg, groups=2, timeout=300)
    chat = ChatFormat.load(tiny_model)
    assert len(sched.results) == 4 and len({d.seed for d in sched.results}) == 2
    for d in sched.results:
        assert len(d.turns) == 1 and d.stop_reason == "terminated"
        turn = d.turns[0]
        assert 1 <= turn.response_len <= 6
        gen = d.token_ids[turn.start:turn.start + turn.response_len]
        assert d.response_mask == [0] * turn.start + [1] * turn.response_len
        assert len(d.token_ids) == turn.start + turn.response_len == len(d.logprobs)
        i = d.seed % 3
        prompt = chat.decode(d.token_ids[:turn.start])
        assert tiny.prompt(i) in prompt and "Be brief." in prompt, prompt
        reply = chat.decode(gen).strip()
        assert d.reward == pytest.approx(tiny.score(reply, tiny.WORDS[i]), abs=1e-9), reply
        assert d.success == (d.reward >= 0.2)
    mgr = next(a for a in actors if a.role == "env")
    assert mgr._agents is not None and len(mgr._agents) == 0, "every trajectory's URL closed"


async def test_an_episode_that_fails_scoring_is_dead_lettered(memory_bus_only, tiny_model, tiny):
    args = {"env_args": {"task": {"broken": True}}, "max_tokens": 4}
    cfg = make_cfg(tiny_model, {"type": TINY, "args": args})
    sched, _ = await run_groups(memory_bus_only, cfg, groups=1, timeout=300)
    dead = await collect(memory_bus_only, cfg.run, "dead", 2, deadline=5)
    assert len(dead) == 2 and not sched.results
    for d in dead:
        assert d.kind == "permanent", d.reason
        assert d.reason.startswith("agent_error: RuntimeError: verifiers episode failed"), d.reason
        assert "the rubric is broken" in d.reason, d.reason


async def test_an_episode_past_the_deadline_is_stopped(memory_bus_only, tiny_model, tiny):
    """Scoring stalls: the trajectory ends at ``max_trajectory_s`` with its one turn
    (verifiers' episode is cancelled, its servers closed)."""
    args = {"env_args": {"task": {"stall_s": 300}}, "max_tokens": 4}
    # the deadline leaves room for verifiers to start the episode's harness on a busy host
    cfg = make_cfg(tiny_model, {"type": TINY, "args": args, "max_trajectory_s": 20})
    sched, actors = await run_groups(memory_bus_only, cfg, groups=1, timeout=120)
    assert len(sched.results) == 2
    assert all(d.stop_reason == "max_time" and len(d.turns) == 1 and d.reward == 0.0
               for d in sched.results)
    mgr = next(a for a in actors if a.role == "env")
    assert len(mgr._agents) == 0

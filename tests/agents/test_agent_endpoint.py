"""Agents of ``type: agent:...`` through the real EnvManager, its OpenAI-compatible endpoint
and the real ``openai`` client, against the tiny torch engine."""

from __future__ import annotations

import pytest

from rollart.config import RunConfig, convert
from tests.actors.sample_actors import collect, new_run
from tests.agents import sample_agents as sa
from tests.e2e.test_rollout import run_groups

pytest.importorskip("openai")
pytest.importorskip("uvicorn")

LAKE = {"map": ["SFFF", "FHFH", "FFFH", "HFFG"], "max_steps": 6}


def make_cfg(tiny_model, env: dict, **rollout) -> RunConfig:
    ro = {"group_size": 2, "batch_groups": 1, "on_failed_group": "skip", **rollout}
    return convert({"run": new_run(), "model": {"path": str(tiny_model)},
                    "envs": {"main": {"max_turns": 6, **env}}, "rollout": ro}, RunConfig)


def agent(name: str) -> str:
    return f"agent:tests.agents.sample_agents:{name}"


async def test_an_openai_client_agent_gives_the_env_path_s_trajectory(bus, tiny_model):
    """The packaged FrozenLake agent, greedy, against the EnvManager's own turn loop on the
    same env and seeds: the same tokens, mask, log-probs, versions and rewards."""
    greedy = {"sampling": {"temperature": 0}}
    env_cfg = make_cfg(tiny_model, {"type": "frozenlake", "args": LAKE, **greedy}, seed=7)
    ag_cfg = make_cfg(tiny_model, {"type": "agent:rollart.agents.examples:frozenlake",
                                   "args": LAKE, **greedy}, seed=7)
    s1, _ = await run_groups(bus, env_cfg, groups=2)
    s2, actors = await run_groups(bus, ag_cfg, groups=2)
    key = lambda d: (d.seed, d.index_in_group)  # noqa: E731
    by_seed = {key(d): d for d in s1.results}
    assert len(s2.results) == 4 and sorted(by_seed) == sorted(key(d) for d in s2.results)
    for d in s2.results:
        e = by_seed[key(d)]
        assert d.token_ids == e.token_ids and d.response_mask == e.response_mask
        assert d.logprobs == pytest.approx(e.logprobs, abs=1e-5)
        assert d.token_versions == e.token_versions
        assert (d.reward, d.success, len(d.turns)) == (e.reward, e.success, len(e.turns))
        assert sum(t.reward for t in d.turns) == d.reward, "what the trainer's admission checks"
        assert [t.action for t in d.turns] == [t.action for t in e.turns]
    mgr = next(a for a in actors if a.role == "env")
    assert mgr._agents is not None and len(mgr._agents) == 0, "every trajectory's URL closed"


async def test_logprobs_token_ids_and_streaming_are_the_engine_s(memory_bus_only, tiny_model):
    cfg = make_cfg(tiny_model, {"type": agent("echo_logprobs"),
                                "sampling": {"max_new_tokens": 5}})
    sched, _ = await run_groups(memory_bus_only, cfg, groups=1)
    assert len(sched.results) == 2
    for d in sched.results:
        seen = sa.SEEN[d.traj_id]
        assert seen["models"] == ["rollart-policy"]
        gen = [t for t, k in zip(d.token_ids, d.response_mask) if k]
        lps = [lp for lp, k in zip(d.logprobs, d.response_mask) if k]
        first = d.turns[0]
        assert seen["ids"][0] == d.token_ids[first.start:first.start + first.response_len]
        assert seen["prompt_ids"][0] == d.token_ids[:first.start]
        assert sum(len(x) for x in seen["logprobs"]) == len(gen) == sum(t.response_len for t in d.turns)
        assert [x for turn in seen["logprobs"] for x in turn] == pytest.approx(lps, abs=1e-6)
        assert len(d.turns) == 2 and d.reward == 0.5 and not d.success
        second = d.turns[1]
        from rollart.actors.env.chat import ChatFormat

        chat = ChatFormat.load(tiny_model)
        assert seen["streamed"] == chat.decode(
            d.token_ids[second.start:second.start + second.response_len])


@pytest.mark.parametrize("name, kind", [
    ("raises", "agent_error: RuntimeError: the agent's own bug"),
    ("junk", "agent_contract: request 1: the body is not JSON"),
    ("rewrites_history", "agent_contract: request 2: messages[1] differs from the assistant reply"),
    ("silent", "agent_contract: the agent made no request"),
])
async def test_a_failing_agent_is_dead_lettered_with_its_kind(memory_bus_only, tiny_model, name, kind):
    cfg = make_cfg(tiny_model, {"type": agent(name)})
    sched, _ = await run_groups(memory_bus_only, cfg, groups=1)
    dead = await collect(memory_bus_only, cfg.run, "dead", 2, deadline=5)
    assert len(dead) == 2 and not sched.results
    assert all(d.reason.startswith(kind) and d.kind == "permanent" for d in dead), [d.reason for d in dead]


async def test_a_transient_agent_failure_is_retried(memory_bus_only, tiny_model):
    cfg = make_cfg(tiny_model, {"type": agent("flaky")})
    sched, _ = await run_groups(memory_bus_only, cfg, groups=1)
    assert len(sched.results) == 2 and all(d.attempt == 2 and d.reward == 1.0 for d in sched.results)
    assert all(len(d.turns) == 1 for d in sched.results), "the failed attempt's turns are not kept"


async def test_a_hung_agent_stops_at_its_deadline(memory_bus_only, tiny_model):
    cfg = make_cfg(tiny_model, {"type": agent("hangs"), "max_trajectory_s": 1.5})
    sched, _ = await run_groups(memory_bus_only, cfg, groups=1, timeout=60)
    assert len(sched.results) == 2
    assert all(d.stop_reason == "max_time" and len(d.turns) == 1 and d.reward == 0.0
               for d in sched.results)


async def test_an_agent_hung_before_its_first_request_is_dead_lettered_at_its_deadline(
        memory_bus_only, tiny_model):
    """Nothing to train: a permanent failure that says it was the deadline."""
    cfg = make_cfg(tiny_model, {"type": agent("hangs_at_once"), "max_trajectory_s": 1.5})
    sched, _ = await run_groups(memory_bus_only, cfg, groups=1, timeout=60)
    dead = await collect(memory_bus_only, cfg.run, "dead", 2, deadline=5)
    assert len(dead) == 2 and not sched.results
    assert all(d.kind == "permanent" and d.reason.startswith(
        "agent_error: TimeoutError: no request to its endpoint within the trajectory's "
        "deadline (1.5 s") for d in dead), [d.reason for d in dead]


async def test_max_turns_ends_an_agent_that_never_stops(memory_bus_only, tiny_model):
    cfg = make_cfg(tiny_model, {"type": agent("talks_forever"), "max_turns": 3})
    sched, _ = await run_groups(memory_bus_only, cfg, groups=1, timeout=60)
    assert len(sched.results) == 2
    assert all(d.stop_reason == "max_turns" and len(d.turns) == 3 for d in sched.results)
    assert all(sum(t.reward for t in d.turns) == d.reward == 0.0 for d in sched.results)


async def test_a_plain_function_agent_runs_in_a_thread(memory_bus_only, tiny_model):
    cfg = make_cfg(tiny_model, {"type": agent("sync_agent")})
    sched, _ = await run_groups(memory_bus_only, cfg, groups=1)
    assert len(sched.results) == 2 and all(d.success and d.reward == 1.0 for d in sched.results)


def test_a_config_naming_a_missing_agent_is_refused(tiny_model):
    from rollart.envs.check import static_problems

    cfg = make_cfg(tiny_model, {"type": "agent:tests.agents.sample_agents:nope"})
    problems = static_problems("main", cfg.envs["main"])
    assert problems and "has no 'nope'" in problems[0] and problems[0].startswith("envs.main.type")
    cfg = make_cfg(tiny_model, {"type": "agent:tests.agents.sample_agents"})
    assert "use 'agent:pkg.module:function'" in static_problems("main", cfg.envs["main"])[0]


class _Session:
    """Answers every request with one reply (the HTTP layer's test: no engine behind it)."""

    def __init__(self) -> None:
        self.refused: list[str] = []

    async def complete(self, body: dict) -> dict:
        from rollart.agents.chat_request import EndpointError

        if body["messages"][-1]["content"] == "bad":
            raise EndpointError(400, "messages[0] differs from the previous request")
        return {"id": "c1", "object": "chat.completion", "created": 0, "model": "m",
                "choices": [{"index": 0, "finish_reason": "stop", "logprobs": None,
                             "message": {"role": "assistant", "content": "ok"}}],
                "usage": {"prompt_tokens": 1, "completion_tokens": 1, "total_tokens": 2}}

    def refuse(self, reason: str) -> None:
        self.refused.append(reason)


async def test_the_endpoint_speaks_openai_errors():
    import httpx
    import openai

    from rollart.agents.endpoint import AgentEndpoint

    ep = AgentEndpoint()
    await ep.start()
    try:
        session = _Session()
        url = ep.open("t-1", session)
        async with openai.AsyncOpenAI(base_url=url, api_key="-", max_retries=0) as client:
            r = await client.chat.completions.create(model="m", messages=[{"role": "user", "content": "hi"}])
            assert r.choices[0].message.content == "ok"
            with pytest.raises(openai.BadRequestError, match="differs from the previous request"):
                await client.chat.completions.create(model="m", messages=[{"role": "user", "content": "bad"}])
        async with httpx.AsyncClient() as http:
            r = await http.post(f"{url}/chat/completions", content=b"{junk")
            assert r.status_code == 400 and "not JSON" in r.json()["error"]["message"]
            assert session.refused and "not JSON" in session.refused[0]
            wrong = url.replace("/t-1/", "/t-2/")
            assert (await http.get(f"{wrong}/models")).status_code == 404
            forged = url.rsplit("/", 2)[0] + "/not-the-key/v1"
            assert (await http.get(f"{forged}/models")).status_code == 404
            ep.close("t-1")
            r = await http.get(f"{url}/models")
            assert r.status_code == 404 and r.json()["error"]["type"] == "not_found_error"
    finally:
        await ep.stop()

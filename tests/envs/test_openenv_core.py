"""``type: "openenv:<url>"`` against real OpenEnv servers: text FrozenLake as an
``openenv-core`` ``Environment`` served by openenv-core's own ``create_app`` and uvicorn in a
child process (:mod:`tests.envs.openenv_core_servers`).

:mod:`tests.envs.test_openenv` runs the same adapter against a stand-in written from the
protocol, in the default install; these need ``openenv-core`` (gradio, pandas, mcp, fastmcp
with it), which only ``make test-openenv``'s venv has, so they skip elsewhere. Each server
takes ~10-25 s to start on a loaded 2-core host (openenv-core imports gradio): the module
starts two for all the tests that leave them running, and two more for the tests that kill
or stop theirs.
"""

from __future__ import annotations

import asyncio
import contextlib
import importlib.metadata
import os
import signal
import time

import pytest

from rollart.envs.errors import EnvError, EnvSetupError, EnvTimeout
from rollart.envs.runner import EnvRunner
from tests.envs.test_openenv import MOVE, WIN, Server, runner, servers_of
from tests.waiting import until


def _openenv_core() -> str | None:
    try:
        return importlib.metadata.version("openenv-core")
    except importlib.metadata.PackageNotFoundError:
        return None


pytestmark = pytest.mark.skipif(
    _openenv_core() is None,
    reason="openenv-core is not installed (it stays out of the default install): "
           "`make test-openenv` runs these in its own venv")

LAKE = "PFFF\nFHFH\nFFFH\nHFFG"


class CoreServer(Server):
    """``python -m tests.envs.openenv_core_servers ARGS``: a real openenv-core server."""

    MODULE = "tests.envs.openenv_core_servers"
    START = 180.0  # importing openenv-core (gradio) takes ~15-25 s on a loaded 2-core host


@pytest.fixture(scope="module")
def server():
    """Per-session envs (openenv-core's default: HTTP requests each get a fresh env), room
    for four sessions at once."""
    s = CoreServer("--max-sessions", "4")
    yield s
    s.kill()


@pytest.fixture(scope="module")
def shared():
    """One env behind every request and session (a factory that returns one instance), the
    moves as the action schema's enum."""
    s = CoreServer("--shared", "--actions", "enum")
    yield s
    s.kill()


@pytest.fixture
def own_server():
    """A server of the test's own, which it may kill or stop: ``own_server(*args)``."""
    yield from servers_of(CoreServer)


async def reset_when_room(server: Server, seed: int) -> str:
    """The first observation of a new session once the server has a slot for it: a server
    frees an aborted session's slot when it notices the connection gone, which may be just
    after the next client knocks."""

    async def attempt() -> str | None:
        async with runner(server) as r:
            try:
                return (await r.reset(seed))[0]
            except EnvError as e:
                if "at capacity" in str(e):
                    return None
                raise

    return await until(attempt, deadline=60, what=f"a free session on {server.url}",
                       step=0.1, abort=server.proc.exited)


# -- episodes --------------------------------------------------------------------------------


async def test_an_episode_to_the_goal_over_a_session(server):
    async with runner(server) as r:
        obs, info = await r.reset(7)
        assert obs == LAKE and info["valid_action"] and not info["success"]
        assert info["observation"] == {"board": obs, "steps": 0}  # done, reward, metadata apart
        assert r.instruction.startswith("You act in the OpenEnv environment CoreFrozenLake: Walk")
        assert r.legal_actions() is None  # free text: the schema has no enum
        for move in WIN[:-1]:
            _, reward, term, trunc, info = await r.step(move)
            assert (reward, term, trunc, info["success"], info["valid_action"]) == \
                (0.0, False, False, False, True)
        obs, reward, term, trunc, info = await r.step(WIN[-1])
        assert obs == "SFFF\nFHFH\nFFFH\nHFFP"
        assert (reward, term, trunc, info["success"]) == (1.0, True, False, True)
        assert info["observation"]["steps"] == 6
        with pytest.raises(EnvError, match="after the episode ended"):
            await r.step("L")
        assert (await r.reset(8))[0] == LAKE  # the same session plays another episode


async def test_a_hole_ends_the_episode_without_success(server):
    async with runner(server) as r:
        await r.reset(1)
        await r.step("D")
        _, reward, term, _, info = await r.step("R")
        assert (reward, term, info["success"]) == (0.0, True, False)


async def test_bad_actions(server):
    """A move the game does not know wastes a step; one openenv-core's pydantic validation
    rejects (empty; an extra field) is invalid, never reaches the env, and says why."""
    async with runner(server, invalid_reward=-0.5) as r:
        await r.reset(1)
        obs, reward, _, _, info = await r.step("jump")
        assert obs == LAKE and reward == 0.0 and info["valid_action"]
        assert info["observation"]["steps"] == 1
        obs, reward, term, _, info = await r.step("")
        assert obs == LAKE and reward == -0.5 and not term and not info["valid_action"]
        assert "VALIDATION_ERROR" in info["error"] and "string_too_short" in info["error"]
        _, _, _, _, info = await r.step("R")
        assert info["observation"]["steps"] == 2
    async with EnvRunner(server.type, {"action_field": None}, timeout=20) as r:
        await r.reset(1)
        obs, _, _, _, info = await r.step('{"move": "R"}')
        assert obs.startswith("SP") and info["valid_action"]
        obs, _, _, _, info = await r.step('{"move": "R", "speed": 2}')
        assert obs.startswith("SP") and not info["valid_action"]
        assert "extra_forbidden" in info["error"] and "speed" in info["error"]


async def test_concurrent_sessions_are_isolated_up_to_the_servers_capacity(server):
    """Four sessions play at once, each on its own env; a fifth is refused transiently
    (``CAPACITY_REACHED``) until one closes."""
    routes = {"goal": WIN, "hole": ["D", "R"], "mid": ["R", "R", "D"], "jump": ["jump", "D"]}
    ends = {"goal": (1.0, True, "SFFF\nFHFH\nFFFH\nHFFP"), "hole": (0.0, True, "SFFF\nFPFH\nFFFH\nHFFG"),
            "mid": (0.0, False, "SFFF\nFHPH\nFFFH\nHFFG"), "jump": (0.0, False, "SFFF\nPHFH\nFFFH\nHFFG")}
    async with contextlib.AsyncExitStack() as stack:
        rs = {name: await stack.enter_async_context(runner(server)) for name in routes}
        await asyncio.gather(*(r.reset(i) for i, r in enumerate(rs.values())))  # all open now

        async def play(name: str) -> tuple[float, bool, str]:
            for move in routes[name]:
                obs, reward, term, _, _ = await rs[name].step(move)
            return reward, term, obs

        got = await asyncio.gather(*(play(name) for name in routes))
        assert dict(zip(routes, got)) == ends
        async with runner(server) as fifth:
            with pytest.raises(EnvError, match=r"at capacity \(4 of 4 sessions\)") as ei:
                await fifth.reset(1)
            assert not isinstance(ei.value, EnvSetupError)
    async with runner(server) as again:  # the four closed their sessions: room again
        assert (await again.reset(1))[0] == LAKE


# -- what the real server says no to ---------------------------------------------------------


@pytest.mark.parametrize("args, named", [
    ({}, "'action_field': the server's action has no field 'message'; its fields: move"),
    ({**MOVE, "observation_field": "text"}, "observation has no field 'text'; its fields: board, steps"),
])
async def test_a_field_the_schema_lacks_fails_construction(server, args, named):
    """Checked against openenv-core's own ``/schema`` (pydantic's JSON schema, with the
    ``metadata``, ``done`` and ``reward`` fields every action and observation has)."""
    async with EnvRunner(server.type, args, timeout=20) as r:
        with pytest.raises(EnvSetupError) as ei:
            await r.reset(1)
    assert named in str(ei.value)


async def test_a_url_without_openenv_behind_it_is_permanent(server):
    async with EnvRunner(f"openenv:{server.url}/nope", MOVE, timeout=20) as r:
        with pytest.raises(EnvSetupError, match=r"GET /health answered HTTP 404"):
            await r.reset(1)


async def test_http_endpoints_build_a_fresh_env_per_request(server):
    """openenv-core >= 0.2: ``POST /reset`` works, but ``POST /step`` acts on a new env that
    was never reset, so the episode needs ``/ws`` (the default transport)."""
    async with runner(server, "http") as r:
        assert (await r.reset(1))[0] == LAKE
        with pytest.raises(EnvError, match=r"POST /step answered HTTP 500") as ei:
            await r.step("R")
        assert not isinstance(ei.value, EnvSetupError)


# -- one env behind every request: HTTP keeps the episode, the schema's enum -----------------


@pytest.mark.parametrize("transport", ["ws", "http"])
async def test_an_episode_on_a_shared_env(shared, transport):
    async with runner(shared, transport, invalid_reward=-1.0) as r:
        assert (await r.reset(1))[0] == LAKE
        assert r.legal_actions() == ["L", "D", "R", "U"]  # from the action schema's enum
        obs, reward, _, _, info = await r.step("jump")  # not one of the enum: never applied
        assert obs == LAKE and reward == -1.0 and not info["valid_action"]
        assert "literal_error" in info["error"]
        assert ("HTTP 422" if transport == "http" else "VALIDATION_ERROR") in info["error"]
        for move in WIN:
            obs, reward, term, _, info = await r.step(move)
        assert (reward, term, info["success"], info["observation"]["steps"]) == (1.0, True, True, 6)


@pytest.mark.parametrize("transport", ["ws", "http"])
async def test_an_env_that_raises_fails_the_step(shared, transport):
    """Two clients of the one env: one walking into a hole ends the episode under the other,
    whose step the env then refuses (openenv-core: ``EXECUTION_ERROR`` over ``/ws``, HTTP 500
    over ``POST /step``): a RuntimeError naming it, not a setup error."""
    async with runner(shared, transport) as a, runner(shared, transport) as b:
        await b.reset(1)
        await a.reset(1)
        await a.step("D")
        await a.step("R")  # into the hole: the shared episode is over
        want = "EXECUTION_ERROR" if transport == "ws" else r"POST /step answered HTTP 500"
        with pytest.raises(EnvError, match=want) as ei:
            await b.step("R")
        assert not isinstance(ei.value, EnvSetupError)
        if transport == "ws":
            assert "reset first" in str(ei.value)


# -- a server that goes away or stops answering ----------------------------------------------


async def test_server_killed_mid_episode(own_server):
    """SIGKILL with a session (``/ws``) and an HTTP client mid-episode: each next step is a
    ``ConnectionError`` at once (transient); a new env cannot be reached (transient too)."""
    s = own_server("--shared")
    async with runner(s) as ws, runner(s, "http") as http:
        await ws.reset(1)
        await ws.step("R")
        await http.reset(1)
        await http.step("R")
        s.kill()
        for r in (ws, http):
            t0 = time.monotonic()
            with pytest.raises(EnvError, match="ConnectionError") as ei:
                await r.step("R")
            assert time.monotonic() - t0 < 30 and not isinstance(ei.value, EnvSetupError)
    for transport in ("ws", "http"):
        async with runner(s, transport) as again:
            with pytest.raises(EnvError, match="cannot be reached") as ei:
                await again.reset(1)
            assert not isinstance(ei.value, EnvSetupError), ei.value


async def test_a_stopped_server_times_out_and_frees_the_session(own_server):
    """A server that stops answering (SIGSTOP): the env's own ``timeout`` and, apart, the
    runner's deadline each drop the session's connection, so openenv-core frees its one
    session slot once it runs again and the next trajectory gets it."""
    s = own_server("--max-sessions", "1")
    pid = s.proc.proc.pid
    async with runner(s, timeout=1.0) as r:
        await r.reset(1)
        os.kill(pid, signal.SIGSTOP)
        try:
            t0 = time.monotonic()
            with pytest.raises(EnvError, match=r"TimeoutError: .*within 1s") as ei:
                await r.step("R")
            assert time.monotonic() - t0 < 30 and not isinstance(ei.value, EnvSetupError)
        finally:
            os.kill(pid, signal.SIGCONT)
    assert await reset_when_room(s, 2) == LAKE
    async with runner(s) as r:  # env timeout 20 s, the runner's deadline 0.5 s
        assert (await r.reset(2))[0] == LAKE
        os.kill(pid, signal.SIGSTOP)
        try:
            with pytest.raises(EnvTimeout):
                await r.step("R", timeout=0.5)
        finally:
            os.kill(pid, signal.SIGCONT)
    assert await reset_when_room(s, 3) == LAKE


# -- end to end ------------------------------------------------------------------------------


async def test_trajectories_through_the_actors(server, tiny_model):
    """The start-up check passes and a group completes through the real actors (scheduler,
    EnvManager, a tiny torch engine) with the env on the real OpenEnv server."""
    from rollart.envs.check import check_envs
    from tests.envs.test_env_plugins import cfg_of, rollout

    envs = {"main": {"type": server.type, "args": MOVE, "max_turns": 2,
                     "sampling": {"max_new_tokens": 4}}}
    cfg = cfg_of(envs, model=str(tiny_model))
    await asyncio.to_thread(check_envs, cfg)
    sched = await rollout(cfg, groups=1, timeout=60)
    assert sched.summary()["completed"] == 2 and len(sched.results) == 2
    for d in sched.results:
        assert d.stop_reason in ("terminated", "max_turns") and 1 <= len(d.turns) <= 2

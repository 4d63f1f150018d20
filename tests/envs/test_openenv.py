"""``type: "openenv:<url>"`` against a real OpenEnv-style server in a child process
(:mod:`tests.envs.openenv_server`: text FrozenLake, action ``{"move": ...}``)."""

from __future__ import annotations

import asyncio
import os
import signal
import socket
import time
from types import SimpleNamespace

import pytest

from rollart.envs.errors import EnvError, EnvSetupError, EnvTimeout
from rollart.envs.openenv import OpenEnvEnv
from rollart.envs.runner import EnvRunner
from tests.child_output import ROOT, ReadProcess
from tests.waiting import until_sync

TRANSPORTS = ["ws", "http"]
MOVE = {"action_field": "move"}
WIN = ["R", "R", "D", "D", "D", "R"]  # the classic 4x4 map: S(0,0) .. G(3,3) around the holes


class Server:
    """``python -m MODULE`` (the stand-in: :mod:`tests.envs.openenv_server`), ready once its
    ``/health`` answers."""

    MODULE = "tests.envs.openenv_server"
    START = 60.0  # seconds it may take to print its port

    def __init__(self, *args: str) -> None:
        import httpx

        self.proc = ReadProcess(["-m", self.MODULE, *args], cwd=ROOT, name=self.MODULE)
        line = self.proc.line_with_sync("PORT ", deadline=self.START)
        self.url = f"http://127.0.0.1:{int(line.split()[1])}"

        def healthy() -> bool:
            try:
                return httpx.get(self.url + "/health", timeout=2).status_code == 200
            except httpx.TransportError:
                return False

        until_sync(healthy, deadline=60, what=f"{self.url}/health", abort=self.proc.exited,
                   state=lambda: self.proc.output(last=40))

    @property
    def type(self) -> str:
        return f"openenv:{self.url}"

    def kill(self) -> None:
        self.proc.kill()


@pytest.fixture(scope="module")
def server():
    s = Server()
    yield s
    s.kill()


def servers_of(kind: type[Server]):
    """A test's own servers of ``kind`` (ones it may kill or stop), as a fixture body: yields
    ``start(*args)``, then stops every server it started, a stopped (SIGSTOP) one too."""
    made: list[Server] = []

    def start(*args: str) -> Server:
        made.append(kind(*args))
        return made[-1]

    yield start
    for s in made:
        if s.proc.proc.poll() is None:
            os.kill(s.proc.proc.pid, signal.SIGCONT)
        s.kill()


@pytest.fixture
def own_server():
    """A server of the test's own (one it may kill or stop): ``own_server(*args)``."""
    yield from servers_of(Server)


def runner(server: Server, transport: str = "ws", **args) -> EnvRunner:
    return EnvRunner(server.type, {**MOVE, "transport": transport, **args}, timeout=20)


# -- episodes --------------------------------------------------------------------------------


@pytest.mark.parametrize("transport", TRANSPORTS)
async def test_an_episode_to_the_goal(server, transport):
    async with runner(server, transport) as r:
        obs, info = await r.reset(7)
        assert obs == "PFFF\nFHFH\nFFFH\nHFFG" and info["valid_action"] and not info["success"]
        assert info["observation"] == {"board": obs, "steps": 0}
        assert r.instruction.startswith("You act in the OpenEnv environment TestFrozenLake: Walk")
        assert r.legal_actions() is None  # free text: the schema has no enum
        for move in WIN[:-1]:
            obs, reward, term, trunc, info = await r.step(move)
            assert (reward, term, trunc, info["success"]) == (0.0, False, False, False)
            assert info["valid_action"]
        obs, reward, term, trunc, info = await r.step(WIN[-1])
        assert obs == "SFFF\nFHFH\nFFFH\nHFFP"
        assert (reward, term, trunc, info["success"]) == (1.0, True, False, True)
        assert info["observation"]["steps"] == 6
        with pytest.raises(EnvError, match="after the episode ended"):
            await r.step("L")
        obs, _ = await r.reset(8)  # the same env plays another episode
        assert obs.startswith("P")


async def test_a_hole_ends_the_episode_without_success(server):
    async with runner(server) as r:
        await r.reset(1)
        await r.step("D")
        _, reward, term, _, info = await r.step("R")
        assert (reward, term, info["success"]) == (0.0, True, False)


async def test_success_reward_is_the_threshold(server):
    async with runner(server, success_reward=2.0) as r:
        await r.reset(1)
        for move in WIN:
            _, reward, term, _, info = await r.step(move)
        assert (reward, term, info["success"]) == (1.0, True, False)


async def test_observation_field_and_instruction_args(server):
    async with runner(server, observation_field="steps", instruction="Go.") as r:
        assert (await r.reset(1))[0] == "0" and r.instruction == "Go."
        assert (await r.step("R"))[0] == "1"


@pytest.mark.parametrize("transport", TRANSPORTS)
async def test_bad_actions(server, transport):
    """An unknown move is the game's business (a valid action that wastes a step); one the
    action schema rejects (empty) is invalid: not applied, ``invalid_reward``, the reason."""
    async with runner(server, transport, invalid_reward=-0.5) as r:
        await r.reset(1)
        obs, reward, _, _, info = await r.step("jump")
        assert obs.startswith("P") and reward == 0.0 and info["valid_action"]
        assert info["observation"]["steps"] == 1
        obs, reward, term, _, info = await r.step("")
        assert obs.startswith("P") and reward == -0.5 and not term
        assert not info["valid_action"] and not info["success"]
        assert "string_too_short" in info["error"]
        assert ("HTTP 422" if transport == "http" else "VALIDATION_ERROR") in info["error"]
        _, _, _, _, info = await r.step("R")
        assert info["observation"]["steps"] == 2  # the rejected one never reached the game


async def test_json_actions(server):
    async with EnvRunner(server.type, {"action_field": None}, timeout=20) as r:
        await r.reset(1)
        obs, _, _, _, info = await r.step('{"move": "R"}')
        assert obs.startswith("SP") and info["valid_action"]
        for text in ("R", "[1]", '{"move": "R", "speed": 2}'):
            obs, _, _, _, info = await r.step(text)
            assert obs.startswith("SP") and not info["valid_action"], text
        assert "speed" in info["error"]


async def test_sessions_are_isolated(server):
    async with runner(server) as a, runner(server) as b:
        await a.reset(1)
        await b.reset(2)
        assert (await a.step("R"))[0].startswith("SP")
        assert (await b.step("D"))[0].startswith("SFFF\nP")
        assert (await a.step("R"))[0].startswith("SFP")


def test_enum_of_the_action_field_is_the_legal_actions():
    env = SimpleNamespace(action_field="move")
    schema = {"properties": {"move": {"enum": ["L", "D", "R", "U"]}}}
    assert OpenEnvEnv._enum_of(env, schema) == ["L", "D", "R", "U"]
    assert OpenEnvEnv._enum_of(env, {"properties": {"move": {"type": "string"}}}) is None


# -- what the server says no to ------------------------------------------------------------


@pytest.mark.parametrize("args, named", [
    ({}, "'action_field': the server's action has no field 'message'; its fields: move"),
    ({**MOVE, "observation_field": "text"}, "observation has no field 'text'; its fields: board, steps"),
])
async def test_a_field_the_schema_lacks_fails_construction(server, args, named):
    async with EnvRunner(server.type, args, timeout=20) as r:
        with pytest.raises(EnvSetupError) as ei:
            await r.reset(1)
    assert named in str(ei.value)


async def test_a_url_without_openenv_behind_it_is_permanent(server):
    async with EnvRunner(f"openenv:{server.url}/nope", MOVE, timeout=20) as r:
        with pytest.raises(EnvSetupError, match=r"GET /health answered HTTP 404"):
            await r.reset(1)


async def test_http_4xx_on_a_step_names_status_and_body(server):
    """Over HTTP every client shares the server's one env: one ending the episode under
    another makes the other's step a 409, raised with its body."""
    async with runner(server, "http") as a, runner(server, "http") as b:
        await b.reset(1)
        await a.reset(1)
        await a.step("D")
        await a.step("R")  # into the hole: the shared episode is over
        with pytest.raises(EnvError, match=r"POST /step answered HTTP 409: .*reset first"):
            await b.step("R")


async def test_a_full_server_refuses_the_session_transiently(own_server):
    s = own_server("--max-sessions", "1")
    async with runner(s) as first:
        await first.reset(1)
        async with runner(s) as second:
            with pytest.raises(EnvError, match="at capacity") as ei:
                await second.reset(1)
            assert not isinstance(ei.value, EnvSetupError)
    async with runner(s) as third:  # the first session was closed: room again
        assert (await third.reset(1))[0].startswith("P")


# -- a server that goes away -----------------------------------------------------------------


@pytest.mark.parametrize("transport", TRANSPORTS)
async def test_server_killed_mid_episode(own_server, transport):
    s = own_server()
    async with runner(s, transport) as r:
        await r.reset(1)
        await r.step("R")
        s.kill()  # SIGKILL
        t0 = time.monotonic()
        with pytest.raises(EnvError, match="ConnectionError") as ei:
            await r.step("R")
        assert time.monotonic() - t0 < 30
        assert not isinstance(ei.value, EnvSetupError)
    async with runner(s, transport) as again:  # a new env: unreachable at construction
        t0 = time.monotonic()
        with pytest.raises(EnvError, match="cannot be reached") as ei:
            await again.reset(1)
        assert not isinstance(ei.value, EnvSetupError), ei.value
        assert time.monotonic() - t0 < 30


@pytest.mark.parametrize("transport", TRANSPORTS)
async def test_a_server_that_stops_answering_times_out(own_server, transport):
    s = own_server()
    async with runner(s, transport, timeout=1.0) as r:
        await r.reset(1)
        os.kill(s.proc.proc.pid, signal.SIGSTOP)
        try:
            t0 = time.monotonic()
            with pytest.raises(EnvError, match="TimeoutError: .*within 1s") as ei:
                await r.step("R")
            assert time.monotonic() - t0 < 30 and not isinstance(ei.value, EnvSetupError)
        finally:
            os.kill(s.proc.proc.pid, signal.SIGCONT)


async def test_the_runners_deadline_frees_the_session(own_server):
    """A step the runner gives up on (its deadline before the env's own) drops the session's
    connection, so a server with room for one session serves the next trajectory."""
    s = own_server("--max-sessions", "1")
    async with runner(s) as r:
        await r.reset(1)
        os.kill(s.proc.proc.pid, signal.SIGSTOP)
        try:
            with pytest.raises(EnvTimeout):
                await r.step("R", timeout=0.5)
        finally:
            os.kill(s.proc.proc.pid, signal.SIGCONT)
    async with runner(s) as nxt:
        assert (await nxt.reset(2))[0].startswith("P")


async def test_process_executor(server):
    async with EnvRunner(server.type, MOVE, executor="process", timeout=20) as r:
        assert (await r.reset(1))[0].startswith("P")
        assert (await r.step("R"))[0].startswith("SP")


async def test_an_unreachable_url_is_transient():
    with socket.socket() as sock:  # a port nothing listens on
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    async with EnvRunner(f"openenv:http://127.0.0.1:{port}", MOVE, timeout=20) as r:
        t0 = time.monotonic()
        with pytest.raises(EnvError, match=f"127.0.0.1:{port} cannot be reached") as ei:
            await r.reset(1)
        assert not isinstance(ei.value, EnvSetupError) and time.monotonic() - t0 < 30


# -- end to end ------------------------------------------------------------------------------


async def test_trajectories_through_the_actors(server, tiny_model):
    """The start-up check passes and a group completes through the real actors (scheduler,
    EnvManager, a tiny torch engine) with the env on the OpenEnv server."""
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

"""The agent endpoint fails closed (issue 43, finding 7).

Any local process can reach an EnvManager's OpenAI-compatible endpoint, and an agent is code
the run does not control. Each test throws one attack found against the endpoint at the real
server (uvicorn on a real socket, the real ``openai`` client beside it) and checks that it
ends in a named refusal while a legitimate agent is still served:

- 1,000 idle connections (from another process, at the usual 1,024 open-file limit) once
  took every file descriptor, locked out the agent and logged an error per retried accept;
- a 200 MiB body was read whole (+600 MB);
- deep nesting, a 5,000-digit integer, ``tools: [1, "x"]``, a non-ASCII key in the URL were
  HTTP 500s;
- a 10 MB message was tokenised for 10 s on the EnvManager's event loop.
"""

from __future__ import annotations

import asyncio
import json
import logging
import resource
import subprocess
import sys
import textwrap
import time
from urllib.parse import quote

import msgspec
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from rollart import messages as m
from rollart.actors.env.chat import ChatFormat
from rollart.agents.chat_request import MAX_DEPTH, decode_request, nesting_depth
from rollart.agents.endpoint import AgentEndpoint
from rollart.actors.env.agent_loop import AgentTrajectory
from rollart.agents.threads import AgentThreads
from rollart.config import RunConfig, convert
from tests.actors.sample_actors import collect, new_run
from tests.e2e.test_rollout import run_groups
from tests.waiting import until

pytest.importorskip("openai")
pytest.importorskip("uvicorn")
httpx = pytest.importorskip("httpx")

MiB = 1 << 20
GOOD = {"model": "m", "messages": [{"role": "user", "content": "hi"}]}


class Session:
    """Answers every request with one reply, noting refusals (the HTTP layer's test)."""

    def __init__(self) -> None:
        self.refused: list[str] = []
        self.completed = 0

    async def complete(self, body: dict) -> dict:
        self.completed += 1
        return {"id": "c1", "object": "chat.completion", "created": 0, "model": "m",
                "choices": [{"index": 0, "finish_reason": "stop", "logprobs": None,
                             "message": {"role": "assistant", "content": "ok"}}],
                "usage": {"prompt_tokens": 1, "completion_tokens": 1, "total_tokens": 2}}

    def refuse(self, reason: str) -> None:
        self.refused.append(reason)


async def ask(url: str) -> str:
    """One chat completion through the real openai client (a legitimate agent's turn)."""
    import openai

    async with openai.AsyncOpenAI(base_url=url, api_key="-", max_retries=0, timeout=20) as c:
        r = await c.chat.completions.create(**GOOD)
    return r.choices[0].message.content


def rss() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * resource.getpagesize()


async def peak_growth(aw) -> tuple[object, float]:
    """``aw``'s result and the most this process's RSS grew (MiB) while it ran, sampled on
    the loop (the body the endpoint reads is freed once refused: the peak is what counts)."""
    before, peak = rss(), 0
    task = asyncio.ensure_future(aw)
    while not task.done():
        peak = max(peak, rss() - before)
        await asyncio.wait([task], timeout=0.005)
    return task.result(), peak / MiB


FLOOD_N = 1100
"""Idle connections thrown at the endpoint: more than the usual 1,024 open files."""
FLOOD = textwrap.dedent("""
    import resource, socket, sys, time
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (max(soft, min(hard, 4096)), hard))
    socks = []
    for _ in range(int(sys.argv[2])):
        s = socket.create_connection(("127.0.0.1", int(sys.argv[1])))
        s.send(b"POST /t/x/y/v1/chat/comp")  # a head begun and never ended
        socks.append(s)
    print("open", len(socks), flush=True)
    sys.stdin.read()  # held until the test ends
""")


@pytest.fixture
def usual_file_limit():
    """This process at the usual 1,024 open files (this host allows more), as the
    EnvManager that ran out of them was."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (min(1024, hard), hard))
    try:
        yield
    finally:
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))


def accept_queue(port: int) -> int:
    """Connections waiting in the kernel for the server on ``port`` to accept them."""
    for name in ("/proc/net/tcp", "/proc/net/tcp6"):
        with open(name) as f:
            for row in f.read().splitlines()[1:]:
                cols = row.split()
                if cols[3] == "0A" and int(cols[1].rsplit(":", 1)[1], 16) == port:
                    return int(cols[4].split(":")[1], 16)
    return 0


async def post_streamed(url: str, mib: int) -> int | None:
    """POST ``mib`` MiB as a chunked body (no length); the status, or None when the server
    closed before the client sent it all."""
    chunk = b"x" * MiB

    async def body():
        for _ in range(mib):
            yield chunk

    async with httpx.AsyncClient(timeout=30) as http:
        try:
            return (await http.post(f"{url}/chat/completions", content=body())).status_code
        except httpx.TransportError:
            return None


@pytest.mark.slow
async def test_an_agent_is_served_while_1000_idle_connections_and_a_200_mib_body_come(
        usual_file_limit, caplog):
    """The issue's done-when: a flood of 1,100 connections that each began a head and went
    quiet, from another process (the endpoint's at the usual 1,024 open files), then a 200 MiB body streamed to an authenticated URL, while
    an agent asks for its turns."""
    ep = AgentEndpoint()  # the defaults: 320 connections, 30 s, 4 MiB
    await ep.start()
    flood = subprocess.Popen([sys.executable, "-c", FLOOD, str(ep.port), str(FLOOD_N)],
                             stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        legit, victim = Session(), Session()
        url, big_url = ep.open("t-legit", legit), ep.open("t-big", victim)
        line = await asyncio.wait_for(asyncio.to_thread(flood.stdout.readline), 60)
        assert line.startswith(f"open {FLOOD_N}"), line
        await until(lambda: accept_queue(ep.port) == 0, deadline=20,
                    what=f"the endpoint accepting the flood of {FLOOD_N} connections",
                    state=lambda: f"{accept_queue(ep.port)} not accepted")
        t0 = time.monotonic()
        assert await asyncio.wait_for(ask(url), 20) == "ok"
        served_s = time.monotonic() - t0
        sent = asyncio.ensure_future(peak_growth(post_streamed(big_url, 200)))
        assert await asyncio.wait_for(ask(url), 20) == "ok", "served while the body comes"
        status, grew = await sent
        assert status in (413, None)
        assert grew < 64, f"the endpoint's process grew {grew:.0f} MiB on a refused body"
        assert victim.refused and "agent_max_request_bytes" in victim.refused[0]
        assert victim.completed == 0 and legit.completed == 2
        assert len(ep.connections.open) <= ep.connections.cap
        assert ep.connections.evicted >= FLOOD_N - ep.connections.cap
        errors = [r for r in caplog.records if r.levelno >= logging.ERROR]
        assert not errors, [r.getMessage()[:200] for r in errors[:3]]
        print(f"served in {served_s * 1000:.0f} ms behind {FLOOD_N} idle connections "
              f"({ep.connections.evicted} evicted); peak RSS +{grew:.1f} MiB on a 200 MiB body")
    finally:
        flood.kill()
        flood.wait()
        await ep.stop()


async def test_a_200_mib_body_is_refused_before_it_is_read():
    ep = AgentEndpoint()
    await ep.start()
    try:
        victim = Session()
        url = ep.open("t-big", victim)
        # declared: refused from its Content-Length, before one byte of it is sent
        reader, writer = await asyncio.open_connection("127.0.0.1", ep.port)
        path = url.split(str(ep.port), 1)[1]
        writer.write(f"POST {path}/chat/completions HTTP/1.1\r\nhost: x\r\n"
                     f"content-length: {200 * MiB}\r\n\r\n".encode())
        head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 10)
        assert head.startswith(b"HTTP/1.1 413") and b"connection: close" in head.lower()
        writer.close()
        status, grew = await peak_growth(post_streamed(url, 200))  # chunked: read to the bound
        assert status in (413, None)
        assert grew < 64, f"the endpoint's process grew {grew:.0f} MiB on refused bodies"
        assert len(victim.refused) == 2 and victim.completed == 0
        assert all("rollout.agent_max_request_bytes" in x for x in victim.refused)
    finally:
        await ep.stop()


async def test_a_connection_that_sends_no_request_head_in_time_is_closed():
    """A deadline per head that trickled bytes do not extend (slowloris)."""
    ep = AgentEndpoint(request_timeout=0.5)
    await ep.start()
    try:
        url = ep.open("t-1", Session())
        reader, writer = await asyncio.open_connection("127.0.0.1", ep.port)
        t0 = time.monotonic()
        for b in b"POST /t/t-1/":
            if reader.at_eof():
                break
            writer.write(bytes([b]))
            await asyncio.sleep(0.1)
        assert await asyncio.wait_for(reader.read(), 10) == b""  # closed by the server
        assert 0.4 < time.monotonic() - t0 < 5 and ep.connections.timed_out == 1
        writer.close()
        assert await ask(url) == "ok"
    finally:
        await ep.stop()


async def test_at_the_cap_a_new_connection_is_closed_when_every_one_is_busy():
    """No idle connection to close for it: the newcomer is, and the busy one is served."""
    release = asyncio.Event()

    class Slow(Session):
        async def complete(self, body: dict) -> dict:
            await release.wait()
            return await super().complete(body)

    ep = AgentEndpoint(max_connections=1)
    await ep.start()
    try:
        url = ep.open("t-1", Slow())
        busy = asyncio.ensure_future(ask(url))
        await until(lambda: ep.connections.open and next(iter(ep.connections.open)).busy(),
                    deadline=10, what="the first request in progress")
        reader, writer = await asyncio.open_connection("127.0.0.1", ep.port)
        assert await asyncio.wait_for(reader.read(), 10) == b""
        writer.close()
        assert ep.connections.refused == 1 and not busy.done()
        release.set()
        assert await busy == "ok"
    finally:
        await ep.stop()


BAD = [
    ("deep nesting", b'{"messages": [{"role": "user", "content": "x"}], "tools": [{"function": '
                     b'{"name": "f", "parameters": {"a": ' + b"[" * 5000 + b"]" * 5000 + b"}}}]}",
     "nested too deeply"),
    ("deep nesting where an object belongs", b'{"messages": ' + b"[" * 5000 + b"]" * 5000
     + b"}", "Expected `object`, got `array` - at `$.messages[0]`"),
    ("deep nesting in a tool schema", json.dumps(
        {**GOOD, "tools": [{"type": "function", "function": {
            "name": "f", "parameters": json.loads("{\"a\":" * 40 + "1" + "}" * 40)}}]}).encode(),
     "nested too deeply"),
    ("a 5,000-digit integer", json.dumps({**GOOD, "max_tokens": 0}).encode().replace(
        b"0", b"9" * 5000), "Integer value out of range"),
    ("tools: [1, 'x']", json.dumps({**GOOD, "tools": [1, "x"]}).encode(),
     "Expected `object`, got `int` - at `$.tools[0]`"),
    ("a wrong role", json.dumps({"messages": [{"role": "robot", "content": "x"}]}).encode(),
     "$.messages[0].role"),
    ("messages missing", b'{"model": "m"}', "missing required field `messages`"),
    ("not JSON", b"{junk", "the body is not JSON"),
    ("not UTF-8", b'{"messages": [{"role": "user", "content": "\xff"}]}', "the body is not JSON"),
    ("a lone surrogate", b'{"model": "\\ud800", "messages": []}', "the body is not JSON"),
    ("a float out of range", json.dumps({**GOOD, "max_tokens": 1}).encode().replace(
        b'"max_tokens": 1', b'"max_tokens": 1e999'), "max_tokens"),
]


@pytest.mark.parametrize("what, body, says", BAD, ids=[b[0] for b in BAD])
async def test_a_malformed_request_is_a_named_400_and_refuses_the_trajectory(what, body, says):
    ep = AgentEndpoint()
    await ep.start()
    try:
        session = Session()
        url = ep.open("t-1", session)
        async with httpx.AsyncClient() as http:
            r = await http.post(f"{url}/chat/completions", content=body)
        assert r.status_code == 400, (r.status_code, r.text[:300])
        err = r.json()["error"]
        assert says in err["message"] and err["type"] == "invalid_request_error", err
        assert session.refused == [err["message"]] and session.completed == 0
    finally:
        await ep.stop()


async def test_non_ascii_keys_and_headers_are_a_404_or_ignored():
    ep = AgentEndpoint()
    await ep.start()
    try:
        session = Session()
        url = ep.open("t-1", session)
        base = url.rsplit("/", 2)[0]
        async with httpx.AsyncClient() as http:
            for key in ("%C3%A9t%C3%A9", "%FF%FE", "\u00e9"):
                r = await http.get(f"{base}/{key}/v1/models")
                assert r.status_code == 404 and r.json()["error"]["type"] == "not_found_error"
            r = await http.post(f"{url}/chat/completions", json=GOOD,
                                headers={"authorization": "Bearer \u00e9\u00e8".encode("latin-1")})
            assert r.status_code == 200  # the key is in the URL: the header is not read
        assert not session.refused
    finally:
        await ep.stop()


def test_a_chat_template_that_refuses_the_messages_is_a_contract_error(tiny_model):
    """A real model's template raises on messages it cannot render (Qwen's: a system message
    after the first): an agent_contract refusal, not an HTTP 500."""
    from rollart.agents.conversation import ContractError, Conversation

    chat = ChatFormat.load(tiny_model)
    chat.tok.chat_template = ("{% if messages[-1].role == 'system' %}{{ raise_exception("
                              "'System message must be at the beginning.') }}{% endif %}x")
    assert Conversation(chat).prompt([{"role": "user", "content": "x"}])
    with pytest.raises(ContractError, match="System message must be at the beginning"):
        Conversation(chat).prompt([{"role": "user", "content": "x"},
                                   {"role": "system", "content": "y"}])


# -- the trajectory behind the endpoint (the real EnvManager) ------------------------------

def make_cfg(tiny_model, agent: str, **env) -> RunConfig:
    return convert({"run": new_run(), "model": {"path": str(tiny_model)},
                    "envs": {"main": {"type": f"agent:tests.security.test_agent_surfaces:{agent}",
                                      "max_turns": 2, **env}},
                    "rollout": {"group_size": 2, "batch_groups": 1, "on_failed_group": "skip"}},
                   RunConfig)


async def huge_message(base_url: str, task: dict) -> float:
    """10 MB of text in one message (past the 4 MiB body bound)."""
    async with httpx.AsyncClient(timeout=60) as http:
        await http.post(f"{base_url}/chat/completions", json={
            "messages": [{"role": "user", "content": "word " * (2 * MiB)}]})
    return 0.0


async def long_message(base_url: str, task: dict) -> float:
    """2 MB of text (within the body bound, 120 characters a token of the context)."""
    async with httpx.AsyncClient(timeout=60) as http:
        await http.post(f"{base_url}/chat/completions", json={
            "messages": [{"role": "user", "content": "word " * (MiB // 2)}]})
    return 0.0


async def bad_tools(base_url: str, task: dict) -> float:
    async with httpx.AsyncClient(timeout=60) as http:
        await http.post(f"{base_url}/chat/completions", json={**GOOD, "tools": [1, "x"]})
    return 0.0


@pytest.mark.parametrize("agent, reason", [
    ("huge_message", "agent_contract: request 1: the request body is 10485"),
    ("long_message", "agent_contract: the agent's first request is longer than the env's "
                     "max_context_tokens (1024)"),
])
async def test_a_huge_message_is_refused_by_its_size_not_tokenised(memory_bus_only, tiny_model,
                                                                  agent, reason):
    cfg = make_cfg(tiny_model, agent, max_context_tokens=1024)
    t0 = time.monotonic()
    sched, _ = await run_groups(memory_bus_only, cfg, groups=1)
    dead = await collect(memory_bus_only, cfg.run, "dead", 2, deadline=5)
    took = time.monotonic() - t0
    assert len(dead) == 2 and not sched.results
    assert all(d.reason.startswith(reason) for d in dead), [d.reason for d in dead]
    assert took < 8, f"{took:.1f} s: the message was tokenised"


async def test_a_wrongly_typed_request_is_an_agent_contract_refusal(memory_bus_only, tiny_model):
    cfg = make_cfg(tiny_model, "bad_tools")
    sched, _ = await run_groups(memory_bus_only, cfg, groups=1)
    dead = await collect(memory_bus_only, cfg.run, "dead", 2, deadline=5)
    assert len(dead) == 2 and not sched.results
    assert all(d.reason.startswith("agent_contract: request 1: the request does not match the "
                                   "chat-completions contract: Expected `object`, got `int` - "
                                   "at `$.tools[0]`") and d.kind == "permanent"
               for d in dead), [d.reason for d in dead]


async def test_a_long_request_is_tokenised_off_the_event_loop(tiny_model):
    """Past INLINE_PROMPT_CHARS (within the size bound) a request is tokenised on the
    EnvManager's prompt thread, not on the event loop's."""
    import threading

    from rollart.actors.env import agent_loop as at

    class Chat(ChatFormat):
        threads: list[str] = []

        def encode(self, text: str) -> list[int]:
            self.threads.append(threading.current_thread().name)
            return super().encode(text)

    class Mgr:
        chat = Chat(ChatFormat.load(tiny_model).tok)
        prompt_threads = AgentThreads(1, name="prompts")

        async def generate(self, req, cfg, tr, choice, turn, max_new_tokens=None):
            return m.GenerateResult(token_ids=[5], logprobs=[-0.1], version=0), [], "p", -1

    cfg = make_cfg(tiny_model, "bad_tools", max_context_tokens=1 << 16).envs["main"]
    req = m.RolloutRequested(traj_id="t", group_id="g", env="main", seed=0)
    traj = AgentTrajectory(Mgr(), req, cfg, asyncio.Event())
    try:
        for words in (10, at.INLINE_PROMPT_CHARS // 2):
            Chat.threads.clear()
            resp = await traj.complete(decode_request(json.dumps(
                {"messages": [{"role": "user", "content": "word " * words}]}).encode()))
            assert resp["choices"][0]["message"]["role"] == "assistant"
            assert Chat.threads == ["prompts-0" if words > 10 else "MainThread"]
            traj = AgentTrajectory(Mgr(), req, cfg, asyncio.Event())
    finally:
        Mgr.prompt_threads.close()


# -- fuzz ---------------------------------------------------------------------------------

JSON = st.recursive(
    st.none() | st.booleans() | st.integers(min_value=-(1 << 70), max_value=1 << 70)
    | st.floats(allow_nan=False) | st.text(max_size=20),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner,
                                                                max_size=4),
    max_leaves=30)
FIELDS = st.sampled_from(["messages", "tools", "max_tokens", "n", "stream", "logprobs",
                          "guided_choice", "structured_outputs", "model", "other"])


def deep(n: int) -> bytes:
    return b'{"messages": ' + b"[" * n + b"]" * n + b"}"


BODIES = st.one_of(
    st.binary(max_size=200),
    JSON.map(lambda j: json.dumps(j).encode()),
    st.tuples(FIELDS, JSON).map(lambda kv: json.dumps({**GOOD, kv[0]: kv[1]}).encode()),
    st.tuples(st.integers(0, 1), FIELDS, JSON).map(lambda t: json.dumps(
        {**GOOD, "messages": [{"role": "user", "content": "x"} if not t[0] else {t[1]: t[2]}]}
    ).encode()),
    st.integers(1, 3000).map(deep),
)


@settings(max_examples=150, deadline=None, derandomize=True)
@given(body=BODIES)
def test_fuzz_request_decoding(body):
    """Any bytes decode to a request or end in a named 400: never another exception, never
    deeper than MAX_DEPTH, never more memory than a bounded multiple of the body."""
    from rollart.agents.chat_request import EndpointError

    try:
        out = decode_request(body)
    except EndpointError as e:
        assert e.status == 400 and str(e).startswith((
            "the body is not JSON", "the request does not match the chat-completions contract",
            "the body is nested too deeply")), str(e)
    else:
        assert isinstance(out["messages"], list) and nesting_depth(out) <= MAX_DEPTH
        assert len(msgspec.json.encode(out)) <= 4 * len(body) + 64


@pytest.fixture(scope="module")
def chat(tiny_model):
    return ChatFormat.load(tiny_model)


@settings(max_examples=30, deadline=None, derandomize=True,
          suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(body=BODIES, key=st.one_of(st.just(None), st.text(max_size=12)))
async def test_fuzz_the_endpoint_over_http(chat, tiny_model, body, key):
    """Random bodies and keys through the live endpoint and a real trajectory (the tiny
    tokenizer's chat template renders whatever decoded): a named 4xx or a reply, never a 500,
    and a 400 always refuses the trajectory as ``agent_contract``."""

    class Mgr:
        prompt_threads = AgentThreads(1, name="prompts")

        async def generate(self, req, cfg, tr, choice, turn, max_new_tokens=None):
            return m.GenerateResult(token_ids=chat.encode("ok"), logprobs=[-0.1] * len(
                chat.encode("ok")), version=0), [], "p", -1

    Mgr.chat = chat
    cfg = make_cfg(tiny_model, "bad_tools").envs["main"]
    traj = AgentTrajectory(Mgr(), m.RolloutRequested(traj_id="t", group_id="g", env="main",
                                                     seed=0), cfg, asyncio.Event())
    ep = AgentEndpoint(max_request_bytes=64 * 1024)
    await ep.start()
    try:
        url = ep.open("t", traj)
        if key is not None:
            url = url.rsplit("/", 2)[0] + "/" + quote(key, safe="") + "/v1"
        async with httpx.AsyncClient(timeout=20) as http:
            try:
                r = await http.post(f"{url}/chat/completions", content=body)
            except httpx.InvalidURL:
                return
        assert r.status_code in (200, 400, 404), (r.status_code, r.text[:300])
        if r.status_code == 400:
            assert r.json()["error"]["message"]
            assert traj.failure is None or traj.failure.startswith("agent_contract: ")
            assert traj.over.is_set()
    finally:
        await ep.stop()
        Mgr.prompt_threads.close()

"""Issue 43, finding 6 and the payload/OpenEnv halves of 9: the stores a run name maps to,
offloaded payload references and the OpenEnv HTTP/WebSocket client (finding 5, the SGLang
launch, is tested in ``tests/engines/test_sglang_engine.py``).

Each test reproduces an attack against a real part (the permission table, a real
nats-server, a real local HTTP server) and checks the named refusal.
"""

from __future__ import annotations

import asyncio
import contextlib
import gzip
import hashlib
import http.server
import json
import threading
import time
import tracemalloc
import uuid

import msgspec
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from rollart import messages as m
from rollart.actors.kernel import payloads
from rollart.bus.codec import encode
from rollart.bus.nats import NatsBus
from rollart.envs.openenv import OpenEnvEnv
from rollart.envs.openenv_wire import OpenEnvWire
from rollart.security import permissions as P

TOKEN = st.from_regex(r"[A-Za-z0-9_-]{1,24}", fullmatch=True)


# ======================================================================================
# Finding 6: run names alias (`exp-1` and `exp_1` shared stores)
# ======================================================================================
def store_names(run: str) -> set[str]:
    """Every JetStream stream a run's names make (KV and object stores are streams too)."""
    return {m.stream_name(run, "events"), m.stream_name(run, "work"),
            f"KV_{m.kv_bucket(run)}", f"OBJ_{m.object_bucket(run)}", f"OBJ_{m.traj_bucket(run)}"}


def js_grants(role: str, run: str) -> set[str]:
    """The JetStream/KV/object grants of ``role`` pinned to ``run``."""
    allow = P.role_permissions(role, run)["publish"]["allow"]
    return {s for s in allow if s.startswith(("$JS.", "$KV.", "$O."))}


def test_dash_and_underscore_runs_get_disjoint_stores():
    assert store_names("exp-1").isdisjoint(store_names("exp_1"))
    for f in (m.kv_bucket, m.object_bucket, m.traj_bucket):
        assert f("exp-1") != f("exp_1")


@pytest.mark.parametrize("role", P.ROLES)
def test_a_credential_pinned_to_one_run_gets_no_grant_on_its_alias(role):
    """A credential for ``exp-1`` shares with ``exp_1`` only what it shares with any other
    run (``$JS.API.STREAM.NAMES``): no stream, KV or object grant of the other run."""
    a, b, unrelated = js_grants(role, "exp-1"), js_grants(role, "exp_1"), js_grants(role, "zz9")
    assert a & b == a & unrelated, sorted((a & b) - unrelated)


def test_a_run_named_like_another_runs_work_queue_is_refused():
    """``a_WORK``'s events stream would be ``a``'s work queue: refused by name."""
    with pytest.raises(ValueError, match="_WORK"):
        m.stream_name("a_WORK", "events")
    with pytest.raises(ValueError, match="_WORK"):
        m.check_token("run", "a_WORK")
    m.check_token("pool", "a_WORK")  # a pool makes no stream name


@settings(max_examples=200, deadline=None, derandomize=True)
@given(TOKEN, TOKEN)
def test_fuzz_store_names_are_injective(a, b):
    """Two runs never share a stream (a name that would is refused with a ValueError)."""
    names = []
    for run in (a, b):
        try:
            names.append(store_names(run))
        except ValueError as e:
            assert "_WORK" in str(e)
            return
    if a != b:
        assert names[0].isdisjoint(names[1]), (a, b)


async def test_the_real_server_takes_dashed_store_names(nats_server):
    """nats-server and nats-py accept ``-`` in stream, KV and object-store names."""
    run = f"exp-{uuid.uuid4().hex[:6]}"
    async with NatsBus(nats_server.url) as bus:
        from rollart.node import ensure_run_streams

        await ensure_run_streams(bus, run)
        kv = await bus.key_value(m.kv_bucket(run))
        await kv.put("k", b"v")
        for bucket in (m.object_bucket(run), m.traj_bucket(run)):
            store = await bus.object_store(bucket)
            await store.put("o", b"x")
            assert await store.get("o") == b"x"
        assert (await kv.get("k")).value == b"v"


# ======================================================================================
# Finding 9: offloaded payload references (bounded before reading) and the bucket's size
# ======================================================================================
def completion(traj: str, n: int) -> m.RolloutCompleted:
    return m.RolloutCompleted(
        traj_id=traj, group_id="g", env="main", seed=1, token_ids=[7] * n,
        response_mask=[1] * n, logprobs=[-0.5] * n, token_versions=[0] * n,
        turns=[m.TurnRecord(start=1, response_len=n - 1, version=0)], group_index=0)


def name_of(data: bytes) -> str:
    return payloads.object_name("t", hashlib.sha256(data).hexdigest())


def ref_of(run: str, data: bytes, *, size: int | None = None) -> bytes:
    """A reference to ``data`` (stored under :func:`name_of`), announcing ``size``."""
    ref = m.PayloadRef(bucket=m.traj_bucket(run), name=name_of(data),
                       size=len(data) if size is None else size,
                       sha256=hashlib.sha256(data).hexdigest(), type="RolloutCompleted",
                       traj_id="t", group_id="g", group_index=0)
    return encode(ref)


HEADERS = {m.PAYLOAD_HEADER: payloads.OBJECT}


async def peak_alloc(coro) -> tuple[int, object]:
    """(peak bytes Python allocated while awaiting ``coro``, its outcome or exception)."""
    tracemalloc.start()
    try:
        tracemalloc.reset_peak()
        try:
            out: object = await coro
        except Exception as e:  # noqa: BLE001 - the outcome is what the caller checks
            out = e
        return tracemalloc.get_traced_memory()[1], out
    finally:
        tracemalloc.stop()


async def test_a_reference_over_the_cap_is_refused_before_any_read(memory_bus_only):
    """The announced size is checked against the cap before the store is asked."""
    run = f"p{uuid.uuid4().hex[:6]}"
    data = b"x" * 10
    with pytest.raises(payloads.PayloadError, match="cap"):
        await payloads.fetch_payload(memory_bus_only, run, m.RolloutCompleted, HEADERS,
                                     ref_of(run, data, size=payloads.MAX_OBJECT_BYTES + 1))


async def test_an_object_larger_than_its_reference_is_not_read(nats_bus):
    """A 24 MiB object behind a reference that announces 1 KiB: refused from the object's
    info, with no more than ~1 MiB allocated (it was read whole before: +48 MiB)."""
    run = f"p{uuid.uuid4().hex[:6]}"
    big = b"\x00" * (24 << 20)
    store = await nats_bus.object_store(m.traj_bucket(run))
    await store.put(name_of(big[:1024]), big)
    peak, out = await peak_alloc(payloads.fetch_payload(
        nats_bus, run, m.RolloutCompleted, HEADERS, ref_of(run, big[:1024])))
    assert isinstance(out, payloads.PayloadError), out
    assert "larger than" in out.reason and "1024" in out.reason
    assert peak < 1 << 20, f"{peak / 2**20:.1f} MiB allocated to refuse it"


async def test_a_good_reference_reads_in_one_buffer(nats_bus):
    """A legitimate ~6 MiB payload: read into one buffer of its announced size (not chunks
    plus a joined copy), digest checked. (Measured: peak 1.47 x the payload, 2.01 x
    before; nats-py's queue of pushed chunks makes the exact figure vary.)"""
    run = f"p{uuid.uuid4().hex[:6]}"
    msg = completion("t", 550_000)
    data = encode(msg)
    store = await nats_bus.object_store(m.traj_bucket(run))
    await store.put(name_of(data), data)
    peak, out = await peak_alloc(payloads.fetch_payload(
        nats_bus, run, m.RolloutCompleted, HEADERS, ref_of(run, data)))
    assert not isinstance(out, Exception), out
    blob, ref = out
    assert isinstance(blob, bytearray) and blob == data and ref.size == len(data)
    assert peak < 2.5 * len(data), f"{peak / len(data):.2f} x the payload allocated"


async def test_the_trajectory_bucket_has_a_size_limit(nats_bus):
    """offload creates the run's trajectory store with max_bytes (it had none: any env
    credential could fill the server's disk)."""
    run = f"p{uuid.uuid4().hex[:6]}"
    msg = completion("t", 10)
    await payloads.offload(nats_bus, run, msg, encode(msg), ttl=60.0)
    info = await nats_bus._jetstream().stream_info(f"OBJ_{m.traj_bucket(run)}")
    assert info.config.max_bytes == payloads.TRAJ_STORE_MAX_BYTES > 0


def test_offload_refuses_a_payload_over_the_cap():
    """The writer refuses what every reader would (a clear error at the source)."""
    class NoBus:  # never reached: the size is checked first
        async def object_store(self, *a, **k):
            raise AssertionError("the store was asked")

    msg = completion("t", 10)
    with pytest.raises(payloads.PayloadError, match="cap"):
        asyncio.run(payloads.offload(NoBus(), "r", msg, b"\0" * (payloads.MAX_OBJECT_BYTES + 1)))


GOOD = b"0123456789"
REF_FIELDS = st.fixed_dictionaries({
    "bucket": st.sampled_from(["BUCKET", "ROLLART_other_TRAJ", "", "../x", "*"]),
    "name": st.one_of(st.sampled_from([name_of(GOOD), name_of(b"other"), "o",
                                       "../../etc/passwd"]), st.text(max_size=40)),
    "size": st.one_of(st.integers(min_value=-5, max_value=1 << 40), st.just(10)),
    "sha256": st.one_of(st.text(max_size=70), st.just(hashlib.sha256(GOOD).hexdigest())),
    "type": st.sampled_from(["RolloutCompleted", "RolloutRequested", ""]),
})


@settings(max_examples=60, deadline=None, derandomize=True,
          suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(fields=REF_FIELDS, junk=st.binary(max_size=64), raw=st.booleans())
async def test_fuzz_payload_references(memory_bus_only, fields, junk, raw):
    """Random references (and random bytes) end as a PayloadError or a good payload, never
    another exception, never a read of more than the cap."""
    bus, run = memory_bus_only, "fuzzrun"
    store = await bus.object_store(m.traj_bucket(run))
    await store.put(name_of(GOOD), GOOD)
    await store.put(name_of(b"other"), b"x" * 100)  # larger than its name's reference says
    if raw:
        body = junk
    else:
        f = dict(fields)
        if f["bucket"] == "BUCKET":
            f["bucket"] = m.traj_bucket(run)
        body = msgspec.msgpack.encode({**f, "traj_id": "t", "group_id": "g", "group_index": 0})
    try:
        blob, ref = await payloads.fetch_payload(bus, run, m.RolloutCompleted, HEADERS, body)
    except payloads.PayloadError as e:
        assert e.reason.startswith("payload: ")
    else:
        assert bytes(blob) == GOOD and ref.size == 10


# ======================================================================================
# Finding 9: the OpenEnv client against a hostile server
# ======================================================================================
class Hostile(http.server.BaseHTTPRequestHandler):
    """An OpenEnv-looking server whose ``/reset`` (or ``/health``) misbehaves as
    ``self.server.mode`` says; every path it is asked is recorded in ``server.hits``."""

    protocol_version = "HTTP/1.1"

    def log_message(self, *args) -> None:  # quiet
        pass

    def _send(self, status: int, body: bytes, **headers: str) -> None:
        self.send_response(status)
        for k, v in {"Content-Length": str(len(body)), **headers}.items():
            self.send_header(k.replace("_", "-"), v)
        self.end_headers()
        self.wfile.write(body)

    def _stream(self, length: int | None, pause: float = 0.0, total: int = 1 << 30) -> None:
        self.send_response(200)
        if length is not None:
            self.send_header("Content-Length", str(length))
        self.send_header("Connection", "close")
        self.end_headers()
        chunk = b"0" * (1 if pause else 1 << 16)
        sent = 0
        try:
            while sent < total and not self.server.stop.is_set():
                self.wfile.write(chunk)
                self.wfile.flush()
                sent += len(chunk)
                if pause:
                    self.server.stop.wait(pause)
        except OSError:  # the client hung up: what the test wants
            pass

    def do_GET(self) -> None:
        self._route()

    def do_POST(self) -> None:
        n = int(self.headers.get("Content-Length") or 0)
        self.rfile.read(n)
        self._route()

    def _route(self) -> None:
        srv, path = self.server, self.path
        srv.hits.append(path)
        mode = srv.mode if path == srv.target else "ok"
        if mode == "ok":
            body = {"/health": {"status": "healthy"}, "/schema": {}, "/metadata": {"name": "h"}}
            self._send(200, json.dumps(body.get(path, {
                "observation": {"text": "hi"}, "reward": 0.0, "done": False})).encode(),
                Content_Type="application/json")
        elif mode == "announced":  # a huge Content-Length, then the bytes
            self._stream(length=1 << 30)
        elif mode == "unannounced":  # no length: read until the server closes
            self._stream(length=None)
        elif mode == "trickle":  # one byte every 0.2 s, forever
            self._stream(length=None, pause=0.2)
        elif mode == "redirect":
            self._send(302, b"", Location=f"http://127.0.0.1:{srv.server_port}/secret")
        elif mode == "gzip":
            self._send(200, gzip.compress(b"0" * (1 << 20)), Content_Encoding="gzip")
        elif mode == "deep":
            self._send(200, b"[" * 100_000 + b"]" * 100_000)


@contextlib.contextmanager
def hostile(mode: str, target: str = "/reset"):
    srv = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Hostile)
    srv.daemon_threads = True
    srv.mode, srv.target, srv.hits, srv.stop = mode, target, [], threading.Event()
    t = threading.Thread(target=srv.serve_forever, daemon=True)
    t.start()
    try:
        yield srv
    finally:
        srv.stop.set()
        srv.shutdown()
        srv.server_close()
        t.join(10)


CAP = 1 << 20


def http_env(srv, **kw) -> OpenEnvEnv:
    return OpenEnvEnv(f"http://127.0.0.1:{srv.server_port}", transport="http",
                      action_field="text", max_response_bytes=CAP, **kw)


@pytest.mark.parametrize("mode", ["announced", "unannounced"])
async def test_openenv_a_huge_body_is_refused_at_the_cap(mode):
    """A 1 GiB answer (announced or not) is refused past ``max_response_bytes``, having
    held no more than about that much (it was read whole before)."""
    with hostile(mode) as srv:
        env = await asyncio.to_thread(http_env, srv, timeout=20)
        try:
            peak, out = await peak_alloc(env.reset(1))
        finally:
            await env.close()
    assert isinstance(out, RuntimeError) and "max_response_bytes" in str(out), out
    assert peak < 4 * CAP, f"{peak / 2**20:.1f} MiB held"


@pytest.mark.parametrize("target", ["/health", "/reset"])
async def test_openenv_redirects_are_refused_not_followed(target):
    with hostile("redirect", target) as srv:
        with pytest.raises(RuntimeError, match="redirect"):
            env = await asyncio.to_thread(http_env, srv)
            try:
                await env.reset(1)
            finally:
                await env.close()
        assert "/secret" not in srv.hits


async def test_openenv_a_trickling_answer_hits_the_whole_request_deadline():
    """One byte every 0.2 s never trips a per-read timeout; the request's does."""
    with hostile("trickle") as srv:
        env = await asyncio.to_thread(http_env, srv, timeout=1.0)
        try:
            t0 = time.monotonic()
            with pytest.raises(TimeoutError, match="whole answer within 1s"):
                await env.reset(1)
            assert time.monotonic() - t0 < 5
        finally:
            await env.close()


async def test_openenv_a_trickling_health_check_hits_the_deadline_too():
    with hostile("trickle", "/health") as srv:
        t0 = time.monotonic()
        with pytest.raises(TimeoutError, match="GET /health"):
            await asyncio.to_thread(http_env, srv, timeout=1.0)
        assert time.monotonic() - t0 < 5


@pytest.mark.parametrize("mode, match", [("gzip", "encoded"), ("deep", "not JSON")])
async def test_openenv_compressed_or_deeply_nested_answers_are_refused(mode, match):
    with hostile(mode) as srv:
        env = await asyncio.to_thread(http_env, srv)
        try:
            with pytest.raises(RuntimeError, match=match):
                await env.reset(1)
        finally:
            await env.close()


async def test_openenv_websocket_messages_are_bounded():
    """A WebSocket answer over ``max_response_bytes`` is a named refusal."""
    import websockets.asyncio.server

    async def handler(ws):
        async for _ in ws:
            await ws.send("x" * (2 * CAP))

    with hostile("ok") as http_srv:  # /health, /schema and /metadata for the constructor
        async with websockets.asyncio.server.serve(handler, "127.0.0.1", 0) as ws_srv:
            port = ws_srv.sockets[0].getsockname()[1]
            env = await asyncio.to_thread(http_env, http_srv)
            env._wire = OpenEnvWire(  # the session goes to the hostile one
                f"http://127.0.0.1:{port}", "ws", env.timeout, env.max_response_bytes)
            try:
                with pytest.raises(RuntimeError, match="max_response_bytes"):
                    await env.reset(1)
            finally:
                await env.close()


class OneAnswer(Hostile):
    """``/reset`` answers ``server.answer``: (status, body, Content-Length or None)."""

    def _route(self) -> None:
        if self.path != "/reset":
            return super()._route()
        status, body, length = self.server.answer
        self.send_response(status)
        self.send_header("Content-Length", str(len(body)) if length is None else length)
        self.send_header("Connection", "close")
        self.end_headers()
        with contextlib.suppress(OSError):
            self.wfile.write(body)


@pytest.fixture(scope="module")
def one_answer():
    srv = http.server.ThreadingHTTPServer(("127.0.0.1", 0), OneAnswer)
    srv.daemon_threads = True
    srv.mode, srv.target, srv.hits, srv.stop = "ok", "/none", [], threading.Event()
    t = threading.Thread(target=srv.serve_forever, daemon=True)
    t.start()
    yield srv
    srv.shutdown()
    srv.server_close()
    t.join(10)


JSONS = st.recursive(st.none() | st.booleans() | st.floats() | st.text(max_size=20),
                     lambda c: st.lists(c, max_size=4)
                     | st.dictionaries(st.text(max_size=8), c, max_size=4), max_leaves=20)


@settings(max_examples=30, deadline=None, derandomize=True,
          suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(status=st.sampled_from([200, 200, 200, 204, 301, 404, 422, 500]),
       body=st.one_of(st.binary(max_size=3000), JSONS.map(lambda v: json.dumps(v).encode()),
                      st.builds(lambda o: json.dumps({"observation": o, "done": False}).encode(),
                                JSONS)),
       length=st.sampled_from([None, None, "bogus", "-1", "5", str(1 << 40)]))
def test_fuzz_openenv_answers(one_answer, status, body, length):
    """Random answers to ``/reset`` end as a reset or a named refusal (RuntimeError,
    TimeoutError, ConnectionError naming the server), never another exception type."""
    one_answer.answer = (status, body, length)

    async def go() -> None:
        env = http_env(one_answer, timeout=1)
        try:
            obs, _ = await env.reset(1)
            assert isinstance(obs, str)
        except (RuntimeError, TimeoutError, ConnectionError) as e:
            assert str(e).startswith("OpenEnv server"), e
        finally:
            await env.close()

    asyncio.run(go())

"""TLS for the trainer's weight server (issue 43, finding 4: "TLS with the run's CA when the
control plane has TLS"). Before, the token and every weight byte crossed the network in
cleartext, readable (and the token reusable) by anyone on the path.

Real server threads, real sockets, a real relay that records what crosses it, the trainer's
own publisher on an in-process bus: no mocks of what is under test."""

from __future__ import annotations

import contextlib
import hashlib
import socket
import ssl
import threading
import time

import msgspec
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from rollart import messages as m
from rollart.config import NatsConfig, NatsTlsConfig, RunConfig, convert
from rollart.engines.weight_stream import StreamError
from rollart.engines.weight_blobs import blobs_for_uri
from rollart.engines.weight_tcp import TOKEN_OBJECT, WeightAccess, read_access, tls_wanted
from rollart.engines.weight_tcp_client import fetch_blob, token_reader
from rollart.engines.weight_tcp_server import WeightServer
from rollart.engines.weight_tls import PinMismatch, server_context
from tests.waiting import until, until_sync

PATTERN = b"WEIGHTS-0123456789abcdef!" * 4096  # ~100 KiB a capture would show in cleartext


class Relay:
    """A TCP relay between a client and ``port`` that keeps every byte it forwards (both
    directions): what an observer on the path sees."""

    def __init__(self, port: int):
        self.target = port
        self.seen = bytearray()
        self._lock = threading.Lock()
        self.sock = socket.create_server(("127.0.0.1", 0))
        self.port = self.sock.getsockname()[1]
        self._threads: list[threading.Thread] = []
        self._accept = threading.Thread(target=self._run, daemon=True)
        self._accept.start()

    def _pipe(self, a: socket.socket, b: socket.socket) -> None:
        with contextlib.suppress(OSError):
            while c := a.recv(1 << 16):
                with self._lock:
                    self.seen += c
                b.sendall(c)
        with contextlib.suppress(OSError):
            b.shutdown(socket.SHUT_WR)

    def _run(self) -> None:
        with contextlib.suppress(OSError):
            while True:
                c, _ = self.sock.accept()
                s = socket.create_connection(("127.0.0.1", self.target), timeout=10)
                c.settimeout(10)
                for a, b in ((c, s), (s, c)):
                    t = threading.Thread(target=self._pipe, args=(a, b), daemon=True)
                    t.start()
                    self._threads.append(t)

    def close(self) -> None:
        self.sock.close()
        for t in self._threads:
            t.join(timeout=10)


async def test_a_version_travels_over_tls_and_is_assembled_unchanged(tmp_path, memory_bus_only):
    """A streamed version written by the trainer's encoder, served with TLS, read through
    the token record of the run's weights store (the generator's path), assembles to the
    digest the trainer announced."""
    torch = pytest.importorskip("torch")
    from safetensors.torch import load_file

    from rollart.engines.weight_decode import assemble_version
    from rollart.engines.weight_encode import TorchTensors, write_version
    from rollart.engines.weight_blobs import DirBlobs

    bus, run = memory_bus_only, "tlsrun"
    root = tmp_path / "stream"
    root.mkdir()
    g = torch.Generator().manual_seed(0)
    tensors = {f"layer{i}.w": torch.randn(64, 128, generator=g) for i in range(4)}
    man, name = await write_version(DirBlobs(root), TorchTensors(tensors, "bfloat16"), version=1,
                                    dtype="bfloat16", bucket_bytes=32 << 10, base=None,
                                    delta=False, anchor_every=8, base_out=None)
    assert len(man.buckets) > 1
    async with WeightServer(root, tls=True) as srv:
        assert len(srv.cert_sha256) == 64
        store = await bus.object_store(m.object_bucket(run))
        await store.put(TOKEN_OBJECT, srv.access_object())
        blobs, got_name = await blobs_for_uri(bus, srv.uri(name), token_bucket=m.object_bucket(run))
        got, _ = await assemble_version(blobs, got_name, tmp_path / "stage", base=None,
                                        digest=man.digest)
        assert blobs.cert_sha256 == srv.cert_sha256, "the client pinned the published certificate"
        wire = sum(b.wire for b in man.buckets)
        await until(lambda: srv.served >= wire, deadline=10, what="the server to count the buckets")
    assert got.digest == man.digest
    loaded = load_file(got.path)
    assert all(torch.equal(loaded[k], t.to(torch.bfloat16)) for k, t in tensors.items())


@pytest.mark.parametrize("tls", [False, True])
def test_an_observer_on_the_path_sees_neither_token_nor_weights_under_tls(tmp_path, tls):
    """The attack: a relay on the path records the connection. In cleartext it holds the
    token (reusable to fetch every version) and the weight bytes; under TLS neither."""
    (tmp_path / "b").write_bytes(PATTERN)
    srv = WeightServer(tmp_path, tls=tls)
    srv.start_sync()
    relay = Relay(srv.port)
    try:
        got = fetch_blob("127.0.0.1", relay.port, srv.token, "b", stall_s=10.0,
                         cert_sha256=srv.cert_sha256)
        assert bytes(got) == PATTERN
    finally:
        relay.close()
        srv.close_sync()
    seen = bytes(relay.seen)
    assert len(seen) > len(PATTERN)
    leaked = srv.token.encode() in seen, PATTERN[:64] in seen, b"GET " in seen
    assert leaked == ((True,) * 3 if not tls else (False,) * 3), leaked


def _tls_listener() -> tuple[socket.socket, ssl.SSLContext, str]:
    ctx, sha = server_context()
    return socket.create_server(("127.0.0.1", 0)), ctx, sha


def test_a_client_pinned_to_another_certificate_refuses_and_sends_nothing():
    """A server (an impostor on the trainer's port, a man in the middle) whose certificate
    is not the one the trainer published: ``PinMismatch`` after the handshake; the token is
    never sent and the blob it offers is never read."""
    sock, ctx, sha = _tls_listener()
    other = hashlib.sha256(b"another certificate").hexdigest()
    heard: list[bytes] = []

    def impostor() -> None:
        c, _ = sock.accept()
        got = b""
        with ctx.wrap_socket(c, server_side=True) as t, contextlib.suppress(OSError):
            t.settimeout(10)
            t.sendall(b"OK 5\nhello")  # offered at once: a client that reads would take it
            while chunk := t.recv(4096):
                got += chunk
        heard.append(got)

    th = threading.Thread(target=impostor, daemon=True)
    th.start()
    t0 = time.monotonic()
    try:
        with pytest.raises(PinMismatch, match=r"weight server 127\.0\.0\.1:\d+ presented a "
                                              r"certificate other than the one the trainer published"):
            fetch_blob("127.0.0.1", sock.getsockname()[1], "secret-token-xyz", "b", stall_s=10.0,
                       cert_sha256=other)
        th.join(timeout=10)
    finally:
        sock.close()
    assert time.monotonic() - t0 < 10
    assert heard == [b""], "nothing of the request (its token) reached the impostor"
    assert sha != other


async def test_a_restarted_trainer_is_pinned_again_from_the_store(tmp_path, memory_bus_only):
    """The pin held is a former launch's (a trainer restarted with a new certificate): the
    reader takes the new record from the store once, then fetches; a store that still names
    another certificate is refused."""
    bus, run = memory_bus_only, "repin"
    (tmp_path / "b").write_bytes(b"bucket")
    store = await bus.object_store(m.object_bucket(run))
    async with WeightServer(tmp_path, tls=True) as old:
        await store.put(TOKEN_OBJECT, old.access_object())
        blobs, name = await blobs_for_uri(bus, old.uri("b"), token_bucket=m.object_bucket(run))
        assert bytes(await blobs.get(name)) == b"bucket"
        port = old.port
    async with WeightServer(tmp_path, tls=True, port=port) as new:
        assert new.cert_sha256 != old.cert_sha256
        await store.put(TOKEN_OBJECT, new.access_object())
        assert bytes(await blobs.get(name)) == b"bucket" and blobs.cert_sha256 == new.cert_sha256
        await store.put(TOKEN_OBJECT, old.access_object())  # a stale record: refused, not sent
        blobs.cert_sha256 = old.cert_sha256
        with pytest.raises(PinMismatch):
            await blobs.get(name)


def test_a_cleartext_client_against_a_tls_server_fails_with_a_named_reason(tmp_path):
    """A client without the pin (an older generator, a record not read) gets a named error
    at once, never a hang or a mangled answer read as data."""
    (tmp_path / "b").write_bytes(b"served")
    srv = WeightServer(tmp_path, tls=True, request_s=2.0)
    srv.start_sync()
    try:
        t0 = time.monotonic()
        with pytest.raises(OSError, match=r"refused b: TLS only \(trainer.sync.tls\): this client has no certificate pinned"):
            fetch_blob("127.0.0.1", srv.port, srv.token, "b", stall_s=5.0)
        assert time.monotonic() - t0 < 5
    finally:
        srv.close_sync()
    assert srv.served == 0


def test_a_tls_client_against_a_cleartext_server_fails_with_a_named_reason(tmp_path):
    (tmp_path / "b").write_bytes(b"served")
    srv = WeightServer(tmp_path, request_s=1.0)
    srv.start_sync()
    try:
        t0 = time.monotonic()
        with pytest.raises(OSError, match="does not speak TLS"):
            fetch_blob("127.0.0.1", srv.port, srv.token, "b", stall_s=5.0,
                       cert_sha256=hashlib.sha256(b"x").hexdigest())
        assert time.monotonic() - t0 < 5
    finally:
        srv.close_sync()
    assert srv.served == 0


def test_a_stalled_tls_handshake_frees_its_place(tmp_path):
    """A peer that connects and never completes the handshake holds its place only for
    ``request_s`` (the handshake and the request line share one deadline)."""
    (tmp_path / "b").write_bytes(b"served")
    srv = WeightServer(tmp_path, tls=True, max_connections=1, request_s=1.0)
    srv.start_sync()
    try:
        with socket.create_connection(("127.0.0.1", srv.port)) as idle:
            until_sync(lambda: srv.active == 1, deadline=10, what="the idle peer to hold the place")
            idle.sendall(b"\x16\x03\x01")  # the start of a record, and then nothing
            until_sync(lambda: srv.active == 0, deadline=10, what="the stalled handshake to end")
        got = fetch_blob("127.0.0.1", srv.port, srv.token, "b", stall_s=10.0,
                         cert_sha256=srv.cert_sha256)
        assert bytes(got) == b"served"
    finally:
        srv.close_sync()


def test_a_busy_tls_server_is_waited_out(tmp_path):
    """At ``max_connections`` a TLS server closes the next connection before a handshake
    (no thread, no handshake on the accept thread); the client asks again."""
    (tmp_path / "b").write_bytes(b"served")
    srv = WeightServer(tmp_path, tls=True, max_connections=1, request_s=30.0)
    srv.start_sync()
    try:
        holder = socket.create_connection(("127.0.0.1", srv.port))
        until_sync(lambda: srv.active == 1, deadline=10, what="the holder to take the place")
        out: list = []
        th = threading.Thread(target=lambda: out.append(fetch_blob(
            "127.0.0.1", srv.port, srv.token, "b", stall_s=20.0, cert_sha256=srv.cert_sha256)))
        th.start()
        until_sync(lambda: srv.refused_busy >= 1, deadline=10, what="a busy refusal")
        holder.close()
        th.join(timeout=20)
        assert [bytes(x) for x in out] == [b"served"]
    finally:
        srv.close_sync()


def test_auto_follows_the_control_plane():
    """``trainer.sync.tls: auto`` is on exactly when the run's NATS connection uses TLS."""
    assert convert({}, RunConfig).trainer.sync.tls == "auto"
    plain, tls = NatsConfig(url="nats://h:4222"), NatsConfig(url="nats://h:4222",
                                                            tls=NatsTlsConfig(ca="/ca.pem"))
    assert not tls_wanted("auto", None) and not tls_wanted("auto", plain) and not tls_wanted("auto", NatsConfig())
    assert tls_wanted("auto", tls) and tls_wanted("auto", NatsConfig(url="tls://h:4222"))
    assert tls_wanted("auto", NatsConfig(urls=["nats://a:1", "tls://b:2"]))
    assert tls_wanted(True, plain) and not tls_wanted(False, tls)
    with pytest.raises(Exception, match="trainer.sync.tls"):
        convert({"trainer": {"sync": {"tls": "yes"}}}, RunConfig)


@pytest.mark.parametrize(("nats", "sync_tls", "on"), [
    ({"url": "memory", "tls": {"ca": "/nonexistent/ca.pem"}}, "auto", True),
    ("memory", "auto", False),
    ({"url": "memory", "tls": {"ca": "/nonexistent/ca.pem"}}, False, False),
])
async def test_the_trainer_serves_tls_when_its_control_plane_has_it(tmp_path, tiny_model,
                                                                    memory_bus_only, nats, sync_tls, on):
    """The trainer's own publisher: it starts the server with TLS by ``trainer.sync.tls``
    and the run's NATS settings, and puts the pin beside the token (the plain token, as
    before, for a cleartext server)."""
    pytest.importorskip("torch")
    from rollart.node import ensure_run_streams
    from rollart.node.build import training_actors

    bus, run = memory_bus_only, "tlstrainer"
    cfg = convert({"run": run, "run_dir": str(tmp_path / "runs"), "model": {"path": str(tiny_model)},
                   "nats": nats, "envs": {"main": {"type": "frozenlake"}},
                   "trainer": {"steps": 2, "weights": "tcp",
                               "sync": {"format": "stream", "bucket_mb": 0.05, "tls": sync_tls}}},
                  RunConfig)
    _, trainer, _ = training_actors(cfg)
    trainer.bus = bus
    await trainer.setup()
    await ensure_run_streams(bus, run)
    try:
        await trainer.weights.publish()
        srv = trainer.weights.stream.server
        raw = bytes(await (await bus.object_store(m.object_bucket(run))).get(TOKEN_OBJECT))
        if on:
            assert msgspec.json.decode(raw, type=WeightAccess) == WeightAccess(
                token=srv.token, cert_sha256=srv.cert_sha256)
        else:
            assert raw == srv.token.encode() and srv.cert_sha256 == ""
        from rollart.actors.kernel.policy import current_policy

        pub = await until(lambda: current_policy(bus, run), deadline=30, what="v0 announced")
        blobs, name = await blobs_for_uri(bus, pub.uri, token_bucket=m.object_bucket(run))
        assert len(bytes(await blobs.get(name))) > 0 and blobs.cert_sha256 == srv.cert_sha256
    finally:
        await trainer.weights.close()


async def test_the_token_record_is_bounded_and_checked(memory_bus_only):
    bus, bucket = memory_bus_only, m.object_bucket("rec")
    store = await bus.object_store(bucket)
    read = token_reader(bus, bucket)
    await store.put(TOKEN_OBJECT, b"{" + b" " * 5000 + b"}")
    with pytest.raises(StreamError, match="larger than 1024 bytes"):
        await read()
    await store.put(TOKEN_OBJECT, b'{"token": "short", "cert_sha256": ""}')
    with pytest.raises(StreamError, match="not a weight server record"):
        await read()
    await store.put(TOKEN_OBJECT, b"a-plain-token-of-an-older-trainer")  # as before TLS
    assert await read() == WeightAccess(token="a-plain-token-of-an-older-trainer")


@settings(max_examples=200, derandomize=True, database=None, deadline=None,
          suppress_health_check=list(HealthCheck))
@given(st.binary(max_size=1500) | st.builds(
    lambda tok, sha, extra: msgspec.json.encode({"token": tok, "cert_sha256": sha, **extra}),
    st.text(max_size=140), st.text(max_size=70) | st.just("a" * 64),
    st.dictionaries(st.text(max_size=5), st.integers(), max_size=2)))
def test_fuzz_token_records(raw):
    """Any bytes in the token object: a :class:`WeightAccess` with a well-formed token and
    pin, or a ``StreamError`` that says what is wrong, never another exception."""
    try:
        a = read_access(raw, "the run's weights store")
    except StreamError as e:
        assert TOKEN_OBJECT in str(e)
        return
    assert 16 <= len(a.token) <= 128 and len(a.cert_sha256) in (0, 64)


@pytest.fixture(scope="module")
def tls_server(tmp_path_factory):
    root = tmp_path_factory.mktemp("served-tls")
    (root / "b").write_bytes(b"served")
    srv = WeightServer(root, tls=True, request_s=0.3)  # a line without "\n" waits this long
    srv.start_sync()
    yield srv
    srv.close_sync()


@settings(max_examples=30, derandomize=True, database=None, deadline=None,
          suppress_health_check=list(HealthCheck))
@given(st.binary(max_size=600) | st.builds(lambda a, b: b"GET " + a + b" " + b + b"\n",
                                           st.binary(max_size=40), st.binary(max_size=40)))
def test_fuzz_tls_server_inputs(tls_server, data):
    """Any bytes, before the handshake (raw) or inside TLS (a request line): a closed
    connection or ``ERR <reason>``, never a crashed handler; the token holder is served
    afterwards."""
    srv = tls_server
    with socket.create_connection(("127.0.0.1", srv.port), timeout=10) as s:  # raw bytes
        with contextlib.suppress(OSError):
            s.sendall(data)
            s.shutdown(socket.SHUT_WR)
            while s.recv(4096):
                pass
    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
    ctx.check_hostname, ctx.verify_mode = False, ssl.CERT_NONE
    with socket.create_connection(("127.0.0.1", srv.port), timeout=10) as raw:  # inside TLS
        with ctx.wrap_socket(raw) as s:
            out = b""
            with contextlib.suppress(OSError):
                s.sendall(data)
                while c := s.recv(4096):
                    out += c
    assert out == b"" or out.startswith((b"ERR ", b"OK ")), out[:100]
    if out.startswith(b"OK "):
        assert data.split()[1] == srv.token.encode()
    assert bytes(fetch_blob("127.0.0.1", srv.port, srv.token, "b",
                            cert_sha256=srv.cert_sha256)) == b"served"
    until_sync(lambda: srv.active == 0, deadline=10, what="every handler to end")


def test_the_tls_send_buffer_is_bounded(tmp_path):
    """Under TLS the server reads the file through one buffer of ``TLS_CHUNK``, never the
    file whole (a 32 MiB blob: the peak stays near the buffer)."""
    import tracemalloc

    from rollart.engines.weight_tcp import TLS_CHUNK

    (tmp_path / "b").write_bytes(b"\0" * (32 << 20))
    srv = WeightServer(tmp_path, tls=True)
    srv.start_sync()
    into = bytearray(32 << 20)
    try:
        tracemalloc.start()
        got = fetch_blob("127.0.0.1", srv.port, srv.token, "b", into=into,
                         cert_sha256=srv.cert_sha256)
        peak = tracemalloc.get_traced_memory()[1]
        tracemalloc.stop()
        assert got.obj is into and len(got) == 32 << 20
    finally:
        srv.close_sync()
    assert peak < 4 * TLS_CHUNK, f"{peak / 2**20:.1f} MiB"


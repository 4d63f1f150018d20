"""The direct TCP path for weight buckets (``trainer.weights: tcp``): a real server thread,
real sockets."""

from __future__ import annotations

import asyncio
import os
import socket

import pytest

from rollart.engines.weight_tcp import advertised_host
from rollart.engines.weight_tcp_client import fetch_blob, parse_tcp_uri
from rollart.engines.weight_tcp_server import WeightServer
from tests.waiting import until


async def test_serves_files_by_name_to_the_token_holder(tmp_path):
    data = os.urandom(3 << 20)
    (tmp_path / "v000001.b00000").write_bytes(data)
    async with WeightServer(tmp_path, host="127.0.0.1") as srv:
        host, port, token, name = parse_tcp_uri(srv.uri("v000001.b00000"))
        assert (host, port, token) == ("127.0.0.1", srv.port, "")  # the token is not in the uri
        token = srv.token
        small = bytearray(16)  # too small: another buffer holds the bytes, `small` is untouched
        got = await asyncio.to_thread(fetch_blob, host, port, token, name, into=small)
        assert bytes(got) == data and got.obj is not small and small == bytearray(16)
        big = got.obj
        again = await asyncio.to_thread(fetch_blob, host, port, token, name, into=big)
        assert bytes(again) == data and again.obj is big  # large enough: reused
        # the server thread counts a file after sendfile returns, which can be after the
        # client has read its last byte (seen once in CI on a loaded host)
        await until(lambda: srv.served == 2 * len(data), deadline=30,
                    what="the server to count both files", state=lambda: f"served {srv.served}")


@pytest.mark.parametrize(("token", "name", "why"), [
    ("wrong", "v000001.b00000", "bad token"),
    (None, "../secret", "bad name"),
    (None, "absent", "not found"),
])
async def test_refusals_say_why(tmp_path, token, name, why):
    (tmp_path / "v000001.b00000").write_bytes(b"x" * 10)
    async with WeightServer(tmp_path, host="127.0.0.1") as srv:
        with pytest.raises(OSError, match=why):
            await asyncio.to_thread(fetch_blob, "127.0.0.1", srv.port, token or srv.token, name)


def test_unreachable_server_names_the_key():
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
    s.close()  # nothing listens there now
    with pytest.raises(OSError, match="trainer.weights: tcp"):
        fetch_blob("127.0.0.1", port, "t", "v000001.b00000", stall_s=2.0)


def test_a_transfer_cut_short_is_an_error_not_short_data():
    srv = socket.socket()
    srv.bind(("127.0.0.1", 0))
    srv.listen(1)
    port = srv.getsockname()[1]

    import threading

    def half():  # announces 1000 bytes, sends 10, hangs up: a trainer killed mid-transfer
        c, _ = srv.accept()
        c.recv(100)
        c.sendall(b"OK 1000\n" + b"y" * 10)
        c.close()

    t = threading.Thread(target=half)
    t.start()
    try:
        with pytest.raises(OSError, match="cut short at 10 of 1000"):
            fetch_blob("127.0.0.1", port, "t", "b", stall_s=5.0)
    finally:
        t.join()
        srv.close()


@pytest.mark.parametrize("uri", ["tcp://h:1/a/b/c", "obj://b/n", "tcp://h/tok/n", "tcp://h:1/",
                                 "tcp://h:1//n", "tcp://h:x/n"])
def test_bad_uris_are_refused(uri):
    with pytest.raises(ValueError, match="not a weight server uri"):
        parse_tcp_uri(uri)


def test_advertised_host_is_loopback_for_a_local_server():
    assert advertised_host("nats://127.0.0.1:4222") == "127.0.0.1"
    assert advertised_host(None) == "127.0.0.1"


async def test_tcp_blobs_read_a_stream_folder(tmp_path):
    from rollart.engines.weight_tcp_client import TcpBlobs

    (tmp_path / "a").write_bytes(b"first" * 1000)
    (tmp_path / "b").write_bytes(b"second")
    async with WeightServer(tmp_path, host="127.0.0.1") as srv:
        blobs = TcpBlobs("127.0.0.1", srv.port, srv.token)
        assert bytes(await blobs.get("a")) == b"first" * 1000
        assert bytes(await blobs.get("b")) == b"second"  # the buffer reused, smaller content
        with pytest.raises(KeyError):
            await blobs.get("c")
        assert await blobs.exists("a") and not await blobs.exists("c")
        assert parse_tcp_uri(blobs.uri("a"))[1:] == (srv.port, "", "a")

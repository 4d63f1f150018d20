"""A three-server nats-server cluster from `rollart cluster init`, on loopback (real processes):
streams and KV buckets with 3 replicas keep working, and lose no acknowledged message, when
the server the client is connected to is killed with SIGKILL."""

from __future__ import annotations

import random
import socket
import time

import pytest

from rollart.bus import BusError, ConsumerSpec, StreamSpec
from rollart.bus.nats import NatsBus
from rollart.bus.server import EmbeddedServer
from rollart.bus.server_config import InsecureServerError, check_listen
from rollart.app.cli import main as rollart_main
from tests.waiting import until

pytestmark = pytest.mark.timeout(120)


def _free_run(n: int) -> int:
    """A base port with ``n`` consecutive free ports (client) and ``n`` more 1000 above (routes),
    below the kernel's ephemeral range: a port found free inside it can be taken by any
    outgoing connection of another test before the server binds it (CI ci49: "bind: address
    already in use" on a route port)."""
    try:
        low = int(open("/proc/sys/net/ipv4/ip_local_port_range").read().split()[0])
    except (OSError, ValueError, IndexError):
        low = 32768
    rng = random.Random()
    for _ in range(200):
        base = rng.randrange(10000, max(10001, low - 1000 - n))
        ok = True
        for p in [*range(base, base + n), *range(base + 1000, base + 1000 + n)]:
            with socket.socket() as s:
                try:
                    s.bind(("127.0.0.1", p))
                except OSError:
                    ok = False
                    break
        if ok:
            return base
    raise RuntimeError("no free ports")


async def _without_bus_error(what: str, fn, deadline_s: float):
    """Call async ``fn`` until it returns without a BusError; its result."""
    errors: list[BusError] = []

    async def attempt():
        try:
            return (await fn(),)
        except BusError as e:
            errors.append(e)
            return None

    (result,) = await until(attempt, deadline=deadline_s, what=what, step=0.1,
                            state=lambda: f"last error: {errors[-1] if errors else None!r}")
    return result



@pytest.fixture
def cluster(tmp_path):
    base = _free_run(3)
    out = tmp_path / "cluster"
    assert rollart_main(["cluster", "init", str(out), "--servers", "3", "--client-port", str(base),
                         "--cluster-port", str(base + 1000)]) == 0
    servers = [EmbeddedServer(tmp_path / f"run{i}", config_file=out / f"server-{i}.conf")
               for i in (1, 2, 3)]
    try:
        for s in servers:
            s.start()
        yield servers
    finally:
        for s in servers:
            s.kill()


def test_cluster_configs(tmp_path):
    out = tmp_path / "c"
    assert rollart_main(["cluster", "init", str(out), "--servers", "3"]) == 0
    text = (out / "server-2.conf").read_text()
    assert 'listen: "127.0.0.1:4223"' in text and 'listen: "127.0.0.1:6223"' in text
    assert all(f"nats-route://127.0.0.1:{6222 + i}" in text for i in range(3))
    check_listen("127.0.0.1", out / "server-2.conf")  # loopback: no auth needed
    with pytest.raises(InsecureServerError):  # clients beyond loopback need users
        check_listen("0.0.0.0", out / "server-2.conf")
    hosts = tmp_path / "h"
    assert rollart_main(["cluster", "init", str(hosts), "--host", "a.example", "--host", "b.example",
                         "--host", "c.example"]) == 0
    text = (hosts / "server-1.conf").read_text()
    assert "nats-route://route:" in text and "@c.example:6222" in text and "authorization" in text
    check_listen("127.0.0.1", hosts / "server-1.conf")  # routes have a password
    with pytest.raises(InsecureServerError):  # ...which is no client authentication
        check_listen("0.0.0.0", hosts / "server-1.conf")
    bare = tmp_path / "bare.conf"  # a route port open to all without authorization: refused
    bare.write_text('cluster { name: x\n listen: "0.0.0.0:6222" }\n')
    with pytest.raises(InsecureServerError, match="cluster"):
        check_listen("127.0.0.1", bare)
    assert rollart_main(["cluster", "init", str(tmp_path / "x"), "--servers", "2",
                         "--host", "a"]) == 2  # one --host per server


@pytest.mark.slow
async def test_replicated_stream_and_kv_survive_killed_server(cluster):
    servers = cluster
    assert [s.port for s in servers] == [servers[0].port + i for i in range(3)]  # the config's ports
    bus = NatsBus([s.url for s in servers], name="rollart-cluster-test", reconnect_time_wait=0.1,
                  connect_timeout=10)
    bus.replicas = 3
    await bus.connect()
    try:
        spec = StreamSpec(name="CLTEST", subjects=("cltest.>",), replicas=3)
        await _without_bus_error("stream with 3 replicas (the cluster has a meta leader)",
                     lambda: bus.ensure_stream(spec), 30)
        kv = await _without_bus_error("kv bucket with 3 replicas", lambda: bus.key_value("cltest"), 30)
        js = bus._jetstream()  # white-box: the raw JetStream context, for what the servers hold
        assert (await js.stream_info("CLTEST")).config.num_replicas == 3
        assert (await js.stream_info("KV_cltest")).config.num_replicas == 3
        acked: dict[str, int] = {}
        for i in range(20):
            acked[f"m{i}"] = await bus.publish(f"cltest.{i}", f"m{i}".encode(), msg_id=f"m{i}")
        assert await kv.put("k", b"before") > 0

        port = bus._nc.connected_url.port  # white-box (raw client): the server it talks to
        victim = next(s for s in servers if s.port == port)
        victim.kill()

        async def publish(i: int) -> int:
            return await bus.publish(f"cltest.{i}", f"m{i}".encode(), msg_id=f"m{i}", timeout=2)

        for i in range(20, 40):
            acked[f"m{i}"] = await _without_bus_error(f"publish m{i} after the kill", lambda i=i: publish(i), 30)
        assert bus._nc.connected_url.port != port
        await _without_bus_error("kv put after the kill", lambda: kv.put("k", b"after"), 30)

        async def read_after():  # a direct get may be answered by a replica that lags a moment
            e = await kv.get("k")
            if e is None or e.value != b"after":
                raise BusError(f"kv get answered {e}")
            return e

        got = await _without_bus_error("kv get after the kill sees the put", read_after, 30)
        assert got.value == b"after"

        info = await bus.stream_info("CLTEST")
        assert info["messages"] == len(acked) == 40  # each acked once (msg ids), none lost
        consumer = await _without_bus_error("consumer", lambda: bus.pull_consumer(
            "CLTEST", ConsumerSpec(durable="check", filter_subject="cltest.>")), 30)
        seen: dict[str, int] = {}
        deadline = time.monotonic() + 20
        while len(seen) < len(acked) and time.monotonic() < deadline:
            for d in await consumer.fetch(64, timeout=1.0):
                seen[d.data.decode()] = d.stream_seq
                await d.ack()
        assert seen == acked  # every acknowledged message, at the sequence its ack named
    finally:
        await bus.close()


async def test_secure_cluster_on_loopback(tmp_path):
    """--secure merges the users and TLS of `rollart secure init`: the three servers start,
    form a cluster, and a client with a credential gets a replicated stream over TLS."""
    pytest.importorskip("bcrypt")
    pytest.importorskip("cryptography")
    from rollart.bus.auth import AuthError
    from rollart.bus.connect import bus_from_config

    from rollart.deploy.cluster import cluster_init
    from rollart.security.init import secure_init

    creds = tmp_path / "creds"
    secure_init(creds, ["127.0.0.1"], ["env"])  # (the CLI runs its own event loop)
    base = _free_run(3)
    out = tmp_path / "cluster"
    cluster_init(out, 3, client_port=base, cluster_port=base + 1000, secure=creds)
    for i in (1, 2, 3):
        check_listen("0.0.0.0", out / f"server-{i}.conf")  # clients must authenticate now
    servers = [EmbeddedServer(tmp_path / f"run{i}", config_file=out / f"server-{i}.conf")
               for i in (1, 2, 3)]
    try:
        for s in servers:
            s.start()
        urls = [f"tls://127.0.0.1:{s.port}" for s in servers]
        anon = NatsBus(urls, connect_timeout=2)
        with pytest.raises(AuthError):
            await anon.connect()
        await anon.close()
        bus = bus_from_config({"urls": urls, "user": "admin", "password_file": str(creds / "admin.password"),
                               "tls": {"ca": str(creds / "ca.pem")}}, replicas=3)
        assert bus.replicas == 3
        await bus.connect()
        try:
            spec = StreamSpec(name="SECURE", subjects=("secure.>",), replicas=3)
            await _without_bus_error("replicated stream over TLS", lambda: bus.ensure_stream(spec), 30)
            # A new R3 stream answers publishes once its leader is elected; the msg id makes a
            # repeated publish a duplicate, so the first accepted one stays sequence 1.
            seq = await _without_bus_error("publish to the new replicated stream",
                                           lambda: bus.publish("secure.x", b"1", msg_id="x"), 30)
            assert seq == 1
        finally:
            await bus.close()
    finally:
        for s in servers:
            s.kill()

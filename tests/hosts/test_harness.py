"""The many-hosts harness itself: namespaces reach each other over the bridge, the test
process reaches them, cleanup leaves nothing behind, and a 3-server JetStream cluster
across 3 namespaces keeps a 3-replica stream through the kill -9 of one server."""

from __future__ import annotations

import asyncio
import sys
import time

import pytest

pytestmark = pytest.mark.hosts

ECHO = ("import socket,sys; s=socket.socket(); s.setsockopt(socket.SOL_SOCKET,socket.SO_REUSEADDR,1);"
        "s.bind((sys.argv[1],7000)); s.listen(); print('listening',flush=True);"
        "c,a=s.accept(); c.sendall(('from '+a[0]).encode()); c.close()")
CALL = ("import socket,sys; s=socket.create_connection((sys.argv[1],7000),timeout=5);"
        "print(s.recv(100).decode())")


async def test_hosts_talk_and_leave_nothing_behind(hosts):
    h = hosts(2)
    a, b = h[0], h[1]
    assert a.addr != b.addr and a.addr.rsplit(".", 1)[0] == b.addr.rsplit(".", 1)[0]
    server = b.run([sys.executable, "-c", ECHO, b.addr], "echo")
    await server.line_with("listening", 10)
    r = a.exec(sys.executable, "-c", CALL, b.addr)
    assert r.returncode == 0 and r.stdout.strip() == f"from {a.addr}", r
    assert await server.wait(5) == 0
    # the root namespace (this process) reaches the hosts through the bridge
    server = b.run([sys.executable, "-c", ECHO, b.addr], "echo2")
    await server.line_with("listening", 10)
    import socket
    with socket.create_connection((b.addr, 7000), timeout=5) as s:
        assert s.recv(100).decode() == f"from {h.gateway}"
    # a process killed with -9 is gone; close removes namespaces, veths and the bridge
    sleeper = a.run([sys.executable, "-c", "import time; time.sleep(600)"], "sleep")
    sleeper.kill()
    assert sleeper.poll() == -9
    assert h.leftovers()
    h.close()
    end = time.monotonic() + 5
    while h.leftovers() and time.monotonic() < end:
        await asyncio.sleep(0.05)
    assert h.leftovers() == []


async def publish_within(js, subject: str, data: bytes, seconds: float, cluster, what: str) -> None:
    """Publish once the stream answers: a stream without a leader yet (just made, or its leader
    killed) has no responders, or times out, until one is elected. A message id keeps a try that
    timed out after it was stored from storing it twice."""
    end = time.monotonic() + seconds
    msg_id = f"{what}-{time.monotonic_ns()}"
    while True:
        try:
            await js.publish(subject, data, timeout=1, headers={"Nats-Msg-Id": msg_id})
            return
        except Exception:  # noqa: BLE001 - not yet: no leader answers
            if time.monotonic() > end:
                raise AssertionError(f"no answer to {what} in {seconds} s:\n{cluster.logs()}") from None
            await asyncio.sleep(0.1)


async def test_three_server_cluster_survives_kill9(hosts, nats_cluster):
    import nats
    from nats.js.api import StreamConfig

    h = hosts(3)
    cluster = await nats_cluster(list(h))
    assert cluster.ready_s < 30
    nc = await nats.connect(servers=cluster.urls, reconnect_time_wait=0.2, max_reconnect_attempts=-1)
    try:
        js = nc.jetstream(timeout=3)
        await js.add_stream(StreamConfig(name="R3", subjects=["r3.>"], num_replicas=3))
        # add_stream returns before the new stream's leader answers on every server: the first
        # publish may find no responders (CI saw it once), so it waits for one, with a deadline
        await publish_within(js, "r3.x", b"0", 20, cluster, "the stream's first publish")
        for i in range(1, 5):
            await js.publish("r3.x", str(i).encode())
        info = await js.stream_info("R3")
        assert info.config.num_replicas == 3 and info.state.messages == 5
        leader = info.cluster.leader
        victim = next(k for k in range(3) if cluster.procs[k] and leader.endswith(f"-n{k + 1}"))
        cluster.kill(victim)  # the stream's leader: a new one is elected among the two left
        await publish_within(js, "r3.x", b"after", 20, cluster, "a publish after the kill")
        info = await js.stream_info("R3")
        assert info.state.messages == 6 and info.cluster.leader != leader
    finally:
        await nc.close()

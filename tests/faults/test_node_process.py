"""A real `python -m rollart.node` process with its embedded server: serve, SIGTERM, drain."""

from __future__ import annotations

import signal
import re
import subprocess
import sys
import time
from pathlib import Path


from rollart import messages as m
from rollart.bus.codec import decode
from rollart.bus.nats import NatsBus
from rollart.bus.server import EmbeddedServer
from tests.actors.sample_actors import collect, request
from tests.child_output import NodeProcess
from tests.waiting import until



def _start_node(tmp_path: Path, *extra: str, grace: float = 20) -> NodeProcess:
    cfg = tmp_path / "run.yaml"
    cfg.write_text(
        "run: nodetest\n"
        f"run_dir: {tmp_path / 'runs'}\n"
        f"node: {{grace: {grace}, heartbeat_every: 0.5}}\n"
        "actors:\n"
        "  echo: {type: 'tests.actors.sample_actors:EchoEnv',"
        " handlers: {on_request: {max_inflight: 2}}}\n"
    )
    return NodeProcess(cfg, "echo", *extra)


async def _serving(node: NodeProcess) -> str:
    """The URL of the node's embedded server, once it serves its role."""
    line = await node.line_with("embedded nats-server at")
    await node.line_with("serving echo")
    return line.rsplit(" ", 1)[-1].strip()


def _outcomes(out: str, handler: str = "on_request") -> dict[str, tuple[int, int]]:
    """``{actor: (acked, nak'ed)}`` of ``handler`` from the node's "drained: ..." log line."""
    line = next((ln for ln in out.splitlines() if " drained: " in ln), None)
    assert line is not None, f"no 'drained:' line with the handlers' outcomes; output:\n{out}"
    found = {a: (int(acked), int(naked)) for a, acked, naked in
             re.findall(rf"([\w.-]+)\.{handler} acked (\d+), nak'ed (\d+)", line)}
    assert found, f"{handler} missing from {line!r}"
    return found


async def test_node_serves_and_drains_on_sigterm(tmp_path):
    node = _start_node(tmp_path)
    proc = node.proc
    try:
        url = await _serving(node)
        bus = NatsBus(url)
        await bus.connect()
        n = 12
        for i in range(n):
            await bus.publish(*request("nodetest", 300 + i, env="slow"), msg_id=f"req{i}")
        first = await collect(bus, "nodetest", "rollout.completed", 3, deadline=30)
        assert len(first) == 3
        await bus.close()
        proc.send_signal(signal.SIGTERM)  # mid-run: some in flight, some never fetched
        rc = await node.exit_code(60)
        out = node.output()
        assert rc == 0, out
        assert "drained" in out
        # every request in flight at SIGTERM takes ~0.3 s, far within the grace period (20 s):
        # all of them finish and are acked; not one is handed back (nak'ed)
        outcomes = _outcomes(out)
        assert len(outcomes) == 1, outcomes
        ((acked, naked),) = outcomes.values()
        assert naked == 0, f"{naked} request(s) nak'ed though they could finish within grace:\n{out}"
    finally:
        node.kill()

    # reopen the node's store: finished work is acked (gone from the work queue) and
    # everything not finished is still there, so nothing is lost and nothing is done twice
    with EmbeddedServer(tmp_path / "runs" / "nodetest" / "nats") as server:
        bus = NatsBus(server.url)
        await bus.connect()
        done = await collect(bus, "nodetest", "rollout.completed", n, deadline=3)
        work = await bus.stream_info(m.stream_name("nodetest", "work"))
        c = await bus.pull_consumer(m.stream_name("nodetest", "work"),
                                    __import__("rollart.bus", fromlist=["ConsumerSpec"]).ConsumerSpec(
                                        durable="echo-on-request",
                                        filter_subject=m.subject("nodetest", "rollout.requested", "default")))
        left = []
        end = time.monotonic() + 5
        while len(left) < work["messages"] and time.monotonic() < end:
            left += [decode(m.RolloutRequested, d.data).traj_id for d in await c.fetch(n, timeout=0.5)]
        await bus.close()
    done_ids = {d.traj_id for d in done}
    assert len(done_ids) == len(done), "a trajectory completed twice"
    assert acked == len(done), f"acked {acked}, completed {len(done)}"
    assert done_ids.isdisjoint(left), "a finished request was left un-acked"
    assert done_ids | set(left) == {f"t{300 + i}" for i in range(n)}
    assert len(done) >= 3


def test_node_bad_config_names_the_key(tmp_path):
    cfg = tmp_path / "bad.yaml"
    cfg.write_text("run: x\nnode: {grace: soon}\n")
    r = subprocess.run([sys.executable, "-m", "rollart.node", "--config", str(cfg), "--roles", "echo"],
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 2
    assert "node.grace" in r.stderr and "float" in r.stderr


def test_node_unknown_role_is_a_clear_error(tmp_path):
    cfg = tmp_path / "ok.yaml"
    cfg.write_text("run: x\n")
    r = subprocess.run([sys.executable, "-m", "rollart.node", "--config", str(cfg), "--roles", "wizard"],
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 2 and "unknown role 'wizard'" in r.stderr


async def test_second_signal_stops_a_draining_node_at_once(tmp_path):
    """The first SIGTERM drains (in-flight work may take up to the grace period); a second
    one while it drains ends the process at once."""
    node = _start_node(tmp_path)
    proc = node.proc
    try:
        url = await _serving(node)
        bus = NatsBus(url)
        await bus.connect()
        await bus.publish(*request("nodetest", 15000, env="slow"), msg_id="long")  # 15 s
        await until(lambda: _inflight(bus), deadline=60, step=0.05, what="the node to fetch it")
        await bus.close()
        proc.send_signal(signal.SIGTERM)
        await node.line_with("send it again to stop at once")
        proc.send_signal(signal.SIGTERM)
        # at once: the status of the signal, not the 0 of a drain that waited for the work
        assert await node.exit_code(60) == 128 + signal.SIGTERM, node.output()
    finally:
        node.kill()


async def test_work_that_outlasts_grace_is_nakd_and_counted(tmp_path):
    """The counterpart of the SIGTERM test above: a request that cannot finish within the
    grace period (15 s of work, 1 s of grace) is handed back (nak'ed, counted per handler)
    and stays in the work queue for another node."""
    node = _start_node(tmp_path, grace=1)
    try:
        url = await _serving(node)
        bus = NatsBus(url)
        await bus.connect()
        await bus.publish(*request("nodetest", 15000, env="slow"), msg_id="long")
        await until(lambda: _inflight(bus), deadline=60, step=0.05, what="the node to fetch it")
        await bus.close()
        node.proc.send_signal(signal.SIGTERM)
        rc = await node.exit_code(60)
        out = node.output()
        assert rc == 0, out
    finally:
        node.kill()
    assert list(_outcomes(out).values()) == [(0, 1)], out
    with EmbeddedServer(tmp_path / "runs" / "nodetest" / "nats") as server:
        async with NatsBus(server.url) as bus:
            work = await bus.stream_info(m.stream_name("nodetest", "work"))
    assert work["messages"] == 1, "the nak'ed request left the work queue"


async def _inflight(bus) -> bool:
    """Has the node fetched the request (its consumer shows one delivery pending an ack)?"""
    import nats

    nc = await nats.connect(bus.url)
    try:
        ci = await nc.jetstream().consumer_info(m.stream_name("nodetest", "work"), "echo-on-request")
        return ci.num_ack_pending >= 1
    except nats.js.errors.NotFoundError:
        return False
    finally:
        await nc.close()

"""``rollart tap``: live messages of a run's subjects, decoded by the subject table, as a real
subprocess on a real nats-server (stdout piped: JSON lines); filters, a malformed payload,
Ctrl-C, and the read-only ``monitor`` credential of ``rollart secure init``."""

from __future__ import annotations

import asyncio
import base64
import json
import signal
import ssl
import sys
from pathlib import Path

import pytest

from rollart import messages as m
from rollart.bus.auth import inbox_prefix
from rollart.bus.codec import encode
from rollart.bus.nats import NatsBus
from rollart.app.tap import TrajFilter, full_pattern, readable, record
from tests.actors.sample_actors import new_run

ROOT = Path(__file__).resolve().parents[2]


class Tap:
    """``python -m rollart tap ARGS`` with stdout piped; ``start`` returns once it listens."""

    def __init__(self, *args: str) -> None:
        self.args = args
        self.proc: asyncio.subprocess.Process | None = None
        self.err = ""

    async def start(self) -> Tap:
        self.proc = await asyncio.create_subprocess_exec(
            sys.executable, "-m", "rollart", "tap", *self.args, cwd=ROOT,
            stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE)
        while "listening on" not in self.err:  # printed once the server knows the subscription
            line = await asyncio.wait_for(self.proc.stderr.readline(), 30)
            if not line:
                rc = await self.proc.wait()
                raise AssertionError(f"rollart tap exited {rc} before listening:\n{self.err}")
            self.err += line.decode()
        return self

    async def line(self) -> dict:
        raw = await asyncio.wait_for(self.proc.stdout.readline(), 15)
        assert raw, f"no more output; stderr:\n{self.err}"
        return json.loads(raw)

    async def finish(self, timeout: float = 15) -> tuple[int, str]:
        out, err = await asyncio.wait_for(self.proc.communicate(), timeout)
        self.err += err.decode()
        return self.proc.returncode, out.decode()

    def kill(self) -> None:
        if self.proc is not None and self.proc.returncode is None:
            self.proc.kill()


def completed(traj: str, group: str, **kw) -> m.RolloutCompleted:
    n = 40
    return m.RolloutCompleted(traj_id=traj, group_id=group, env="main", seed=1,
                              token_ids=list(range(n)), response_mask=[0] * 20 + [1] * 20,
                              logprobs=[0.0] * 20 + [-0.5] * 20, reward=1.0, success=True, **kw)


def heartbeat() -> m.NodeHeartbeat:
    return m.NodeHeartbeat(node_id="n1", host="h", pid=7, pool="cpu", roles=["env"], ts=1.0,
                           stats={"env.inflight": 2.0})


# -- pieces, no server ---------------------------------------------------------------------


def test_patterns_full_or_relative():
    assert full_pattern("rollout.completed", "e1") == ("rollart.e1.rollout.completed", "e1")
    assert full_pattern(">", "e1") == ("rollart.e1.>", "e1")
    assert full_pattern("generate.request", "e1") == ("rollart.e1.generate.request.*", "e1")
    assert full_pattern("rollart.e1.rollout.>", None) == ("rollart.e1.rollout.>", "e1")
    assert full_pattern("rollart.*.node.heartbeat", None) == ("rollart.*.node.heartbeat", None)
    for bad, run in (("rollout.completed", None), ("a..b", "e1"), (">.x", "e1"),
                     ("rollart.e1.dead", "e2"), ("rollout completed", "e1")):
        with pytest.raises(ValueError):
            full_pattern(bad, run)


def test_readable_line_is_short_and_names_the_fields():
    subj = m.subject("e1", "rollout.completed")
    msg = completed("g1-0", "g1")
    line = readable(record(subj, encode(msg)), msg, "e1", width=400)
    assert "rollout.completed  RolloutCompleted  traj_id=g1-0 group_id=g1" in line
    assert "token_ids=[0, 1, 2, 3, 4, 5, … +34]" in line and "success=True" in line
    assert "max_version" not in line  # at its default
    junk = readable(record(subj, b"\xff\x00"), None, "e1", width=60)
    assert len(junk) <= 60 and "error" in junk


def test_traj_filter_follows_group_requests_and_dead_letters():
    f = TrajFilter("g1-1")
    s = "rollart.e1.x"
    assert f.matches(s, m.GenerateRequest(traj_id="g1-1", prompt_ids=[1], request_id="r9"), b"")
    assert f.matches(s, m.ServiceProgress(service="generate.request", replica="a",
                                          request_ids=["r1", "r9"]), b"")
    assert not f.matches(s, m.ServiceProgress(service="generate.request", replica="a",
                                              request_ids=["r1"]), b"")
    assert f.matches(s, m.CancelGroup(group_id="g1", keep=["g1-0"]), b"")
    assert not f.matches(s, m.CancelGroup(group_id="g2"), b"")
    inner = m.RolloutRequested(traj_id="g1-1", group_id="g1", env="main", seed=0)
    dl = m.DeadLetter(subject=m.subject("e1", "rollout.requested", "cpu"), payload=encode(inner),
                      reason="boom")
    assert f.matches(s, dl, b"")
    assert not f.matches(s, completed("g1-10", "g1"), b"")
    assert f.matches(s, None, b"junk g1-1 junk") and not f.matches(s, None, b"junk")


# -- the command, on a real server ---------------------------------------------------------


async def test_tap_prints_decoded_json_lines_and_survives_junk(nats_server, nats_bus):
    run = new_run()
    tap = await Tap(">", "--run", run, "--nats", nats_server.url, "--limit", "5").start()
    try:
        await nats_bus.publish_core(m.subject(run, "rollout.completed"), b"\xff\x00not msgpack")
        await nats_bus.publish_core(f"rollart.{run}.no.such.subject", b"hello")
        await nats_bus.publish_core(m.subject(run, "rollout.completed"), encode(completed("g1-0", "g1")),
                               headers={"trace": "t1"})
        await nats_bus.publish_core(m.subject(run, "node.heartbeat"), encode(heartbeat()))
        await nats_bus.publish_core(m.subject(run, "generate.request", "big"),
                               encode(m.GenerateRequest(traj_id="g1-0", prompt_ids=[1, 2])))
        await nats_bus.publish_core(m.subject(run, "node.heartbeat"), encode(heartbeat()))  # past --limit
        rc, out = await tap.finish()
    finally:
        tap.kill()
    assert rc == 0, tap.err
    lines = [json.loads(x) for x in out.splitlines()]
    assert len(lines) == 5, out
    junk, unknown, done, hb, gen = lines
    assert junk["type"] == "RolloutCompleted" and junk["msg"] is None
    assert "undecodable" in junk["error"] and junk["raw_encoding"] == "base64"
    assert base64.b64decode(junk["raw"]) == b"\xff\x00not msgpack" and junk["size"] == 13
    assert unknown["type"] is None and unknown["raw"] == "hello" and "unknown subject" in unknown["error"]
    assert done["subject"] == f"rollart.{run}.rollout.completed" and done["type"] == "RolloutCompleted"
    assert done["msg"]["traj_id"] == "g1-0" and done["msg"]["reward"] == 1.0
    assert done["msg"]["token_ids"] == list(range(40)) and done["headers"] == {"trace": "t1"}
    assert "error" not in done and isinstance(done["ts"], float)
    assert hb["type"] == "NodeHeartbeat" and hb["msg"]["stats"] == {"env.inflight": 2.0}
    assert gen["type"] == "GenerateRequest" and gen["subject"].endswith(".generate.request.big")


async def test_tap_traj_keeps_one_trajectory(nats_server, nats_bus):
    run = new_run()
    tap = await Tap("rollout.>", "--run", run, "--nats", nats_server.url, "--traj", "g1-1",
                    "--limit", "3").start()
    try:
        for i in (0, 1):
            await nats_bus.publish_core(m.subject(run, "rollout.requested", "cpu"), encode(
                m.RolloutRequested(traj_id=f"g1-{i}", group_id="g1", env="main", seed=i)))
        await nats_bus.publish_core(m.subject(run, "rollout.completed"), encode(completed("g1-0", "g1")))
        await nats_bus.publish_core(m.subject(run, "rollout.cancel"),
                               encode(m.CancelGroup(group_id="g1", keep=["g1-0"])))
        await nats_bus.publish_core(m.subject(run, "rollout.cancel"), encode(m.CancelGroup(group_id="g2")))
        await nats_bus.publish_core(m.subject(run, "rollout.cancelled"),
                               encode(m.RolloutCancelled(traj_id="g1-1", group_id="g1")))
        rc, out = await tap.finish()
    finally:
        tap.kill()
    assert rc == 0, tap.err
    got = [(x["type"], x["msg"].get("traj_id") or x["msg"].get("group_id")) for x in map(json.loads, out.splitlines())]
    assert got == [("RolloutRequested", "g1-1"), ("CancelGroup", "g1"), ("RolloutCancelled", "g1-1")]


async def test_tap_ctrl_c_exits_0(nats_server, nats_bus):
    run = new_run()
    tap = await Tap("node.heartbeat", "--run", run, "--nats", nats_server.url).start()
    try:
        await nats_bus.publish_core(m.subject(run, "node.heartbeat"), encode(heartbeat()))
        assert (await tap.line())["type"] == "NodeHeartbeat"
        tap.proc.send_signal(signal.SIGINT)
        rc, _ = await tap.finish()
    finally:
        tap.kill()
    assert rc == 0, tap.err


async def test_tap_duration_without_enough_messages_exits_1(nats_server):
    tap = await Tap("dead", "--run", new_run(), "--nats", nats_server.url, "--limit", "1",
                    "--duration", "0.3").start()
    try:
        rc, out = await tap.finish()
    finally:
        tap.kill()
    assert rc == 1 and out == "" and "0 of 1 messages" in tap.err


# -- the monitor credential ------------------------------------------------------------------


@pytest.fixture(scope="module")
def secure(tmp_path_factory):
    """(credentials pinned to a run: monitor and admin only, the server that uses them)."""
    from rollart.bus.server import EmbeddedServer
    from rollart.security.init import secure_init

    run = new_run()
    d = tmp_path_factory.mktemp("tap-secure") / "creds"
    secure_init(d, ["localhost"], roles=("monitor",), run=run)
    srv = EmbeddedServer(tmp_path_factory.mktemp("tap-secure-nats"), config_file=d / "server.conf")
    srv.start()
    try:
        yield run, d, srv
    finally:
        srv.stop()


async def test_tap_works_with_the_monitor_credential(secure):
    run, d, srv = secure
    url = srv.url.replace("127.0.0.1", "localhost")
    admin = NatsBus(url, name="rollart-admin", connect_timeout=5, auth={
        "user": "admin", "password": (d / "admin.password").read_text().strip(),
        "tls": ssl.create_default_context(cafile=str(d / "ca.pem")), "inbox_prefix": inbox_prefix("admin")})
    await admin.connect()
    tap = await Tap("rollout.completed", "--run", run, "--nats", url, "--limit", "1",
                    "--user", "monitor", "--password-file", str(d / "monitor.password"),
                    "--tls-ca", str(d / "ca.pem")).start()
    try:
        await admin.publish_core(m.subject(run, "rollout.completed"), encode(completed("g1-0", "g1")))
        rc, out = await tap.finish()
    finally:
        tap.kill()
        await admin.close()
    assert rc == 0, tap.err
    assert json.loads(out)["msg"]["traj_id"] == "g1-0"
    assert "violation" not in tap.err.lower(), tap.err
    log = srv.log_path.read_text()
    assert "Violation" not in log, [x for x in log.splitlines() if "Violation" in x]

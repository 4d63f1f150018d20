"""``rollart top`` shows each JetStream consumer of a run as the server counts it.

A real nats-server with its monitoring port: a run's streams and consumers are made by hand
(requests fetched without ack, one redelivered; completions not yet fetched), the trainer's
ledger summary and the scheduler's counts put in KV, dead letters, heartbeats and a
``policy.loaded`` published while top listens. ``rollart top --once --json`` (a subprocess)
must report what ``/jsz?consumers=true`` says; the live view, under a pseudo-terminal, must
show the consumer table.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import re
import signal
import socket
import sys
import time
import urllib.request
import uuid

import msgspec
import pytest

from rollart import messages as m
from rollart.bus import ConsumerSpec
from rollart.bus.codec import encode
from rollart.bus.nats import NatsBus
from rollart.bus.server import EmbeddedServer
from rollart.node import ensure_run_streams

WORK_DURABLE = "env-on-requested"
EVENTS_DURABLE = "trainer-on-completed"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def monitored_server(tmp_path_factory):
    """A nats-server with its HTTP monitoring endpoint (``-m PORT``)."""
    port = _free_port()
    server = EmbeddedServer(tmp_path_factory.mktemp("nats-mon"), extra_args=("-m", str(port)))
    server.start()
    try:
        yield server, f"http://127.0.0.1:{port}"
    finally:
        server.stop()


def jsz_consumers(http: str) -> dict[tuple[str, str], dict]:
    """(stream, consumer) -> the server's own consumer detail (``/jsz?consumers=true``)."""
    with urllib.request.urlopen(f"{http}/jsz?consumers=true&config=true", timeout=5) as r:
        doc = json.load(r)
    out = {}
    for acc in doc.get("account_details", []):
        for st in acc.get("stream_detail", []):
            for c in st.get("consumer_detail") or []:
                out[(st["name"], c["name"])] = c
    return out


async def make_run_state(bus: NatsBus, run: str) -> None:
    """Streams and consumers of ``run`` in a known state: 6 requests of which 3 are delivered
    and un-acked (one of them redelivered), 3 completions not yet fetched."""
    await ensure_run_streams(bus, run)
    for i in range(6):
        await bus.publish(m.subject(run, "rollout.requested", "default"), f"req{i}".encode())
    for i in range(3):
        await bus.publish(m.subject(run, "rollout.completed"), f"done{i}".encode())
    work = await bus.pull_consumer(m.stream_name(run, "work"), ConsumerSpec(
        durable=WORK_DURABLE, filter_subject=m.subject(run, "rollout.requested", ">"), ack_wait=120))
    await bus.pull_consumer(m.stream_name(run, "events"), ConsumerSpec(
        durable=EVENTS_DURABLE, filter_subject=m.subject(run, "rollout.completed"), ack_wait=120))
    got = []
    end = time.monotonic() + 10
    while len(got) < 3 and time.monotonic() < end:
        got += await work.fetch(3 - len(got), timeout=1)
    assert len(got) == 3
    await got[0].nak()
    end = time.monotonic() + 10
    again = []
    while not again and time.monotonic() < end:
        again = await work.fetch(1, timeout=1)
    assert again and again[0].num_delivered == 2
    kv = await bus.key_value(m.kv_bucket(run))
    await kv.put(m.LEDGER_KEY, encode(m.LedgerSummary(version=2, lost=1, trained=2, steps_total=10,
                                                      started_at=time.time() - 5, dead=3)))
    await kv.put("scheduler.g.admitted", b"20")
    await kv.put("scheduler.g.issued", b"21")


async def chatter(bus: NatsBus, run: str, stop: asyncio.Event) -> None:
    """What a live run says on core subjects and events while top listens."""
    hb = m.NodeHeartbeat(node_id="node-a", host="h", pid=1, pool="gpu", roles=["generate"],
                         ts=0.0, versions={"generate-gpu-0": 2, "trainer": 2}, pools=["gpu", "cpu"])
    dead = [m.DeadLetter(subject=m.subject(run, "rollout.completed"), payload=b"", reason="env_setup: no such env"),
            m.DeadLetter(subject=m.subject(run, "rollout.completed"), payload=b"", reason="invalid: bad seed"),
            m.DeadLetter(subject=m.subject(run, "rollout.completed"), payload=b"", reason="env_setup: again")]
    while not stop.is_set():
        hb = msgspec.structs.replace(hb, ts=time.time())
        await bus.publish_core(m.subject(run, "node.heartbeat"), encode(hb))
        await bus.publish_core(m.subject(run, "policy.loaded"),
                               encode(m.PolicyLoaded(version=1, replica="generate-gpu-1", pool="gpu")))
        for d in dead:
            await bus.publish_core(m.subject(run, "dead"), encode(d))
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(stop.wait(), 0.2)


def _top_cmd(url: str, run: str, *extra: str) -> list[str]:
    return [sys.executable, "-m", "rollart", "top", "--nats", url, "--run", run, *extra]


async def test_top_once_json_agrees_with_the_server(monitored_server):
    server, http = monitored_server
    run = f"top{uuid.uuid4().hex[:8]}"
    async with NatsBus(server.url) as bus:
        await make_run_state(bus, run)
        stop = asyncio.Event()
        talk = asyncio.create_task(chatter(bus, run, stop))
        try:
            proc = await asyncio.create_subprocess_exec(
                *_top_cmd(server.url, run, "--once", "--json", "--duration", "1.5",
                          "--config", "quickstart"),
                stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE)
            out, err = await asyncio.wait_for(proc.communicate(), 120)
        finally:
            stop.set()
            await talk
    assert proc.returncode == 0, err.decode()
    snap = json.loads(out)
    server_says = jsz_consumers(http)
    cons = {(c["stream"], c["name"]): c for c in snap["consumers"]}
    work = (m.stream_name(run, "work"), WORK_DURABLE)
    events = (m.stream_name(run, "events"), EVENTS_DURABLE)
    assert work in cons and events in cons, snap["consumers"]
    for key in (work, events):  # nothing touches them while top looks: a stable state
        for f in ("num_pending", "num_ack_pending", "num_redelivered"):
            assert cons[key][f] == server_says[key][f], (key, f, cons[key], server_says[key])
        assert cons[key]["delivered_stream_seq"] == server_says[key]["delivered"]["stream_seq"]
        assert cons[key]["delivered_per_s"] == 0.0 and cons[key]["acked_per_s"] == 0.0
    assert (cons[work]["num_pending"], cons[work]["num_ack_pending"], cons[work]["num_redelivered"]) == (3, 3, 1)
    assert (cons[events]["num_pending"], cons[events]["num_ack_pending"]) == (3, 0)
    # what top showed before these sections is still there
    assert snap["ledger"]["version"] == 2 and "step 2/10" in snap["progress"]
    assert any(s.endswith(".node.heartbeat") for s in snap["subjects"])
    assert snap["streams"]["work"]["messages"] == 6
    # dead letters by the kind of their reason
    kinds = snap["dead_letters"]["by_reason"]
    assert set(kinds) == {"env_setup", "invalid"} and kinds["env_setup"] >= 2 and kinds["invalid"] >= 1
    # α headroom: quickstart's alpha and batch_groups, the ledger's version and lost count
    from rollart.app.configs import resolve_config
    from rollart.config import RunConfig, load

    r = load(resolve_config("quickstart"), RunConfig).rollout
    a = snap["alpha"]
    assert (a["admitted"], a["issued"], a["lost"], a["version"]) == (20, 21, 1, 2)
    assert a["allowed"] == (2 + r.alpha + 1) * r.batch_groups
    assert a["headroom"] == a["allowed"] - (20 - 1)
    # policy version per generation replica: policy.loaded and heartbeat versions
    reps = snap["policy"]["replicas"]
    assert reps["generate-gpu-1"]["version"] == 1 and reps["generate-gpu-0"]["version"] == 2
    assert "trainer" not in reps
    assert snap["pools"] == {"cpu": ["node-a"], "gpu": ["node-a"]}
    assert snap["errors"] == []


async def test_top_once_json_reports_a_missing_run_without_failing(monitored_server):
    server, _ = monitored_server
    proc = await asyncio.create_subprocess_exec(
        *_top_cmd(server.url, f"none{uuid.uuid4().hex[:8]}", "--once", "--json", "--duration", "0.2"),
        stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE)
    out, err = await asyncio.wait_for(proc.communicate(), 120)
    assert proc.returncode == 0, err.decode()
    snap = json.loads(out)
    assert snap["consumers"] == [] and snap["errors"] and "stream" in snap["errors"][0]


_ANSI = re.compile(r"\x1b\[[0-9;?]*[ -/]*[@-~]|\x1b[()][A-Z0-9]|\x1b[=>]")


def _screen_text(raw: bytes) -> str:
    return _ANSI.sub("", raw.decode(errors="replace"))


async def test_live_top_shows_the_consumer_table_in_a_terminal(monitored_server):
    """What a person sees: top under a pseudo-terminal (160x60) draws the consumer table."""
    import fcntl
    import pty
    import struct
    import termios

    server, _ = monitored_server
    run = f"tty{uuid.uuid4().hex[:8]}"
    async with NatsBus(server.url) as bus:
        await make_run_state(bus, run)
    master, slave = pty.openpty()
    fcntl.ioctl(slave, termios.TIOCSWINSZ, struct.pack("HHHH", 60, 160, 0, 0))
    env = {**os.environ, "TERM": "xterm-256color", "COLUMNS": "160", "LINES": "60"}
    env.pop("NO_COLOR", None)
    proc = await asyncio.create_subprocess_exec(
        *_top_cmd(server.url, run, "--duration", "60"), stdin=slave, stdout=slave, stderr=slave,
        env=env, start_new_session=True)
    os.close(slave)
    os.set_blocking(master, False)
    seen = b""
    # the work consumer's row: stream kind, durable, pending 3, ack pending 3, redelivered 1
    row = re.compile(r"work\s*\S?\s*" + re.escape(WORK_DURABLE) + r"\s*\S?\s*3\s*\S?\s*3\s*\S?\s*1\b")
    try:
        loop = asyncio.get_running_loop()
        end = time.monotonic() + 90
        while time.monotonic() < end:
            ready = asyncio.Event()
            loop.add_reader(master, ready.set)
            try:
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(ready.wait(), max(0.1, end - time.monotonic()))
            finally:
                loop.remove_reader(master)
            try:
                chunk = os.read(master, 65536)
            except BlockingIOError:
                continue
            except OSError:  # the terminal closed: top exited
                break
            if not chunk:
                break
            seen += chunk
            text = _screen_text(seen)
            if "consumers (JetStream)" in text and row.search(text):
                break
        text = _screen_text(seen)
        assert "consumers (JetStream)" in text, text[-3000:]
        for header in ("pending", "ack pending", "redelivered", "waiting", "delivered/s", "acked/s"):
            assert header in text, header
        assert row.search(text), text[-3000:]
    finally:
        if proc.returncode is None:
            with contextlib.suppress(ProcessLookupError):
                proc.send_signal(signal.SIGINT)
            try:
                await asyncio.wait_for(proc.wait(), 20)
            except TimeoutError:
                proc.kill()
                await proc.wait()
        os.close(master)


async def test_tap_and_top_on_a_live_run_agree_with_the_server(monitored_server, tiny_model, tmp_path):
    """A real run (``rollart run`` on the monitored server): ``rollart tap`` decodes every
    ``rollout.completed`` it published (as many as the trainer's consumer was given), and
    ``rollart top --once --json`` afterwards reports every consumer of the run as ``/jsz`` does."""
    from tests.telemetry.test_tap import Tap

    server, http = monitored_server
    run = f"live{uuid.uuid4().hex[:8]}"
    cfg = tmp_path / "run.yaml"
    cfg.write_text(
        f"run: {run}\nrun_dir: {tmp_path / 'runs'}\nmodel: {{path: '{tiny_model}'}}\n"
        "envs: {main: {type: frozenlake, max_turns: 4}}\n"
        "rollout: {group_size: 4, batch_groups: 2, alpha: 1}\n"
        "trainer: {steps: 2, eval_groups: 1}\n")
    tap = await Tap("rollout.completed", "--run", run, "--nats", server.url, "--json").start()
    try:
        proc = await asyncio.create_subprocess_exec(
            sys.executable, "-m", "rollart", "run", str(cfg), "--nats", server.url, "--quiet",
            cwd=tmp_path, stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.STDOUT)
        out, _ = await asyncio.wait_for(proc.communicate(), 240)
        assert proc.returncode == 0, out.decode()[-3000:]
        tap.proc.send_signal(signal.SIGINT)
        rc, tapped = await tap.finish()
    finally:
        tap.kill()
    assert rc == 0, tap.err
    lines = [json.loads(x) for x in tapped.splitlines()]
    server_says = jsz_consumers(http)
    events = (m.stream_name(run, "events"), "scheduler-on-completed")  # sees every completion
    assert events in server_says, sorted(server_says)
    completed = server_says[events]
    assert lines and all(x["type"] == "RolloutCompleted" and "error" not in x for x in lines)
    assert all(x["msg"]["token_ids"] and x["msg"]["traj_id"] for x in lines)
    # every completion published was tapped once and given to the scheduler (redeliveries aside)
    assert len({x["msg"]["traj_id"] for x in lines}) == len(lines)
    assert len(lines) == completed["delivered"]["consumer_seq"] - completed["num_redelivered"]

    proc = await asyncio.create_subprocess_exec(
        *_top_cmd(server.url, run, "--once", "--json", "--duration", "0.5"),
        stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE)
    out, err = await asyncio.wait_for(proc.communicate(), 120)
    assert proc.returncode == 0, err.decode()
    snap = json.loads(out)
    server_says = jsz_consumers(http)  # the run is over: nothing moves any more
    base = m.stream_name(run, "events")
    mine = {k: v for k, v in server_says.items() if k[0] == base or k[0].startswith(base + "_")}
    cons = {(c["stream"], c["name"]): c for c in snap["consumers"]}
    assert set(cons) == set(mine) and events in cons, (sorted(cons), sorted(mine))
    # the final evaluation's scheduler left durables that the server deletes once idle
    from rollart.node.build import TRANSIENT_DURABLE_IDLE_S

    evals = [k for k in mine if "eval" in k[1]]
    assert len(evals) == 3 and all(
        mine[k]["config"]["inactive_threshold"] == TRANSIENT_DURABLE_IDLE_S * 1e9 for k in evals)
    assert all(not mine[k]["config"].get("inactive_threshold") for k in mine if k not in evals)
    # ... and that start at the stream's end: the evaluation's completions and the training
    # ones that came after it bound (a loaded host's late extras: 17 of 33 once), never every
    # earlier one of the run (before, each evaluation read the run's whole backlog, as many as
    # the run's own consumer)
    (eval_done,) = [k for k in evals if k[1].endswith("on-completed")]
    assert mine[eval_done]["config"]["deliver_policy"] == "new"
    assert 0 < mine[eval_done]["delivered"]["consumer_seq"] < completed["delivered"]["consumer_seq"]
    for key, c in cons.items():
        for f in ("num_pending", "num_ack_pending", "num_redelivered"):
            assert c[f] == mine[key][f], (key, f, c, mine[key])
        assert c["delivered_stream_seq"] == mine[key]["delivered"]["stream_seq"]

"""`rollart run` uses the machine: on a nats-server the trainer and the scheduler stay in the
`rollart run` process and generation and envs run in child node processes
(``node.local_processes``), with real processes and a real embedded nats-server: the children
serve their roles and leave nothing behind, a killed child is restarted and the run still
takes all its steps, ``--single-process`` (and ``--nats memory``) starts none, and a bad
value of the key fails naming it."""

from __future__ import annotations

import asyncio
import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml

from rollart.config import ConfigError, RunConfig, convert
from rollart.app.local_nodes import LocalNodes
from rollart.app.local_plan import log_name, plan
from rollart.config.deploy import default_local_processes
from tests.child_output import ReadProcess
from tests.waiting import until_sync

ROOT = Path(__file__).resolve().parents[2]
STARTED = re.compile(r"started (\d+) node process(?:es)?: (.*)$", re.MULTILINE)
CHILD = re.compile(r"([\w,]+) \(pid (\d+), log (\S+)\)")


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory) -> Path:
    """One run folder for the module: the quickstart's tiny model is built once (``_models``)."""
    return tmp_path_factory.mktemp("runs")


def quickstart(tmp_path: Path, run_dir: Path, run: str, steps: int, rollout: dict | None = None,
               **node) -> Path:
    """The packaged quickstart config with few, small steps (2 groups of 4, every group
    trained: the processes are the point, not the learning) and a one-group final evaluation
    (``rollout``: keys of its rollout section to change)."""
    from rollart.app.configs import packaged_configs

    raw = yaml.safe_load(packaged_configs()["quickstart"].read_text())
    raw.update(run=run, run_dir=str(run_dir))
    raw["trainer"].update(steps=steps, eval_groups=1, skip_uniform=0)
    raw.setdefault("rollout", {}).update({"group_size": 4, "batch_groups": 2, **(rollout or {})})
    if node:
        raw["node"] = node
    path = tmp_path / f"{run}.yaml"
    path.write_text(yaml.safe_dump(raw))
    return path


class Run(ReadProcess):
    """``rollart run`` as a user starts it, its output read by a thread (the pipe never
    fills), in a session of its own so a failed test can stop the whole group."""

    def __init__(self, cwd: Path, *args: str):
        super().__init__(["-m", "rollart", "run", *args, "--quiet"], cwd=cwd,
                         start_new_session=True)

    def wait_for(self, what, deadline: float, why: str):
        """Poll ``what()`` until it is truthy; fail with the output past the deadline or when
        the run exits first."""
        return until_sync(what, deadline=deadline, what=why, step=0.1, abort=self.exited,
                          state=self.output)

    def children(self, deadline: float = 60) -> dict[str, int]:
        """Roles -> pid of the child processes the run says it started."""
        m = self.wait_for(lambda: STARTED.search(self.output()), deadline,
                          "the run to say which processes it started")
        found = {roles: int(pid) for roles, pid, _ in CHILD.findall(m.group(2))}
        assert len(found) == int(m.group(1)), m.group(0)
        return found

    def finish(self, deadline: float) -> dict:
        try:
            rc = self.proc.wait(timeout=deadline)
        except subprocess.TimeoutExpired:
            raise AssertionError(f"the run did not end within {deadline}s:\n{self.output()}") from None
        self.reader.join(10)
        out = self.output()
        assert rc == 0, out
        start = out.index("\n{\n") + 1
        return json.loads(out[start:out.index("\n}\n", start) + 2])

    def stop(self) -> None:
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait()


def alive(pid: int) -> bool:
    """A process that runs (a zombie, killed and not yet reaped, is not)."""
    try:
        status = Path(f"/proc/{pid}/status").read_text()
    except (FileNotFoundError, ProcessLookupError):
        return False
    return not re.search(r"^State:\s+[ZX]", status, re.MULTILINE)


def parent_of(pid: int) -> int:
    return int(re.search(r"^PPid:\s+(\d+)", Path(f"/proc/{pid}/status").read_text(), re.MULTILINE).group(1))


def node_children(pid: int) -> list[int]:
    """Processes whose parent is ``pid`` and that run ``rollart.node``."""
    out = []
    for d in Path("/proc").iterdir():
        if not d.name.isdigit():
            continue
        try:
            if parent_of(int(d.name)) == pid and b"rollart.node" in (d / "cmdline").read_bytes():
                out.append(int(d.name))
        except (OSError, AttributeError):
            continue
    return out


def metrics_rows(run_dir: Path, run: str) -> list[dict]:
    path = run_dir / run / "metrics.jsonl"
    try:
        return [json.loads(x) for x in path.read_text().splitlines() if x.strip()]
    except (FileNotFoundError, ValueError):
        return []


needs_proc = pytest.mark.skipif(not Path("/proc/self/status").exists(), reason="needs /proc")


@needs_proc
def test_default_run_starts_node_processes_and_leaves_none(tmp_path, run_dir):
    run = f"lp{os.getpid()}a"
    cfg = quickstart(tmp_path, run_dir, run, steps=3)
    groups = default_local_processes()  # this host's default (one child on <= 2 cores)
    r = Run(tmp_path, str(cfg))
    try:
        kids = r.children()
        assert set(kids) == {",".join(g) for g in groups}, kids
        for pid in kids.values():
            assert pid != r.proc.pid
            assert not alive(pid) or parent_of(pid) == r.proc.pid  # its child, not a stranger
        summary = r.finish(deadline=150)
    finally:
        r.stop()
    assert summary["steps"] == 3 and not summary["interrupted"], summary
    assert "greedy_success" in summary, summary  # the final evaluation ran on the children
    assert [x["step"] for x in metrics_rows(run_dir, run)] == [1, 2, 3]
    logs = run_dir / run / "logs"
    for roles, shown in ((",".join(g), ", ".join(g)) for g in groups):
        text = (logs / log_name(roles.split(","))).read_text()
        assert f"serving {shown} (run={run}" in text, text
        assert f"run {run} ended at step 3; draining" in text, text
        assert "--password" not in text
    assert [p for p in kids.values() if alive(p)] == [], "a child outlived the run"


@needs_proc
@pytest.mark.parametrize("how,layout", [("killed", "split"), ("stuck", "split"), ("killed", "one")])
def test_lost_generate_process_is_restarted_and_the_run_finishes(tmp_path, run_dir, how, layout):
    """Killed mid-run (SIGKILL), or alive but stuck (SIGSTOP: no heartbeat, so it is killed
    after node.stuck_after): the generate process is restarted and the run takes every step.
    ``one``: the child that also steps the envs (the default on <= 2 cores), whose trajectories
    in flight are redelivered to its successor."""
    run = f"lp{os.getpid()}{how}{layout}"
    steps = 5 if how == "killed" else 4
    node = {"heartbeat_every": 0.5, "stuck_after": 3} if how == "stuck" else {}
    groups = [["generate"], ["env", "reward"]] if layout == "split" else [["generate", "env", "reward"]]
    node["local_processes"] = groups
    gen = ",".join(groups[0])  # the child that generates
    # ``one``: the trajectories the killed child held come back after rollout.ack_wait (30 s
    # by default; 8 s here, still far above the child's restart)
    rollout = {"ack_wait": 8.0} if layout == "one" else None
    cfg = quickstart(tmp_path, run_dir, run, steps=steps, rollout=rollout, **node)
    r = Run(tmp_path, str(cfg))
    pids = []
    try:
        kids = r.children()
        pids += kids.values()
        r.wait_for(lambda: metrics_rows(run_dir, run), 120, "a training step")
        # mid-run: the steps after the first need a generator
        os.kill(kids[gen], signal.SIGKILL if how == "killed" else signal.SIGSTOP)
        lost_at = time.monotonic()
        again = r.wait_for(lambda: re.search(rf"node process {gen} restarted: pid (\d+)",
                                             r.output()), 60, "the generate process to be restarted")
        if how == "stuck":
            assert time.monotonic() - lost_at >= 3  # not before node.stuck_after
        pids.append(int(again.group(1)))
        assert int(again.group(1)) != kids[gen]
        summary = r.finish(deadline=150)
    finally:
        r.stop()  # its process group, a stopped child too (which also dies with it)
    out = r.output()
    if how == "killed":
        assert f"node process {gen} (pid" in out and "signal SIGKILL" in out, out
    else:
        assert f"node process {gen} (pid {kids[gen]}) sent no heartbeat for" in out, out
        assert "was stuck (no heartbeat for" in out, out
    assert summary["steps"] == steps and not summary["interrupted"] and "failed" not in summary
    assert [x["step"] for x in metrics_rows(run_dir, run)] == list(range(1, steps + 1))
    text = (run_dir / run / "logs" / log_name(groups[0])).read_text()
    assert text.count(f"serving {', '.join(groups[0])} (run={run}") == 2, text
    assert [p for p in pids if alive(p)] == [], "a child outlived the run"


@needs_proc
@pytest.mark.parametrize("flag", [["--single-process"], ["--nats", "memory"]], ids=["flag", "memory"])
def test_single_process_starts_no_child(tmp_path, run_dir, flag):
    run = f"lp{os.getpid()}c{len(flag)}"
    cfg = quickstart(tmp_path, run_dir, run, steps=1)
    r = Run(tmp_path, str(cfg), *flag)
    try:
        r.wait_for(lambda: metrics_rows(run_dir, run), 120, "a training step")
        during = node_children(r.proc.pid)
        summary = r.finish(deadline=90)
    finally:
        r.stop()
    assert during == [], during
    assert summary["steps"] == 1
    assert "node process" not in r.output(), r.output()
    assert not list((run_dir / run).glob("logs/*.log"))


def test_bad_local_processes_fails_naming_the_key(tmp_path):
    bad = {"envs": {"main": {"type": "frozenlake"}},
           "node": {"local_processes": [["generate"], ["env", "trainer"]]}}
    cfg = tmp_path / "bad.yaml"
    cfg.write_text(yaml.safe_dump(bad))
    env = dict(os.environ, PYTHONPATH=f"{ROOT}{os.pathsep}{os.environ.get('PYTHONPATH', '')}")
    for cmd in (["config", str(cfg), "--static"], ["run", str(cfg), "--steps", "1"]):
        res = subprocess.run([sys.executable, "-m", "rollart", *cmd], cwd=tmp_path, env=env,
                             capture_output=True, text=True, timeout=120, check=False)
        assert res.returncode == 2, (cmd, res.stdout, res.stderr)
        assert "node.local_processes[1]: 'trainer' always stays in the `rollart run` process" \
            in res.stderr, res.stderr
    assert not (tmp_path / "runs").exists()  # nothing was started
    for value, says in (([["generate", "gen"]], "unknown role 'gen'"),
                        ([["env"], ["reward", "env"]], "role 'env' is given twice"),
                        ([[]], "node.local_processes[0] is empty"),
                        ("generate", "node.local_processes: Expected `array`")):
        with pytest.raises(ConfigError, match=re.escape(says)):
            convert({"node": {"local_processes": value}}, RunConfig)
    assert convert({"node": {"local_processes": []}}, RunConfig).node.local_processes == []


def test_plan_forwards_the_bus_and_only_names_of_credentials(tmp_path):
    cfg = convert({}, RunConfig)
    url = "nats://127.0.0.1:4999"
    assert plan(cfg, bus_url="memory") == ([], [])
    assert plan(cfg, bus_url=url, single_process=True) == ([], [])
    assert plan(convert({"node": {"local_processes": []}}, RunConfig), bus_url=url) == ([], [])
    groups, flags = plan(cfg, bus_url=url)  # the embedded server: its URL
    assert groups == default_local_processes() and flags == ["--nats", url]
    pw = tmp_path / "pw"
    pw.write_text("s3cret\n")
    over = {"url": None, "user": "alice", "password_file": "pw", "token_file": None,
            "creds_file": None, "tls_ca": str(tmp_path / "ca.pem"), "listen": "0.0.0.0",
            "server_config": "server.conf"}
    cwd = os.getcwd()
    os.chdir(tmp_path)
    try:
        _, flags = plan(cfg, bus_url=url, nats="nats://head:4222", overrides=over)
    finally:
        os.chdir(cwd)
    assert flags == ["--nats", "nats://head:4222", "--user", "alice", "--password-file", str(pw),
                     "--tls-ca", str(tmp_path / "ca.pem")]
    assert "s3cret" not in " ".join(flags)
    # a config that joins a server by itself: the child reads the same nats section
    joined = convert({"nats": {"url": "nats://head:4222", "user": "a", "password_env": "PW"}},
                     RunConfig)
    assert plan(joined, bus_url="nats://head:4222")[1] == []
    # no reward service in the run: no reward role in a child
    none = convert({"actors": {"reward": {"replicas": 0}},
                    "node": {"local_processes": [["generate"], ["env", "reward"]]}}, RunConfig)
    assert plan(none, bus_url=url)[0] == [["generate"], ["env"]]


def test_default_placement_follows_the_cores():
    assert default_local_processes(1) == default_local_processes(2) == [["generate", "env", "reward"]]
    assert default_local_processes(3) == default_local_processes(64) == [["generate"], ["env", "reward"]]
    assert convert({}, RunConfig).node.local_processes == default_local_processes()


class _Node:
    """What LocalNodes needs of a Node: ``stop`` and ``wait``."""

    def __init__(self):
        self.stopped = asyncio.Event()

    def stop(self) -> None:
        self.stopped.set()

    async def wait(self) -> None:
        await self.stopped.wait()


def _fake(tmp_path: Path, code: str, window: float = 600.0, **node):
    """LocalNodes of one ``generate`` child that runs ``code`` instead of a node."""
    cfg = convert({"run": "fake", "run_dir": str(tmp_path / "runs"), "node": node}, RunConfig)
    local = LocalNodes(cfg, [["generate"]], [], backoff=0.01, window=window)
    local._command = lambda child: [sys.executable, "-c", code]  # a test seam: the child's command
    return local


@needs_proc
async def test_a_child_that_keeps_dying_stops_the_run_naming_role_and_log(tmp_path):
    local = _fake(tmp_path, "import sys; print('boom: no engine'); sys.exit(3)")
    node = _Node()
    async with local:
        local.attach(node)
        await asyncio.wait_for(node.stopped.wait(), 60)  # the run is stopped, not left waiting
    log = tmp_path / "runs" / "fake" / "logs" / "generate.log"
    assert local.failure is not None
    assert "serving generate exited with status 3" in local.failure, local.failure
    assert "after 3 restarts within 600 s" in local.failure and str(log) in local.failure, \
        local.failure
    lines = log.read_text().splitlines()
    assert lines.count("boom: no engine") == 4, lines  # the first start and 3 restarts
    assert [x.split("): ")[1].split()[0] for x in lines if x.startswith("--- ")] == \
        ["start", "restart", "restart", "restart"], lines


@needs_proc
async def test_restarts_count_within_the_window_only(tmp_path):
    """A child that dies now and then (each life longer than the window) is restarted past
    the limit: only restarts within the window stop the run."""
    local = _fake(tmp_path, "import sys, time; time.sleep(0.3); print('died'); sys.exit(3)",
                  window=0.2)
    node = _Node()
    log = tmp_path / "runs" / "fake" / "logs" / "generate.log"
    t0 = time.monotonic()
    async with local:
        local.attach(node)
        while log.read_text().splitlines().count("died") < 5:
            assert local.failure is None and time.monotonic() - t0 < 60, log.read_text()
            await asyncio.sleep(0.05)
        assert not node.stopped.is_set()
    assert local.failure is None and local.children[0].restarts >= 4


@needs_proc
async def test_a_child_that_ignores_sigterm_is_killed(tmp_path):
    code = ("import signal, sys, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); "
            "print('UP', 'NOW', flush=True); time.sleep(120)")
    local = _fake(tmp_path, code, grace=0.5)
    t0 = time.monotonic()
    async with local:
        pid = local.children[0].proc.pid
        log = local.children[0].log_path
        while "UP NOW" not in log.read_text().splitlines():
            assert time.monotonic() - t0 < 30, log.read_text()
            await asyncio.sleep(0.05)
    # interrupted (never run_ended): SIGTERM, grace + 5 s, then SIGKILL
    assert local.children[0].proc.returncode == -signal.SIGKILL
    assert not alive(pid) and time.monotonic() - t0 < 30


@needs_proc
async def test_training_waits_for_every_childs_first_heartbeat(tmp_path, memory_bus_only, caplog):
    """``started()`` (what the trainer awaits before its first step) returns once each child
    sent a heartbeat, and after its timeout when one never does (with a warning)."""
    import socket

    from rollart import messages as m
    from rollart.bus.codec import encode

    local = _fake(tmp_path, "import time; time.sleep(120)", heartbeat_every=0.2, stuck_after=60)
    local.bus = memory_bus_only
    async with local:
        with caplog.at_level("WARNING", logger="rollart.app.local_nodes"):
            await asyncio.wait_for(local.started(timeout=0.2), 30)  # nobody beat: it gave up
        assert "not all started within 0 s" in caplog.text, caplog.text
        waiter = asyncio.ensure_future(local.started(timeout=120))
        done, _ = await asyncio.wait([waiter], timeout=0.3)
        assert not done  # still waiting: no heartbeat yet
        pid = local.children[0].proc.pid
        hb = m.NodeHeartbeat(node_id="n1", host=socket.gethostname(), pid=pid, pool="default",
                             roles=["generate"], ts=time.time())
        t0 = time.monotonic()
        while not waiter.done():  # the watcher subscribes as the children start: beat until seen
            assert time.monotonic() - t0 < 30, "started() never saw the heartbeat"
            await memory_bus_only.publish_core(m.subject("fake", "node.heartbeat"), encode(hb))
            await asyncio.wait([waiter], timeout=0.05)
        await waiter
        # no run_ended(): the stand-in child is no node and would never exit by itself, so the
        # stop would wait out the drain window (~25 s) before its SIGTERM

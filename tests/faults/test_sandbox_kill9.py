"""kill -9 of an env host leaves no sandbox behind (issue 46): every sandbox, warm or lent with
a command running in it, dies with the process that started it (bubblewrap's
``--die-with-parent``), though nothing of the host ran its teardown. Twice: a process that
holds the pool as an EnvManager does, and a real ``python -m rollart.node --roles env`` whose
env declares ``uses_sandbox`` (its warm pool and the sandbox of a trajectory that waits for a
generate replica)."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from rollart import messages as m
from rollart.bus.codec import encode
from rollart.bus.nats import NatsBus
from rollart.bus.server import EmbeddedServer
from tests.actors.sample_actors import new_run
from tests.child_output import NodeProcess
from tests.waiting import until, until_sync

ROOT = Path(__file__).resolve().parents[2]
pytestmark = pytest.mark.skipif(shutil.which("bwrap") is None,
                                reason="bubblewrap ('bwrap') is not installed: no sandbox to "
                                       "leave behind (apt-get install bubblewrap)")


def _proc(pid: int) -> tuple[int, str, bytes] | None:
    """(parent pid, state, command line) of a live process, None when gone or a zombie."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            cmd = f.read()
    except (OSError, IndexError):
        return None
    return None if fields[0] in ("Z", "X") else (int(fields[1]), fields[0], cmd)


def descendants(root: int) -> dict[int, bytes]:
    """Every live process under ``root``, with its command line."""
    children: dict[int, list[int]] = {}
    for d in os.listdir("/proc"):
        if d.isdigit() and (p := _proc(int(d))) is not None:
            children.setdefault(p[0], []).append(int(d))
    out, todo = {}, [root]
    while todo:
        for c in children.get(todo.pop(), []):
            if (p := _proc(c)) is not None:
                out[c] = p[2]
                todo.append(c)
    return out


def test_kill9_of_a_host_leaves_no_sandbox_process(tmp_path):
    env = dict(os.environ, PYTHONPATH=f"{ROOT / 'src'}{os.pathsep}{ROOT}")
    host = subprocess.Popen([sys.executable, "-m", "tests.faults.sandbox_host", "2"], cwd=ROOT,
                            env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        line = host.stdout.readline()  # "ready", or EOF when it failed (its stderr says why)
        assert line.strip() == "ready", f"the host did not get ready: {host.stderr.read()[-2000:]}"
        tree = descendants(host.pid)
        sandboxes = {p for p, cmd in tree.items() if b"rollart-sandbox-supervisor" in cmd}
        sleeping = {p for p, cmd in tree.items() if cmd.startswith(b"sleep\0") or b"sleep 600" in cmd}
        started = {p for p in sandboxes if _proc(p)[0] == host.pid}  # the bwraps it started
        assert len(started) == 3, f"2 warm and 1 lent sandboxes expected: {tree}"
        assert sleeping, f"the lent sandbox's command is not running: {tree}"
        host.send_signal(signal.SIGKILL)
        host.wait(timeout=30)
        until_sync(lambda: not any(_proc(p) for p in tree), deadline=30,
                   what="every sandbox process of the killed host to exit",
                   state=lambda: {p: _proc(p) for p in tree if _proc(p)})
    finally:
        if host.poll() is None:
            host.kill()
            host.wait()
        host.stdout.close()
        host.stderr.close()


def started_sandboxes(pid: int) -> dict[int, bytes]:
    """The sandboxes (bwraps) process ``pid`` started, and every process under them."""
    tree = descendants(pid)
    if sum(1 for p, cmd in tree.items()
           if b"rollart-sandbox-supervisor" in cmd and (_proc(p) or (0,))[0] == pid) < 3:
        return {}
    return tree


async def test_kill9_of_an_env_node_leaves_no_sandbox_process(tmp_path, tiny_model):
    run = new_run()
    cfg = tmp_path / "run.yaml"
    cfg.write_text(
        f"run: {run}\n"
        f"run_dir: {tmp_path / 'runs'}\n"
        "node: {grace: 5, heartbeat_every: 1}\n"
        f"model: {{path: '{tiny_model}'}}\n"
        "sandbox: {warm: 2}\n"
        "envs: {main: {type: 'tests.actors.sandbox_envs:DyingSandboxEnv', max_turns: 2,"
        " args: {key: kill9, dies: 0}}}\n"
        "rollout: {generate_timeout: 600, service_wait: 600}\n")
    with EmbeddedServer(tmp_path / "nats") as server:
        node = NodeProcess(cfg, "env", "--nats", server.url, name="env node")
        try:
            await node.line_with("serving env")
            bus = NatsBus(server.url)
            await bus.connect()
            try:  # one trajectory takes a sandbox, then waits for a generate replica
                msg = m.RolloutRequested(traj_id="t0", group_id="g0", env="main", seed=0)
                await bus.publish(m.subject(run, "rollout.requested", "default"), encode(msg),
                                  msg_id="t0")
                await node.line_with("wait for a generate replica", deadline=60)
            finally:
                await bus.close()
            tree = await until(lambda: started_sandboxes(node.proc.pid), deadline=60,
                               what="2 warm sandboxes and 1 lent in the env node",
                               state=lambda: descendants(node.proc.pid))
            node.proc.send_signal(signal.SIGKILL)
            node.proc.wait(timeout=30)
            await until(lambda: not any(_proc(p) for p in tree), deadline=30,
                        what="every sandbox process of the killed env node to exit",
                        state=lambda: {p: _proc(p) for p in tree if _proc(p)})
        finally:
            node.kill()

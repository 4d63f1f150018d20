"""kill -9 of an env host leaves no sandbox behind (issue 46): every sandbox, warm or lent with
a command running in it, dies with the process that started it (bubblewrap's
``--die-with-parent``), though nothing of the host ran its teardown."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from tests.waiting import until_sync

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

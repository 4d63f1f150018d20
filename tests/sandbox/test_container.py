"""The container backend (``sandbox.backend: podman``) on a real podman, with an image made
from this host's python (``make_image.sh``: no registry is reachable here). Skipped, saying
why, where podman is missing or cannot run a container; ``.ci/run`` installs it."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
from pathlib import Path

import pytest

from rollart import sandbox
from rollart.config.sandbox import SandboxConfig
from tests.waiting import until_sync

TAG = "localhost/rollart-sandbox-test:1"
MAKE_IMAGE = Path(__file__).with_name("make_image.sh")


def _podman(*args: str, timeout: float = 120) -> subprocess.CompletedProcess:
    return subprocess.run(["podman", *args], capture_output=True, text=True, timeout=timeout)


def _skip(why: str) -> None:
    if os.environ.get("ROLLART_REQUIRE_SANDBOX") == "1":  # .ci/run installed it: it must run
        pytest.fail(why)
    pytest.skip(why)


@pytest.fixture(scope="module")
def cfg() -> SandboxConfig:
    if shutil.which("podman") is None:
        _skip("podman is not installed (apt-get install podman runc; .ci/run does as root)")
    if _podman("image", "exists", TAG).returncode != 0:
        made = subprocess.run(["bash", str(MAKE_IMAGE), "podman", TAG], capture_output=True,
                              text=True, timeout=300)
        if made.returncode != 0:
            _skip(f"cannot make the test image: {made.stderr[-300:]}")
    # crun, podman's default runtime, refuses hosts with hybrid cgroups (this one); runc runs
    extra = ["--runtime", "runc"] if shutil.which("runc") else []
    c = SandboxConfig(backend="podman", image=TAG, engine_args=extra, warm=0, processes=32,
                      memory_bytes=512 << 20, workspace_bytes=16 << 20, timeout_s=10)
    try:
        sandbox.start(c).close()
    except sandbox.SandboxError as e:
        _skip(f"podman cannot run a container here: {e}")
    return c


def _containers() -> list[str]:
    r = _podman("ps", "-a", "--filter", f"ancestor={TAG}", "--format", "{{.ID}}")
    return r.stdout.split()


def test_the_same_contract_in_a_container(cfg):
    with sandbox.start(cfg) as sb:
        sb.write("main.py", "import sys\nprint(sys.stdin.read().upper())")
        r = sb.run(["python3", "main.py"], stdin="abc")
        assert (r.exit_code, r.stdout) == (0, b"ABC\n")
        assert sb.run("echo kept > f").ok and sb.read("f") == b"kept\n"
        assert sb.run("id -u").stdout == b"1000\n"
        assert sb.run("sleep 100", timeout=1).limit == "timeout"
        r = sb.run(["python3", "-c", "import socket; socket.create_connection(('127.0.0.1', 4222), 1)"])
        assert r.exit_code != 0 and b"CONNECTED" not in r.stdout
        r = sb.run(["python3", "-c", "import socket; socket.create_connection(('8.8.8.8', 53), 1)"])
        assert b"unreachable" in r.stderr.lower() or r.exit_code != 0
        r = sb.run(["python3", "-c", "import os\nwhile True: os.fork()"], timeout=5)
        assert r.limit in ("processes", "timeout") and sb.run("true").ok
        assert sb.run("touch /usr/x").exit_code != 0  # a read-only root
    until_sync(lambda: _containers() == [], deadline=60, what="the closed sandbox's container to go")


def test_a_killed_client_leaves_no_container(cfg):
    sb = sandbox.start(cfg)
    assert sb.run("true").ok
    os.kill(sb.pid, signal.SIGKILL)  # what a kill -9 of the env host does to its clients
    until_sync(lambda: _containers() == [], deadline=60, what="the container of a killed client to go",
               state=lambda: _podman("ps", "-a").stdout)
    sb.close()

"""One sandbox's contract: commands, files, limits, output caps, and which failures are
infrastructure (:class:`SandboxError`) and which are the caller's (:class:`SandboxRequestError`)."""

from __future__ import annotations

import os
import shutil
import sys
import tempfile
import threading
from pathlib import Path
import time

import pytest

from rollart import sandbox
from rollart.config.sandbox import SandboxConfig
from rollart.sandbox import Limits, Sandbox, SandboxError, SandboxPool, SandboxRequestError
from tests.sandbox.conftest import SMALL, needs_bwrap
from tests.waiting import until, until_sync


def test_run_write_read_and_state_across_commands(sb):
    sb.write("src/main.py", "import sys\nprint(sys.stdin.read()[::-1])\n")
    r = sb.run(["python3", "src/main.py"], stdin="abc")
    assert (r.exit_code, r.stdout, r.limit, r.timed_out) == (0, b"cba\n", None, False)
    assert r.wall_s > 0 and r.cpu_s > 0
    assert sb.run("echo more >> src/log; echo again >> src/log").ok
    assert sb.read("src/log") == b"more\nagain\n"
    assert sb.read("src/main.py", max_bytes=6) == b"import"
    r = sb.run("exit 3")
    assert r.exit_code == 3 and not r.ok


def test_output_is_capped_and_the_cut_is_said(sb):
    r = sb.run("head -c 100000 /dev/zero | tr '\\0' x; echo err >&2")
    assert len(r.stdout) == SMALL.max_output_bytes
    assert r.stdout_truncated == 100000 - SMALL.max_output_bytes
    assert r.text().endswith(f"[... {r.stdout_truncated} more bytes truncated]")
    assert r.stderr == b"err\n" and r.stderr_truncated == 0


def test_a_command_may_lower_a_limit_never_raise_it(sb):
    r = sb.run(["python3", "-c", "import resource; print(resource.getrlimit(resource.RLIMIT_NPROC)[0])"],
               limits=Limits(processes=10_000))
    assert int(r.stdout) == SMALL.processes
    r = sb.run(["python3", "-c", "import resource; print(resource.getrlimit(resource.RLIMIT_NPROC)[0])"],
               limits=Limits(processes=5))
    assert int(r.stdout) == 5
    t0 = time.monotonic()
    r = sb.run("sleep 5", limits=Limits(timeout_s=0.5))
    assert r.timed_out and r.limit == "timeout" and time.monotonic() - t0 < 4


def test_paths_outside_the_workspace_are_the_callers_mistake(sb):
    for bad in ("/etc/passwd", "../x", "a/../../x", ""):
        with pytest.raises(SandboxRequestError):
            sb.read(bad)
        with pytest.raises(SandboxRequestError):
            sb.write(bad, b"x")
    # a link the code made to outside the workspace is refused inside too
    assert sb.run("ln -s /usr/bin/env link && ln -s /tmp tlink").ok
    with pytest.raises(SandboxRequestError, match="outside the workspace"):
        sb.read("link")
    with pytest.raises(SandboxRequestError, match="outside the workspace"):
        sb.write("tlink/x", b"x")
    with pytest.raises(SandboxRequestError, match="No such file"):
        sb.read("missing")
    with pytest.raises(SandboxRequestError, match="pass data as stdin"):
        sb.run(["echo", "x" * (2 << 20)])
    with pytest.raises(SandboxRequestError, match="NUL"):
        sb.run(["echo", "a\0b"])
    assert sb.run("true").ok  # the sandbox is fine after refusals


def test_a_dead_supervisor_is_an_infrastructure_failure(sb):
    os.kill(sb.pid, 9)
    with pytest.raises(SandboxError, match="exited|gone|stopped"):
        sb.run("true")
    assert not sb.alive
    with pytest.raises(SandboxError, match="gone"):
        sb.run("true")


@needs_bwrap
def test_a_supervisor_that_speaks_garbage_is_refused_typed_and_bounded():
    # a real process on the other end that answers with a frame claiming 1 GiB
    box = Sandbox(argv=[sys.executable, "-c", "import sys; sys.stdin.buffer.readline(); "
                        "sys.stdout.buffer.write(b'\\x40\\x00\\x00\\x00'); sys.stdout.flush(); "
                        "import time; time.sleep(60)"], limits=Limits(), start_timeout_s=10)
    with pytest.raises(SandboxError, match="claims 1073741824 bytes"):
        box.start()
    assert not box.alive
    box = Sandbox(argv=[sys.executable, "-c", "import sys; sys.stdin.buffer.readline(); "
                        "sys.stdout.buffer.write(b'\\x00\\x00\\x00\\x05{\"ok\"'); sys.stdout.flush()"],
                  limits=Limits(), start_timeout_s=10)
    with pytest.raises(SandboxError, match="malformed|exited"):
        box.start()


@needs_bwrap
def test_a_process_with_thousands_of_descriptors_drives_sandboxes():
    # an env host with many connections: its pipes to a sandbox get numbers past select's 1024
    import resource

    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard < 2100:
        pytest.skip(f"RLIMIT_NOFILE hard limit {hard} < 2100")
    resource.setrlimit(resource.RLIMIT_NOFILE, (max(soft, 2100), hard))
    held = [os.open("/dev/null", os.O_RDONLY) for _ in range(1100)]
    try:
        box = sandbox.start(SMALL)
        try:
            assert box._proc.stdout.fileno() > 1024
            assert box.run("echo far").stdout == b"far\n"
        finally:
            box.close()
    finally:
        for fd in held:
            os.close(fd)
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))


@needs_bwrap
def test_a_sandbox_outlives_the_thread_that_started_it():
    # --die-with-parent is per thread: an env runner's thread that ends must not take its
    # sandbox along (every sandbox is spawned from one long-lived thread)
    box: list[Sandbox] = []
    t = threading.Thread(target=lambda: box.append(sandbox.start(SMALL)))
    t.start()
    t.join()
    try:
        assert box[0].run("echo still here").stdout == b"still here\n"
    finally:
        box[0].close()


@needs_bwrap
def test_a_sandbox_that_cannot_start_says_why():
    cfg = SandboxConfig(python="/usr/bin/no-such-python", warm=0)
    with pytest.raises(SandboxError) as e:
        sandbox.start(cfg)
    assert "no-such-python" in str(e.value)
    with pytest.raises(SandboxError, match="no such interpreter"):
        sandbox.start(SandboxConfig(python="/nonexistent/python3", warm=0))
    # an interpreter at /tmp/x/python3 has the prefix /tmp: binding it would show the sandbox
    # every other process's temporary files
    folder = Path(tempfile.mkdtemp(dir="/tmp"))
    try:
        (folder / "python3").write_bytes(b"")
        with pytest.raises(SandboxError, match="too much of the host"):
            sandbox.start(SandboxConfig(python=str(folder / "python3"), warm=0))
    finally:
        shutil.rmtree(folder)


@needs_bwrap
def test_the_pool_hands_out_warm_sandboxes_and_never_reuses_one():
    pool = SandboxPool(SMALL, warm=2)
    try:
        assert pool.wait_ready(2, timeout=30)
        a = pool.acquire()
        a.write("mine", "episode 1")
        pool.release(a)
        until_sync(lambda: not a.alive, deadline=10, what="the released sandbox is killed")
        b = pool.acquire()
        assert b is not a and b.alive
        assert b.run("ls").stdout == b""  # a fresh workspace
        snap = pool.snapshot()
        assert snap["warm_hits"] == 2 and snap["cold_starts"] == 0
        assert snap["start_p50_s"] is not None and snap["lent"] == 1
        assert pool.wait_ready(2, timeout=30)  # refilled
        dead = pool._ready[0]
        os.kill(dead.pid, 9)  # one dies while idle: skipped, counted, cleaned up
        until_sync(lambda: not dead.alive, deadline=10, what="the idle sandbox died")
        c = pool.acquire()
        assert c.alive and c.run("true").ok
        assert pool.snapshot()["died_idle"] == 1
        until_sync(lambda: dead._dead == "closed" and dead.cgroups is None, deadline=10,
                   what="the dead sandbox's pipes and cgroups released")
    finally:
        pool.close()
    assert not b.alive and not c.alive  # close kills lent ones too


@needs_bwrap
async def test_the_async_face_runs_off_the_event_loop():
    pool = SandboxPool(SMALL, warm=1)
    try:
        async with pool.session() as box:
            await box.awrite("x.py", "print(6 * 7)")
            r = await box.arun(["python3", "x.py"])
            assert r.stdout == b"42\n"
            assert await box.aread("x.py") == b"print(6 * 7)"
        await until(lambda: not box.alive, deadline=10, what="the session's sandbox is killed")
    finally:
        pool.close()


def test_config_errors_name_the_key():
    with pytest.raises(ValueError, match="sandbox.image is required"):
        SandboxConfig(backend="podman")
    with pytest.raises(ValueError, match="sandbox.processes"):
        SandboxConfig(processes=0)
    with pytest.raises(ValueError, match="sandbox.binds"):
        SandboxConfig(binds=["relative/dir"])


def test_empty_cgroups_of_a_killed_process_are_swept_and_no_other():
    """A process killed with SIGKILL leaves its sandboxes' empty cgroup folders; the next
    process's first sandbox removes them. Kept: a live process's folder, a folder that still
    holds a process, and anything not named as rollart's. Removed: a dead maker's, and one
    whose pid now belongs to another process (another start time)."""
    import subprocess

    from rollart.sandbox import cgroups

    cg = cgroups.make(64 << 20, 16)
    if cg is None:
        pytest.skip("this host offers rollart no cgroups (not root, no delegated subtree)")
    parents = [d.parent for d in cg.folders]
    cg.remove()
    dead_pid = subprocess.Popen([sys.executable, "-c", "pass"])
    dead_pid.wait()
    names = {"dead": f"rollart-sandbox-{dead_pid.pid}-12345-{'a' * 12}",
             "reused": f"rollart-sandbox-{os.getpid()}-1-{'b' * 12}",
             "live": f"rollart-sandbox-{cgroups._own_tag()}-{'c' * 12}",
             "busy": f"rollart-sandbox-{dead_pid.pid}-12345-{'d' * 12}",
             "other": "rollart-sandbox-not-ours"}
    sleeper = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        for parent in parents:
            for name in names.values():
                (parent / name).mkdir()
            (parent / names["busy"] / "cgroup.procs").write_text(str(sleeper.pid))
        # at least this test's two a parent: other processes' leftovers (a sandbox whose maker a
        # test beside this one killed) are swept too (load1: 10 removed for these 4)
        assert cgroups.sweep(parents) >= 2 * len(parents)
        for parent in parents:
            left = {k for k, n in names.items() if (parent / n).exists()}
            assert left == {"live", "busy", "other"}, (parent, left)
    finally:
        sleeper.kill()
        sleeper.wait()
        for parent in parents:
            for name in names.values():
                d = parent / name
                if d.exists():
                    until_sync(lambda d=d: not (d / "cgroup.procs").read_text().strip(),
                               deadline=10, what=f"{d} empty")
                    d.rmdir()

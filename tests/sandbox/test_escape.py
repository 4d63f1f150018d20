"""Hostile programs run as the model's code, each contained: the command ends with its
outcome, the host, the run and other sandboxes are untouched, and the sandbox still works.

What each probes is what a model could try from inside (issue 46 §4): the host's files and
the run's credentials, writes outside the workspace, the run's nats-server and other
loopback ports, fork and memory bombs, filling the disk, sleeping forever, processes left
in the background, signals to the supervisor and the host, ptrace. Killing an env host
with SIGKILL and checking that no sandbox process is left is in
``tests/faults/test_sandbox_kill9.py``.
"""

from __future__ import annotations

import os
import socket
import threading
import time

import pytest

from rollart import sandbox
from tests.sandbox.conftest import SMALL

SECRET = "rollart-test-secret-3f9a"


def _py(sb, code: str, **kw):
    return sb.run(["python3", "-c", code], **kw)


def _host_pids_with(marker: str) -> list[int]:
    out = []
    for pid in os.listdir("/proc"):
        if not pid.isdigit():
            continue
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                if marker.encode() in f.read():
                    out.append(int(pid))
        except OSError:
            continue
    return out


def test_the_host_files_and_the_run_folder_are_not_there(sb, tmp_path):
    run = tmp_path / "run"
    (run / "secrets").mkdir(parents=True)
    (run / "secrets" / "token").write_text(SECRET)
    r = sb.run(f"cat {run}/secrets/token; ls {tmp_path}; ls /root /home /work /etc/shadow /var; "
               f"grep -rs {SECRET} /etc /tmp /workspace /dev /proc/1; echo done")
    assert SECRET.encode() not in r.stdout and SECRET.encode() not in r.stderr
    assert r.stdout.endswith(b"done\n")
    seen = set(_py(sb, "import os; print(' '.join(os.listdir('/')))").text().split())
    assert seen <= {"bin", "sbin", "lib", "lib32", "lib64", "libx32", "usr", "proc", "dev", "tmp",
                    "workspace", "etc"}, seen
    assert set(_py(sb, "import os; print(' '.join(os.listdir('/etc')))").text().split()) \
        <= {"ld.so.cache", "alternatives"}
    if os.geteuid() == 0:  # rollart runs as root here: the sandbox runs as an unprivileged host user
        inside = [p for p in _host_pids_with("rollart-sandbox-supervisor") if _ppid(p) == sb.pid]
        assert inside, "the sandbox's supervisor was not found among the host's processes"
        for pid in inside:
            uids = _status(pid, "Uid").split()
            assert set(uids) == {str(SMALL.uid)}, uids


def _status(pid: int, key: str) -> str:
    with open(f"/proc/{pid}/status") as f:
        return next(line.split(":", 1)[1] for line in f if line.startswith(key + ":"))


def _ppid(pid: int) -> int:
    try:
        return int(_status(pid, "PPid"))
    except (OSError, StopIteration):
        return -1


def test_the_run_credentials_in_the_environment_are_not_there(sb, monkeypatch):
    monkeypatch.setenv("NATS_CREDS_TEST", SECRET)  # the host process's environment
    fresh = sandbox.start(SMALL)
    try:
        r = fresh.run("env; cat /proc/1/environ")
        assert SECRET.encode() not in r.stdout + r.stderr
        assert b"NATS" not in r.stdout
    finally:
        fresh.close()


def test_writes_outside_the_workspace_fail(sb, tmp_path):
    target = tmp_path / "host-file"
    target.write_text("original")
    r = sb.run(f"echo pwned > {target}; echo pwned > /usr/pwned; echo pwned > /etc/pwned; "
               f"mkdir /pwned; touch /proc/sys/kernel/hostname; echo exit=$?")
    assert target.read_text() == "original"
    assert not os.path.exists("/usr/pwned") and not os.path.exists("/pwned")
    assert b"Read-only file system" in r.stderr or b"Permission denied" in r.stderr
    assert socket.gethostname() != "pwned"


def test_the_runs_nats_server_and_loopback_ports_are_out_of_reach(sb, nats_server):
    port = int(nats_server.url.rsplit(":", 1)[1])
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen()
    other = listener.getsockname()[1]
    accepted: list = []
    listener.settimeout(0.2)
    stop = threading.Event()

    def accept():
        while not stop.is_set():
            try:
                accepted.append(listener.accept())
            except OSError:
                continue

    t = threading.Thread(target=accept, daemon=True)
    t.start()
    try:
        code = ("import socket\n"
                f"for host, port in [('127.0.0.1', {port}), ('127.0.0.1', {other}), ('::1', {port}), "
                "('10.0.2.2', 4222), ('8.8.8.8', 53)]:\n"
                "    try:\n"
                "        socket.create_connection((host, port), timeout=1); print('CONNECTED', host, port)\n"
                "    except OSError as e:\n"
                "        print('refused', host, port, type(e).__name__)\n")
        r = _py(sb, code)
        assert b"CONNECTED" not in r.stdout, r.stdout
        assert r.stdout.count(b"refused") == 5
        assert accepted == []
        r = sb.run("cat /proc/net/tcp /proc/net/tcp6 | wc -l; ls /sys/class/net 2>&1")
        assert int(r.stdout.split()[0]) <= 2  # headers only: the host's sockets are not visible
    finally:
        stop.set()
        t.join()
        listener.close()


def test_a_fork_bomb_stops_at_the_process_limit(sb):
    before = len(os.listdir("/proc"))
    r = _py(sb, "import os\nwhile True:\n    os.fork()", timeout=5)
    assert r.exit_code != 0 or r.timed_out
    assert r.limit in ("processes", "timeout")
    assert len(os.listdir("/proc")) < before + 20  # nothing left behind on the host
    assert sb.run("true").ok
    assert int(sb.run("ls /proc | grep -c '^[0-9]'").stdout) <= 4  # init, sh, ls, grep


def test_a_memory_bomb_stops_at_the_address_space_limit(sb):
    r = _py(sb, "b = []\nwhile True:\n    b.append(bytearray(64 << 20))")
    assert r.exit_code != 0 and r.limit == "memory", r
    assert sb.run("true").ok


def test_a_memory_bomb_of_many_processes_stops_at_the_sandboxs_memory(sb):
    # each process stays under its RLIMIT_AS (512 MiB); together they are 3x the sandbox's
    if sb.cgroups is None:
        pytest.skip("this host offers rollart no cgroups (not root, no delegated subtree): "
                    "only per-process rlimits bound a sandbox")
    code = ("import os, time\n"
            "for _ in range(6):\n"
            "    if os.fork() == 0:\n"
            "        b = bytearray(300 << 20)\n"  # written: resident, not just reserved
            "        time.sleep(3)\n"
            "        os._exit(0)\n"
            "for _ in range(6):\n"
            "    print(os.wait())\n")
    r = _py(sb, code)
    assert r.limit == "memory" and not r.timed_out, r
    assert r.stdout.count(b", 9)") >= 3  # os.wait(): most were killed by SIGKILL
    assert sb.run("echo alive").stdout == b"alive\n"  # the supervisor was not the one killed


def test_filling_the_disk_stops_at_the_caps(sb):
    r = sb.run("dd if=/dev/zero of=big bs=1M count=64")
    assert r.exit_code != 0 and r.limit == "file_size"
    r = sb.run("for i in 1 2 3 4 5 6; do dd if=/dev/zero of=f$i bs=1M count=4 2>/dev/null; done; "
               "df -k /workspace | tail -1")
    used_kb = int(r.stdout.split()[2])
    assert used_kb <= SMALL.workspace_bytes // 1024
    assert sb.run("rm -f big f*; echo ok > small && cat small").stdout == b"ok\n"


def test_sleeping_forever_ends_at_the_deadline(sb):
    t0 = time.monotonic()
    r = sb.run("sleep 1000", timeout=1)
    assert r.timed_out and r.limit == "timeout" and r.exit_code < 0
    assert time.monotonic() - t0 < 8
    r = _py(sb, "while True: pass", limits=sandbox.Limits(cpu_s=1, timeout_s=30))
    assert r.limit == "cpu" and r.cpu_s >= 0.9


def test_background_processes_do_not_outlive_their_command(sb):
    marker = "4747.4747"
    r = sb.run(f"(sleep {marker} &); nohup sleep {marker} >/dev/null 2>&1 & "
               f"setsid sleep {marker} & python3 -c 'import os,time\nif os.fork()==0:\n os.setsid(); time.sleep({marker})' & echo started")
    assert r.stdout == b"started\n" and r.wall_s < 5
    assert _host_pids_with(marker) == []
    assert marker.encode() not in sb.run("ps -eo args").stdout


def test_signals_reach_neither_the_supervisor_nor_the_host(sb):
    host_pid = os.getpid()
    r = sb.run(f"kill -9 1; kill -9 -1; kill -9 {host_pid}; kill -STOP 1; echo still-here")
    assert b"still-here" in r.stdout
    assert sb.run("echo alive").stdout == b"alive\n"
    assert os.getpid() == host_pid  # this test process was not touched


def test_ptrace_and_proc_peeking_at_the_supervisor_fail(sb):
    code = ("import ctypes, os\n"
            "libc = ctypes.CDLL(None, use_errno=True)\n"
            "print('attach', libc.ptrace(16, 1, 0, 0), ctypes.get_errno())\n"  # PTRACE_ATTACH
            "for p in ('/proc/1/environ', '/proc/1/mem', '/proc/1/fd/0', '/proc/1/fd/1'):\n"
            "    try:\n"
            "        open(p, 'rb').read(1); print('OPENED', p)\n"
            "    except OSError as e:\n"
            "        print('denied', p, e.errno)\n")
    r = _py(sb, code)
    lines = r.text().splitlines()
    assert lines[0].startswith("attach -1"), lines
    assert not any(line.startswith("OPENED") for line in lines), lines
    assert sb.run("echo alive").ok


def test_other_sandboxes_are_untouched(sb):
    other = sandbox.start(SMALL)
    try:
        other.write("mine.txt", "other's data")
        r = sb.run("ls /workspace; find / -name mine.txt 2>/dev/null; echo done")
        assert b"mine.txt" not in r.stdout
        # a bomb in one while the other works
        done = threading.Event()
        results = []

        def busy():
            for _ in range(5):
                results.append(other.run(["python3", "-c", "print(sum(range(1000)))"]))
            done.set()

        t = threading.Thread(target=busy)
        t.start()
        _py(sb, "import os\nwhile True:\n    os.fork()", timeout=3)
        t.join(timeout=60)
        assert done.is_set() and all(x.stdout == b"499500\n" for x in results)
        assert other.read("mine.txt") == b"other's data"
    finally:
        other.close()


@pytest.mark.parametrize("what", ["mount", "unshare", "chroot"])
def test_no_privilege_to_rearrange_the_sandbox(sb, what):
    cmd = {"mount": "mount -t tmpfs none /usr", "unshare": "unshare -r true",
           "chroot": "chroot / true"}[what]
    r = sb.run(cmd)
    assert r.exit_code != 0, (what, r)

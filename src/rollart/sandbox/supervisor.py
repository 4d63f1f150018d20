"""The program that runs inside a sandbox as its PID 1: it executes the host's requests.

The host (:mod:`rollart.sandbox.core`) starts ``python3 -I -S -u -c BOOT``, writes this
source's length and the source on its stdin (so that ``ps`` in the sandbox shows a short
command line), then speaks length-prefixed JSON frames on its stdin/stdout: ``run`` (a command
with rlimits, a deadline and capped output), ``write`` and ``read`` (files under the
workspace) and ``ping``. Standard library only: the sandbox sees the host's ``/usr``, not
rollart's virtualenv.

Being the namespace's PID 1 makes it the one process the model's code cannot kill (the
kernel drops signals to a PID namespace's init from inside it), and it makes itself
non-dumpable, so that the code cannot ptrace it or open its pipes through ``/proc``. After
every command it kills every other process in the namespace (``kill(-1, SIGKILL)`` from
init reaches exactly them) and reaps them: nothing a command leaves in the background
outlives it.
"""

import base64
import json
import os
import resource
import select
import signal
import struct
import sys
import time

WORKSPACE = "/workspace"
MAX_FRAME = 64 << 20
LIMITS = {"cpu_s": resource.RLIMIT_CPU, "memory_bytes": resource.RLIMIT_AS,
          "processes": resource.RLIMIT_NPROC, "file_bytes": resource.RLIMIT_FSIZE,
          "open_files": resource.RLIMIT_NOFILE}


def _nondumpable():
    try:
        import ctypes

        if ctypes.CDLL(None, use_errno=True).prctl(4, 0, 0, 0, 0) != 0:  # PR_SET_DUMPABLE, 0
            raise OSError(ctypes.get_errno(), "prctl(PR_SET_DUMPABLE)")
    except (ImportError, OSError, AttributeError) as e:  # an image without ctypes: say so
        os.write(2, f"rollart sandbox: the supervisor stays dumpable ({e})\n".encode())


def _read_exact(fd, n):
    buf = b""
    while len(buf) < n:
        chunk = os.read(fd, n - len(buf))
        if not chunk:
            raise EOFError
        buf += chunk
    return buf


def _send(obj):
    data = json.dumps(obj).encode()
    os.write(1, struct.pack(">I", len(data)))
    view = memoryview(data)
    while view:
        view = view[os.write(1, view):]


def _reap_all():
    """Kill and reap every process in the namespace but this one."""
    while True:  # killed again each round: nothing forks past it
        try:
            os.kill(-1, signal.SIGKILL)
        except ProcessLookupError:
            pass
        try:
            os.waitpid(-1, 0)
        except ChildProcessError:
            return


def _inside(path):
    full = os.path.realpath(os.path.join(WORKSPACE, path))
    if full != WORKSPACE and not full.startswith(WORKSPACE + "/"):
        raise ValueError(f"{path!r} is outside the workspace")
    return full


def _run(req):
    argv = req["argv"]
    limits = req.get("limits") or {}
    stdin = base64.b64decode(req.get("stdin") or "")
    cap = int(req["max_output"])
    timeout = float(req["timeout"])
    env = {"PATH": "/usr/local/bin:/usr/bin:/bin", "HOME": WORKSPACE, "LANG": "C.UTF-8",
           "PYTHONDONTWRITEBYTECODE": "1", "TMPDIR": "/tmp"}
    env.update(req.get("env") or {})
    in_r, in_w = os.pipe()
    out_r, out_w = os.pipe()
    err_r, err_w = os.pipe()
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    t0 = time.monotonic()
    try:
        pid = os.fork()
    except OSError as e:
        for fd in (in_r, in_w, out_r, out_w, err_r, err_w):
            os.close(fd)
        return {"ok": False, "error": f"fork: {e}"}
    if pid == 0:  # the command: its own session, the limits, then exec
        try:
            os.setsid()
            os.dup2(in_r, 0)
            os.dup2(out_w, 1)
            os.dup2(err_w, 2)
            os.closerange(3, 65536)
            for key, res in LIMITS.items():
                if limits.get(key) is not None:
                    v = int(limits[key])
                    resource.setrlimit(res, (v, v + 1 if key == "cpu_s" else v))
            resource.setrlimit(resource.RLIMIT_CORE, (0, 0))
            try:  # at the sandbox's memory limit the kernel kills the command, not this init
                with open("/proc/self/oom_score_adj", "w") as f:
                    f.write("1000")
            except OSError:
                pass
            os.chdir(WORKSPACE)
            os.execvpe(argv[0], argv, env)
        except BaseException as e:  # noqa: BLE001 - report and leave, whatever it was
            try:
                os.write(2, f"sandbox: cannot run {argv[0]!r}: {e}\n".encode())
            finally:
                os._exit(127)
    for fd in (in_r, out_w, err_w):
        os.close(fd)
    try:  # readable when the command exits: no polling (Linux 5.3+)
        pidfd = os.pidfd_open(pid)
    except (AttributeError, OSError):
        pidfd = -1
    outs = {out_r: bytearray(), err_r: bytearray()}
    dropped = {out_r: 0, err_r: 0}
    open_fds = {out_r, err_r}
    pending_in = memoryview(stdin)
    if not stdin:
        os.close(in_w)
        in_w = -1
    deadline = t0 + timeout
    status = None
    timed_out = False
    after_exit = None
    while True:
        now = time.monotonic()
        if status is None:
            wpid, st = os.waitpid(pid, os.WNOHANG)
            if wpid == pid:
                status = st
                after_exit = now + 0.2  # what the command's children still write
        if status is None and now >= deadline:
            timed_out = True
            _reap_all()
            try:
                _, status = os.waitpid(pid, 0)
            except ChildProcessError:
                status = status if status is not None else -signal.SIGKILL
        if status is not None and (timed_out or not open_fds or now >= after_exit):
            break
        wfds = [in_w] if in_w >= 0 and pending_in else []
        rfds = list(open_fds) + ([pidfd] if pidfd >= 0 and status is None else [])
        wake = min(deadline, after_exit) if after_exit is not None else deadline
        wait = max(0.0, min(wake - now, 1.0)) if pidfd >= 0 else 0.02
        r, w, _ = select.select(rfds, wfds, [], wait)
        for fd in r:
            if fd == pidfd:
                continue  # waitpid at the top of the loop
            chunk = os.read(fd, 65536)
            if not chunk:
                open_fds.discard(fd)
                continue
            room = cap - len(outs[fd])
            outs[fd] += chunk[:max(room, 0)]
            dropped[fd] += max(len(chunk) - max(room, 0), 0)
        if w:
            try:
                n = os.write(in_w, pending_in[:65536])
                pending_in = pending_in[n:]
            except BrokenPipeError:
                pending_in = memoryview(b"")
            if not pending_in:
                os.close(in_w)
                in_w = -1
    wall = time.monotonic() - t0
    if pidfd >= 0:
        os.close(pidfd)
    _reap_all()
    for fd in (out_r, err_r):
        os.close(fd)
    if in_w >= 0:
        os.close(in_w)
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    cpu = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
    if isinstance(status, int) and status >= 0 and os.WIFSIGNALED(status):
        code, sig = -os.WTERMSIG(status), os.WTERMSIG(status)
    elif isinstance(status, int) and status >= 0:
        code, sig = os.WEXITSTATUS(status), 0
    else:
        code, sig = -signal.SIGKILL, signal.SIGKILL
    return {"ok": True, "exit_code": code, "signal": sig, "timed_out": timed_out,
            "stdout": base64.b64encode(bytes(outs[out_r])).decode(),
            "stderr": base64.b64encode(bytes(outs[err_r])).decode(),
            "stdout_dropped": dropped[out_r], "stderr_dropped": dropped[err_r],
            "wall_s": wall, "cpu_s": cpu}


def _write(req):
    full = _inside(req["path"])
    os.makedirs(os.path.dirname(full), exist_ok=True)
    fd = os.open(full, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW, int(req.get("mode", 0o644)))
    try:
        data = memoryview(base64.b64decode(req["data"]))
        while data:
            data = data[os.write(fd, data):]
    finally:
        os.close(fd)
    return {"ok": True}


def _read(req):
    full = _inside(req["path"])
    cap = int(req["max_bytes"])
    fd = os.open(full, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK)
    try:
        size = os.fstat(fd).st_size
        data = os.read(fd, cap) if cap else b""
    finally:
        os.close(fd)
    return {"ok": True, "data": base64.b64encode(data).decode(), "size": size}


def main():
    _nondumpable()
    signal.signal(signal.SIGPIPE, signal.SIG_IGN)
    _send({"ok": True, "ready": True, "pid": os.getpid()})
    while True:
        try:
            (n,) = struct.unpack(">I", _read_exact(0, 4))
            if n > MAX_FRAME:
                _send({"ok": False, "error": f"request of {n} bytes (max {MAX_FRAME})"})
                return
            req = json.loads(_read_exact(0, n))
        except EOFError:
            return
        op = req.get("op")
        try:
            if op == "run":
                reply = _run(req)
            elif op == "write":
                reply = _write(req)
            elif op == "read":
                reply = _read(req)
            elif op == "ping":
                reply = {"ok": True}
            else:
                reply = {"ok": False, "error": f"unknown op {op!r}"}
        except (OSError, ValueError, KeyError, TypeError) as e:
            reply = {"ok": False, "error": f"{type(e).__name__}: {e}"}
        _send(reply)


if __name__ == "__main__":
    main()

"""One sandbox: a supervisor process inside isolation, driven over a pipe.

The backend (:mod:`rollart.sandbox.bwrap` or :mod:`rollart.sandbox.container`) builds the
command that starts :mod:`rollart.sandbox.supervisor` inside its isolation; this module
owns the process, frames requests, bounds every reply before it allocates, and turns what
the supervisor reports into a :class:`Result`. Calls are blocking and thread-safe (one at a
time per sandbox); the ``a*`` methods run them on this module's own threads, so an env's
event loop never waits on a sandbox and the default executor is never filled by slow
commands.
"""

from __future__ import annotations

import asyncio
import base64
import logging
import os
import select
import signal
import struct
import subprocess
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Annotated, Any, Callable, Sequence

import msgspec

from rollart.sandbox.cgroups import Cgroups, make as make_cgroups
from rollart.sandbox.errors import SandboxError, SandboxRequestError

log = logging.getLogger(__name__)

MAX_FILE = 32 << 20
"""Bytes a single ``write`` or ``read`` (or a command's stdin) carries at most."""
MAX_COMMAND = 1 << 20
"""Bytes of a command line and its environment at most (Linux takes ~2 MiB in all)."""

_FRAME_SLACK = 1 << 20
SUPERVISOR = Path(__file__).with_name("supervisor.py")
BOOT = ("import sys;b=sys.stdin.buffer;"
        "exec(compile(b.read(int(b.readline())),'rollart-sandbox-supervisor','exec'))")
"""The supervisor's command line: it reads its own source from stdin (length line, source)."""
_executor = ThreadPoolExecutor(max_workers=64, thread_name_prefix="rollart-sandbox")
_spawner = ThreadPoolExecutor(max_workers=1, thread_name_prefix="rollart-sandbox-spawn")
"""Every sandbox process is started from this one long-lived thread: ``--die-with-parent``
(PR_SET_PDEATHSIG) fires when the *thread* that forked it ends, so a sandbox started from an
env's runner thread would die with that thread."""


@dataclass(frozen=True)
class Limits:
    """Per-command ceilings (``None``: the sandbox's configured value)."""

    timeout_s: float | None = None
    cpu_s: int | None = None
    memory_bytes: int | None = None
    processes: int | None = None
    file_bytes: int | None = None
    open_files: int | None = None
    max_output_bytes: int | None = None

    def merged(self, ceiling: "Limits") -> "Limits":
        """Each of this one's values, capped by ``ceiling``'s (a command may lower a limit,
        never raise it)."""
        out = {}
        for k in self.__dataclass_fields__:
            mine, top = getattr(self, k), getattr(ceiling, k)
            out[k] = top if mine is None else mine if top is None else min(mine, top)
        return Limits(**out)


@dataclass(frozen=True)
class Result:
    """What a command did. ``limit`` names the limit that ended it (``timeout`` and ``cpu``
    for certain, from the deadline and SIGXCPU; ``file_size``, ``memory`` and ``processes``
    from SIGXFSZ or the error the command printed last) or is None; ``*_truncated`` counts the bytes dropped past the
    output cap. A non-zero exit is an outcome of the episode, not an error."""

    exit_code: int
    stdout: bytes
    stderr: bytes
    wall_s: float
    cpu_s: float
    timed_out: bool = False
    limit: str | None = None
    stdout_truncated: int = 0
    stderr_truncated: int = 0

    @property
    def ok(self) -> bool:
        return self.exit_code == 0

    def text(self, stream: str = "stdout") -> str:
        """The stream decoded (undecodable bytes replaced), with a line saying how much was
        dropped when it was truncated."""
        raw, dropped = (self.stdout, self.stdout_truncated) if stream == "stdout" \
            else (self.stderr, self.stderr_truncated)
        s = raw.decode("utf-8", "replace")
        return s + f"\n[... {dropped} more bytes truncated]" if dropped else s


class _Reply(msgspec.Struct, kw_only=True):
    ok: bool
    error: Annotated[str, msgspec.Meta(max_length=4096)] | None = None
    ready: bool = False
    pid: int | None = None
    exit_code: int | None = None
    signal: int = 0
    timed_out: bool = False
    stdout: bytes = b""
    stderr: bytes = b""
    stdout_dropped: Annotated[int, msgspec.Meta(ge=0)] = 0
    stderr_dropped: Annotated[int, msgspec.Meta(ge=0)] = 0
    wall_s: float = 0.0
    cpu_s: float = 0.0
    data: bytes = b""
    size: int = 0


_reply_decoder = msgspec.json.Decoder(_Reply)


@dataclass(eq=False)
class Sandbox:
    """A started sandbox. Make them with :func:`rollart.sandbox.start` or take one from a
    :class:`~rollart.sandbox.pool.SandboxPool`; ``close`` kills it and everything in it."""

    argv: Sequence[str]
    limits: Limits
    backend: str = "bwrap"
    start_timeout_s: float = 20.0
    run_as: int | None = None
    """Host uid (and gid) the backend process drops to between fork and exec (rollart as root)."""
    cgroup_limits: tuple[int, int] | None = None
    """(memory bytes, processes) of the cgroups the backend process enters before it runs,
    where the host offers them (:mod:`rollart.sandbox.cgroups`)."""
    preexec: Callable[[], None] | None = None
    """Anything else the backend process must do between fork and exec."""
    started_s: float = 0.0
    """Seconds from spawn to the supervisor's first answer."""
    commands: int = 0
    cgroups: "Cgroups | None" = field(default=None, repr=False)
    _proc: subprocess.Popen | None = field(default=None, repr=False)
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False)
    _dead: str | None = field(default=None, repr=False)

    # -- life -----------------------------------------------------------------------------
    def start(self) -> "Sandbox":
        t0 = time.monotonic()
        if self.cgroup_limits is not None:
            self.cgroups = make_cgroups(*self.cgroup_limits)
        try:
            self._proc = _spawner.submit(
                subprocess.Popen, list(self.argv), stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                stderr=subprocess.PIPE, bufsize=0, preexec_fn=self._child_setup()).result()
        except (OSError, subprocess.SubprocessError) as e:
            self._remove_cgroups()
            raise SandboxError(f"{self.backend} sandbox could not be started: {e}") from e
        try:
            src = SUPERVISOR.read_bytes()
            assert self._proc.stdin is not None
            self._proc.stdin.write(b"%d\n" % len(src) + src)
        except OSError as e:  # it died at once: what it said comes with the error
            try:
                self._fail(f"it did not take its supervisor ({e})")
            except SandboxError:
                self.close()
                raise
        try:
            hello = self._receive(t0 + self.start_timeout_s, what="start")
        except SandboxError:
            self.close()
            raise
        if not hello.ready:
            self.close()
            raise SandboxError(f"{self.backend} sandbox answered its start with {hello.error!r}")
        self.started_s = time.monotonic() - t0
        return self

    def _child_setup(self) -> Callable[[], None] | None:
        """What the backend process does between fork and exec: enter the cgroups (still as
        rollart's user, who may write them), then drop to ``run_as``."""
        cg, uid, extra = self.cgroups, self.run_as, self.preexec
        if cg is None and uid is None and extra is None:
            return None

        def setup() -> None:
            if cg is not None:
                cg.enter()
            if uid is not None:
                os.setgroups([])
                os.setgid(uid)
                os.setuid(uid)
            if extra is not None:
                extra()

        return setup

    def _remove_cgroups(self) -> None:
        cg, self.cgroups = self.cgroups, None
        if cg is None:
            return
        deadline = time.monotonic() + 10
        while cg.busy() and time.monotonic() < deadline:  # the kernel reaps the namespace
            time.sleep(0.02)
        cg.remove()

    @property
    def alive(self) -> bool:
        return self._dead is None and self._proc is not None and self._proc.poll() is None

    @property
    def pid(self) -> int | None:
        """The host pid of the backend process (bwrap's), whose death ends the sandbox."""
        return self._proc.pid if self._proc else None

    def close(self) -> None:
        """Kill the sandbox: its PID namespace goes with its init, every process in it too."""
        proc, self._dead = self._proc, self._dead or "closed"
        if proc is None:
            return
        if proc.poll() is None:
            try:
                proc.send_signal(signal.SIGKILL)
            except ProcessLookupError:
                pass
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            log.warning("sandbox %s did not exit 10 s after SIGKILL", proc.pid)
        self._remove_cgroups()
        for f in (proc.stdin, proc.stdout, proc.stderr):
            if f is not None:
                try:
                    f.close()
                except OSError:
                    pass

    def __enter__(self) -> "Sandbox":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- requests -------------------------------------------------------------------------
    def run(self, cmd: str | Sequence[str], *, stdin: bytes | str = b"", timeout: float | None = None,
            limits: Limits | None = None, env: dict[str, str] | None = None) -> Result:
        """Run ``cmd`` (argv, or a string for ``/bin/sh -c``) in the workspace with ``stdin``.
        Anything it starts is killed when it ends; the workspace stays for the next command."""
        argv = ["/bin/sh", "-c", cmd] if isinstance(cmd, str) else [str(a) for a in cmd]
        if not argv:
            raise SandboxRequestError("run: empty command")
        lim = (limits or Limits()).merged(self.limits)
        if timeout is not None:
            lim = Limits(**{**lim.__dict__, "timeout_s": min(timeout, lim.timeout_s or timeout)})
        data = stdin.encode() if isinstance(stdin, str) else bytes(stdin)
        if len(data) > MAX_FILE:
            raise SandboxRequestError(f"run: stdin is {len(data)} bytes (max {MAX_FILE})")
        size = sum(len(a.encode()) for a in argv) + sum(len(k) + len(v) for k, v in (env or {}).items())
        if size > MAX_COMMAND or any("\0" in a for a in argv):
            raise SandboxRequestError(f"run: the command is {size} bytes or holds a NUL byte "
                                      f"(at most {MAX_COMMAND} bytes, no NUL): pass data as stdin "
                                      f"or a file")
        wall = float(lim.timeout_s or 10.0)
        req = {"op": "run", "argv": argv, "stdin": base64.b64encode(data).decode(),
               "timeout": wall, "max_output": int(lim.max_output_bytes or 0), "env": env or {},
               "limits": {"cpu_s": lim.cpu_s, "memory_bytes": lim.memory_bytes,
                          "processes": lim.processes, "file_bytes": lim.file_bytes,
                          "open_files": lim.open_files}}
        # the supervisor enforces the deadline; past it plus a grace, it is the sandbox that hangs
        ooms = self.cgroups.oom_kills() if self.cgroups is not None else 0
        r = self._request(req, wall + 10.0, max_frame=2 * 4 * (lim.max_output_bytes or 0) // 3 + _FRAME_SLACK)
        self.commands += 1
        if r.exit_code is None:
            raise SandboxError(f"sandbox run: malformed reply {r!r:.200}")
        limit = "timeout" if r.timed_out else {signal.SIGXCPU: "cpu", signal.SIGXFSZ: "file_size"}.get(r.signal)
        if limit is None and self.cgroups is not None and self.cgroups.oom_kills() > ooms:
            limit = "memory"  # the kernel killed a process of it at the sandbox's memory limit
        if limit is None and r.exit_code != 0:
            tail = r.stderr[-2000:]
            limit = ("memory" if any(x in tail for x in _OOM) else
                     "file_size" if b"File too large" in tail else
                     "processes" if b"Resource temporarily unavailable" in tail else None)
        return Result(exit_code=r.exit_code, stdout=r.stdout, stderr=r.stderr, wall_s=r.wall_s,
                      cpu_s=r.cpu_s, timed_out=r.timed_out, limit=limit,
                      stdout_truncated=r.stdout_dropped, stderr_truncated=r.stderr_dropped)

    def write(self, path: str, data: bytes | str, *, mode: int = 0o644) -> None:
        """Write a file under the workspace (``path`` relative to it; folders made)."""
        raw = data.encode() if isinstance(data, str) else bytes(data)
        _check_path(path)
        if len(raw) > MAX_FILE:
            raise SandboxRequestError(f"write {path!r}: {len(raw)} bytes (max {MAX_FILE})")
        self._checked({"op": "write", "path": path, "data": base64.b64encode(raw).decode(),
                       "mode": mode & 0o777}, "write", path, len(raw) * 4 // 3 + _FRAME_SLACK)

    def read(self, path: str, *, max_bytes: int = 1 << 20) -> bytes:
        """The first ``max_bytes`` of a file under the workspace."""
        _check_path(path)
        max_bytes = max(0, min(int(max_bytes), MAX_FILE))
        r = self._checked({"op": "read", "path": path, "max_bytes": max_bytes}, "read", path,
                          max_bytes * 4 // 3 + _FRAME_SLACK)
        return r.data[:max_bytes]

    async def arun(self, cmd: str | Sequence[str], **kw: Any) -> Result:
        return await asyncio.get_running_loop().run_in_executor(_executor, lambda: self.run(cmd, **kw))

    async def awrite(self, path: str, data: bytes | str, **kw: Any) -> None:
        await asyncio.get_running_loop().run_in_executor(_executor, lambda: self.write(path, data, **kw))

    async def aread(self, path: str, **kw: Any) -> bytes:
        return await asyncio.get_running_loop().run_in_executor(_executor, lambda: self.read(path, **kw))

    # -- the wire -------------------------------------------------------------------------
    def _checked(self, req: dict, op: str, path: str, max_frame: int) -> _Reply:
        r = self._request(req, 30.0, max_frame=max_frame)
        if not r.ok:
            raise SandboxRequestError(f"{op} {path!r}: {r.error}")
        return r

    def _request(self, req: dict, timeout: float, *, max_frame: int) -> _Reply:
        with self._lock:
            if not self.alive:
                raise SandboxError(f"sandbox is gone ({self._why_dead()})")
            body = msgspec.json.encode(req)
            try:
                assert self._proc is not None and self._proc.stdin is not None
                self._proc.stdin.write(struct.pack(">I", len(body)) + body)
            except (BrokenPipeError, OSError) as e:
                self._fail(f"its supervisor stopped reading ({e})")
            reply = self._receive(time.monotonic() + timeout, what=req["op"], max_frame=max_frame)
            if not reply.ok and req["op"] == "run":
                self._fail(f"its supervisor could not run the command: {reply.error}")
            return reply

    def _receive(self, deadline: float, *, what: str, max_frame: int = 4096) -> _Reply:
        head = self._read_exact(4, deadline, what)
        (n,) = struct.unpack(">I", head)
        if n > max_frame:
            self._fail(f"its {what} reply claims {n} bytes (at most {max_frame} expected)")
        try:
            return _reply_decoder.decode(self._read_exact(n, deadline, what))
        except msgspec.DecodeError as e:
            self._fail(f"its {what} reply is malformed: {e}")
            raise  # unreachable: _fail raises

    def _read_exact(self, n: int, deadline: float, what: str) -> bytes:
        assert self._proc is not None and self._proc.stdout is not None
        fd = self._proc.stdout.fileno()
        buf = bytearray()
        while len(buf) < n:
            left = deadline - time.monotonic()
            if left <= 0:
                self._fail(f"no answer to {what} in time")
            if not _readable(fd, min(left, 1.0)):
                continue
            chunk = os.read(fd, n - len(buf))
            if not chunk:
                self._fail(f"it exited during {what}")
            buf += chunk
        return bytes(buf)

    def _why_dead(self) -> str:
        if self._dead and self._dead != "closed":
            return self._dead
        proc = self._proc
        if proc is None:
            return "never started"
        if self._dead == "closed":
            return "closed"
        return f"exit code {proc.poll()}"

    def _fail(self, why: str) -> None:
        proc, err = self._proc, b""
        if proc is not None:
            if proc.poll() is None:
                proc.kill()
            try:
                proc.wait(timeout=10)
                if proc.stderr is not None and _readable(proc.stderr.fileno(), 1.0):
                    err = os.read(proc.stderr.fileno(), 4000)
            except (OSError, ValueError, subprocess.TimeoutExpired):
                pass
        self.close()
        self._dead = f"{self.backend} sandbox failed: {why}"
        tail = err.decode("utf-8", "replace").strip()
        raise SandboxError(self._dead + (f"; it said: {tail[-500:]}" if tail else ""))


def _readable(fd: int, timeout_s: float) -> bool:
    """poll(2), not select(2): a host with many connections has descriptors past 1024."""
    p = select.poll()
    p.register(fd, select.POLLIN | select.POLLHUP | select.POLLERR)
    return bool(p.poll(timeout_s * 1000))


def _check_path(path: str) -> None:
    if not path or path.startswith("/") or ".." in path.split("/") or "\0" in path or len(path) > 4096:
        raise SandboxRequestError(f"{path!r}: give a path relative to the workspace, without '..'")


_OOM = (b"MemoryError", b"Cannot allocate memory", b"std::bad_alloc", b"out of memory")

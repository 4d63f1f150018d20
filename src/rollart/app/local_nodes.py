"""Child node processes of ``rollart run`` on this host (``node.local_processes``).

One Python process runs one interpreter lock: with every actor in it, the engine's
generation, env stepping and tokenization, and the trainer's steps take turns on one core.
So when its bus is a nats-server (the embedded one, or ``--nats URL``), ``rollart run`` keeps
the trainer and the scheduler in its own process and starts one ``python -m rollart.node``
per entry of ``node.local_processes`` (default: ``generate``, then ``env`` with ``reward``)::

    async with local_processes(cfg, bus, nats=nats, overrides=overrides) as local:
        ...                                  # build the actors of the roles local.roles leaves here
        async with Node(bus, actors, ...) as node:
            local.attach(node)               # Ctrl-C / SIGTERM of this process stop them too
            summary = await drive_training(...)
            local.run_ended()                # the end is published: they drain and exit

Each child gets the run's config (``runs/<run>/config.yaml``), its roles, ``--run`` and the
bus flags of this process (the URL, and credentials only as the names of files or variables:
secrets never reach a command line), writes its output to ``runs/<run>/logs/<roles>.log``
and dies with this process (Linux: ``PR_SET_PDEATHSIG``). A child that exits before the run
ends is restarted with a backoff (JetStream redelivers the work it held), at most
:data:`RESTARTS` times within :data:`RESTART_WINDOW_S`; past that the run stops, naming the
role and the log file. A child that is alive but stuck (no node heartbeat for
``node.stuck_after`` seconds once it has sent one: its event loop blocked, or the process
stopped) is killed and restarted the same way. At the
end the children drain and exit by themselves on the end of the run
(:func:`rollart.actors.kernel.run_end.wait_run_end`); one that does not within its deadline gets
SIGTERM, then SIGKILL.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import signal
import socket
import sys
import time
from collections import deque
from collections.abc import Callable
from pathlib import Path
from typing import Any, Self


from rollart import messages as m
from rollart.actors.kernel.runtime import decode_core
from rollart.app.local_plan import config_file, log_name, plan, tail
from rollart.config import RunConfig
from rollart.node.build import role_config
from rollart.procs import describe_exit, die_with_parent

log = logging.getLogger(__name__)

RESTARTS = 3
"""Restarts of one child process within :data:`RESTART_WINDOW_S` before the run stops."""
RESTART_WINDOW_S = 600.0
"""Seconds over which a child's restarts count: a long run survives a child that dies now
and then, and stops on one that keeps dying."""
BACKOFF_S = 1.0
"""Seconds before the first restart of a child; doubled for each further one."""
STARTED_WAIT_S = 120.0
"""Seconds ``rollart run``'s trainer waits at most for its node processes' first heartbeats."""
CLEAN_EXIT_WAIT_S = 2.0
"""A child that exited cleanly (drained, status 0 or by SIGINT/SIGTERM) while the run goes on
is restarted unless this process stops within these seconds: Ctrl-C reaches the whole
process group, and this process may see its children exit before its own signal."""

class Child:
    """One child node process: its roles, log file, current process and restarts."""

    def __init__(self, roles: list[str], log_path: Path):
        self.roles = roles
        self.log_path = log_path
        self.proc: asyncio.subprocess.Process | None = None
        self.restarts = 0
        """Restarts over the whole run."""
        self.recent: deque[float] = deque()
        """When (monotonic) the restarts within the restart window happened."""
        self.last_beat: float | None = None
        """When (monotonic) the current process's last heartbeat arrived; None before its first."""
        self.stuck_for: float | None = None
        """Seconds without a heartbeat when the current process was killed as stuck."""
        self.ever_beat = False
        """Whether any of its processes sent a heartbeat (it started once)."""

    @property
    def name(self) -> str:
        return ",".join(self.roles)

    @property
    def alive(self) -> bool:
        return self.proc is not None and self.proc.returncode is None

    def signal(self, sig: int) -> None:
        if self.alive:
            with contextlib.suppress(ProcessLookupError):
                self.proc.send_signal(sig)


class LocalNodes:
    """The child node processes of one ``rollart run`` (an async context manager; see the
    module docstring). :attr:`failure` says why the run had to stop, if a child kept dying."""

    def __init__(self, cfg: RunConfig, groups: list[list[str]], flags: list[str], *,
                 bus: Any = None, restarts: int = RESTARTS, backoff: float = BACKOFF_S,
                 window: float = RESTART_WINDOW_S, cwd: str | None = None):
        self.cfg = cfg
        self.flags = list(flags)
        self.bus = bus
        """The run's bus (a nats-server), where the children's heartbeats arrive; None: the
        children are not watched for being stuck."""
        self.max_restarts = restarts
        self.backoff = backoff
        self.window = window
        self.cwd = cwd or os.getcwd()
        self.logs = Path(cfg.run_dir) / cfg.run / "logs"
        self.children = [Child(g, self.logs / log_name(g)) for g in groups]
        self.failure: str | None = None
        self._on_failure: Callable[[], Any] | None = None
        self._ending = asyncio.Event()
        self._ended_normally = False
        self._tasks: list[asyncio.Task] = []
        self._preexec = die_with_parent(signal.SIGKILL)
        self._config: Path | None = None
        self._started = asyncio.Event()
        """Set once every child sent its first heartbeat (or none is watched for one)."""

    @property
    def roles(self) -> set[str]:
        """The roles the children serve (this process hosts the others)."""
        return {r for c in self.children for r in c.roles}

    # -- lifecycle ---------------------------------------------------------------------
    async def __aenter__(self) -> Self:
        self._config = await asyncio.to_thread(self._prepare)
        try:
            for child in self.children:
                await self._spawn(child)
        except BaseException:
            for child in self.children:
                child.signal(signal.SIGKILL)
            raise
        for child in self.children:
            self._tasks.append(asyncio.ensure_future(self._supervise(child)))
        if self.bus is not None and self.cfg.node.heartbeat_every > 0 and self.cfg.node.stuck_after > 0:
            self._tasks.append(asyncio.ensure_future(self._watch_stuck()))
        else:
            self._started.set()  # no heartbeats are followed: nothing to wait for
        where = ", ".join(f"{c.name} (pid {c.proc.pid}, log {c.log_path})" for c in self.children)
        here = ["trainer", "scheduler"] + [r for r in ("env", "generate", "reward") if r not in
                                           self.roles and role_config(self.cfg, r).replicas]
        print(f"rollart run: {', '.join(here)} in this process (pid {os.getpid()}); started "
              f"{len(self.children)} node process{'es' if len(self.children) > 1 else ''}: {where}",
              flush=True)
        return self

    async def __aexit__(self, et, exc, tb) -> None:
        self._ending.set()
        try:
            await self._stop(normal=self._ended_normally and exc is None)
        finally:
            for child in self.children:  # whatever happened above (a second Ctrl-C)
                child.signal(signal.SIGKILL)
            for t in self._tasks:
                t.cancel()
            if self._tasks:
                await asyncio.wait(self._tasks, timeout=5)
            for child in self.children:
                if child.proc is not None and child.proc.returncode is not None:
                    log.info("node process %s (pid %d) exited: %s", child.name, child.proc.pid,
                             describe_exit(child.proc.returncode))

    def attach(self, node: Any) -> None:
        """``node`` (this process's): its stop (SIGINT, SIGTERM, a lost bus) ends the children
        too, and a child that keeps dying stops it."""
        self._on_failure = node.stop
        self._tasks.append(asyncio.ensure_future(self._follow(node)))
        if self.failure is not None:
            node.stop()

    async def started(self, timeout: float = STARTED_WAIT_S) -> None:
        """Wait until every child node process sent its first heartbeat (its actors are set
        up: engine loaded, services bound), at most ``timeout`` seconds; then go on anyway
        (a child that keeps failing is the supervisor's to report). ``rollart run``'s trainer
        waits here before its first step, so that the first step's time is not the
        children's start-up."""
        t0 = time.monotonic()
        try:
            await asyncio.wait_for(self._started.wait(), timeout)
        except TimeoutError:
            log.warning("node processes %s: not all started within %.0f s; training starts "
                        "anyway", ", ".join(c.name for c in self.children), timeout)
            return
        log.info("node processes started (waited %.1f s)", time.monotonic() - t0)

    def run_ended(self) -> None:
        """The end of the run is published (:func:`rollart.app.launch.drive_training` returned
        without interruption): the children drain and exit by themselves."""
        self._ended_normally = True
        self._ending.set()

    # -- internals ---------------------------------------------------------------------
    def _prepare(self) -> Path:
        self.logs.mkdir(parents=True, exist_ok=True)
        return config_file(self.cfg)

    def _command(self, child: Child) -> list[str]:
        return [sys.executable, "-m", "rollart.node", "--config", str(self._config),
                "--roles", child.name, "--run", self.cfg.run, *self.flags]

    def _env(self) -> dict[str, str]:
        env = dict(os.environ)
        env.setdefault("OMP_NUM_THREADS", str(self.cfg.model.threads))  # model.threads each
        env.setdefault("TOKENIZERS_PARALLELISM", "false")
        env["PYTHONUNBUFFERED"] = "1"  # its log is current when it dies
        return env

    async def _spawn(self, child: Child) -> None:
        cmd = self._command(child)
        what = "restart" if child.restarts else "start"
        line = (f"--- {time.strftime('%Y-%m-%d %H:%M:%S')} rollart run (pid {os.getpid()}): "
                f"{what} {' '.join(cmd[1:])}\n")

        def open_log():
            f = open(child.log_path, "ab")  # noqa: SIM115 - handed to the child, closed below
            f.write(line.encode())
            f.flush()
            return f

        out = await asyncio.to_thread(open_log)
        child.last_beat = child.stuck_for = None
        try:
            child.proc = await asyncio.create_subprocess_exec(
                *cmd, stdin=asyncio.subprocess.DEVNULL, stdout=out,
                stderr=asyncio.subprocess.STDOUT, cwd=self.cwd, env=self._env(),
                start_new_session=False, preexec_fn=self._preexec)
        finally:
            out.close()

    async def _follow(self, node: Any) -> None:
        await node.wait()
        self._ending.set()

    async def _supervise(self, child: Child) -> None:
        try:
            while True:
                assert child.proc is not None
                rc = await child.proc.wait()
                if self._ending.is_set():
                    return
                if rc in (0, -signal.SIGINT, -signal.SIGTERM, 128 + signal.SIGINT,
                          128 + signal.SIGTERM):  # it drained: maybe Ctrl-C, for everyone
                    with contextlib.suppress(TimeoutError):
                        await asyncio.wait_for(self._ending.wait(), CLEAN_EXIT_WAIT_S)
                    if self._ending.is_set():
                        return
                last = await asyncio.to_thread(tail, child.log_path)
                pid = child.proc.pid
                how = (f"was stuck (no heartbeat for {child.stuck_for:.0f} s) and was killed"
                       if child.stuck_for is not None else f"exited with {describe_exit(rc)}")
                now = time.monotonic()
                while child.recent and now - child.recent[0] > self.window:
                    child.recent.popleft()
                if len(child.recent) >= self.max_restarts:
                    self.failure = (
                        f"the node process serving {child.name} {how} before the end of the "
                        f"run, after {len(child.recent)} restarts within {self.window:.0f} s "
                        f"(pid {pid}); see its log {child.log_path}")
                    log.error("%s; its last lines:\n%s", self.failure, last)
                    self._fail()
                    return
                delay = self.backoff * 2 ** len(child.recent)
                log.error("node process %s (pid %d) %s before the end of the run; restarting "
                          "it in %gs (restart %d of %d within %.0f s; the work it held is "
                          "redelivered); last lines of %s:\n%s", child.name, pid, how, delay,
                          len(child.recent) + 1, self.max_restarts, self.window,
                          child.log_path, last)
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(self._ending.wait(), delay)
                if self._ending.is_set():
                    return
                child.restarts += 1
                child.recent.append(time.monotonic())
                await self._spawn(child)
                log.warning("node process %s restarted: pid %d (log %s)", child.name,
                            child.proc.pid, child.log_path)
        except asyncio.CancelledError:
            raise
        except Exception as e:  # noqa: BLE001 - e.g. the restart could not exec
            self.failure = (f"the node process serving {child.name} could not be restarted "
                            f"({type(e).__name__}: {e}); see its log {child.log_path}")
            log.error("%s", self.failure)
            self._fail()

    async def _watch_stuck(self) -> None:
        """Follow the run's node heartbeats; SIGKILL a child whose last one is older than
        ``node.stuck_after`` (its supervisor then restarts it). Never raises but
        CancelledError: bus errors are logged and retried."""
        host, limit = socket.gethostname(), self.cfg.node.stuck_after

        async def on_hb(req) -> None:
            hb = decode_core(m.NodeHeartbeat, req)
            if hb is None or hb.host != host:
                return
            for c in self.children:
                if c.alive and c.proc.pid == hb.pid:
                    c.last_beat = time.monotonic()
                    c.ever_beat = True
            if all(c.ever_beat for c in self.children):
                self._started.set()

        every = max(0.05, min(1.0, self.cfg.node.heartbeat_every / 2))
        delay = 1.0
        while True:
            try:
                sub = await self.bus.subscribe(m.subject(self.cfg.run, "node.heartbeat"), on_hb)
            except Exception as e:  # noqa: BLE001 - a watch never stops the run
                log.warning("cannot follow the node processes' heartbeats (%s); retrying in "
                            "%.0fs", e, delay)
                await asyncio.sleep(delay)
                delay = min(2 * delay, 60.0)
                continue
            try:
                while not self._ending.is_set():
                    await asyncio.sleep(every)
                    now = time.monotonic()
                    for c in self.children:
                        if (c.alive and c.last_beat is not None and c.stuck_for is None
                                and now - c.last_beat > limit):
                            c.stuck_for = now - c.last_beat
                            log.error("node process %s (pid %d) sent no heartbeat for %.0f s "
                                      "(node.stuck_after %g): its event loop is blocked or the "
                                      "process is stopped; killing it (SIGKILL) to restart it",
                                      c.name, c.proc.pid, c.stuck_for, limit)
                            c.signal(signal.SIGKILL)
                return
            finally:
                with contextlib.suppress(Exception):
                    await sub.unsubscribe()

    def _fail(self) -> None:
        if self._on_failure is not None:
            self._on_failure()

    async def _stop(self, normal: bool) -> None:
        """After a run that ended: wait for the children to drain and exit by themselves
        (they watch for the end of the run), then SIGTERM, then SIGKILL. After an interrupted
        run (Ctrl-C, SIGTERM, a child that kept dying): SIGTERM at once, first the children
        hosting ``env`` (their trajectories in flight still reach generation and reward),
        then the others; each drains within ``node.grace``; then SIGKILL."""
        grace = self.cfg.node.grace
        if normal:
            late = await self._wait(self.children,
                                    2 * grace + 3 * self.cfg.node.heartbeat_every + 5)
            waves = [late]
        else:
            envs = [c for c in self.children if "env" in c.roles]
            waves = [envs, [c for c in self.children if c not in envs]]
        for wave in waves:
            alive = [c for c in wave if c.alive]
            for c in alive:
                log.log(logging.WARNING if normal else logging.INFO,
                        "node process %s (pid %d) %s: SIGTERM", c.name, c.proc.pid,
                        "still up after the end of the run" if normal else "stopping")
                c.signal(signal.SIGTERM)
            await self._wait(alive, grace + 5)
        late = [c for c in self.children if c.alive]
        for c in late:
            log.warning("node process %s (pid %d) did not stop: SIGKILL", c.name, c.proc.pid)
            c.signal(signal.SIGKILL)
        await self._wait(late, 5)

    @staticmethod
    async def _wait(children: list[Child], timeout: float) -> list[Child]:
        """Wait up to ``timeout`` seconds for ``children`` to exit; those still alive."""
        waits = [asyncio.ensure_future(c.proc.wait()) for c in children if c.alive]
        if waits:
            try:
                await asyncio.wait(waits, timeout=timeout)
            finally:
                for w in waits:
                    w.cancel()
        return [c for c in children if c.alive]


def local_processes(cfg: RunConfig, bus: Any, *, nats: str | None = None,
                    overrides: dict | None = None, single_process: bool = False):
    """The :class:`LocalNodes` of a ``rollart run`` on ``bus`` (an async context manager), or
    a null one yielding None when the run stays in one process (:func:`plan`)."""
    groups, flags = plan(cfg, bus_url=str(getattr(bus, "url", "memory")), nats=nats,
                         overrides=overrides, single_process=single_process)
    if not groups:
        return contextlib.nullcontext()
    return LocalNodes(cfg, groups, flags, bus=bus)

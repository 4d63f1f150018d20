"""Warm sandboxes: started ahead of demand, used once, replaced.

A :class:`SandboxPool` keeps ``sandbox.warm`` sandboxes started; ``acquire`` hands one out
(a *warm* start: nothing to wait for) or, when none is ready, starts one (a *cold* start).
``release`` kills the used one (a fresh workspace with no process left behind is a new
sandbox: resetting one in place could leave what the last episode's code hid) and a
refill thread starts its replacement. Start failures are counted, logged with their reason
and retried with backoff; the pool never hands out a sandbox that did not answer.

:func:`pool` is this process's pool, configured from the run's ``sandbox:`` section by the
EnvManager and the RewardService (:func:`hold` at their setup, :func:`let_go` at their
teardown: the last one closes it) so that envs, agents and scorers on a host share it;
:func:`stats` is what the node's heartbeat carries of it.
"""

from __future__ import annotations

import asyncio
import collections
import logging
import threading
import time
from typing import Callable

from rollart.config.sandbox import SandboxConfig
from rollart.sandbox.core import Limits, Sandbox, _executor
from rollart.sandbox.errors import SandboxError, SandboxUnavailable

log = logging.getLogger(__name__)


def limits_of(cfg: SandboxConfig) -> Limits:
    return Limits(timeout_s=cfg.timeout_s, cpu_s=cfg.cpu_s, memory_bytes=cfg.memory_bytes,
                  processes=cfg.processes, file_bytes=cfg.file_bytes, open_files=cfg.open_files,
                  max_output_bytes=cfg.max_output_bytes)


def new_sandbox(cfg: SandboxConfig) -> Sandbox:
    """An unstarted sandbox of ``cfg``'s backend (``SandboxUnavailable`` when it is missing)."""
    if cfg.backend == "bwrap":
        from rollart.sandbox.bwrap import argv as backend_argv
    else:
        from rollart.sandbox.container import argv as backend_argv
    argv, extra = backend_argv(cfg)
    return Sandbox(argv=argv, limits=limits_of(cfg), backend=cfg.backend,
                   start_timeout_s=cfg.start_timeout_s, **extra)


def start(cfg: SandboxConfig | None = None) -> Sandbox:
    """Start one sandbox now (blocking): for scripts and tests; envs take theirs from :func:`pool`."""
    return new_sandbox(cfg or SandboxConfig()).start()


class SandboxPool:
    """Sandboxes of one config, ``warm`` of them kept started. Thread-safe."""

    def __init__(self, cfg: SandboxConfig | None = None, *, warm: int | None = None,
                 factory: Callable[[], Sandbox] | None = None) -> None:
        self.cfg = cfg or SandboxConfig()
        self.warm = self.cfg.warm if warm is None else warm
        self._factory = factory or (lambda: new_sandbox(self.cfg))
        self._ready: collections.deque[Sandbox] = collections.deque()
        self._lent: set[Sandbox] = set()
        self._cv = threading.Condition()
        self._closed = False
        self._thread: threading.Thread | None = None
        self.stats = PoolStats()

    # -- public ---------------------------------------------------------------------------
    def acquire(self) -> Sandbox:
        """A started sandbox: a warm one when ready, else one started now (``SandboxError``
        when it cannot start)."""
        t0 = time.monotonic()
        with self._cv:
            if self._closed:
                raise SandboxError("the sandbox pool is closed")
            self._ensure_thread()
            sb = self._ready.popleft() if self._ready else None
            while sb is not None and not sb.alive:  # died while waiting: infrastructure
                self.stats.died_idle += 1
                log.warning("a warm sandbox died while idle (%s); starting another", sb._why_dead())
                _executor.submit(sb.close)  # its pipes and cgroups
                sb = self._ready.popleft() if self._ready else None
            self._cv.notify_all()  # the refill thread tops up
        warm = sb is not None
        if sb is None:
            sb = self._start_one()
        with self._cv:  # the counters and the lent set change under the one lock
            self.stats.note_acquire(time.monotonic() - t0, warm=warm)
            self._lent.add(sb)
        return sb

    def release(self, sb: Sandbox) -> None:
        """Kill a used sandbox (it is never handed out again)."""
        with self._cv:
            self._lent.discard(sb)
        _executor.submit(sb.close)

    async def aacquire(self) -> Sandbox:
        return await asyncio.get_running_loop().run_in_executor(_executor, self.acquire)

    def session(self) -> "_Session":
        """``async with pool.session() as sb:`` / ``with pool.session() as sb:``: one sandbox
        for one episode, released at the end."""
        return _Session(self)

    def close(self) -> None:
        """Kill every sandbox, idle or lent, and stop the refill thread."""
        with self._cv:
            self._closed = True
            ready, lent = list(self._ready), list(self._lent)
            self._ready.clear()
            self._lent.clear()
            self._cv.notify_all()
        for sb in ready + lent:
            sb.close()
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join(timeout=30)

    def snapshot(self) -> dict:
        with self._cv:
            return {**self.stats.snapshot(), "ready": len(self._ready), "lent": len(self._lent),
                    "warm_target": self.warm}

    # -- inside ---------------------------------------------------------------------------
    def _start_one(self) -> Sandbox:
        try:
            sb = self._factory().start()
        except SandboxUnavailable:
            raise
        except SandboxError:
            with self._cv:
                self.stats.start_failures += 1
            raise
        with self._cv:
            self.stats.note_start(sb.started_s)
        return sb

    def _ensure_thread(self) -> None:
        if self._thread is None and self.warm > 0:
            self._thread = threading.Thread(target=self._refill, name="rollart-sandbox-refill", daemon=True)
            self._thread.start()

    def _refill(self) -> None:
        backoff = 0.5
        while True:
            with self._cv:
                while not self._closed and len(self._ready) >= self.warm:
                    self._cv.wait()
                if self._closed:
                    return
            try:
                sb = self._start_one()
            except SandboxUnavailable as e:
                log.error("sandbox pool: %s; no warm sandboxes on this host", e)
                return
            except SandboxError as e:
                log.warning("sandbox pool: a warm sandbox failed to start (%s); again in %.1f s", e, backoff)
                with self._cv:
                    self._cv.wait(timeout=backoff)
                backoff = min(backoff * 2, 30.0)
                continue
            backoff = 0.5
            with self._cv:
                if self._closed:
                    sb.close()
                    return
                self._ready.append(sb)
                self._cv.notify_all()

    def start_warming(self) -> None:
        """Start the refill thread now (the EnvManager does, at its start)."""
        with self._cv:
            if not self._closed:
                self._ensure_thread()

    def wait_ready(self, n: int | None = None, timeout: float = 30.0) -> bool:
        """Block until ``n`` (default ``warm``) sandboxes are ready, or ``timeout``."""
        want = self.warm if n is None else n
        deadline = time.monotonic() + timeout
        with self._cv:
            self._ensure_thread()
            while len(self._ready) < want:
                left = deadline - time.monotonic()
                if left <= 0 or self._closed:
                    return False
                self._cv.wait(timeout=left)
            return True


class _Session:
    def __init__(self, pool: SandboxPool) -> None:
        self.pool = pool
        self.sb: Sandbox | None = None

    def __enter__(self) -> Sandbox:
        self.sb = self.pool.acquire()
        return self.sb

    def __exit__(self, *exc: object) -> None:
        if self.sb is not None:
            self.pool.release(self.sb)

    async def __aenter__(self) -> Sandbox:
        self.sb = await self.pool.aacquire()
        return self.sb

    async def __aexit__(self, *exc: object) -> None:
        if self.sb is not None:
            self.pool.release(self.sb)


class PoolStats:
    """Counts and recent latencies (seconds), for ``rollart top`` and the step-time report."""

    def __init__(self, keep: int = 512) -> None:
        self.starts = collections.deque(maxlen=keep)     # spawn -> supervisor ready
        self.acquires = collections.deque(maxlen=keep)   # acquire() wait, as the env sees it
        self.warm_hits = 0
        self.cold_starts = 0
        self.start_failures = 0
        self.died_idle = 0

    def note_start(self, s: float) -> None:
        self.starts.append(s)

    def note_acquire(self, s: float, *, warm: bool) -> None:
        self.acquires.append(s)
        if warm:
            self.warm_hits += 1
        else:
            self.cold_starts += 1

    def snapshot(self) -> dict:
        def pct(xs: collections.deque, q: float) -> float | None:
            if not xs:
                return None
            s = sorted(xs)
            return s[min(len(s) - 1, int(q * len(s)))]

        return {"start_p50_s": pct(self.starts, 0.5), "start_p99_s": pct(self.starts, 0.99),
                "acquire_p50_s": pct(self.acquires, 0.5), "acquire_p99_s": pct(self.acquires, 0.99),
                "warm_hits": self.warm_hits, "cold_starts": self.cold_starts,
                "start_failures": self.start_failures, "died_idle": self.died_idle}


_POOL: SandboxPool | None = None
_POOL_LOCK = threading.Lock()
_HOLDERS = 0
"""Actors of this process holding its pool (:func:`hold`): the last one to let go closes it."""


def configure(cfg: SandboxConfig) -> SandboxPool:
    """Make ``cfg`` this process's pool (closing a previous one of another config)."""
    global _POOL
    with _POOL_LOCK:
        if _POOL is not None and _POOL.cfg == cfg and not _POOL._closed:
            return _POOL
        old, _POOL = _POOL, SandboxPool(cfg)
    if old is not None:
        old.close()
    return _POOL


def pool() -> SandboxPool:
    """This process's pool (the default config until :func:`configure` is called)."""
    global _POOL
    with _POOL_LOCK:
        if _POOL is None or _POOL._closed:
            _POOL = SandboxPool(SandboxConfig())
        return _POOL


def shutdown() -> None:
    """Close this process's pool (every sandbox killed)."""
    global _POOL, _HOLDERS
    with _POOL_LOCK:
        old, _POOL, _HOLDERS = _POOL, None, 0
    if old is not None:
        old.close()


def hold(cfg: SandboxConfig, *, warm: bool) -> SandboxPool:
    """:func:`configure` for an actor that owns per-process resources (the EnvManager, the
    RewardService, several of them in one process): the pool stays until the last holder
    calls :func:`let_go`. ``warm``: this holder's run declares sandboxes, so start keeping
    ``cfg.warm`` of them ready now (a run without code tasks starts none)."""
    global _HOLDERS
    p = configure(cfg)
    with _POOL_LOCK:
        _HOLDERS += 1
    if warm:
        p.start_warming()
    return p


def let_go() -> None:
    """One holder is done (after its consumers drained): the last one closes the pool,
    killing every sandbox of this process."""
    global _HOLDERS
    with _POOL_LOCK:
        _HOLDERS = max(0, _HOLDERS - 1)
        last = _HOLDERS == 0
    if last:
        shutdown()


def stats() -> dict[str, float]:
    """This process's pool statistics, numbers only (``{}`` when no pool was made): for a
    node's heartbeat (``sandbox.<stat>``)."""
    with _POOL_LOCK:
        p = _POOL
    if p is None:
        return {}
    return {k: float(v) for k, v in p.snapshot().items() if isinstance(v, (int, float))}

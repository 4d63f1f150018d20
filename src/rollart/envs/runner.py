"""Run one environment instance under asyncio, with deadlines.

:class:`EnvRunner` owns one env and gives it an async face whatever the env is like:

- **async env** (``async def reset/step``): awaited on the event loop.
- **sync env, executor="thread"** (default): every call runs on a dedicated daemon
  thread of this runner, so a slow env never blocks the loop and calls on one env stay
  serial. A thread cannot be killed: on a timeout the runner *abandons* the thread
  (it finishes, or hangs, on its own; being a daemon it never blocks interpreter exit)
  and marks itself broken.
- **sync env, executor="inline"**: called on the event loop itself (no thread hand-off: for
  envs whose steps take microseconds; nothing can interrupt a call), see
  :mod:`rollart.envs.inline_backend`.
- **sync env, executor="process"**: the env is constructed *inside* a dedicated worker
  process from its type and args (so they must be picklable) and lives there; calls
  travel over a pipe. One process per runner, rather than a shared pool with envs keyed
  by id, because a hung or crashed env can then be killed without harming other
  trajectories, the env's state never has to move, and a dead worker is detected as
  EOF on its pipe. Processes come from the ``forkserver`` start method by default, so
  starting one is cheap and safe in a threaded program. On a timeout the worker is
  killed and the runner is broken.

A broken runner raises :class:`EnvError` on every later call; make a new one. Errors
raised by the env surface as :class:`EnvError` with the original type and message.

Abandoned threads are accounted for per env type (:func:`abandoned_threads`) until their
call returns. Once ``max_abandoned_threads`` of one type are still running, thread-mode
runners of that type fail fast with :class:`EnvContractError` ("... steps hang; use
executor: process") instead of leaking a thread per hung step: the process executor is
the one that can kill a hung step, and switching silently would change where (and with
which pickled args) the env is built, so the runner says so and the config decides.

Two subclasses are *permanent*: trying again fails the same way, so callers should not.
:class:`EnvSetupError`: the env cannot be built (its type does not import, its args are
wrong, its constructor raised anything but a ``ConnectionError``/``TimeoutError``).
:class:`EnvContractError`: reset/step returned the wrong shape or types. Anything else
(an exception inside reset/step, a timeout, a dead worker) may be transient.

This module is the front (deadlines, broken state, the reset/step contract); the backends
live beside it, :mod:`rollart.envs.thread_backend` and :mod:`rollart.envs.process_backend`
(whose ``worker_main`` is what a worker process runs), and the errors in
:mod:`rollart.envs.errors`, re-exported here.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Mapping
from typing import Any, Literal

from rollart.envs.base import ResetResult, StepResult
from rollart.envs.errors import (EnvContractError, EnvError, EnvSetupError, EnvTimeout,
                                 WorkerError, describe, transient_setup)
from rollart.envs.inline_backend import InlineBackend
from rollart.envs.process_backend import ProcessBackend
from rollart.envs.registry import make_env
from rollart.envs.thread_backend import ThreadBackend, abandoned_threads

log = logging.getLogger(__name__)

__all__ = ["EnvContractError", "EnvError", "EnvRunner", "EnvSetupError", "EnvTimeout",
           "abandoned_threads"]



def _check_info(what: str, info: Any) -> dict[str, Any]:
    if info is None:
        return {}
    if not isinstance(info, Mapping):
        raise EnvContractError(f"{what}() info must be a dict, got {type(info).__name__}: {info!r:.200}")
    return dict(info)


def _check_reset(res: Any) -> ResetResult:
    if not (isinstance(res, tuple) and len(res) == 2 and isinstance(res[0], str)):
        raise EnvContractError(f"reset() must return (observation: str, info: dict), got {res!r:.200}")
    return res[0], _check_info("reset", res[1])


def _check_step(res: Any) -> StepResult:
    if not (isinstance(res, tuple) and len(res) == 5 and isinstance(res[0], str)):
        raise EnvContractError(
            f"step() must return (obs: str, reward, terminated, truncated, info), got {res!r:.200}")
    obs, reward, terminated, truncated, info = res
    try:
        reward = float(reward)
    except (TypeError, ValueError):
        raise EnvContractError(f"step() reward must be a number, got {reward!r:.200}") from None
    return obs, reward, bool(terminated), bool(truncated), _check_info("step", info)


class EnvRunner:
    """One environment instance, used from asyncio.

    Args:
        type: env type for :func:`~rollart.envs.registry.make_env` (built-in or import path).
        args: env args (must be picklable in process mode).
        executor: ``"thread"``, ``"process"`` or ``"inline"``; where a *sync* env runs (async envs are
            awaited on the loop in thread mode).
        timeout: default deadline in seconds for reset/step/close; None = no deadline.
        start_timeout: deadline for constructing the env (and its worker process).
        mp_context: multiprocessing start method for process mode.
        max_abandoned_threads: in thread mode, fail fast (``EnvContractError``) while this
            many threads of timed-out calls of this env type are still running; None: no cap.

    The env is built on first use (or by ``await start()``); ``instruction`` is readable
    after that. Calls on one runner are serialized. Use ``async with`` or ``await close()``.
    """

    def __init__(self, type: str, args: dict[str, Any] | None = None, *,
                 executor: Literal["thread", "process", "inline"] = "thread",
                 timeout: float | None = None,
                 start_timeout: float | None = 60.0, mp_context: str = "forkserver",
                 max_abandoned_threads: int | None = None) -> None:
        args = dict(args or {})
        self._backend: ThreadBackend | ProcessBackend | InlineBackend
        if executor == "thread":
            self._backend = ThreadBackend(lambda: make_env(type, args), type)
        elif executor == "process":
            self._backend = ProcessBackend(type, args, mp_context)
        elif executor == "inline":
            self._backend = InlineBackend(lambda: make_env(type, args), type)
        else:
            raise ValueError(f"EnvRunner executor must be 'thread', 'process' or 'inline', "
                             f"got {executor!r}")
        self.type, self.executor = type, executor
        self.timeout, self.start_timeout = timeout, start_timeout
        self.max_abandoned_threads = max_abandoned_threads
        self.broken: str | None = None
        """Why the runner is unusable (None while healthy)."""
        self._instruction: str | None = None
        self._legal: list[str] | None = None
        self._lock = asyncio.Lock()
        self._closed = False

    @classmethod
    def from_env(cls, env: Any, *, timeout: float | None = None) -> "EnvRunner":
        """Wrap an already-built env instance (thread executor)."""
        runner = cls(type(env).__name__, executor="thread", timeout=timeout)
        runner._backend = ThreadBackend(lambda: env, type(env).__name__)
        return runner

    @property
    def instruction(self) -> str:
        """The env's instruction text (after ``start``/first ``reset``)."""
        if self._instruction is None:
            raise RuntimeError("EnvRunner.instruction is known only after start() or reset()")
        return self._instruction

    def legal_actions(self) -> list[str] | None:
        """The env's legal actions after the last reset/step, None for free text."""
        return self._legal

    async def _guarded(self, what: str, coro: Any, timeout: float | None) -> Any:
        try:
            async with asyncio.timeout(timeout) as cm:
                return await coro
        except TimeoutError as e:
            if not cm.expired():  # the env itself raised TimeoutError
                raise EnvError(f"env {self.type!r} {what} failed: {describe(e)}") from e
            self.broken = f"{what} timed out after {timeout}s"
            self._backend.kill()
            log.warning("env %s: %s; abandoning it (%s)", self.type, self.broken,
                        "worker process killed" if self.executor == "process" else
                        f"thread executor; {abandoned_threads(self.type)} abandoned threads "
                        f"of this env type still running")
            raise EnvTimeout(f"env {self.type!r} {self.broken}") from None
        except Exception as e:
            if self._backend.dead and not self.broken:
                self.broken = f"worker process gone after {what}"
            if isinstance(e, EnvError):
                raise
            if what == "construction" and not (e.transient if isinstance(e, WorkerError)
                                               else transient_setup(e)):
                raise EnvSetupError(f"env {self.type!r} {what} failed: {describe(e)}") from e
            raise EnvError(f"env {self.type!r} {what} failed: {describe(e)}") from e

    def _check_usable(self) -> None:
        if self._closed:
            raise EnvError(f"env {self.type!r} runner is closed")
        if self.broken:
            raise EnvError(f"env {self.type!r} runner is broken ({self.broken}); make a new one")
        cap = self.max_abandoned_threads
        if cap is not None and isinstance(self._backend, ThreadBackend):
            n = abandoned_threads(self.type)
            if n >= cap:
                raise EnvContractError(
                    f"env {self.type!r}: {n} threads of calls that timed out are still running "
                    f"(max_abandoned_threads {cap}): its steps hang; use executor: process, "
                    f"where a hung step is killed")

    async def start(self, timeout: float | None = None) -> None:
        """Construct the env (idempotent). Raises EnvSetupError / EnvError / EnvTimeout."""
        async with self._lock:
            await self._start(timeout)

    async def _start(self, timeout: float | None) -> None:
        self._check_usable()
        if self._instruction is None:
            t = timeout if timeout is not None else self.start_timeout
            self._instruction = await self._guarded("construction", self._backend.start(), t)

    async def reset(self, seed: int, timeout: float | None = None) -> ResetResult:
        """``env.reset(seed)`` under a deadline (default: the runner's ``timeout``)."""
        async with self._lock:
            await self._start(None)
            self._check_usable()
            res, self._legal = await self._guarded("reset", self._backend.call("reset", seed),
                                                   timeout if timeout is not None else self.timeout)
            return _check_reset(res)

    async def step(self, action: str, timeout: float | None = None) -> StepResult:
        """``env.step(action)`` under a deadline (default: the runner's ``timeout``)."""
        async with self._lock:
            self._check_usable()
            if self._instruction is None:
                raise EnvError(f"env {self.type!r}: step() before reset()")
            res, self._legal = await self._guarded("step", self._backend.call("step", action),
                                                   timeout if timeout is not None else self.timeout)
            return _check_step(res)

    async def close(self, timeout: float | None = 5.0) -> None:
        """Close the env (calls its ``close()`` if any) and release the thread/process.
        Best effort: failures are logged, not raised. Idempotent."""
        if self._closed:
            return
        self._closed = True
        healthy = self.broken is None and self._instruction is not None
        try:
            async with asyncio.timeout(timeout):
                await self._backend.close(healthy)
        except Exception as e:  # includes TimeoutError
            log.warning("env %s: close failed: %s", self.type, describe(e))
            self._backend.kill()

    async def __aenter__(self) -> "EnvRunner":
        return self

    async def __aexit__(self, *exc: Any) -> None:
        await self.close()

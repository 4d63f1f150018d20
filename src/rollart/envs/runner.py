"""Run one environment instance under asyncio, with deadlines.

:class:`EnvRunner` owns one env and gives it an async face whatever the env is like:

- **async env** (``async def reset/step``): awaited on the event loop.
- **sync env, executor="thread"** (default): every call runs on a dedicated daemon
  thread of this runner, so a slow env never blocks the loop and calls on one env stay
  serial. A thread cannot be killed: on a timeout the runner *abandons* the thread
  (it finishes, or hangs, on its own; being a daemon it never blocks interpreter exit)
  and marks itself broken.
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
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import inspect
import logging
import multiprocessing
import queue
import signal
import sys
import threading
import traceback
import weakref
from collections.abc import Mapping
from typing import Any, Callable, Literal

from rollart.envs.base import ResetResult, StepResult, legal_actions_of
from rollart.envs.registry import make_env

log = logging.getLogger(__name__)


class EnvError(RuntimeError):
    """reset/step of an env failed, or the runner is broken. The message carries the
    original exception's type and message."""


class EnvTimeout(EnvError, TimeoutError):
    """An env call ran past its deadline; the runner is now broken."""


class EnvSetupError(EnvError):
    """The env cannot be built: unknown or unimportable type, bad args, or its constructor
    raised. Permanent: building it again fails the same way."""


class EnvContractError(EnvError):
    """The env broke the protocol: reset/step returned the wrong shape or types. Permanent."""


class _RemoteError(Exception):
    """An exception inside a worker process, as ``"Type: message"``."""

    def __init__(self, text: str, transient: bool = True) -> None:
        super().__init__(text)
        self.transient = transient


def _transient_setup(e: BaseException) -> bool:
    """A constructor failing this way (a sandbox it connects to is away) may succeed later."""
    return isinstance(e, (ConnectionError, TimeoutError))


def _describe(e: BaseException) -> str:
    return str(e) if isinstance(e, _RemoteError) else f"{type(e).__name__}: {e}"


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


class _DaemonThread:
    """A one-thread executor whose thread is a daemon (ThreadPoolExecutor joins its threads
    at exit, so one hung env would hang the interpreter). The thread ends on ``stop()`` or
    when this object is garbage-collected, once its current job returns."""

    def __init__(self, name: str) -> None:
        self._q: queue.SimpleQueue = queue.SimpleQueue()
        self.thread = threading.Thread(target=self._serve, args=(self._q,), name=name, daemon=True)
        self.thread.start()
        weakref.finalize(self, self._q.put, None)

    def submit(self, fn: Callable[[], Any]) -> concurrent.futures.Future:
        fut: concurrent.futures.Future = concurrent.futures.Future()
        self._q.put((fut, fn))
        return fut

    def stop(self) -> None:
        self._q.put(None)

    @staticmethod
    def _serve(q: queue.SimpleQueue) -> None:
        while (item := q.get()) is not None:
            fut, fn = item
            if fut.set_running_or_notify_cancel():
                try:
                    fut.set_result(fn())
                except BaseException as e:  # handed to the awaiting coroutine
                    fut.set_exception(e)
            del item, fut, fn  # drop references to the env while idle


_abandoned: dict[str, list[threading.Thread]] = {}
"""Env type -> threads abandoned by a timed-out call that may still be running."""
_abandoned_lock = threading.Lock()


def abandoned_threads(env_type: str | None = None) -> int:
    """Threads abandoned by timed-out env calls that are still running (of ``env_type``, or
    of every type). A thread is forgotten once its call returns (it then exits)."""
    with _abandoned_lock:
        n = 0
        for t in [env_type] if env_type is not None else list(_abandoned):
            live = [th for th in _abandoned.get(t, ()) if th.is_alive()]
            if live:
                _abandoned[t] = live
            else:
                _abandoned.pop(t, None)
            n += len(live)
        return n


class _ThreadBackend:
    def __init__(self, factory: Callable[[], Any], name: str) -> None:
        self._factory, self._name = factory, name
        self._worker: _DaemonThread | None = None
        self._last: concurrent.futures.Future | None = None  # the latest call on the thread
        self.env: Any = None
        self.dead = False  # a thread never dies under us

    async def _sync(self, fn: Callable[[], Any]) -> Any:
        if self._worker is None:
            self._worker = _DaemonThread(f"env-{self._name}")
        self._last = self._worker.submit(fn)
        return await asyncio.wrap_future(self._last)

    async def start(self) -> str:
        self.env = await self._sync(self._factory)
        return getattr(self.env, "instruction", None) or ""  # optional attribute

    async def call(self, method: str, arg: Any) -> tuple[Any, list[str] | None]:
        fn = getattr(self.env, method)
        if inspect.iscoroutinefunction(fn):
            res = await fn(arg)
            return res, legal_actions_of(self.env)
        return await self._sync(lambda: (fn(arg), legal_actions_of(self.env)))

    async def close(self, healthy: bool) -> None:
        fn = getattr(self.env, "close", None)
        try:
            if healthy and fn is not None:
                await (fn() if inspect.iscoroutinefunction(fn) else self._sync(fn))
        finally:
            if self._worker is not None:
                self._worker.stop()

    def kill(self) -> None:
        if self._worker is not None:
            self._worker.stop()  # the thread exits once the env returns, if ever
            if self._last is not None and not self._last.done():  # busy: abandoned, counted
                with _abandoned_lock:
                    _abandoned.setdefault(self._name, []).append(self._worker.thread)
            self._worker = None


def _worker_main(conn: Any, env_type: str, env_args: dict, sys_path: list[str]) -> None:
    """Body of a process-mode worker: build the env, then serve (seq, method, arg) requests."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the parent decides when we stop
    sys.path[:] = sys_path + [p for p in sys.path if p not in sys_path]
    loop: asyncio.AbstractEventLoop | None = None

    def run(x: Any) -> Any:
        nonlocal loop
        if inspect.isawaitable(x):
            loop = loop or asyncio.new_event_loop()
            return loop.run_until_complete(x)
        return x

    def reply(seq: int, ok: bool, payload: Any) -> None:
        try:
            conn.send((seq, ok, payload))
        except (BrokenPipeError, EOFError, OSError):
            raise SystemExit(0)
        except Exception as e:  # e.g. an unpicklable info value
            conn.send((seq, False, f"could not send result: {_describe(e)}"))

    try:
        env = make_env(env_type, env_args)
    except BaseException as e:
        reply(0, False, (_describe(e), _transient_setup(e)))
        return
    reply(0, True, getattr(env, "instruction", None) or "")  # optional attribute
    while True:
        try:
            seq, method, arg = conn.recv()
        except (EOFError, OSError):
            return
        try:
            if method == "close":
                fn = getattr(env, "close", None)
                reply(seq, True, run(fn()) if fn is not None else None)
                return
            res = run(getattr(env, method)(arg))
            reply(seq, True, (res, legal_actions_of(env)))
        except Exception as e:
            log.debug("env %s failed:\n%s", method, traceback.format_exc())
            reply(seq, False, _describe(e))


class _ProcessBackend:
    def __init__(self, env_type: str, env_args: dict, mp_context: str) -> None:
        self._type, self._args = env_type, env_args
        self._ctx = multiprocessing.get_context(mp_context)
        self._proc: Any = None
        self._conn: Any = None
        self._seq = 0
        self.dead = False
        """True once the worker is gone (died, failed to build the env, or was killed)."""

    def _spawn(self) -> None:
        parent, child = self._ctx.Pipe()
        self._conn = parent
        self._proc = self._ctx.Process(target=_worker_main, name=f"env-{self._type}", daemon=True,
                                       args=(child, self._type, self._args, list(sys.path)))
        self._proc.start()
        child.close()

    async def _recv(self, seq: int) -> Any:
        loop = asyncio.get_running_loop()
        fd = self._conn.fileno()
        while True:
            fut = loop.create_future()

            def ready() -> None:
                if not fut.done():
                    try:
                        fut.set_result(self._conn.recv())
                    except BaseException as e:
                        fut.set_exception(e)

            loop.add_reader(fd, ready)
            try:
                msg = await fut
            except (EOFError, OSError) as e:
                self.dead = True
                code = self._proc.exitcode if self._proc is not None else None
                raise EnvError(f"env worker process died (exit code {code})") from e
            finally:
                loop.remove_reader(fd)
            if msg[0] == seq:  # older seqs are replies to cancelled calls: drop them
                _, ok, payload = msg
                if not ok:
                    if isinstance(payload, tuple):  # (text, transient): a construction error
                        raise _RemoteError(*payload)
                    raise _RemoteError(payload)
                return payload

    async def start(self) -> str:
        await asyncio.to_thread(self._spawn)
        try:
            return await self._recv(0)
        except _RemoteError:
            self.dead = True  # the worker exits after reporting a construction error
            raise

    async def call(self, method: str, arg: Any) -> tuple[Any, list[str] | None]:
        self._seq += 1
        try:
            self._conn.send((self._seq, method, arg))
        except (BrokenPipeError, OSError) as e:
            self.dead = True
            raise EnvError(f"env worker process is gone: {_describe(e)}") from e
        return await self._recv(self._seq)

    async def close(self, healthy: bool) -> None:
        try:
            if healthy and self._proc is not None and self._proc.is_alive():
                await self.call("close", None)
                await asyncio.to_thread(self._proc.join, 5.0)
        finally:
            self.kill()

    def kill(self) -> None:
        self.dead = True
        if self._proc is not None and self._proc.pid is not None and self._proc.exitcode is None:
            self._proc.kill()
            self._proc.join(1.0)  # SIGKILL is immediate: this reaps the zombie
        if self._conn is not None:
            self._conn.close()
            self._conn = None


class EnvRunner:
    """One environment instance, used from asyncio.

    Args:
        type: env type for :func:`~rollart.envs.registry.make_env` (built-in or import path).
        args: env args (must be picklable in process mode).
        executor: ``"thread"`` or ``"process"``; where a *sync* env runs (async envs are
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
                 executor: Literal["thread", "process"] = "thread", timeout: float | None = None,
                 start_timeout: float | None = 60.0, mp_context: str = "forkserver",
                 max_abandoned_threads: int | None = None) -> None:
        args = dict(args or {})
        if executor == "thread":
            self._backend: Any = _ThreadBackend(lambda: make_env(type, args), type)
        elif executor == "process":
            self._backend = _ProcessBackend(type, args, mp_context)
        else:
            raise ValueError(f"EnvRunner executor must be 'thread' or 'process', got {executor!r}")
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
        runner._backend = _ThreadBackend(lambda: env, type(env).__name__)
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
                raise EnvError(f"env {self.type!r} {what} failed: {_describe(e)}") from e
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
            if what == "construction" and not (e.transient if isinstance(e, _RemoteError)
                                               else _transient_setup(e)):
                raise EnvSetupError(f"env {self.type!r} {what} failed: {_describe(e)}") from e
            raise EnvError(f"env {self.type!r} {what} failed: {_describe(e)}") from e

    def _check_usable(self) -> None:
        if self._closed:
            raise EnvError(f"env {self.type!r} runner is closed")
        if self.broken:
            raise EnvError(f"env {self.type!r} runner is broken ({self.broken}); make a new one")
        cap = self.max_abandoned_threads
        if cap is not None and isinstance(self._backend, _ThreadBackend):
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
            log.warning("env %s: close failed: %s", self.type, _describe(e))
            self._backend.kill()

    async def __aenter__(self) -> "EnvRunner":
        return self

    async def __aexit__(self, *exc: Any) -> None:
        await self.close()

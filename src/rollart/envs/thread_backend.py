"""The thread backend of :class:`~rollart.envs.runner.EnvRunner` (``executor: thread``).

Every call of a sync env runs on a dedicated daemon thread of its runner, so a slow env
never blocks the event loop and calls on one env stay serial; an async env is awaited on
the loop. A thread cannot be killed: on a timeout the runner *abandons* it (it finishes,
or hangs, on its own; being a daemon it never blocks interpreter exit). Abandoned threads
are accounted for per env type (:func:`abandoned_threads`) until their call returns. The
thread of an env closed healthy, with no call running, is kept (up to :data:`IDLE_MAX`) and
serves the next env, which it runs alone as before; an abandoned one never is.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import inspect
import queue
import threading
import weakref
from typing import Any, Callable

from rollart.envs.base import legal_actions_of


class _DaemonThread:
    """A one-thread executor whose thread is a daemon (ThreadPoolExecutor joins its threads
    at exit, so one hung env would hang the interpreter). The thread ends on ``stop()`` or
    when this object is garbage-collected, once its current job returns."""

    def __init__(self, name: str) -> None:
        self._q: queue.SimpleQueue = queue.SimpleQueue()
        self.thread = threading.Thread(target=self._serve, args=(self._q,), name=name, daemon=True)
        self.thread.start()
        weakref.finalize(self, self._q.put, None)

    @classmethod
    def take(cls, name: str) -> "_DaemonThread":
        """An idle thread a closed env gave back (:func:`_give_back`), renamed ``name``, or a
        new one: starting a thread per trajectory cost more CPU than a FrozenLake episode."""
        with _idle_lock:
            worker = _idle.pop() if _idle else None
        if worker is None:
            return cls(name)
        worker.thread.name = name
        return worker

    def submit(self, fn: Callable[[], Any]) -> concurrent.futures.Future:
        fut: concurrent.futures.Future = concurrent.futures.Future()
        self._q.put((fut, fn))
        return fut

    def run(self, fn: Callable[[], Any]) -> tuple["_Job", asyncio.Future]:
        """``fn`` on this thread, for the running loop: the job (``done()`` once ``fn``
        returned or was skipped, whatever happened to the awaiting coroutine) and the future
        its result is set on, from the thread with one ``call_soon_threadsafe`` (cheaper per
        env step than a ``concurrent.futures.Future`` wrapped by ``asyncio.wrap_future``)."""
        job = _Job(asyncio.get_running_loop().create_future(), fn)
        self._q.put((job, fn))
        return job, job.fut

    def stop(self) -> None:
        self._q.put(None)

    @staticmethod
    def _serve(q: queue.SimpleQueue) -> None:
        while (item := q.get()) is not None:
            fut, fn = item
            if isinstance(fut, _Job):
                fut.serve()
            elif fut.set_running_or_notify_cancel():
                try:
                    fut.set_result(fn())
                except BaseException as e:  # handed to the awaiting coroutine
                    fut.set_exception(e)
            del item, fut, fn  # drop references to the env while idle


class _Job:
    """One call handed to a :class:`_DaemonThread` by :meth:`_DaemonThread.run`."""

    __slots__ = ("fut", "fn", "finished")

    def __init__(self, fut: asyncio.Future, fn: Callable[[], Any]) -> None:
        self.fut, self.fn, self.finished = fut, fn, False

    def done(self) -> bool:
        """Whether the call returned (or was skipped): the thread is free again."""
        return self.finished

    def serve(self) -> None:
        """On the thread: run the call unless its awaiter was cancelled already."""
        fut, fn, self.fn = self.fut, self.fn, None
        if fut.cancelled():  # nobody waits (a timed-out or cancelled caller): skip it
            self.finished = True
            return
        try:
            res, err = fn(), None
        except BaseException as e:  # handed to the awaiting coroutine
            res, err = None, e
        self.finished = True
        try:
            fut.get_loop().call_soon_threadsafe(_resolve, fut, res, err)
        except RuntimeError:  # the loop is closed: nobody is left to tell
            pass


def _resolve(fut: asyncio.Future, res: Any, err: BaseException | None) -> None:
    if fut.done():  # the awaiter gave up (a timeout) while the call ran
        return
    if err is not None:
        fut.set_exception(err)
    else:
        fut.set_result(res)


IDLE_MAX = 256
"""Idle env threads kept for the next env (:meth:`_DaemonThread.take`); more are stopped."""
IDLE_NAME = "rollart-idle-env-thread"
"""The name of a kept idle thread (an env thread is named ``env-<type>`` while it serves one)."""
_idle: list[_DaemonThread] = []
_idle_lock = threading.Lock()


def _give_back(worker: _DaemonThread) -> None:
    """Keep the thread of a closed env (its last call returned) for the next one, or stop it."""
    with _idle_lock:
        if len(_idle) < IDLE_MAX and worker.thread.is_alive():
            worker.thread.name = IDLE_NAME
            _idle.append(worker)
            return
    worker.stop()


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


class ThreadBackend:
    """One env built by ``factory`` and called on a daemon thread of its own (named after
    ``name``, the env type, which also keys its abandoned threads)."""

    def __init__(self, factory: Callable[[], Any], name: str) -> None:
        self._factory, self._name = factory, name
        self._worker: _DaemonThread | None = None
        self._last: _Job | None = None  # the latest call on the thread
        self.env: Any = None
        self.dead = False  # a thread never dies under us

    async def _sync(self, fn: Callable[[], Any]) -> Any:
        if self._worker is None:
            self._worker = _DaemonThread.take(f"env-{self._name}")
        self._last, fut = self._worker.run(fn)
        return await fut

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
        reuse = False
        try:
            if healthy and fn is not None:
                await (fn() if inspect.iscoroutinefunction(fn) else self._sync(fn))
            reuse = healthy
        finally:
            worker, self._worker = self._worker, None
            if worker is not None:
                # a healthy env whose calls all returned: its thread serves the next env
                if reuse and (self._last is None or self._last.done()):
                    _give_back(worker)
                else:
                    worker.stop()

    def kill(self) -> None:
        if self._worker is not None:
            self._worker.stop()  # the thread exits once the env returns, if ever
            if self._last is not None and not self._last.done():  # busy: abandoned, counted
                with _abandoned_lock:
                    _abandoned.setdefault(self._name, []).append(self._worker.thread)
            self._worker = None

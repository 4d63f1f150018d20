"""The thread backend of :class:`~rollart.envs.runner.EnvRunner` (``executor: thread``).

Every call of a sync env runs on a dedicated daemon thread of its runner, so a slow env
never blocks the event loop and calls on one env stay serial; an async env is awaited on
the loop. A thread cannot be killed: on a timeout the runner *abandons* it (it finishes,
or hangs, on its own; being a daemon it never blocks interpreter exit). Abandoned threads
are accounted for per env type (:func:`abandoned_threads`) until their call returns.
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


class ThreadBackend:
    """One env built by ``factory`` and called on a daemon thread of its own (named after
    ``name``, the env type, which also keys its abandoned threads)."""

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

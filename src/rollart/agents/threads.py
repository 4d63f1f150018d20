"""The bounded thread pool that plain ``def`` agents run on (:class:`AgentThreads`).

A blocking agent runs on one of these threads, never on asyncio's default executor: blocking
agents there once held every thread that the policy loader, payload hashing and reward scoring
wait for (issue 43). The EnvManager owns one pool (``rollout.agent_threads``); verifiers'
task loading owns another.
"""

from __future__ import annotations

import asyncio
import contextvars
import functools
import queue
import threading
from collections.abc import Callable
from typing import Any


class AgentThreads:
    """The bounded pool of daemon threads that plain ``def`` agents run on, one pool per
    EnvManager (which sizes it by ``rollout.agent_threads`` and closes it at teardown).

    Not a ``ThreadPoolExecutor``: its threads are joined at interpreter exit, and an agent
    stuck in user code would then hold a stopping node until SIGKILL. A thread here is a
    daemon; a cancelled caller stops waiting at once while its thread runs the agent to its
    end (a thread cannot be interrupted), holding its slot until then, so at most ``size``
    agents run and a hung one never takes more than its one thread. Threads start on demand
    and stay for the next agent; :meth:`close` waits for none of them."""

    def __init__(self, size: int, name: str) -> None:
        if size < 1:
            raise ValueError(f"AgentThreads needs at least one thread, got {size}")
        self.size, self.name = size, name
        self._jobs: queue.SimpleQueue = queue.SimpleQueue()
        self._idle = threading.Semaphore(0)
        """Released by a thread each time it is free for the next job."""
        self._threads: list[threading.Thread] = []
        self._closed = False

    @property
    def threads(self) -> int:
        """Threads started (at most ``size``)."""
        return len(self._threads)

    async def run(self, fn: Callable[..., Any], *args: Any) -> Any:
        """``fn(*args)`` on a thread of the pool (in the caller's context, as
        :func:`asyncio.to_thread` runs it); waits for a free thread."""
        if self._closed:
            raise RuntimeError(f"{self.name}: the agent threads are closed")
        fut = asyncio.get_running_loop().create_future()
        call = functools.partial(contextvars.copy_context().run, fn, *args)
        self._jobs.put((fut, call))
        if not self._idle.acquire(blocking=False) and len(self._threads) < self.size:
            t = threading.Thread(target=self._serve, name=f"{self.name}-{len(self._threads)}",
                                 daemon=True)
            self._threads.append(t)
            t.start()
        return await fut

    def _serve(self) -> None:
        while (job := self._jobs.get()) is not None:
            fut, call = job
            if not fut.cancelled():  # nobody waits for a job cancelled before it started
                try:
                    res, err = call(), None
                except BaseException as e:  # handed to the awaiting coroutine
                    res, err = None, e
                try:
                    fut.get_loop().call_soon_threadsafe(_settle_future, fut, res, err)
                except RuntimeError:  # the loop is closed: nobody is left to tell
                    pass
            del job, fut, call  # no reference to the agent's objects while idle
            self._idle.release()

    def close(self) -> None:
        """Stop the threads once their current agent returns; waits for none of them."""
        self._closed = True
        for _ in self._threads:
            self._jobs.put(None)


def _settle_future(fut: asyncio.Future, res: Any, err: BaseException | None) -> None:
    if fut.done():  # the caller stopped waiting (its deadline, a cancel)
        return
    if err is not None:
        fut.set_exception(err)
    else:
        fut.set_result(res)

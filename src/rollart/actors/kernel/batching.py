"""Gather concurrent requests into batches without making any request wait for a full one."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable
from typing import Generic, TypeVar

X = TypeVar("X")
Y = TypeVar("Y")


class Batcher(Generic[X, Y]):
    """Requests that arrive while a batch runs, or within ``gather_s`` of the first one,
    share the next batch; a lone request waits at most ``gather_s``.

    ``run()`` is the batching loop (an actor's ``main``); ``submit`` awaits one result.
    ``before_batch`` runs between batches (e.g. to load new weights).
    """

    def __init__(self, fn: Callable[[list[X]], Awaitable[list[Y]]], *, gather_s: float = 0.002,
                 max_batch: int = 128,
                 before_batch: Callable[[], Awaitable[None]] | None = None):
        self.fn = fn
        self.gather_s = gather_s
        self.max_batch = max_batch
        self.before_batch = before_batch
        self._queue: list[tuple[X, asyncio.Future]] = []
        self._wake = asyncio.Event()
        self.stopped = False
        """Set once :meth:`run` ended: nothing submitted will run any more."""
        self.batches = 0
        self.items = 0
        self.sizes: list[int] = []
        self.busy_s = 0.0

    async def submit(self, x: X) -> Y:
        fut: asyncio.Future = asyncio.get_running_loop().create_future()
        self._queue.append((x, fut))
        self._wake.set()
        return await fut

    @property
    def queued(self) -> int:
        """Items waiting for a batch (not counting the one being run)."""
        return len(self._queue)

    @property
    def mean_batch(self) -> float:
        return self.items / self.batches if self.batches else 0.0

    async def run(self) -> None:
        try:
            await self._loop()
        except asyncio.CancelledError:  # stopping: nobody will run the queued requests
            self.stopped = True  # before the waiters wake: they are told to go elsewhere
            self.fail_pending(RuntimeError("batcher stopped"))
            raise
        finally:
            self.stopped = True

    async def submit_or_unavailable(self, x: X, unavailable: Callable[[str], Exception]) -> Y:
        """:meth:`submit`, but a request that a stopping batcher will never run (or dropped
        mid-batch) raises ``unavailable(why)`` so that its requester retries elsewhere."""
        if self.stopped:
            raise unavailable("is stopping")
        try:
            return await self.submit(x)
        except asyncio.CancelledError:
            task = asyncio.current_task()
            if self.stopped and task is not None and not task.cancelling():
                raise unavailable("stopped mid-batch") from None  # not this request's cancel
            raise
        except RuntimeError as e:
            if self.stopped:
                raise unavailable(f"is stopping: {e}") from e
            raise

    async def _loop(self) -> None:
        while True:
            await self._wake.wait()
            if len(self._queue) < self.max_batch and self.gather_s > 0:
                await asyncio.sleep(self.gather_s)
            if self.before_batch is not None:
                await self.before_batch()
            take, self._queue = self._queue[: self.max_batch], self._queue[self.max_batch:]
            if not self._queue:
                self._wake.clear()
            take = [(x, f) for x, f in take if not f.done()]  # requester gave up
            if not take:
                continue
            t0 = time.perf_counter()
            try:
                out = await self.fn([x for x, _ in take])
            except asyncio.CancelledError:
                for _, f in take:
                    f.cancel()
                raise
            except Exception as e:  # noqa: BLE001 - every waiter gets the error
                for _, f in take:
                    if not f.done():
                        f.set_exception(e)
                continue
            finally:
                self.busy_s += time.perf_counter() - t0
            self.batches += 1
            self.items += len(take)
            self.sizes.append(len(take))
            for (_, f), y in zip(take, out):
                if not f.done():
                    f.set_result(y)

    def fail_pending(self, exc: BaseException) -> None:
        for _, f in self._queue:
            if not f.done():
                f.set_exception(exc)
        self._queue.clear()

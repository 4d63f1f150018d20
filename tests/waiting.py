"""Waiting in tests: the one place that polls a condition until a deadline.

``await until(cond, deadline=..., what=...)`` polls ``cond`` (a plain function, or one that
returns an awaitable) until it returns something truthy and returns that value. At the deadline
it fails with an :class:`AssertionError` that names ``what`` and, when given, the text of
``state()`` (a log tail, the counters seen so far). ``abort`` is polled beside ``cond``: when it
returns something truthy (a process exited, say) the wait fails at once instead of running out
the clock. :func:`until_sync` is the same for tests that are not coroutines.

A deadline here is a bound on a hang, never a measurement: pick it generous (a loaded 2-core
machine is several times slower than an idle one); the test passes as soon as ``cond`` holds.
"""

from __future__ import annotations

import asyncio
import inspect
import time
from collections.abc import Callable
from typing import Any

__all__ = ["until", "until_sync"]


def _failure(what: str, deadline: float, state: Callable[[], Any] | None, why: str) -> AssertionError:
    msg = f"{why} waiting for {what}" if why else f"timed out after {deadline:g}s waiting for {what}"
    if state is not None:
        msg += f"\n{state()}"
    return AssertionError(msg)


async def until(cond: Callable[[], Any], *, deadline: float, what: str, step: float = 0.02,
                state: Callable[[], Any] | None = None,
                abort: Callable[[], Any] | None = None) -> Any:
    """Poll ``cond()`` (sync or async) every ``step`` seconds until truthy; return its value."""
    end = time.monotonic() + deadline
    while True:
        v = cond()
        if inspect.isawaitable(v):
            v = await v
        if v:
            return v
        if abort is not None and (why := abort()):
            raise _failure(what, deadline, state, why if isinstance(why, str) else "gave up")
        if time.monotonic() > end:
            raise _failure(what, deadline, state, "")
        await asyncio.sleep(step)


def until_sync(cond: Callable[[], Any], *, deadline: float, what: str, step: float = 0.05,
               state: Callable[[], Any] | None = None,
               abort: Callable[[], Any] | None = None) -> Any:
    """:func:`until` for synchronous tests (``time.sleep`` between polls)."""
    end = time.monotonic() + deadline
    while True:
        v = cond()
        if v:
            return v
        if abort is not None and (why := abort()):
            raise _failure(what, deadline, state, why if isinstance(why, str) else "gave up")
        if time.monotonic() > end:
            raise _failure(what, deadline, state, "")
        time.sleep(step)

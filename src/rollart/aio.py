"""The two asyncio shapes every part of rollart needs, written once.

- :func:`retry`: call ``fn`` until it returns, retrying the exceptions named in ``retry_on``
  with jittered exponential backoff (:func:`backoff`) until a deadline or a number of
  attempts; one warning at the first failure, one info line when it goes through after
  failing (none with ``quiet``: the caller logs), the last error raised (or ``default``
  returned) when the budget is spent.
- :func:`first_of`: wait for whichever of several awaitables finishes first, cancel the
  others and wait until they have ended (structured: no task outlives the call).
- :func:`any_done`: wait until one of several running futures is done, cancelling none
  (they belong to the caller, who reads each one's result or error itself).

A transient failure is retried here; a permanent one is not in ``retry_on`` and goes up at
once (design.md, "Failure kinds").
"""

from __future__ import annotations

import asyncio
import logging
import random
import time
from collections.abc import Awaitable, Callable
from typing import Any, TypeVar

T = TypeVar("T")

log = logging.getLogger(__name__)

_RAISE: Any = object()


def backoff(attempt: int, base: float = 0.2, cap: float = 10.0) -> float:
    """Jittered exponential backoff before retry ``attempt`` (1, 2, ...): ``base * 2**(a-1)``
    capped at ``cap``, times a random factor in [0.5, 1)."""
    return min(cap, base * 2 ** max(0, attempt - 1)) * (0.5 + random.random() / 2)


async def retry(fn: Callable[[], Awaitable[T]], *,
                retry_on: type[BaseException] | tuple[type[BaseException], ...],
                what: str, deadline: float | None = None, attempts: int | None = None,
                base: float = 0.1, cap: float = 5.0, default: Any = _RAISE,
                fatal: type[BaseException] | tuple[type[BaseException], ...] = (),
                logger: logging.Logger | None = None, quiet: bool = False,
                on_error: Callable[[BaseException, int], None] | None = None) -> T:
    """``await fn()``, retried on ``retry_on`` until it succeeds.

    The budget is ``deadline`` seconds and/or ``attempts`` calls (at least one must be
    given; the first one spent ends it). ``what`` names the operation in the log lines
    ("storing the issued count"). When the budget is spent the last error is raised, or
    ``default`` is returned (and the failure logged as an error) when one is given.
    ``fatal`` names subclasses of ``retry_on`` that are raised at once (permanent kinds of
    a transient error). ``on_error(exc, attempt)`` runs after each other failure (e.g. to count
    it, or to log each one: with ``quiet`` this function logs nothing)."""
    if deadline is None and attempts is None:
        raise ValueError("retry needs a deadline or a number of attempts")
    lg = logger or log
    end = None if deadline is None else time.monotonic() + deadline
    attempt = 0
    while True:
        try:
            out = await fn()
        except retry_on as e:
            if isinstance(e, fatal):
                raise
            attempt += 1
            if on_error is not None:
                on_error(e, attempt)
            spent = ((attempts is not None and attempt >= attempts)
                     or (end is not None and time.monotonic() >= end))
            if spent:
                if default is _RAISE:
                    raise
                if not quiet:
                    lg.error("%s failed %d times (%s); giving up", what, attempt, e)
                return default
            if attempt == 1 and not quiet:
                budget = f"for up to {deadline:.0f}s" if deadline is not None else f"{attempts - 1} more times"
                lg.warning("%s failed (%s); retrying %s", what, e, budget)
            pause = backoff(attempt, base, cap)
            if end is not None:
                pause = max(0.0, min(pause, end - time.monotonic()))
            await asyncio.sleep(pause)
            continue
        if attempt and not quiet:
            lg.info("%s went through after %d retries", what, attempt)
        return out


async def first_of(*aws: Awaitable[Any], timeout: float | None = None,
                   ) -> tuple[set[asyncio.Future], set[asyncio.Future]]:
    """Wait until the first of ``aws`` (coroutines, tasks or futures) is done, or
    ``timeout`` seconds (None: no limit); cancel the rest and wait until they have ended.
    Returns ``(done, cancelled)`` as the futures, so a caller tells which finished
    (``fut.result()`` re-raises its error); ``done`` is empty when the time ran out. If the
    caller is cancelled while waiting, every one of ``aws`` is cancelled before the cancel
    goes on."""
    futs = [asyncio.ensure_future(a) for a in aws]
    try:
        done, pending = await asyncio.wait(futs, timeout=timeout,
                                           return_when=asyncio.FIRST_COMPLETED)
    finally:
        rest = [f for f in futs if not f.done()]
        for f in rest:
            f.cancel()
        await _settle(rest)
    return done, pending


async def any_done(*futs: asyncio.Future) -> None:
    """Wait until one of the running futures ``futs`` is done (none: forever). Nothing is
    cancelled, not even when the caller is: the futures stay the caller's, and no wrapper
    is made whose error nobody would read (``first_of`` over ``asyncio.shield`` wrappers
    left one "Future exception was never retrieved" per failed request)."""
    if not futs:
        await asyncio.get_running_loop().create_future()  # until the caller is cancelled
    await asyncio.wait(futs, return_when=asyncio.FIRST_COMPLETED)


async def _settle(futs: list[asyncio.Future]) -> None:
    """Wait until cancelled futures have ended. A cancel can be swallowed once (Python
    3.11's ``wait_for`` inside a client library loses one that lands as its reply arrives),
    so ask again until each is done; a cancel of the caller is held until then."""
    cancelled_outside = False
    futs = [f for f in futs if not f.done()]  # a cancelled plain future is done at once
    while futs:
        try:
            await asyncio.wait(futs, timeout=1.0)
        except asyncio.CancelledError:
            cancelled_outside = True
        for f in futs:
            if f.done() and not f.cancelled():
                f.exception()  # retrieved: an error raised while cancelling is not reported
        futs = [f for f in futs if not f.done()]
        for f in futs:
            f.cancel()
    if cancelled_outside:
        raise asyncio.CancelledError


settle = _settle
"""Wait until cancelled futures have ended (what :func:`first_of` does with the rest)."""

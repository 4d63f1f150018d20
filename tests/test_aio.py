"""rollart.aio: backoff, retry (budgets, default vs raise, what is retried, its log lines)
and first_of (the winner, the losers cancelled and ended, a cancel of the caller, a timeout)."""

from __future__ import annotations

import asyncio
import logging

import pytest

from rollart.aio import backoff, first_of, retry


class Flaky(Exception):
    pass


class Permanent(Flaky):
    pass


def failing(times: int, exc: type[BaseException] = Flaky, value: object = "ok"):
    """An async callable that raises ``exc`` ``times`` times, then returns ``value``;
    ``calls`` counts its calls."""
    calls: list[int] = []

    async def fn():
        calls.append(1)
        if len(calls) <= times:
            raise exc(f"failure {len(calls)}")
        return value

    return fn, calls


# -- backoff -----------------------------------------------------------------------------


def test_backoff_grows_from_base_to_cap_with_jitter():
    for attempt in range(1, 12):
        top = min(1.0, 0.1 * 2 ** (attempt - 1))
        for _ in range(50):
            assert top / 2 <= backoff(attempt, base=0.1, cap=1.0) < top
    assert backoff(0, base=0.1, cap=1.0) < 0.1  # attempt 0 counts as the first


# -- retry -------------------------------------------------------------------------------

FAST = {"base": 0.001, "cap": 0.001}


async def test_retry_returns_once_it_goes_through_and_logs_twice(caplog):
    fn, calls = failing(3)
    seen: list[tuple[str, int]] = []
    with caplog.at_level(logging.INFO, logger="rollart.aio"):
        out = await retry(fn, retry_on=Flaky, what="storing x", attempts=10,
                          on_error=lambda e, n: seen.append((str(e), n)), **FAST)
    assert out == "ok"
    assert len(calls) == 4
    assert seen == [("failure 1", 1), ("failure 2", 2), ("failure 3", 3)]
    msgs = [(r.levelno, r.getMessage()) for r in caplog.records if r.name == "rollart.aio"]
    assert msgs == [(logging.WARNING, "storing x failed (failure 1); retrying 9 more times"),
                    (logging.INFO, "storing x went through after 3 retries")]


async def test_retry_first_try_logs_nothing(caplog):
    fn, calls = failing(0)
    with caplog.at_level(logging.DEBUG, logger="rollart.aio"):
        assert await retry(fn, retry_on=Flaky, what="x", attempts=3, **FAST) == "ok"
    assert len(calls) == 1
    assert not [r for r in caplog.records if r.name == "rollart.aio"]


async def test_retry_raises_the_last_error_when_the_attempts_are_spent():
    fn, calls = failing(100)
    with pytest.raises(Flaky, match="failure 5"):
        await retry(fn, retry_on=Flaky, what="x", attempts=5, **FAST)
    assert len(calls) == 5


async def test_retry_default_is_returned_and_logged_instead_of_raising(caplog):
    fn, calls = failing(100)
    with caplog.at_level(logging.ERROR, logger="rollart.aio"):
        out = await retry(fn, retry_on=Flaky, what="storing y", attempts=3, default=None, **FAST)
    assert out is None
    assert len(calls) == 3
    assert [r.getMessage() for r in caplog.records if r.levelno == logging.ERROR] == [
        "storing y failed 3 times (failure 3); giving up"]


async def test_retry_deadline_ends_it():
    fn, calls = failing(10**9)  # only the deadline can end this
    with pytest.raises(Flaky):
        await retry(fn, retry_on=Flaky, what="x", deadline=0.05, **FAST)
    assert len(calls) >= 1
    n = len(calls)
    assert await retry(failing(10**9)[0], retry_on=Flaky, what="x", deadline=0.05,
                       default="gave up", **FAST) == "gave up"
    assert len(calls) == n  # nothing runs on after the call returned


async def test_retry_deadline_zero_is_one_try():
    fn, calls = failing(10)
    with pytest.raises(Flaky):
        await retry(fn, retry_on=Flaky, what="x", deadline=0.0)
    assert len(calls) == 1


async def test_retry_whichever_budget_is_spent_first_ends_it():
    fn, calls = failing(100)
    with pytest.raises(Flaky):
        await retry(fn, retry_on=Flaky, what="x", deadline=3600.0, attempts=2, **FAST)
    assert len(calls) == 2


async def test_retry_does_not_retry_other_errors_nor_fatal_ones():
    fn, calls = failing(1, exc=KeyError)
    with pytest.raises(KeyError):
        await retry(fn, retry_on=Flaky, what="x", attempts=5, **FAST)
    assert len(calls) == 1
    fn, calls = failing(1, exc=Permanent)
    errors: list[int] = []
    with pytest.raises(Permanent):
        await retry(fn, retry_on=Flaky, fatal=Permanent, what="x", attempts=5,
                    on_error=lambda e, n: errors.append(n), **FAST)
    assert len(calls) == 1 and errors == []


async def test_retry_quiet_logs_nothing(caplog):
    fn, calls = failing(2)
    with caplog.at_level(logging.DEBUG, logger="rollart.aio"):
        assert await retry(fn, retry_on=Flaky, what="x", attempts=5, quiet=True, **FAST) == "ok"
        assert await retry(failing(9)[0], retry_on=Flaky, what="x", attempts=2, quiet=True,
                           default=0, **FAST) == 0
    assert not [r for r in caplog.records if r.name == "rollart.aio"]


async def test_retry_needs_a_budget():
    with pytest.raises(ValueError):
        await retry(failing(0)[0], retry_on=Flaky, what="x")


async def test_retry_cancelled_while_waiting_stops_retrying():
    fn, calls = failing(10**9)
    task = asyncio.ensure_future(retry(fn, retry_on=Flaky, what="x", deadline=3600.0,
                                       base=3600.0, cap=3600.0))
    while not calls:
        await asyncio.sleep(0)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    assert len(calls) == 1


# -- first_of ----------------------------------------------------------------------------


async def test_first_of_returns_the_winner_and_ends_the_losers():
    started, ended = asyncio.Event(), []

    async def loser():
        started.set()
        try:
            await asyncio.Event().wait()
        finally:
            ended.append("loser")

    async def winner():
        await started.wait()
        return 7

    plain = asyncio.get_running_loop().create_future()
    lose = asyncio.ensure_future(loser())
    win = asyncio.ensure_future(winner())
    done, pending = await first_of(lose, win, plain)
    assert done == {win} and win.result() == 7
    assert pending == {lose, plain}
    assert lose.cancelled() and plain.cancelled()
    assert ended == ["loser"]  # its cleanup ran before first_of returned


async def test_first_of_takes_coroutines_and_reports_an_error_through_the_future():
    async def boom():
        raise Flaky("no")

    done, pending = await first_of(boom(), asyncio.Event().wait())
    (fut,) = done
    with pytest.raises(Flaky):
        fut.result()
    (other,) = pending
    assert other.done() and other.cancelled()


async def test_first_of_asks_again_when_a_loser_swallows_the_cancel():
    started, ended = asyncio.Event(), []

    async def stubborn():
        started.set()
        try:
            await asyncio.Event().wait()
        except asyncio.CancelledError:
            pass  # swallowed once, as wait_for in 3.11 can
        try:
            await asyncio.Event().wait()
        finally:
            ended.append(1)

    async def winner():
        await started.wait()

    s = asyncio.ensure_future(stubborn())
    await first_of(s, winner())
    assert s.done() and ended == [1]


async def test_first_of_an_error_while_cancelling_a_loser_is_not_raised():
    started = asyncio.Event()

    async def messy():
        started.set()
        try:
            await asyncio.Event().wait()
        finally:
            raise RuntimeError("cleanup failed")

    async def winner():
        await started.wait()
        return "w"

    m = asyncio.ensure_future(messy())
    done, _ = await first_of(m, winner())
    assert [f.result() for f in done] == ["w"]
    assert m.done() and isinstance(m.exception(), RuntimeError)


async def test_first_of_cancelled_caller_cancels_and_ends_every_awaitable():
    started, ended = [], []

    async def waiter(i: int):
        started.append(i)
        try:
            await asyncio.Event().wait()
        finally:
            ended.append(i)

    a, b = asyncio.ensure_future(waiter(1)), asyncio.ensure_future(waiter(2))
    outer = asyncio.ensure_future(first_of(a, b))
    while len(started) < 2:
        await asyncio.sleep(0)
    outer.cancel()
    with pytest.raises(asyncio.CancelledError):
        await outer
    assert a.cancelled() and b.cancelled()
    assert sorted(ended) == [1, 2]


async def test_first_of_already_done_returns_at_once():
    f = asyncio.get_running_loop().create_future()
    f.set_result(1)
    other = asyncio.get_running_loop().create_future()
    done, pending = await first_of(f, other)
    assert done == {f} and pending == {other} and other.cancelled()


async def test_first_of_timeout_ends_every_awaitable_and_returns_none_done():
    started, ended = asyncio.Event(), []

    async def waiter():
        started.set()
        try:
            await asyncio.Event().wait()
        finally:
            ended.append("waiter")

    w = asyncio.ensure_future(waiter())
    plain = asyncio.get_running_loop().create_future()
    done, pending = await first_of(w, plain, timeout=0.01)
    assert started.is_set()
    assert done == set() and pending == {w, plain}
    assert w.cancelled() and plain.cancelled()
    assert ended == ["waiter"]  # its cleanup ran before first_of returned


async def test_first_of_timeout_does_not_hide_a_winner_that_comes_in_time():
    done, pending = await first_of(asyncio.sleep(0, "w"), asyncio.Event().wait(), timeout=60)
    assert [f.result() for f in done] == ["w"]
    (other,) = pending
    assert other.cancelled()

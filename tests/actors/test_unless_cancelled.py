"""``unless_cancelled``: a turn's service call raced against its trajectory's cancel event
(one future per turn with :class:`CancelEvent`, ``first_of`` with any other event)."""

from __future__ import annotations

import asyncio

import pytest

from rollart.actors.env.trajectory import (
    CancelEvent,
    Cancelled,
    RunningTrajectories,
    unless_cancelled,
)
from tests.waiting import until


class Call:
    def __init__(self, seconds: float, result: object = "ok", error: Exception | None = None):
        self.seconds, self.result, self.error = seconds, result, error
        self.started = self.ended = False

    async def __call__(self):
        self.started = True
        try:
            await asyncio.sleep(self.seconds)
            if self.error is not None:
                raise self.error
            return self.result
        finally:
            self.ended = True


@pytest.mark.parametrize("event", [CancelEvent, asyncio.Event])
async def test_result_error_and_cancel(event):
    ev = event()
    assert await unless_cancelled(Call(0.01)(), ev) == "ok"
    with pytest.raises(ValueError):
        await unless_cancelled(Call(0.01, error=ValueError("x"))(), ev)
    call = Call(30)
    asyncio.get_running_loop().call_later(0.05, ev.set)
    with pytest.raises(Cancelled):
        await unless_cancelled(call(), ev)
    assert call.started and call.ended  # the call was cancelled and had ended
    if isinstance(ev, CancelEvent):
        assert not ev.watchers


async def test_an_already_cancelled_trajectory_sends_nothing():
    running = RunningTrajectories()
    ev = running.start("t-0", "g", cancelled=True)
    assert isinstance(ev, CancelEvent) and ev.is_set()
    call = Call(30)
    with pytest.raises(Cancelled):
        await unless_cancelled(call(), ev)
    assert not call.started


async def test_cancelling_the_caller_cancels_the_call_first():
    ev = CancelEvent()
    call = Call(30)
    task = asyncio.ensure_future(unless_cancelled(call(), ev))
    await until(lambda: call.started, deadline=30, what="the call to start")
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    assert call.started and call.ended and not ev.watchers


async def test_group_cancel_reaches_the_waiting_turn():
    running = RunningTrajectories()
    keep, stop = running.start("g-0", "g"), running.start("g-1", "g")
    calls = [Call(0.3, result=i) for i in range(2)]
    tasks = [asyncio.ensure_future(unless_cancelled(c(), ev)) for c, ev in zip(calls, (keep, stop))]
    await until(lambda: all(c.started for c in calls), deadline=30, what="both calls to start")
    running.cancel_group("g", keep={"g-0"})
    assert await tasks[0] == 0
    with pytest.raises(Cancelled):
        await tasks[1]

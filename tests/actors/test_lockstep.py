"""Lock-step waves for batch mode: members wait for the slowest, waves never mix."""

from __future__ import annotations

import asyncio

from rollart.actors.env.lockstep import LockStep


async def test_members_wait_for_the_slowest_and_waves_are_separate():
    ls = LockStep()
    order: list[str] = []

    async def member(wave: str, name: str, delay: float, phases: int):
        assert ls.join(wave, 2)
        for p in range(phases):
            await asyncio.sleep(delay)
            await ls.arrive(wave)
            order.append(f"{wave}{name}{p}")
        ls.leave(wave)

    await asyncio.wait_for(asyncio.gather(
        member("a", "fast", 0.0, 2), member("a", "slow", 0.05, 2),
        member("b", "fast", 0.0, 1), member("b", "slow", 0.01, 1)), 5)
    # in wave a, nobody starts phase 1 before both finished phase 0
    assert order.index("afast1") > order.index("aslow0")
    assert {"bfast0", "bslow0"} <= set(order)


async def test_a_member_that_leaves_releases_the_others():
    ls = LockStep()
    assert ls.join("w", 2)
    waiter = asyncio.ensure_future(ls.arrive("w"))
    await asyncio.sleep(0)
    assert not waiter.done()
    ls.leave("w")  # the other member finished its episode
    await asyncio.wait_for(waiter, 1)


async def test_redelivered_member_of_a_finished_wave_runs_alone():
    ls = LockStep()
    assert ls.join("w", 1)
    ls.leave("w")
    assert ls.join("w", 1) is False

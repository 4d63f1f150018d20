"""The emulated wide-area link (``rollart.emulate.link``): the delay relay delays and paces
what crosses it as asked (measured here within a tolerance: a floor the relay can never beat,
a generous ceiling for a loaded machine), and its arithmetic for a scaled link."""

from __future__ import annotations

import asyncio
import time

import pytest

from rollart.emulate.engine import EmulatedEngine
from rollart.emulate.link import ByteSource, DelayRelay, fetch_bytes, scaled_link

DEADLINE = 30.0
"""A bound on a hang, not a measurement."""


async def _fetch(port: int, n: int) -> float:
    return await asyncio.wait_for(fetch_bytes("127.0.0.1", port, n), DEADLINE)


async def test_the_relay_adds_its_one_way_delay_each_way():
    async with ByteSource() as src, DelayRelay(("127.0.0.1", src.port), delay_s=0.05) as relay:
        direct = min([await _fetch(src.port, 1) for _ in range(3)])
        delayed = min([await _fetch(relay.port, 1) for _ in range(3)])
    # request out, answer back: one round trip of 0.1 s on top of the direct fetch
    assert 0.1 <= delayed - direct + 0.002 and delayed <= 0.1 + direct + 0.15, (direct, delayed)


async def test_the_relay_paces_to_its_rate_and_connections_share_it():
    rate, n = 4e6, 2_000_000  # 0.5 s of link for one fetch
    async with ByteSource() as src, DelayRelay(("127.0.0.1", src.port), delay_s=0.01,
                                               rate=rate) as relay:
        one = await _fetch(relay.port, n)
        t0 = time.perf_counter()
        await asyncio.gather(_fetch(relay.port, n // 2), _fetch(relay.port, n // 2))
        two = time.perf_counter() - t0
        assert relay.down.bytes >= 2 * n
    floor = n / rate + 0.02
    assert floor * 0.97 <= one <= floor * 1.6, one
    assert floor * 0.97 <= two <= floor * 1.6, two  # one link: two halves take as long


def test_scaled_link_keeps_the_modelled_transfer_time():
    delay, rate = scaled_link(10, 0.02, time_scale=0.04, byte_scale=1 / 2048)
    assert delay == pytest.approx(0.01 * 0.04)
    model_bytes = 16e9
    wall = model_bytes / 2048 / rate
    assert wall == pytest.approx(model_bytes * 8 / 10e9 * 0.04)  # 12.8 modelled s, x0.04
    with pytest.raises(ValueError):
        scaled_link(0, 0.02, time_scale=1, byte_scale=1)


async def test_an_engine_awaits_its_before_load_hook_inside_the_load():
    e = EmulatedEngine(time_scale=0.001, model_gb=0.0)
    seen = []

    async def hook(v):
        seen.append((v, e.version))

    e.before_load = hook
    await e.load_weights(b"", 3)
    assert seen == [(3, 0)] and e.version == 3


async def test_a_fetch_dropped_midway_leaves_the_relay_serving():
    async with ByteSource() as src, DelayRelay(("127.0.0.1", src.port), delay_s=0.001,
                                               rate=2e6) as relay:
        task = asyncio.ensure_future(fetch_bytes("127.0.0.1", relay.port, 4_000_000))
        deadline = time.monotonic() + DEADLINE
        while relay.down.bytes < 200_000:  # some of it is on the way
            assert time.monotonic() < deadline, "no bytes crossed the relay"
            await asyncio.sleep(0.01)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        assert await _fetch(relay.port, 1000) < DEADLINE

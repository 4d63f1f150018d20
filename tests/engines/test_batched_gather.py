"""BatchedEngine's adaptive gather and its occupancy statistics, on the real tiny torch engine.

A batch keeps gathering while requests keep arriving (each within ``gather_s`` of the last),
up to ``gather_max_s``; a lone request is cut after the quiet gap ``gather_s`` only.
"""

from __future__ import annotations

import asyncio

import pytest

from rollart.engines.base import GenInput
from rollart.engines.batched import BatchedEngine
from tests.waiting import until

pytestmark = pytest.mark.asyncio


def _inp(n: int) -> GenInput:
    return GenInput(prompt_ids=[5 + (n % 7), 9, 11], max_new_tokens=1, greedy=True)


async def test_a_stream_of_requests_shares_one_call(engine):
    """20 requests 20 ms apart (quiet gap 250 ms, window 30 s): one or two engine calls, where
    a fixed window of one quiet gap from the first request would cut after ~12 of them. (The
    gap is 12x the spacing, so a loaded machine that stretches a sleep does not split it.)"""
    be = BatchedEngine(engine, gather_s=0.25, gather_max_s=30.0, owns=False)
    await be.start()
    try:
        tasks = []
        for i in range(20):
            tasks.append(asyncio.ensure_future(be.generate(_inp(i), f"r{i}")))
            await asyncio.sleep(0.02)
        outs = await asyncio.gather(*tasks)
        assert all(len(o.token_ids) == 1 for o in outs)
        assert be.batches <= 2, be.sizes
        assert max(be.sizes) >= 15, be.sizes
        st = be.stats()
        assert st["batches"] == be.batches and st["rows"] == 20
        assert st["mean_rows"] == pytest.approx(20 / be.batches)
        assert st["busy_s"] > 0
    finally:
        await be.close()


async def test_the_rows_of_a_round_come_back_into_one_call(engine):
    """After a call of 8 rows, their next turns arrive 10 ms apart (longer than the 2 ms
    quiet gap, as a bus round trip plus an env step is): still one call, not eight. (They
    may be up to a quarter of the window apart: 2 s here, 200 times the gap they keep.)"""
    be = BatchedEngine(engine, gather_s=0.002, gather_max_s=8.0, owns=False)
    await be.start()
    try:
        await asyncio.gather(*(be.generate(_inp(i), f"a{i}") for i in range(8)))
        assert be.sizes == [8]
        tasks = []
        for i in range(8):
            tasks.append(asyncio.ensure_future(be.generate(_inp(i), f"b{i}")))
            await asyncio.sleep(0.01)
        await asyncio.gather(*tasks)
        assert be.sizes[1:] == [8], be.sizes
    finally:
        await be.close()


async def test_a_lone_request_waits_only_the_quiet_gap(engine):
    # a window of an hour: a lone request that waited for it would never come back
    be = BatchedEngine(engine, gather_s=0.01, gather_max_s=3600.0, owns=False)
    await be.start()
    try:
        await be.generate(_inp(0), "warm")
        await asyncio.wait_for(be.generate(_inp(1), "lone"), 60)
        assert be.sizes == [1, 1]
    finally:
        await be.close()


async def test_the_window_caps_the_gather(engine):
    """Requests arriving without pause forever: each call is cut by gather_max_s."""
    be = BatchedEngine(engine, gather_s=0.05, gather_max_s=0.1, owns=False)
    await be.start()
    stop = asyncio.Event()
    tasks: list[asyncio.Future] = []

    async def feed() -> None:
        i = 0
        while not stop.is_set():
            tasks.append(asyncio.ensure_future(be.generate(_inp(i), f"s{i}")))
            i += 1
            await asyncio.sleep(0.005)

    try:
        feeder = asyncio.ensure_future(feed())
        try:
            await until(lambda: be.batches >= 3, deadline=60, step=0.01,
                        what="three batches (the gather ends though requests keep arriving)")
        finally:
            stop.set()
        await feeder
        await asyncio.gather(*tasks)
        st = be.stats()
        assert len(be.waiting_sizes) == be.batches
        assert st["mean_waiting"] == pytest.approx(sum(be.waiting_sizes) / be.batches)
        assert be.waited == sum(be.waiting_sizes)
    finally:
        await be.close()


async def test_bad_windows_are_refused(engine):
    with pytest.raises(ValueError, match="gather_max_s"):
        BatchedEngine(engine, gather_s=0.01, gather_max_s=-1, owns=False)


async def test_torch_engine_args_reach_the_engine(tiny_model_dir):
    from rollart.engines import build_engine

    be = build_engine("torch", str(tiny_model_dir),
                      engine_args={"kv_cache_mb": 0, "gather_max_ms": 30})
    await be.start()
    try:
        assert be.gather_max_s == pytest.approx(0.03)
        out = await be.generate(GenInput(prompt_ids=[5, 9], max_new_tokens=1, session="t-0"), "x")
        assert len(out.token_ids) == 1
        assert be.engine.kv_stats()["hits"] == 0 and be.engine.kv_stats()["bytes"] == 0
    finally:
        await be.close()
    with pytest.raises(ValueError, match=r"proxy\.engine_args\.kv_cache: not an argument"):
        build_engine("torch", str(tiny_model_dir), engine_args={"kv_cache": 1})
    with pytest.raises(ValueError, match="gather_max_ms"):
        build_engine("torch", str(tiny_model_dir), engine_args={"gather_max_ms": -1})

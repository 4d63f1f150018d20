"""Nothing blocks the event loop: a short training (asyncio debug mode on) runs no
callback that keeps the loop's thread busy for more than 0.1 s of CPU time (files,
hashing, scorers and model work go to threads).

CPU time of the loop thread, not wall time: on a loaded 2-core machine a callback can be
descheduled or wait for the GIL for longer than that without doing any work itself; what
this test guards against is work done *on* the loop.
"""

from __future__ import annotations

import asyncio
import gc
import time

import pytest

from rollart.app.run import train
from rollart.config import RunConfig, convert
from rollart.app.launch import with_overrides

pytestmark = pytest.mark.slow


def describe(handle) -> str:
    """The task a callback ran (its name and where it now waits), else the callback."""
    task = getattr(handle._callback, "__self__", None)
    if isinstance(task, asyncio.Task):
        frames, coro = [], task.get_coro()
        while coro is not None and len(frames) < 12:  # follow the await chain inwards
            f = getattr(coro, "cr_frame", None) or getattr(coro, "gi_frame", None)
            if f is not None:
                frames.append(f"{f.f_code.co_filename.rsplit('/', 2)[-1]}:{f.f_lineno} {f.f_code.co_name}")
            coro = getattr(coro, "cr_await", None) or getattr(coro, "gi_yieldfrom", None)
        return f"task {task.get_name()} now at {' > '.join(frames)}"
    return repr(handle)[:400]


class CallbackMeter:
    """Wraps ``asyncio.Handle._run`` to measure each callback's thread CPU time."""

    def __init__(self, limit: float):
        self.limit = limit
        self.slow: list[tuple[float, str]] = []
        self._orig = asyncio.events.Handle._run

    def __enter__(self) -> "CallbackMeter":
        meter, orig = self, self._orig

        def run(handle):
            t0 = time.thread_time()
            try:
                return orig(handle)
            finally:
                dt = time.thread_time() - t0
                if dt > meter.limit:
                    meter.slow.append((dt, describe(handle)))

        asyncio.events.Handle._run = run
        return self

    def __exit__(self, *exc) -> None:
        asyncio.events.Handle._run = self._orig


@pytest.mark.parametrize("bus", ["memory", "nats"])
async def test_training_never_blocks_the_loop(tmp_path, tiny_model, bus, request):
    nats = "memory" if bus == "memory" else request.getfixturevalue("nats_server").url
    cfg = convert({"run": f"loop-{bus}", "run_dir": str(tmp_path / "runs"),
                   "model": {"path": str(tiny_model)},
                   "envs": {"main": {"type": "frozenlake", "max_turns": 4}},
                   "rollout": {"group_size": 4, "batch_groups": 2, "alpha": 1},
                   "trainer": {"steps": 3, "eval_groups": 1}}, RunConfig)
    # a first short run imports every lazily imported module (a one-off cost at start)
    # every role in this process (not node.local_processes' children): it is this loop that
    # is measured
    await train(with_overrides(cfg, run=f"warm-{bus}", trainer={"steps": 1}), nats=nats,
                resume=False, quiet=True, single_process=True)
    # objects of earlier tests are not this run's: a full collection scanning them would
    # show up as a pause in whichever callback triggers it
    gc.collect()
    gc.freeze()
    loop = asyncio.get_running_loop()
    debug = loop.get_debug()
    loop.set_debug(True)
    try:
        with CallbackMeter(0.1) as meter:
            summary = await train(cfg, nats=nats, resume=False, quiet=True, single_process=True)
    finally:
        loop.set_debug(debug)
        gc.unfreeze()
    assert summary["steps"] == 3
    assert not meter.slow, "\n".join(f"{dt:.3f}s CPU: {what}" for dt, what in meter.slow[:10])

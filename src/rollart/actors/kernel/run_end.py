"""The end of a run, as a record in the run's KV bucket (:data:`rollart.messages.RUN_END_KEY`).

The trainer writes ``stage="trained"`` after its last step (schedulers stop admitting); the
host of the trainer writes ``stage="ended"`` once the final evaluation and ``summary.json``
are done (nodes of the run drain and exit). A watcher acts only on records written after
it started watching, so a record left by an earlier process of the same run (a resumed
run, a restarted head) is never taken for the end of this one. The host of the trainer
writes ``stage="running"`` as it starts; a node that starts while the record says
``ended`` (the run is over, and no head has started it again) exits at once.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator
from typing import Any

from rollart import messages as m
from rollart.actors.kernel.records import put_record, watch_record
from rollart.bus import BusError
from rollart.bus.codec import DecodeError, decode

log = logging.getLogger(__name__)


async def put_run_end(bus: Any, run: str, rec: m.RunEnd, *, attempts: int = 8) -> bool:
    """Store ``rec``; retried a few times, then logged (never raised)."""
    try:
        await put_record(bus, run, m.RUN_END_KEY, rec, what=f"storing the end of run {run}",
                         attempts=attempts, base=0.1, cap=2.0, logger=log)
        return True
    except BusError as e:
        log.error("could not store the end of run %s (%s): its nodes keep running", run, e)
        return False


async def mark_running(bus: Any, run: str) -> bool:
    """The host of the trainer starts (a new run or a continued one): the record says
    ``running``, so nodes that start now do not take an earlier end for this run's."""
    return await put_run_end(bus, run, m.RunEnd(stage="running", ts=time.time()))


async def ended_already(bus: Any, run: str) -> m.RunEnd | None:
    """The run's end record when it says the run has ended (``stage="ended"``), else None
    (none yet, running, or a record that does not decode)."""
    try:
        kv = await bus.key_value(m.kv_bucket(run))
        e = await kv.get(m.RUN_END_KEY)
    except BusError as err:
        log.warning("cannot read the end-of-run record of %s (%s)", run, err)
        return None
    if e is None or not e.value:
        return None
    try:
        rec = decode(m.RunEnd, e.value)
    except DecodeError:
        return None
    return rec if rec.stage == "ended" else None


async def watch_run_end(bus: Any, run: str) -> AsyncIterator[m.RunEnd]:
    """Each :class:`RunEnd` record written after this call (older ones are skipped)."""
    async for rec in watch_record(bus, run, m.RUN_END_KEY, m.RunEnd,
                                  what="end-of-run record", only_new=True):
        yield rec


async def wait_run_end(bus: Any, run: str, stages: tuple[str, ...] = ("ended",)) -> m.RunEnd:
    """The first new :class:`RunEnd` record whose stage is in ``stages``. A watch that
    fails (the server is away) is started again, with one warning."""
    warned, delay = False, 0.5
    while True:
        try:
            async for rec in watch_run_end(bus, run):
                if rec.stage in stages:
                    return rec
            await asyncio.Event().wait()  # the watch ended (the bus closed): never an end
        except BusError as e:
            if not warned:
                log.warning("cannot watch for the end of run %s (%s); retrying", run, e)
                warned = True
            await asyncio.sleep(delay)
            delay = min(delay * 2, 10.0)

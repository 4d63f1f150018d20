"""The trainer's checkpoint in the run's object store (``trainer.checkpoint_store: object``).

The checkpoint file (``checkpoints/latest.pt``) and the metrics record (``metrics.jsonl``) are
put as the objects :data:`CHECKPOINT` and :data:`METRICS` of the run's bucket
(:func:`rollart.messages.object_bucket`) after every checkpoint, before the deliveries it
covers are acked: what the store holds is never behind what the stream forgot. A head node
whose run folder has no checkpoint (another host took over) fetches both into its folder
(:func:`fetch_checkpoint`) and resumes from them as from its own.
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any

from rollart import messages as m
from rollart.aio import retry
from rollart.bus import BusError

log = logging.getLogger("rollart.actors.trainer")

CHECKPOINT = "checkpoint-latest"
METRICS = "checkpoint-metrics"
PUT_DEADLINE_S = 300.0
"""Seconds a checkpoint put is retried through bus errors before the trainer gives up."""


async def put_checkpoint(bus: Any, run: str, files: Any, *, what: str = "trainer") -> int:
    """Put the checkpoint and the metrics record of ``files`` (a
    :class:`rollart.actors.trainer_files.RunFiles`) in the run's object store; returns the
    bytes put. Bus errors are retried up to :data:`PUT_DEADLINE_S`, then raised."""
    data = await asyncio.to_thread(files.checkpoint.read_bytes)
    rows = await asyncio.to_thread(
        lambda: files.metrics.read_bytes() if files.metrics.exists() else b"")

    async def put() -> None:
        store = await bus.object_store(m.object_bucket(run))
        await store.put(METRICS, rows)  # first: a checkpoint never lacks the rows it holds
        await store.put(CHECKPOINT, data)

    await retry(put, retry_on=BusError, what=f"{what}: putting the checkpoint in the object store",
                deadline=PUT_DEADLINE_S, base=0.2, cap=5.0, logger=log)
    return len(data) + len(rows)


async def fetch_checkpoint(bus: Any, run: str, files: Any) -> bool:
    """Write the checkpoint and metrics record held in the run's object store as the files of
    ``files`` (a :class:`rollart.actors.trainer_files.RunFiles`) unless it has a checkpoint
    already; True when one was fetched, False when the store holds none."""
    if files.checkpoint.exists():
        return False
    store = await bus.object_store(m.object_bucket(run))
    try:
        data = await store.get(CHECKPOINT)
    except KeyError:
        return False
    try:
        rows = await store.get(METRICS)
    except KeyError:
        rows = b""

    def write() -> None:
        files.make()
        tmp = files.checkpoint.with_suffix(".tmp")
        tmp.write_bytes(data)
        files.metrics.write_bytes(rows)
        tmp.replace(files.checkpoint)

    await asyncio.to_thread(write)
    return True

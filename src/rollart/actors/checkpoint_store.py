"""The trainer's checkpoint in the run's object store (``trainer.checkpoint_store: object``).

Every file of the checkpoint (:class:`rollart.actors.trainer_files.RunFiles`) is an object of
the run's bucket (:func:`rollart.messages.object_bucket`): the journal's step records
(:data:`JOURNAL` + sequence number), the metrics record (:data:`METRICS`) and the durable
state (:data:`STATE`) are put at every checkpoint, in that order, before the deliveries it
covers are acked (:func:`put_state`), so what the store holds is never behind what the stream
forgot; the full checkpoint (:data:`CHECKPOINT`) is put after each one is written, in the
background (:func:`put_full`), and the records it makes useless are deleted then
(:func:`delete_journal`). A head node whose run folder has no checkpoint (another host took
over) fetches them into its folder (:func:`fetch_checkpoint`) and resumes from them as from
its own.
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
STATE = "checkpoint-state"
JOURNAL = "checkpoint-journal-"
PUT_DEADLINE_S = 300.0
"""Seconds a checkpoint put is retried through bus errors before the trainer gives up."""


def journal_name(seq: int) -> str:
    return f"{JOURNAL}{seq:08d}"


async def _put(bus: Any, run: str, objects: list[tuple[str, bytes]], what: str) -> None:
    async def put() -> None:
        store = await bus.object_store(m.object_bucket(run))
        for name, data in objects:  # in order: the state last, once what it counts is there
            await store.put(name, data)

    await retry(put, retry_on=BusError, what=f"{what}: putting the checkpoint in the object store",
                deadline=PUT_DEADLINE_S, base=0.2, cap=5.0, logger=log)


async def put_state(bus: Any, run: str, files: Any, seqs: list[int], *, what: str = "trainer") -> int:
    """Put the journal records ``seqs``, the metrics record and the durable state of ``files``
    (a :class:`rollart.actors.trainer_files.RunFiles`) in the run's object store; returns the
    bytes put. Bus errors are retried up to :data:`PUT_DEADLINE_S`, then raised."""
    def read() -> list[tuple[str, bytes]]:
        objs = [(journal_name(s), files.read_journal(s)) for s in seqs]
        objs.append((METRICS, files.metrics.read_bytes() if files.metrics.exists() else b""))
        return objs + [(STATE, files.state.read_bytes())]

    objects = await asyncio.to_thread(read)
    await _put(bus, run, objects, what)
    return sum(len(d) for _, d in objects)


async def put_full(bus: Any, run: str, files: Any, *, what: str = "trainer") -> int:
    """Put the full checkpoint file of ``files`` in the run's object store; returns its bytes."""
    data = await asyncio.to_thread(files.checkpoint.read_bytes)
    await _put(bus, run, [(CHECKPOINT, data)], what)
    return len(data)


async def delete_journal(bus: Any, run: str, seqs: list[int]) -> None:
    """Delete the journal records ``seqs`` (a full checkpoint in the store holds them). A
    failure is logged, not raised: a record left behind costs space, never correctness (a
    resume reads only the records after its full checkpoint)."""
    try:
        store = await bus.object_store(m.object_bucket(run))
        for s in seqs:
            await store.delete(journal_name(s))
    except (BusError, KeyError) as e:
        log.warning("could not delete old journal records from the object store: %s", e)


async def _get(store: Any, name: str) -> bytes | None:
    try:
        return await store.get(name)
    except KeyError:
        return None


async def fetch_checkpoint(bus: Any, run: str, files: Any) -> bool:
    """Write the checkpoint held in the run's object store (full checkpoint, durable state,
    journal records, metrics record) as the files of ``files`` (a
    :class:`rollart.actors.trainer_files.RunFiles`) unless it has a checkpoint already; True
    when one was fetched, False when the store holds none."""
    if files.has_checkpoint():
        return False
    store = await bus.object_store(m.object_bucket(run))
    full = await _get(store, CHECKPOINT)
    state = await _get(store, STATE)
    if full is None and state is None:
        return False
    rows = await _get(store, METRICS) or b""
    records: dict[int, bytes] = {}
    if state is not None:
        import json

        s = json.loads(state)
        for seq in range(int(s.get("journal_from", 1)), int(s["seq"]) + 1):
            data = await _get(store, journal_name(seq))  # gone: a full checkpoint holds it
            if data is not None:
                records[seq] = data

    def write() -> None:
        from rollart.actors.trainer_files import write_atomic

        files.make()
        if full is not None:
            write_atomic(files.checkpoint, full)
        for seq, data in records.items():
            files.write_journal(seq, data)
        files.metrics.write_bytes(rows)
        if state is not None:  # last: a folder with a state has what the state counts
            write_atomic(files.state, state)

    await asyncio.to_thread(write)
    return True

"""The trainer's checkpoint in the run's object store (``trainer.checkpoint_store: object``).

Every file of the checkpoint (:class:`rollart.actors.trainer.files.RunFiles`) is an object of
the run's bucket (:func:`rollart.messages.object_bucket`): the journal's step records
(:data:`JOURNAL` + sequence number), the metrics record (:data:`METRICS`) and the durable
state (:data:`STATE`) are put at every checkpoint, in that order, before the deliveries it
covers are acked (:func:`put_state`), so what the store holds is never behind what the stream
forgot; each full checkpoint (:data:`FULL` + its step) is put after it is written, in the
background (:func:`put_full`), then the state naming it, and only then are the previous one
and the records it makes useless deleted (:func:`delete_full`, :func:`delete_journal`). A
head node whose run folder has no checkpoint (another host took over) fetches them into its
folder (:func:`fetch_checkpoint`) and resumes from them as from its own.

Whoever can write the run's bucket could write these objects (with access control only the
trainer's credential and admin; on an open server any local process), so a fetch trusts
nothing it reads: the state is parsed into a validated head (sizes, hex digests, step range)
before any name is built from it, the full checkpoint and each journal record are written to
the folder only when their bytes are the size and SHA-256 the state records (a state of
format 2, from before the record digests, has its records fetched unchecked with a warning),
and the full checkpoint is a safetensors file with a msgspec record
(:mod:`rollart.engines.checkpoint_codec`), so even a consistent forgery of state and
checkpoint chooses data, never code. A store holding only an old pickle
checkpoint (:data:`CHECKPOINT`) is refused.
"""

from __future__ import annotations

import asyncio
import hashlib
import logging
from typing import Any

from rollart import messages as m
from rollart.actors.trainer.files import (
    MAX_STATE_BYTES,
    FullRef,
    RunFiles,
    check_record,
    parse_state,
    unchecked_warning,
    write_atomic,
)
from rollart.aio import retry
from rollart.bus import BusError, ObjectTooLarge
from rollart.engines.checkpoint_codec import CheckpointRefused

log = logging.getLogger(__name__)

CHECKPOINT = "checkpoint-latest"
"""The full checkpoint of older versions (a pickle): never fetched, only named in a refusal."""
FULL = "checkpoint-full-"
METRICS = "checkpoint-metrics"
STATE = "checkpoint-state"
JOURNAL = "checkpoint-journal-"
PUT_DEADLINE_S = 300.0
"""Seconds a checkpoint put is retried through bus errors before the trainer gives up."""


def journal_name(seq: int) -> str:
    return f"{JOURNAL}{int(seq):08d}"


def full_name(seq: int) -> str:
    return f"{FULL}{int(seq):08d}"


async def _put(bus: Any, run: str, objects: list[tuple[str, bytes]], what: str) -> None:
    async def put() -> None:
        store = await bus.object_store(m.object_bucket(run))
        for name, data in objects:  # in order: the state last, once what it counts is there
            await store.put(name, data)

    await retry(put, retry_on=BusError, what=f"{what}: putting the checkpoint in the object store",
                deadline=PUT_DEADLINE_S, base=0.2, cap=5.0, logger=log)


async def put_state(bus: Any, run: str, files: Any, seqs: list[int], *, what: str = "trainer") -> int:
    """Put the journal records ``seqs``, the metrics record and the durable state of ``files``
    (a :class:`rollart.actors.trainer.files.RunFiles`) in the run's object store; returns the
    bytes put. Bus errors are retried up to :data:`PUT_DEADLINE_S`, then raised."""
    def read() -> list[tuple[str, bytes]]:
        objs = [(journal_name(s), files.read_journal(s)) for s in seqs]
        objs.append((METRICS, files.metrics.read_bytes() if files.metrics.exists() else b""))
        return objs + [(STATE, files.state.read_bytes())]

    objects = await asyncio.to_thread(read)
    await _put(bus, run, objects, what)
    return sum(len(d) for _, d in objects)


async def put_full(bus: Any, run: str, files: Any, ref: FullRef, *, what: str = "trainer") -> int:
    """Put the full checkpoint file ``ref`` of ``files`` in the run's object store (under a
    name of its own: the state in the store names the previous one until it is put again);
    returns its bytes."""
    data = await asyncio.to_thread(files.full_path(ref.seq).read_bytes)
    await _put(bus, run, [(full_name(ref.seq), data)], what)
    return len(data)


async def delete_full(bus: Any, run: str, seq: int) -> None:
    """Delete the full checkpoint of step ``seq`` (the state in the store names a newer one).
    A failure is logged, not raised: it costs space, never correctness."""
    try:
        store = await bus.object_store(m.object_bucket(run))
        await store.delete(full_name(seq))
    except (BusError, KeyError) as e:
        log.warning("could not delete an old full checkpoint from the object store: %s", e)


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


MAX_RECORD_BYTES = 1 << 30
"""Bytes a journal record or the metrics record fetched from the store may have (a step's
trajectories: megabytes)."""


async def _get(store: Any, name: str, max_bytes: int = MAX_RECORD_BYTES) -> bytes | None:
    """The object ``name`` (None: there is none), refused before it is read past ``max_bytes``."""
    try:
        return await store.get(name, max_bytes=max_bytes)
    except KeyError:
        return None
    except ObjectTooLarge as e:
        raise CheckpointRefused(f"object {name} of the run's object store: {e}") from None


async def fetch_checkpoint(bus: Any, run: str, files: RunFiles) -> bool:
    """Write the checkpoint held in the run's object store (full checkpoint, durable state,
    journal records, metrics record) as the files of ``files`` unless it has a checkpoint
    already; True when one was fetched, False when the store holds none. A state that does
    not validate, a full checkpoint or a journal record whose bytes are not the ones the
    state records, a missing record or an old pickle checkpoint raise
    :class:`CheckpointRefused` before anything is written."""
    if files.has_checkpoint():
        return False
    store = await bus.object_store(m.object_bucket(run))
    where = f"object {STATE} of the run's object store"
    raw = await _get(store, STATE, MAX_STATE_BYTES)
    if raw is None:
        if await store.exists(CHECKPOINT):
            raise legacy_refusal_store(run)
        return False
    _, head = parse_state(raw, where)  # bounded and validated before any name is built
    if head.full is None and head.journal_from > 1:
        raise legacy_refusal_store(run)
    full = None
    if head.full is not None:
        full = await _get(store, full_name(head.full.seq), head.full.bytes)
        if full is None:
            raise CheckpointRefused(f"{where} names the full checkpoint of step "
                                    f"{head.full.seq}, which the store does not hold")
        if len(full) != head.full.bytes or \
                await asyncio.to_thread(lambda: hashlib.sha256(full).hexdigest()) != head.full.sha256:
            raise CheckpointRefused(f"object {full_name(head.full.seq)}: {len(full)} bytes whose "
                                    f"SHA-256 is not the one {where} records")
    rows = await _get(store, METRICS) or b""
    unchecked_warning(head, where)
    records: dict[int, bytes] = {}
    for seq in range(head.journal_from, head.seq + 1):  # each one is there: put before the state
        data = await _get(store, journal_name(seq))
        if data is None:
            raise CheckpointRefused(f"{where} counts step {seq}, whose record "
                                    f"{journal_name(seq)} the store does not hold")
        check_record(head, seq, data, f"object {journal_name(seq)}")
        records[seq] = data

    def write() -> None:
        files.make()
        if full is not None:
            files.write_full(head.full, full)
        for seq, data in records.items():
            files.write_journal(seq, data)
        write_atomic(files.metrics, rows)
        write_atomic(files.state, raw)  # last: a folder with a state has what the state counts

    await asyncio.to_thread(write)
    return True


def legacy_refusal_store(run: str) -> CheckpointRefused:
    return CheckpointRefused(
        f"the object store of run {run!r} holds a full checkpoint in the old pickle format "
        f"({CHECKPOINT}), which is never loaded: unpickling runs code the object names. Resume "
        f"on the host whose run folder holds the checkpoint and convert it there "
        f"(`python -m rollart.actors.trainer.files <run folder>`), or start a new run")

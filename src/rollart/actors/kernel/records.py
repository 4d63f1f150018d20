"""Typed records in a run's KV bucket (policy version, ledger summary, end of run, counts):
one way to store them (:func:`put_record`, retried) and one way to watch them, so a malformed
record is skipped the same way everywhere."""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator
from typing import Any, TypeVar

from rollart import messages as m
from rollart.aio import retry
from rollart.bus import BusError
from rollart.bus.codec import DecodeError, decode, encode

log = logging.getLogger(__name__)

T = TypeVar("T")


async def put_record(store: Any, run: str, key: str, value: Any, *, what: str,
                     deadline: float | None = None, attempts: int | None = None,
                     base: float = 0.1, cap: float = 5.0, logger: logging.Logger | None = None) -> int:
    """Store ``value`` (a message, encoded; or bytes as they are) under ``key`` in the run's
    KV bucket, retrying bus errors (:func:`rollart.aio.retry`) for ``deadline`` seconds
    and/or ``attempts`` puts; ``what`` names it in the log lines. ``store`` is the bus (the
    bucket is opened inside the retry) or the bucket itself. Returns the new revision; the
    last :class:`BusError` is raised when the budget is spent."""
    data = value if isinstance(value, bytes) else encode(value)

    async def put() -> int:
        kv = await store.key_value(m.kv_bucket(run)) if hasattr(store, "key_value") else store
        return await kv.put(key, data)

    return await retry(put, retry_on=BusError, what=what, deadline=deadline, attempts=attempts,
                       base=base, cap=cap, logger=logger or log)


async def watch_record(bus: Any, run: str, key: str, typ: type[T], *, what: str,
                       validate: bool = False, only_new: bool = False) -> AsyncIterator[T]:
    """The current record of ``key`` (unless ``only_new``: only those written after this
    call), then each new one, decoded as ``typ``; deleted and malformed records (undecodable,
    or invalid with ``validate``) are skipped with an error naming ``what``."""
    async for _, rec in watch_revisions(bus, run, key, typ, what=what, validate=validate,
                                        only_new=only_new):
        yield rec


async def watch_revisions(bus: Any, run: str, key: str, typ: type[T], *, what: str,
                          validate: bool = False,
                          only_new: bool = False) -> AsyncIterator[tuple[int, T]]:
    """:func:`watch_record`, each record with its KV revision (a re-put of identical bytes
    is a new revision: a new announcement)."""
    kv = await bus.key_value(m.kv_bucket(run))
    seen = 0
    if only_new:
        e = await kv.get(key)
        seen = e.revision if e is not None else 0
    async for e in kv.watch(key):
        if e.deleted or not e.value or (only_new and e.revision <= seen):
            continue
        seen = e.revision
        try:
            rec = decode(typ, e.value)
            if validate:
                m.validate(rec)
        except (DecodeError, m.Invalid) as err:
            log.error("ignoring a malformed %s: %s", what, err)
            continue
        yield e.revision, rec


def decode_entry(entry: Any, typ: type[T], *, validate: bool = True) -> T | None:
    """The record of a KV entry (from ``kv.get``), or None when it is absent, deleted or
    malformed (never raises)."""
    if entry is None or entry.deleted or not entry.value:
        return None
    try:
        rec = decode(typ, entry.value)
        if validate:
            m.validate(rec)
        return rec
    except (DecodeError, m.Invalid):
        return None

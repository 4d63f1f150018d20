"""Replica side of :mod:`rollart.actors.kernel.service_client`: a replica of a stateless
service lists the request ids it holds on ``service.progress`` about once a second, so that a
requester sends again at once what a replica that went silent held (instead of waiting out
its timeout), and knows which replicas are live for affinity.

An actor that keeps a :class:`ProgressReporter` as its ``progress`` attribute (for the subject
it serves) and runs ``await self.progress.run()`` in its ``main`` has every request listed by
the runtime's ``Service`` from arrival (queued included) until the reply. One small message
per replica per second.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import re
import uuid
from collections.abc import Iterator

from rollart import messages as m
from rollart.actors.kernel.base import Actor
from rollart.bus import BusError

__all__ = ["ProgressReporter"]

log = logging.getLogger(__name__)


class ProgressReporter:
    """Replica side: publish the request ids this replica holds, every ``every`` seconds.

    The replica's id in reports is its actor name plus a random suffix, so that two
    processes with the same actor name are told apart; ``token`` is the same as a subject
    token (its per-replica subject's), announced as ``direct`` once the runtime's
    ``Service`` answers there.
    """

    def __init__(self, actor: Actor, service: str, *, pool: str | None = None,
                 every: float = 1.0) -> None:
        self.actor, self.service, self.every = actor, service, every
        self.pool = pool or actor.pool
        suffix = uuid.uuid4().hex[:6]
        self.replica = f"{actor.name}@{suffix}"
        self.token = f"{re.sub(r'[^A-Za-z0-9_-]', '_', actor.name)[:100]}-{suffix}"
        self.direct = ""
        """The token announced in reports (set by the runtime's ``Service``); empty: none."""
        self.held: dict[str, int] = {}

    @contextlib.contextmanager
    def hold(self, request_id: str) -> Iterator[None]:
        """List ``request_id`` in reports while the block runs."""
        if not request_id:
            yield
            return
        self.held[request_id] = self.held.get(request_id, 0) + 1
        try:
            yield
        finally:
            n = self.held.pop(request_id, 1) - 1
            if n > 0:
                self.held[request_id] = n

    async def run(self) -> None:
        while True:
            await self.report()
            await asyncio.sleep(self.every)

    async def report(self) -> None:
        msg = m.ServiceProgress(service=self.service, replica=self.replica, pool=self.pool,
                                request_ids=list(self.held), every=self.every,
                                direct=self.direct)
        try:
            await self.actor.publish("service.progress", msg)
        except BusError as e:
            log.debug("%s: progress report failed: %s", self.actor.name, e)

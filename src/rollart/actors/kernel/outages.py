"""The waits of one :class:`~rollart.actors.kernel.service_client.ServiceClient`: which
requests of each (service, pool) wait for a replica to answer, since when and why, and the
log lines that say so: one after :data:`ANNOUNCE_AFTER` seconds, a reminder every
:data:`REMIND_EVERY`, and one when the pool answers again (never a line per retry).

Plain bookkeeping: no I/O but the log, no clock of its own (the client passes ``now``).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass

__all__ = ["ANNOUNCE_AFTER", "REMIND_EVERY", "Outages", "service_of"]

log = logging.getLogger(__name__)

ANNOUNCE_AFTER = 1.0
"""Seconds requests of a pool wait before a log line says so."""
REMIND_EVERY = 30.0
"""Seconds between reminders while they still wait."""


def service_of(name: str) -> str:
    """The service of a request subject name (``generate`` of ``generate.request``)."""
    return name.split(".", 1)[0]


@dataclass(eq=False)
class _Outage:
    """The requests of one (service, pool) that wait for a replica to answer."""

    since: float
    waiting: int = 0
    why: str = ""
    announced: float = 0.0


class Outages:
    """The (service, pool) keys whose requests wait, for the actor named ``who`` whose
    requests give up after ``wait`` seconds; ``count("service_waits")`` per wait begun."""

    def __init__(self, who: str, wait: float, count: Callable[[str], None]) -> None:
        self.who, self.wait = who, wait
        self._count = count
        self._outages: dict[tuple[str, str], _Outage] = {}

    def begin(self, key: tuple[str, str], now: float) -> None:
        """One more request of ``key`` waits."""
        o = self._outages.get(key)
        if o is None:
            o = self._outages[key] = _Outage(since=now)
        o.waiting += 1
        self._count("service_waits")

    def note(self, key: tuple[str, str], why: str) -> None:
        """Why the last attempt of ``key`` got no answer (said in the next log line)."""
        self._outages[key].why = why

    def end(self, key: tuple[str, str], ok: bool) -> None:
        """A request of ``key`` waits no more (``ok``: it got its answer)."""
        o = self._outages.get(key)
        if o is None:
            return
        o.waiting -= 1
        if o.waiting <= 0:
            del self._outages[key]
            if o.announced and ok:
                log.info("%s: %s replicas in pool %r answer again (waited %.1fs)",
                         self.who, service_of(key[0]), key[1], time.monotonic() - o.since)

    def waits(self, now: float) -> dict[tuple[str, str], tuple[int, float]]:
        """(service, pool) -> (requests waiting, seconds since the first began)."""
        return {k: (o.waiting, now - o.since) for k, o in self._outages.items()}

    def announce(self, now: float) -> None:
        """Log the waits that are due a line (the first, or a reminder)."""
        for (name, pool), o in self._outages.items():
            if o.announced and now - o.announced < REMIND_EVERY:
                continue
            if now - o.since < ANNOUNCE_AFTER:
                continue
            log.warning("%s: %d request(s) %s for a %s replica in pool %r for %.0fs (%s); "
                        "each gives up after %.0fs (rollout.service_wait)", self.who,
                        o.waiting, "still wait" if o.announced else "wait", service_of(name),
                        pool, now - o.since, o.why, self.wait)
            o.announced = now

"""Replica affinity for one :class:`~rollart.actors.kernel.service_client.ServiceClient`: which
replica each key's (a trajectory's) next request goes to, on that replica's own subject.

A key stays with the replica that answered its last request while that replica is live and
not saturated: it holds at most ``AFFINITY_RATIO`` x the mean load of its pool's live
replicas + ``AFFINITY_SLACK`` requests. A replica's load is this client's requests on its
own subject now plus the other clients' at its last progress report. A new key, or one
whose replica is gone or saturated, goes to the live replica with the fewest keys pinned
(then the least load). At most ``AFFINITY_MAX`` keys are remembered, least recently used
going first. Plain bookkeeping: no I/O, no clock; the client says which replicas are live.
"""

from __future__ import annotations

import asyncio
import random
from collections import OrderedDict
from collections.abc import Callable, Sequence
from typing import Protocol

AFFINITY_MAX = 65536
"""Trajectories whose replica one client remembers at most (least recently used go first)."""
AFFINITY_RATIO = 1.25
AFFINITY_SLACK = 2.0
"""A pinned replica is passed over while it holds more than ``AFFINITY_RATIO`` x the mean
held requests of its pool's live replicas + ``AFFINITY_SLACK`` (saturated)."""


class Replica(Protocol):
    name: str
    """Its id in progress reports."""
    others: int
    """Requests of other clients it held at its last report."""


class ReplicaPins:
    """(service, key) -> replica id, with the counts placement reads.

    Args:
        max_keys: keys remembered at most.
        count: ``count(key)`` for notable events (``affinity_moves``).
    """

    def __init__(self, max_keys: int = AFFINITY_MAX,
                 count: Callable[[str], None] | None = None) -> None:
        self.max_keys = max_keys
        self._count = count or (lambda key: None)
        self._pins: OrderedDict[tuple[str, str], str] = OrderedDict()
        """(service, key) -> id of the replica that answered its last request."""
        self._pinned: dict[tuple[str, str], int] = {}
        """(service, replica id) -> keys pinned to it."""
        self._direct: dict[tuple[str, str], int] = {}
        """(service, replica id) -> this client's requests on its own subject now."""

    def __len__(self) -> int:
        return len(self._pins)

    def get(self, name: str, key: str) -> str | None:
        """The replica id ``key``'s next request of service ``name`` goes to first, or None."""
        return self._pins.get((name, key))

    def pin(self, name: str, key: str, replica: str) -> None:
        """``key``'s requests of ``name`` go to ``replica`` from now on."""
        k = (name, key)
        if self._pins.get(k) == replica:
            self._pins.move_to_end(k)
            return
        self.unpin(name, key)
        self._pins[k] = replica
        self._pinned[(name, replica)] = self._pinned.get((name, replica), 0) + 1
        while len(self._pins) > self.max_keys:
            (n, _), old = self._pins.popitem(last=False)
            self._unpinned(n, old)

    def unpin(self, name: str, key: str) -> None:
        old = self._pins.pop((name, key), None)
        if old is not None:
            self._unpinned(name, old)

    def _unpinned(self, name: str, replica: str) -> None:
        n = self._pinned.get((name, replica), 0) - 1
        if n > 0:
            self._pinned[(name, replica)] = n
        else:
            self._pinned.pop((name, replica), None)

    def load(self, name: str, r: Replica) -> int:
        """Requests ``r`` holds: this client's on its own subject now, plus the other
        clients' at its last report."""
        return r.others + self._direct.get((name, r.name), 0)

    def place(self, name: str, key: str, live: Sequence[Replica]) -> Replica | None:
        """The replica of ``live`` (the pool's live replicas with their own subject) that
        ``key``'s request goes to, pinned at once so that the next placement counts it;
        None when ``live`` is empty."""
        if not live:
            return None
        load = {r.name: self.load(name, r) for r in live}
        cap = AFFINITY_RATIO * sum(load.values()) / len(live) + AFFINITY_SLACK
        rid = self._pins.get((name, key))
        if rid is not None:
            for r in live:
                if r.name == rid and load[rid] <= cap:
                    self._pins.move_to_end((name, key))
                    return r
            self.unpin(name, key)  # gone, drained or saturated: placed again
            self._count("affinity_moves")
        best = min((r for r in live if load[r.name] <= cap),  # never empty: the least loaded
                   key=lambda r: (self._pinned.get((name, r.name), 0), load[r.name],
                                  random.random()))
        self.pin(name, key, best.name)
        return best

    def sent(self, name: str, replica: str, attempt: asyncio.Future) -> None:
        """Count ``attempt`` on ``replica``'s own subject until it ends."""
        k = (name, replica)
        self._direct[k] = self._direct.get(k, 0) + 1

        def done(_: asyncio.Future) -> None:
            n = self._direct.get(k, 0) - 1
            if n > 0:
                self._direct[k] = n
            else:
                self._direct.pop(k, None)

        attempt.add_done_callback(done)

"""Lock-step phases for ``rollout.mode: batch``: every trajectory of a wave waits for the
slowest one before each generate and each env step (the synchronous baseline).

A wave runs in lock step on one EnvManager. Were its members split between several (two
replicas, or two env nodes, sharing the work queue), each would wait for members that
another one holds, for ever. So a wave that does not fill within ``fill_timeout`` of its
first member, while this EnvManager has room for the rest, fails: :meth:`LockStep.arrive`
raises :class:`WaveIncomplete` with the reason (the EnvManager dead-letters its members).
A remnant after a crash (some member is a redelivery; members that finished before the
crash never come back) runs on with the members that are here instead."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from dataclasses import dataclass, field

log = logging.getLogger(__name__)

CLOSED_WAVES_KEPT = 8192
"""Finished waves remembered (the newest) so that a late member runs on its own: bounded,
because a long run finishes a wave per batch forever."""


class WaveIncomplete(Exception):
    """This wave cannot run in lock step here; the message says why."""


@dataclass
class _Wave:
    size: int
    """Trajectories in the wave (from the requests)."""
    joined: int = 0
    """Members that joined here, ever."""
    left: int = 0
    """Members that finished (or failed) here."""
    written_off: int = 0
    """Members not waited for any more (the missing part of a crash remnant)."""
    arrived: int = 0
    """Members at the current phase's barrier."""
    release: asyncio.Event = field(default_factory=asyncio.Event)
    """Set when the current phase opens (a new one for each phase)."""
    redelivered: bool = False
    error: str | None = None
    timer: asyncio.TimerHandle | None = None

    @property
    def expected(self) -> int:
        """Members still to join."""
        return max(0, self.size - self.written_off - self.joined)

    @property
    def parties(self) -> int:
        """Members the current phase waits for: those here and those still to join."""
        return self.joined - self.left + self.expected


class LockStep:
    """A barrier per wave whose members may leave (finish) at any time.

    A member that joins a wave which already finished (a redelivery after a crash) gets
    ``False`` from :meth:`join` and runs on its own instead of waiting forever.
    """

    def __init__(self, *, fill_timeout: float = 30.0, room: Callable[[], int] | None = None) -> None:
        """``fill_timeout``: seconds a wave may take to gather its members here (0: wait for
        ever); ``room``: how many more trajectories this EnvManager could take now (a wave
        short of members for lack of room here waits on)."""
        self.fill_timeout = fill_timeout
        self._room = room
        self._waves: dict[str, _Wave] = {}
        # insertion-ordered, the oldest is dropped first; the value is the failure reason
        self._closed: dict[str, str | None] = {}

    @property
    def waves(self) -> list[str]:
        """The waves open now (members joined, not all left yet)."""
        return list(self._waves)

    @property
    def finished(self) -> list[str]:
        """The finished waves still remembered (a late member runs on its own), oldest first."""
        return list(self._closed)

    def join(self, wave: str, size: int, *, redelivered: bool = False) -> bool:
        """Count a member in; ``False``: the wave finished, so run on your own."""
        if wave in self._closed:
            reason = self._closed[wave]
            if reason is None:
                return False
            # a late member of a failed wave fails the same way (at its first arrive)
            self._waves[wave] = _Wave(size=size, joined=1, error=reason)
            del self._closed[wave]
            return True
        w = self._waves.get(wave)
        if w is None:
            w = self._waves[wave] = _Wave(size=size)
            if self.fill_timeout > 0 and size > 1:
                w.timer = asyncio.get_running_loop().call_later(
                    self.fill_timeout, self._check_fill, wave)
        w.joined += 1
        w.redelivered = w.redelivered or redelivered
        if w.written_off and w.joined + w.written_off > w.size:
            w.written_off -= 1  # one given up on came after all: wait for it again
        if w.timer is not None and w.expected == 0:
            w.timer.cancel()
            w.timer = None
        return True

    def leave(self, wave: str) -> None:
        w = self._waves.get(wave)
        if w is None:
            return
        w.left += 1
        if w.joined - w.left <= 0 and (w.expected == 0 or w.error):
            self._close(wave, w)
        elif not w.error and w.arrived >= w.parties:
            self._open(w)

    async def arrive(self, wave: str) -> None:
        """Wait until every member of the wave has arrived at this phase; raises
        :class:`WaveIncomplete` if the wave failed."""
        w = self._waves.get(wave)
        if w is None:  # not joined, or finished meanwhile: nobody to wait for
            return
        if w.error:
            raise WaveIncomplete(w.error)
        w.arrived += 1
        if w.arrived >= w.parties:
            self._open(w)
            return
        release = w.release
        await release.wait()
        if w.error:
            raise WaveIncomplete(w.error)

    def _open(self, w: _Wave) -> None:
        w.release.set()
        w.release, w.arrived = asyncio.Event(), 0

    def _close(self, wave: str, w: _Wave) -> None:
        if w.timer is not None:
            w.timer.cancel()
        w.release.set()
        del self._waves[wave]
        self._closed[wave] = w.error
        if len(self._closed) > CLOSED_WAVES_KEPT:
            del self._closed[next(iter(self._closed))]

    def _check_fill(self, wave: str) -> None:
        w = self._waves.get(wave)
        if w is None or w.error:
            return
        w.timer = None
        missing = w.expected
        if missing == 0:
            return
        here = w.joined - w.left
        if w.redelivered:  # a crash remnant: the members that finished before never come back
            log.warning("wave %s: %d of %d members here after %gs, some redelivered: a remnant "
                        "after a crash; running on without the %d missing", wave, w.joined,
                        w.size, self.fill_timeout, missing)
            w.written_off += missing
            if here > 0 and w.arrived >= w.parties:
                self._open(w)
            elif here <= 0:
                self._close(wave, w)
            return
        if self._room is not None and self._room() < missing:  # they may be queued for us
            w.timer = asyncio.get_running_loop().call_later(self.fill_timeout, self._check_fill, wave)
            return
        w.error = (
            f"wave {wave} has {w.size} trajectories but only {w.joined} reached this EnvManager "
            f"within {self.fill_timeout:g}s while it had room for the rest: rollout.mode 'batch' "
            f"runs a wave in lock step on one EnvManager, so the others went to another one "
            f"(run exactly one: actors.env.replicas 1 on a single env node) or were never admitted")
        log.error("%s", w.error)
        w.release.set()  # the members waiting at the barrier fail now
        if here <= 0:
            self._close(wave, w)

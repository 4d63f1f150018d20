"""Lock-step phases for ``rollout.mode: batch``: every trajectory of a wave waits for the
slowest one before each generate and each env step (the synchronous baseline)."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field


@dataclass
class _Wave:
    parties: int
    arrived: int = 0
    release: asyncio.Event = field(default_factory=asyncio.Event)


class LockStep:
    """A barrier per wave whose members may leave (finish) at any time.

    A member that joins a wave which already finished (a redelivery after a crash) gets
    ``False`` from :meth:`join` and runs on its own instead of waiting forever.
    """

    def __init__(self) -> None:
        self._waves: dict[str, _Wave] = {}
        self._closed: set[str] = set()

    def join(self, wave: str, size: int) -> bool:
        if wave in self._closed:
            return False
        self._waves.setdefault(wave, _Wave(parties=size))
        return True

    def leave(self, wave: str) -> None:
        w = self._waves.get(wave)
        if w is None:
            return
        w.parties -= 1
        if w.parties <= 0:
            w.release.set()
            del self._waves[wave]
            self._closed.add(wave)
        elif w.arrived >= w.parties:
            self._open(wave, w)

    async def arrive(self, wave: str) -> None:
        w = self._waves[wave]
        w.arrived += 1
        if w.arrived >= w.parties:
            self._open(wave, w)
            return
        await w.release.wait()

    def _open(self, wave: str, w: _Wave) -> None:
        w.release.set()
        self._waves[wave] = _Wave(parties=w.parties)

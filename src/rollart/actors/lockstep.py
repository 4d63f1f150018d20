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
    """A barrier per wave whose members may leave (finish) at any time."""

    def __init__(self) -> None:
        self._waves: dict[int, _Wave] = {}

    def join(self, wave: int, size: int) -> None:
        self._waves.setdefault(wave, _Wave(parties=size))

    def leave(self, wave: int) -> None:
        w = self._waves.get(wave)
        if w is None:
            return
        w.parties -= 1
        if w.parties <= 0:
            w.release.set()
            del self._waves[wave]
        elif w.arrived >= w.parties:
            self._open(wave, w)

    async def arrive(self, wave: int) -> None:
        w = self._waves[wave]
        w.arrived += 1
        if w.arrived >= w.parties:
            self._open(wave, w)
            return
        await w.release.wait()

    def _open(self, wave: int, w: _Wave) -> None:
        w.release.set()
        self._waves[wave] = _Wave(parties=w.parties)

"""An emulated wide-area link between two sites, and a generation replica behind one.

- :class:`DelayRelay`: a user-space TCP relay (asyncio) that forwards every connection to a
  target and, in each direction, holds each chunk for a one-way ``delay_s`` and paces the
  direction to ``rate`` bytes/s (one link: the connections through the relay share it). The
  kernel's ``netem`` is not available on the machines this runs on, and a relay needs no
  privileges; ``tc tbf`` could pace but not delay. A chunk (at most ``chunk`` bytes) leaves
  the link when its last byte has been serialised at ``rate`` after the bytes ahead of it,
  and arrives ``delay_s`` later, so a transfer of ``n`` bytes takes about
  ``rtt + n / rate`` (the request's way out, the answer's way back).
- :class:`ByteSource` and :func:`fetch_bytes`: a server that answers an 8-byte length with
  that many bytes, and its client: the weight bytes of one version crossing the link.
- :func:`scaled_link`: the relay's wall-clock delay and rate for a modelled link (Gbit/s, RTT)
  run ``time_scale`` times faster, carrying ``byte_scale`` of the modelled bytes: the modelled
  transfer time ``bytes / rate`` is kept, scaled by ``time_scale``, with ``byte_scale``
  chosen so that the relay's real byte rate is one this host can pace.
- :class:`SiteLLMProxy`: an :class:`~rollart.emulate.engine.EmulatedLLMProxy` at a site other
  than the trainer's: before loading version ``v`` (> 0) it fetches ``site_link.wire_bytes``
  through the relay, either **sync** (inside the engine's load, while generation is paused:
  the site waits for each version to arrive before generating with it) or **async** (before
  the pause, while the engine keeps generating with the version it holds, within α).
"""

from __future__ import annotations

import asyncio
import contextlib
import math
import struct
import time
from dataclasses import dataclass, field
from typing import Any

from rollart.emulate.engine import EmulatedLLMProxy
from rollart.emulate.records import RECORDS

__all__ = ["ByteSource", "DelayRelay", "SiteLLMProxy", "fetch_bytes", "scaled_link"]

_LEN = struct.Struct("!Q")


def scaled_link(gbit_s: float, rtt_s: float, *, time_scale: float,
                byte_scale: float) -> tuple[float, float]:
    """``(delay_s, rate_bytes_s)`` of a relay that emulates a ``gbit_s`` link of round trip
    ``rtt_s``, ``time_scale`` wall seconds per modelled second, carrying ``byte_scale`` of the
    modelled bytes: one-way delay ``rtt_s / 2 x time_scale``, rate
    ``gbit_s x 1e9 / 8 x byte_scale / time_scale``."""
    if min(gbit_s, time_scale, byte_scale) <= 0 or rtt_s < 0:
        raise ValueError("scaled_link: rate, time_scale and byte_scale > 0, rtt >= 0")
    return rtt_s / 2 * time_scale, gbit_s * 1e9 / 8 * byte_scale / time_scale


class _Lane:
    """One direction of the link: when it is next free (loop time)."""

    def __init__(self) -> None:
        self.free_at = 0.0
        self.bytes = 0


class _Listener:
    """A loopback TCP server of its own (``start()`` returns its port) and the connection
    tasks it owns, cancelled by ``close()``; subclasses give ``_handle(reader, writer)``."""

    host: str

    def _listening(self) -> None:
        self.port: int | None = None
        self._server: asyncio.Server | None = None
        self._tasks: set[asyncio.Task] = set()

    async def start(self) -> int:
        self._server = await asyncio.start_server(self._handle, self.host, 0)
        self.port = self._server.sockets[0].getsockname()[1]
        return self.port

    async def close(self) -> None:
        if self._server is not None:
            self._server.close()
            with contextlib.suppress(Exception):
                await self._server.wait_closed()
        for t in list(self._tasks):
            t.cancel()
        for t in list(self._tasks):
            with contextlib.suppress(BaseException):
                await t

    async def __aenter__(self):
        await self.start()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()


class DelayRelay(_Listener):
    """A TCP relay to ``target`` (host, port) with a one-way delay and a rate per direction
    (module docstring). ``rate`` None: no pacing. ``start()`` returns the port it listens on."""

    def __init__(self, target: tuple[str, int], *, delay_s: float = 0.0,
                 rate: float | None = None, host: str = "127.0.0.1", chunk: int = 64 * 1024):
        if delay_s < 0 or (rate is not None and rate <= 0) or chunk <= 0:
            raise ValueError("DelayRelay: delay >= 0, rate > 0, chunk > 0")
        self.target, self.delay_s, self.rate, self.host = target, float(delay_s), rate, host
        self.chunk = int(chunk)
        self.up, self.down = _Lane(), _Lane()  # client -> target, target -> client
        self._listening()
        # what may wait in the relay per direction: the bytes in flight (rate x delay), a few
        # chunks more, so a fast sender is held back (TCP's window, roughly) and memory bounded
        bdp = (rate or 0.0) * self.delay_s
        self._depth = max(8, math.ceil(bdp / self.chunk) * 2 + 8)

    def _spawn(self, coro: Any) -> asyncio.Task:
        t = asyncio.get_running_loop().create_task(coro)
        self._tasks.add(t)
        t.add_done_callback(self._tasks.discard)
        return t

    async def _handle(self, cr: asyncio.StreamReader, cw: asyncio.StreamWriter) -> None:
        try:
            tr, tw = await asyncio.open_connection(*self.target)
        except OSError:
            cw.close()
            return
        a = self._spawn(self._pipe(cr, tw, self.up))
        b = self._spawn(self._pipe(tr, cw, self.down))
        with contextlib.suppress(BaseException):
            await asyncio.gather(a, b)
        for w in (cw, tw):
            w.close()

    async def _pipe(self, r: asyncio.StreamReader, w: asyncio.StreamWriter, lane: _Lane) -> None:
        loop = asyncio.get_running_loop()
        q: asyncio.Queue = asyncio.Queue(self._depth)

        broken = False

        async def send() -> None:
            nonlocal broken
            while True:
                at, data = await q.get()
                if data is None:
                    break
                if broken:  # the far end went away: what is still queued is dropped
                    continue
                wait = at - loop.time()
                if wait > 0:
                    await asyncio.sleep(wait)
                try:
                    w.write(data)
                    await w.drain()
                except OSError:  # e.g. a fetch cancelled at the end of a run
                    broken = True
            with contextlib.suppress(OSError):
                if not broken and w.can_write_eof():
                    w.write_eof()

        sender = self._spawn(send())
        try:
            while not broken and (data := await r.read(self.chunk)):
                now = loop.time()
                start = max(now, lane.free_at)
                lane.free_at = start + (len(data) / self.rate if self.rate else 0.0)
                lane.bytes += len(data)
                await q.put((lane.free_at + self.delay_s, data))
        except OSError:
            pass
        await q.put((0.0, None))
        await sender


class ByteSource(_Listener):
    """A TCP server that answers each request (an 8-byte big-endian length) with that many
    bytes: the other site's weight server, reduced to its bytes."""

    def __init__(self, host: str = "127.0.0.1", block: int = 1 << 20):
        self.host = host
        self._block = bytes(block)
        self._listening()
        self.sent = 0

    async def _handle(self, r: asyncio.StreamReader, w: asyncio.StreamWriter) -> None:
        try:
            (n,) = _LEN.unpack(await r.readexactly(_LEN.size))
            view = memoryview(self._block)
            while n > 0:
                k = min(n, len(view))
                w.write(view[:k])
                await w.drain()
                n -= k
                self.sent += k
        except (OSError, asyncio.IncompleteReadError):
            pass
        finally:
            w.close()


async def fetch_bytes(host: str, port: int, n: int) -> float:
    """Ask the :class:`ByteSource` at ``host:port`` for ``n`` bytes and read them all; the
    seconds from the request to the last byte (a short read raises ``ConnectionError``)."""
    r, w = await asyncio.open_connection(host, port)
    try:
        t0 = time.perf_counter()
        w.write(_LEN.pack(int(n)))
        await w.drain()
        got = 0
        while got < n:
            data = await r.read(1 << 20)
            if not data:
                raise ConnectionError(f"fetch_bytes: {got} of {n} bytes, then the end")
            got += len(data)
        return time.perf_counter() - t0
    finally:
        w.close()


@dataclass(kw_only=True, eq=False)
class SiteLLMProxy(EmulatedLLMProxy):
    """An emulated generation replica at another site than the trainer (module docstring)."""

    site_link: dict[str, Any] = field(default_factory=dict)
    """``host``, ``port`` (the relay to the trainer's site's :class:`ByteSource`),
    ``wire_bytes`` (what one version puts on the wire), ``mode`` (``sync`` or ``async``),
    ``time_scale`` (to record modelled seconds). Empty: the replica is at the trainer's
    site (nothing crosses)."""

    async def setup(self) -> None:
        mode = self.site_link.get("mode")
        if self.site_link and mode not in ("sync", "async"):
            raise ValueError(f"site_link.mode {mode!r} is not sync or async")
        await super().setup()
        if mode == "sync":  # inside the load: generation is paused while the version crosses
            self._emulated.before_load = self._cross

    async def _load_paused(self, data: Any, version: int, changed: Any = None) -> tuple[float, float]:
        if self.site_link.get("mode") == "async":  # the engine serves the old version meanwhile
            await self._cross(version)
        return await super()._load_paused(data, version, changed)

    async def _cross(self, version: int) -> None:
        if version <= 0 or not self.site_link:
            return
        link = self.site_link
        n = int(link["wire_bytes"])
        wall = await fetch_bytes(link["host"], int(link["port"]), n)
        RECORDS.crossings.append({"version": version, "mode": link["mode"], "wire_bytes": n,
                                  "wall_s": wall,
                                  "model_s": wall / float(link.get("time_scale") or 1.0),
                                  "engine": self.name})

"""The generators' end of the weight path (``trainer.weights: tcp``): fetch one blob, read the
server's token, and a blob store over both; the protocol and the threats it meets are
:mod:`rollart.engines.weight_tcp`'s docstring."""

from __future__ import annotations

import asyncio
import socket
import time
from collections.abc import Awaitable, Callable
from typing import Any
from urllib.parse import urlparse

from rollart.bus.base import ObjectTooLarge

from .weight_limits import StreamError, check_blob_name
from .weight_tcp import (
    MAX_ACCESS,
    MAX_LINE,
    SIZE_PATTERN,
    STALL_S,
    TOKEN_OBJECT,
    BlobRefused,
    WeightAccess,
    read_access,
)
from .weight_tls import PinMismatch, connect

__all__ = ["TcpBlobs", "fetch_blob", "parse_tcp_uri", "token_reader"]


def parse_tcp_uri(uri: str) -> tuple[str, int, str, str]:
    """``(host, port, token, name)`` of ``tcp://host:port/name`` (token ``""``: in the run's
    weights store) or of an older ``tcp://host:port/token/name``; ``ValueError`` else."""
    u = urlparse(uri)
    parts = u.path.removeprefix("/").split("/")
    try:
        port = u.port
    except ValueError:
        port = None
    if u.scheme != "tcp" or not u.hostname or not port or len(parts) not in (1, 2) or not all(parts):
        raise ValueError(f"not a weight server uri (tcp://host:port/name): {uri[:200]!r}")
    return u.hostname, port, parts[0] if len(parts) == 2 else "", parts[-1]



def _answer(s: socket.socket, where: str, name: str, deadline: float) -> str:
    """The server's answer line (without the newline), received before ``deadline``."""
    head = bytearray()
    while not head.endswith(b"\n"):
        left = deadline - time.monotonic()
        if left <= 0:
            raise OSError(f"{where}: no answer for {name} in time")
        s.settimeout(left)
        try:
            c = s.recv(1)
        except TimeoutError:
            raise OSError(f"{where}: no answer for {name} in time") from None
        if not c:
            raise OSError(f"{where} closed the connection before answering for {name}")
        head += c
        if len(head) > MAX_LINE:
            raise OSError(f"{where}: malformed answer for {name}")
    return head.decode("ascii", "replace").strip()



def fetch_blob(host: str, port: int, token: str, name: str, *, into: bytearray | None = None,
               stall_s: float = STALL_S, max_size: int | None = None,
               cert_sha256: str = "") -> memoryview:
    """The bytes of ``name`` from a :class:`WeightServer` (blocking: call it off the loop).
    ``OSError`` with what failed: the server unreachable, a refusal (:class:`BlobRefused`),
    an answer larger than ``max_size`` (refused before a buffer is made for it), or a
    transfer cut short. A busy server is asked again until ``stall_s`` has passed.

    ``into``: a buffer to receive into when it is large enough (the view returned says which
    buffer holds the bytes: ``.obj``), to reuse for the next bucket: a fresh buffer per
    bucket costs its page faults, about a third of the speed here.

    ``cert_sha256``: the server's certificate as the trainer published it
    (:class:`WeightAccess`): the request goes inside TLS, to that server only
    (:class:`~rollart.engines.weight_tls.PinMismatch` for another, the token unsent)."""
    where = f"weight server {host}:{port}"
    end = time.monotonic() + stall_s
    wait = 0.05
    while True:
        try:
            s = socket.create_connection((host, port), timeout=stall_s)
        except OSError as e:
            raise OSError(f"cannot reach the trainer's {where} (trainer.weights: tcp; is the "
                          f"trainer up and its port open to this host?): {e}") from e
        if cert_sha256:
            tls = connect(s, where, cert_sha256, max(0.001, end - time.monotonic()))
            if tls is None:  # closed before the handshake: busy (or going away)
                if time.monotonic() + wait >= end:
                    raise OSError(f"{where} closed every TLS connection for {stall_s:.0f}s "
                                  f"(busy: max_connections held, or going away)")
                time.sleep(wait)  # a thread of its own (the caller's to_thread)
                wait = min(1.0, 2 * wait)
                continue
            s = tls
        with s:
            s.sendall(f"GET {token} {name}\n".encode())
            status, _, rest = _answer(s, where, name, time.monotonic() + stall_s).partition(" ")
            if status == "ERR" and rest == "busy" and time.monotonic() + wait < end:
                time.sleep(wait)  # a thread of its own (the caller's to_thread)
                wait = min(1.0, 2 * wait)
                continue
            if status != "OK":
                why = "".join(c if c.isprintable() else "?" for c in rest[:200]) or "no reason"
                raise BlobRefused(f"{where} refused {name}: {why}", why)
            if not SIZE_PATTERN.match(rest):
                raise OSError(f"{where}: malformed answer for {name} (a size was expected)")
            size = int(rest)
            if max_size is not None and size > max_size:
                raise BlobRefused(f"{where} announces {size} bytes for {name}, more than the "
                                  f"{max_size} bytes expected", "too large")
            # a buffer too small is replaced, never resized (the caller's views of it stay valid)
            buf = into if into is not None and len(into) >= size else bytearray(size)
            mv = memoryview(buf)[:size]
            got = 0
            s.settimeout(stall_s)
            while got < size:
                try:
                    n = s.recv_into(mv[got:])
                except TimeoutError:
                    raise OSError(f"{where}: no data for {stall_s:.0f}s after {got} of {size} bytes "
                                  f"of {name}") from None
                if not n:
                    raise OSError(f"{where}: {name} cut short at {got} of {size} bytes")
                got += n
            return mv



def token_reader(bus: Any, bucket: str) -> Callable[[], Awaitable[WeightAccess]]:
    """A function that reads the weight server's token (and its pinned certificate, under
    TLS) from the run's weights store ``bucket`` (:data:`TOKEN_OBJECT`, put there by the
    trainer as it starts its server)."""

    async def read() -> WeightAccess:
        try:
            raw = await (await bus.object_store(bucket)).get(TOKEN_OBJECT, max_bytes=MAX_ACCESS)
        except KeyError:
            raise StreamError(f"the weight server's token is not in the run's weights store "
                              f"{bucket} (yet): the trainer puts it there as it starts its "
                              f"server") from None
        except ObjectTooLarge:
            raise StreamError(f"{TOKEN_OBJECT} in {bucket} is larger than {MAX_ACCESS} bytes: "
                              f"not a weight server record") from None
        return read_access(bytes(raw), bucket)

    return read



class TcpBlobs:
    """The read side of a :class:`WeightServer` as a blob store (``get`` only: the trainer
    writes its stream folder directly). Two receive buffers, used in turn: a bucket's bytes
    stay valid until the second ``get`` after it (the assembler's staged file hashes one
    bucket behind while the next arrives, :class:`~rollart.engines.weight_stream.StagedFile`).

    ``token``: the server's token (``cert_sha256``: its certificate, under TLS), or None to
    read both with ``token_source`` (:func:`token_reader`), again after a ``bad token`` or
    another certificate than the one pinned (a trainer restarted)."""

    def __init__(self, host: str, port: int, token: str | None, *, cert_sha256: str = "",
                 token_source: Callable[[], Awaitable[WeightAccess]] | None = None):
        self.host, self.port, self.token = host, port, token
        self.cert_sha256 = cert_sha256
        """The pinned certificate (empty: cleartext), from ``token_source`` with the token."""
        self._token_source = token_source
        self.where = f"the trainer's weight server {host}:{port}"
        self._bufs = [bytearray(), bytearray()]
        self._turn = 0

    async def _token(self, fresh: bool) -> str:
        if self.token is None or fresh:
            if self._token_source is None:
                raise StreamError(f"{self.where}: no token to ask with")
            access = await self._token_source()
            self.token, self.cert_sha256 = access.token, access.cert_sha256
        return self.token

    async def get(self, name: str, max_bytes: int | None = None) -> memoryview:
        check_blob_name(name, f"{name[:80]!r}")
        i = self._turn
        self._turn ^= 1
        for again in (False, True):
            token = await self._token(fresh=again)
            try:  # into the buffer of two gets ago: consumed by now
                view = await asyncio.to_thread(fetch_blob, self.host, self.port, token, name,
                                               into=self._bufs[i], max_size=max_bytes,
                                               cert_sha256=self.cert_sha256)
            except PinMismatch:
                if not again and self._token_source is not None:
                    continue  # the trainer restarted: its new certificate is in the store
                raise
            except BlobRefused as e:
                if e.reason == "not found":
                    raise KeyError(name) from None
                if e.reason == "too large":
                    raise StreamError(str(e)) from None
                if e.reason == "bad token" and not again and self._token_source is not None:
                    continue  # the trainer restarted: its new token is in the store
                raise
            self._bufs[i] = view.obj  # a larger one when the bucket did not fit
            return view
        raise AssertionError("unreachable")

    async def exists(self, name: str) -> bool:
        try:
            await self.get(name)
        except KeyError:
            return False
        return True

    async def put(self, name: str, data: bytes) -> None:
        raise OSError(f"{self.where} is read-only: the trainer writes its stream folder itself")

    async def delete(self, name: str) -> None:
        raise OSError(f"{self.where} is read-only")

    def uri(self, name: str) -> str:
        return f"tcp://{self.host}:{self.port}/{name}"

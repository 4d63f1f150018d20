"""The trainer's end of the weight path (``trainer.weights: tcp``): a threaded server of one
folder's files; the protocol and the threats it meets are :mod:`rollart.engines.weight_tcp`'s
docstring."""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import logging
import os
import secrets
import socket
import socketserver
import ssl
import threading
import time
from pathlib import Path
from typing import Any

import msgspec

from .safe_files import open_regular
from .weight_tcp import (
    MAX_CONNECTIONS,
    MAX_LINE,
    NAME_PATTERN,
    REQUEST_S,
    STALL_S,
    TLS_CHUNK,
    TLS_HANDSHAKE,
    TLS_ONLY,
    WeightAccess,
)
from .weight_tls import server_context

__all__ = ["WeightServer"]

log = logging.getLogger(__name__)


class WeightServer:
    """Serves the files of ``root`` (names only, no sub-folders) to holders of ``token``.

    Each connection is served in its own thread with blocking sockets and ``os.sendfile``
    (the kernel copies the page cache to the socket; under TLS a send loop): nothing of a
    transfer runs on the event loop, and uvloop, which has no ``loop.sendfile``, is no
    obstacle. At most ``max_connections`` threads at once; ``request_s`` for the TLS
    handshake and the request line together.

    ``host``: the address to listen on (None or empty: ``advertise``, else 127.0.0.1;
    ``0.0.0.0`` only when given). ``tls``: serve TLS 1.3 with a certificate made as it
    starts (:attr:`cert_sha256` says which, for :meth:`access_object`)."""

    def __init__(self, root: str | os.PathLike, *, host: str | None = None, port: int = 0,
                 advertise: str | None = None, token: str | None = None,
                 max_connections: int = MAX_CONNECTIONS, request_s: float = REQUEST_S,
                 tls: bool = False):
        self.root = Path(root)
        self.advertise = advertise
        """The address generators reach this server at (None: the host given, or 127.0.0.1)."""
        self.host = host or advertise or "127.0.0.1"
        self.port = port
        self.token = token or secrets.token_urlsafe(24)
        self.max_connections = max(1, int(max_connections))
        self.request_s = request_s
        self.tls = tls
        self._tls: ssl.SSLContext | None = None
        self.cert_sha256 = ""
        """With ``tls``, once started: the SHA-256 (hex) of the certificate it presents."""
        self._server: socketserver.ThreadingTCPServer | None = None
        self._thread: threading.Thread | None = None
        self._lock = threading.Lock()
        self.active = 0
        """Connections being served now."""
        self.refused_busy = 0
        """Connections answered ``ERR busy`` (``max_connections`` were held)."""
        self.served = 0
        """Bytes sent so far."""

    def _enter(self) -> bool:
        with self._lock:
            if self.active >= self.max_connections:
                self.refused_busy += 1
                return False
            self.active += 1
            return True

    def _leave(self) -> None:
        with self._lock:
            self.active -= 1

    def start_sync(self) -> None:
        owner = self

        class Handler(socketserver.BaseRequestHandler):
            def handle(self) -> None:
                owner._handle(self.request)

        class Server(socketserver.ThreadingTCPServer):
            daemon_threads = True
            allow_reuse_address = True

            def process_request(self, request, client_address) -> None:
                if not owner._enter():  # on the accept thread: a few bytes, never blocks long
                    if owner._tls is None:  # (under TLS no handshake here: closed, waited out)
                        with contextlib.suppress(OSError):
                            request.settimeout(1.0)
                            request.sendall(b"ERR busy\n")
                    self.shutdown_request(request)
                    return
                try:
                    super().process_request(request, client_address)
                except BaseException:
                    owner._leave()
                    raise

            def process_request_thread(self, request, client_address) -> None:
                try:
                    super().process_request_thread(request, client_address)
                finally:
                    owner._leave()

        if self.tls and self._tls is None:
            self._tls, self.cert_sha256 = server_context()
        try:
            self._server = Server((self.host, self.port), Handler)
        except OSError as e:
            raise OSError(f"the weight server cannot listen on {self.host}:{self.port} ({e}): set "
                          f"trainer.sync.host to an address of this host (0.0.0.0: every "
                          f"interface) or trainer.sync.advertise to the one generators reach") from e
        self.port = self._server.server_address[1]
        self._thread = threading.Thread(target=self._server.serve_forever, kwargs={"poll_interval": 0.2},
                                        name=f"weight-server-{self.port}", daemon=True)
        self._thread.start()
        log.info("weight server on %s:%d serves %s (at most %d connections, %s)", self.host,
                 self.port, self.root, self.max_connections,
                 f"TLS, certificate sha256 {self.cert_sha256}" if self._tls else "cleartext")

    async def start(self) -> None:
        await asyncio.to_thread(self.start_sync)

    @property
    def base_uri(self) -> str:
        """``tcp://<host>:<port>``; a file's URI is this plus ``/<name>`` (no token: readers
        take it from the run's weights store, :data:`TOKEN_OBJECT`)."""
        host = self.advertise or (self.host if self.host not in ("0.0.0.0", "::", "") else "127.0.0.1")
        return f"tcp://{host}:{self.port}"

    def uri(self, name: str) -> str:
        return f"{self.base_uri}/{name}"

    def access_object(self) -> bytes:
        """What the trainer puts in :data:`TOKEN_OBJECT`: the plain token of a cleartext
        server (as before TLS: readers of an older release still read it), else the
        :class:`WeightAccess` record that pins this launch's certificate."""
        if not self.cert_sha256:
            return self.token.encode()
        return msgspec.json.encode(WeightAccess(token=self.token, cert_sha256=self.cert_sha256))

    def close_sync(self) -> None:
        if self._server is not None:
            self._server.shutdown()
            self._server.server_close()
            self._server = None

    async def close(self) -> None:
        await asyncio.to_thread(self.close_sync)

    async def __aenter__(self) -> WeightServer:
        await self.start()
        return self

    async def __aexit__(self, *exc) -> None:
        await self.close()

    def _request_line(self, sock: socket.socket, deadline: float) -> bytes | None:
        """The request line (None: the client hung up first); ``TimeoutError`` unless it all
        came before ``deadline``."""
        line = bytearray()
        while b"\n" not in line and len(line) < MAX_LINE:
            left = deadline - time.monotonic()
            if left <= 0:
                raise TimeoutError
            sock.settimeout(left)
            c = sock.recv(MAX_LINE - len(line))
            if not c:
                return None
            line += c
        return bytes(line.partition(b"\n")[0])

    def _handshake(self, sock: socket.socket, deadline: float) -> ssl.SSLSocket | None:
        """``sock`` inside TLS, the handshake done before ``deadline`` (one timeout for the
        whole of it: CPython's ``do_handshake`` keeps a deadline); None when it failed (a
        client without TLS, a stalled one: nothing to answer in a language it speaks)."""
        assert self._tls is not None
        try:
            sock.settimeout(max(0.001, deadline - time.monotonic()))
            first = sock.recv(1, socket.MSG_PEEK)
            if first and first != TLS_HANDSHAKE:  # a cleartext client: told so in cleartext
                sock.sendall(TLS_ONLY)
                return None
            if not first:
                return None
            tls = self._tls.wrap_socket(sock, server_side=True, do_handshake_on_connect=False)
        except OSError as e:
            log.debug("weight server: no TLS for a connection: %s", e)
            return None
        try:
            tls.do_handshake()
            return tls
        except OSError as e:  # ssl.SSLError and TimeoutError are OSErrors
            log.debug("weight server: a TLS handshake failed: %s", e)
            tls.close()
            return None

    def _send(self, sock: socket.socket, f: Any, size: int) -> None:
        """The file's ``size`` bytes: ``sendfile`` in cleartext (the kernel copies the page
        cache to the socket), from one :data:`TLS_CHUNK` buffer under TLS (encrypted here)."""
        if not isinstance(sock, ssl.SSLSocket):
            self.served += sock.sendfile(f, 0, size)  # os.sendfile, waiting on the timeout
            return
        buf = memoryview(bytearray(min(TLS_CHUNK, max(1, size))))
        left = size
        while left:
            n = f.readinto(buf[:min(left, len(buf))])
            if not n:  # the file shrank: the reader reports a transfer cut short
                return
            sock.sendall(buf[:n])
            self.served += n
            left -= n

    def _handle(self, raw: socket.socket) -> None:
        deadline = time.monotonic() + self.request_s
        sock = raw if self._tls is None else self._handshake(raw, deadline)
        if sock is None:
            return
        try:
            self._serve(sock, deadline)
        finally:
            if sock is not raw:  # the TLS socket took the descriptor over: ours to close
                sock.close()

    def _serve(self, sock: socket.socket, deadline: float) -> None:
        try:
            try:
                line = self._request_line(sock, deadline)
            except TimeoutError:
                with contextlib.suppress(OSError):
                    sock.sendall(b"ERR request line not received in time\n")
                return
            if line is None:
                return
            parts = line.split()
            if len(parts) != 3 or parts[0] != b"GET":
                sock.sendall(b"ERR bad request\n")
                return
            _, token, name = parts
            if not hmac.compare_digest(token, self.token.encode()):  # bytes: any input compares
                sock.sendall(b"ERR bad token\n")
                return
            if not NAME_PATTERN.match(name):
                sock.sendall(b"ERR bad name\n")
                return
            path = self.root / name.decode()
            try:  # a link, a FIFO, anything but a regular file: not found
                with open_regular(path, None, "a blob", FileNotFoundError) as (f, size):
                    sock.settimeout(STALL_S)
                    sock.sendall(f"OK {size}\n".encode())
                    self._send(sock, f, size)
            except FileNotFoundError:
                sock.sendall(b"ERR not found\n")
        except OSError as e:  # the reader went away or stalled: its own error to report
            log.debug("weight server: a transfer ended early: %s", e)

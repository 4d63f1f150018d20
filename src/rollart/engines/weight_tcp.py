"""A direct TCP path for weight buckets: the trainer serves its stream folder, generators
read from it at socket speed (``trainer.weights: tcp``).

Why not the object store for every version: nats-py moves an object in 128 KiB chunk
messages, each published, acked and reassembled in Python: ~170-260 MB/s on this machine
where plain loopback TCP moves ~3 GB/s (``benchmarks/weight_sync.py`` measures both). Here
the trainer's process answers each request with ``sendfile`` of the bucket file and the
reader ``recv_into`` one preallocated buffer, so a version travels near the link's speed.

What it does not do, and why that is safe: the bytes are not encrypted and the server
checks only a per-process random token that travels in the version's URI (published on
the run's subjects, which the bus's permissions already protect, like the object store's
contents). Integrity does not rest on the channel: every bucket's SHA-256 is in the
manifest and the assembled version must have the digest the trainer announced on the bus
(:mod:`rollart.engines.weight_stream`), so a tampered byte is refused, never served.

Protocol, one request per connection (buckets are tens of MB: a connection costs nothing
next to them): the client sends ``GET <token> <name>\\n``; the server answers
``OK <size>\\n`` and the file's bytes, or ``ERR <reason>\\n``.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import re
import secrets
import socket
import socketserver
import threading
from pathlib import Path
from urllib.parse import urlparse

__all__ = ["WeightServer", "advertised_host", "fetch_blob", "parse_tcp_uri"]

log = logging.getLogger(__name__)

_NAME = re.compile(r"^[A-Za-z0-9._-]{1,200}$")
_MAX_LINE = 512
STALL_S = 30.0
"""Seconds a read may receive nothing before it fails (a server gone mid-transfer)."""


class WeightServer:
    """Serves the files of ``root`` (names only, no sub-folders) to holders of ``token``.

    Each connection is served in its own thread with blocking sockets and ``os.sendfile``
    (the kernel copies the page cache to the socket): nothing of a transfer runs on the
    event loop, and uvloop, which has no ``loop.sendfile``, is no obstacle."""

    def __init__(self, root: str | os.PathLike, *, host: str = "0.0.0.0", port: int = 0,
                 advertise: str | None = None, token: str | None = None):
        self.root = Path(root)
        self.host = host
        self.port = port
        self.advertise = advertise
        """The address generators reach this server at (None: the host given, or 127.0.0.1)."""
        self.token = token or secrets.token_urlsafe(24)
        self._server: socketserver.ThreadingTCPServer | None = None
        self._thread: threading.Thread | None = None
        self.served = 0
        """Bytes sent so far."""

    def start_sync(self) -> None:
        owner = self

        class Handler(socketserver.BaseRequestHandler):
            def handle(self) -> None:
                owner._handle(self.request)

        class Server(socketserver.ThreadingTCPServer):
            daemon_threads = True
            allow_reuse_address = True

        self._server = Server((self.host, self.port), Handler)
        self.port = self._server.server_address[1]
        self._thread = threading.Thread(target=self._server.serve_forever, kwargs={"poll_interval": 0.2},
                                        name=f"weight-server-{self.port}", daemon=True)
        self._thread.start()
        log.info("weight server on %s:%d serves %s", self.host, self.port, self.root)

    async def start(self) -> None:
        await asyncio.to_thread(self.start_sync)

    @property
    def base_uri(self) -> str:
        """``tcp://<host>:<port>/<token>``; a file's URI is this plus ``/<name>``."""
        host = self.advertise or (self.host if self.host not in ("0.0.0.0", "::", "") else "127.0.0.1")
        return f"tcp://{host}:{self.port}/{self.token}"

    def uri(self, name: str) -> str:
        return f"{self.base_uri}/{name}"

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

    def _handle(self, sock: socket.socket) -> None:
        sock.settimeout(STALL_S)
        try:
            line = bytearray()
            while not line.endswith(b"\n") and len(line) < _MAX_LINE:
                c = sock.recv(_MAX_LINE - len(line))
                if not c:
                    return
                line += c
            parts = line.decode("ascii", "replace").split()
            if len(parts) != 3 or parts[0] != "GET":
                sock.sendall(b"ERR bad request\n")
                return
            _, token, name = parts
            if not secrets.compare_digest(token, self.token):
                sock.sendall(b"ERR bad token\n")
                return
            if not _NAME.match(name):
                sock.sendall(b"ERR bad name\n")
                return
            try:
                f = open(self.root / name, "rb")  # noqa: SIM115 - closed by the with below
            except OSError:
                sock.sendall(b"ERR not found\n")
                return
            with f:
                size = os.fstat(f.fileno()).st_size
                sock.sendall(f"OK {size}\n".encode())
                self.served += sock.sendfile(f, 0, size)  # os.sendfile, waiting on the timeout
        except OSError as e:  # the reader went away or stalled: its own error to report
            log.debug("weight server: a transfer ended early: %s", e)


def parse_tcp_uri(uri: str) -> tuple[str, int, str, str]:
    """``(host, port, token, name)`` of ``tcp://host:port/token/name``; ``ValueError`` else."""
    u = urlparse(uri)
    parts = u.path.lstrip("/").split("/")
    if u.scheme != "tcp" or not u.hostname or not u.port or len(parts) != 2 or not all(parts):
        raise ValueError(f"not a weight server uri (tcp://host:port/token/name): {uri!r}")
    return u.hostname, u.port, parts[0], parts[1]


def fetch_blob(host: str, port: int, token: str, name: str, *, into: bytearray | None = None,
               stall_s: float = STALL_S) -> memoryview:
    """The bytes of ``name`` from a :class:`WeightServer` (blocking: call it off the loop).
    ``OSError`` with what failed: the server unreachable, a refusal, or a transfer cut short.

    ``into``: a buffer to receive into when it is large enough (the view returned says which
    buffer holds the bytes: ``.obj``), to reuse for the next bucket: a fresh buffer per
    bucket costs its page faults, about a third of the speed here."""
    where = f"weight server {host}:{port}"
    try:
        s = socket.create_connection((host, port), timeout=stall_s)
    except OSError as e:
        raise OSError(f"cannot reach the trainer's {where} (trainer.weights: tcp; is the "
                      f"trainer up and its port open to this host?): {e}") from e
    with s:
        s.sendall(f"GET {token} {name}\n".encode())
        head = bytearray()
        while not head.endswith(b"\n"):
            c = s.recv(1)
            if not c:
                raise OSError(f"{where} closed the connection before answering for {name}")
            head += c
            if len(head) > _MAX_LINE:
                raise OSError(f"{where}: malformed answer for {name}")
        status, _, rest = head.decode("ascii", "replace").strip().partition(" ")
        if status != "OK":
            raise OSError(f"{where} refused {name}: {rest or head!r}")
        size = int(rest)
        # a buffer too small is replaced, never resized (the caller's views of it stay valid)
        buf = into if into is not None and len(into) >= size else bytearray(size)
        mv = memoryview(buf)[:size]
        got = 0
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


def advertised_host(nats_url: str | None) -> str:
    """The address of this host on the route to ``nats_url`` (what other hosts of the run
    reach it at); 127.0.0.1 for a loopback or missing server."""
    first = nats_url.split(",")[0].strip() if nats_url else ""
    host = urlparse(first).hostname if first else None
    if not host or host in ("localhost", "127.0.0.1", "::1"):
        return "127.0.0.1"
    with contextlib.suppress(OSError), socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        s.connect((host, 4222))  # UDP: no packet is sent, the kernel picks the route
        return s.getsockname()[0]
    return socket.gethostbyname(socket.gethostname())


class TcpBlobs:
    """The read side of a :class:`WeightServer` as a blob store (``get`` only: the trainer
    writes its stream folder directly). Two receive buffers, used in turn: a bucket's bytes
    stay valid until the second ``get`` after it (the assembler's staged file hashes one
    bucket behind while the next arrives, :class:`~rollart.engines.weight_stream.StagedFile`)."""

    def __init__(self, host: str, port: int, token: str):
        self.host, self.port, self.token = host, port, token
        self.where = f"the trainer's weight server {host}:{port}"
        self._bufs = [bytearray(), bytearray()]
        self._turn = 0

    async def get(self, name: str) -> memoryview:
        i = self._turn
        self._turn ^= 1
        try:  # into the buffer of two gets ago: consumed by now
            view = await asyncio.to_thread(fetch_blob, self.host, self.port, self.token,
                                           name, into=self._bufs[i])
        except OSError as e:
            if "not found" in str(e):
                raise KeyError(name) from None
            raise
        self._bufs[i] = view.obj  # a larger one when the bucket did not fit
        return view

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
        return f"tcp://{self.host}:{self.port}/{self.token}/{name}"

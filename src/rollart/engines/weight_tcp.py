"""A direct TCP path for weight buckets: the trainer serves its stream folder, generators
read from it at socket speed (``trainer.weights: tcp``).

Why not the object store for every version: nats-py moves an object in 128 KiB chunk
messages, each published, acked and reassembled in Python: ~170-260 MB/s on this machine
where plain loopback TCP moves ~3 GB/s (``benchmarks/weight_sync.py`` measures both). Here
the trainer's process answers each request with ``sendfile`` of the bucket file and the
reader ``recv_into`` one preallocated buffer, so a version travels near the link's speed.

Who may fetch, and what a peer can make either side spend (issue 43):

- the server listens on the address it advertises (``trainer.sync.host``: empty), never on
  every interface unless told (``0.0.0.0``);
- it serves the files of one folder by plain name (no path, no link followed) to holders of
  a per-process random token. The token is NOT in the version's URI (KV ``policy.version``
  and ``policy.published``, which env, scheduler and monitor credentials read): the trainer
  puts it in the run's weights object store (:data:`TOKEN_OBJECT`), which only the trainer
  and generate roles may read (:data:`rollart.security.permissions.OBJECTS`);
- at most ``max_connections`` connections at once (the next are answered ``ERR busy``, or
  under TLS closed before the handshake: a reader waits either out), and the TLS handshake
  and the request line must arrive within ``request_s`` in all (a deadline for the whole
  of them, not per read: a peer trickling bytes holds a place that long);
  the token is compared as bytes, so any input is a refusal, never an exception;
- the client never allocates what the server announces beyond what the caller expects (the
  bucket's wire size from the checked manifest): ``OK <size>`` above it is refused unread.

TLS (``trainer.sync.tls``; by default on when the run's NATS connection uses TLS): the
server makes a fresh self-signed certificate as it starts and the trainer publishes its
SHA-256 beside the token (:class:`WeightAccess`); the client pins it, so the token and the
bytes travel only inside TLS and only to the server that holds that key
(:mod:`rollart.engines.weight_tls`). Under TLS the server sends from a buffer
(:data:`TLS_CHUNK`) instead of ``sendfile``, which cannot encrypt. Without TLS the bytes and
the token travel in cleartext. Integrity does not rest on the channel either way: every
bucket's XXH3 is in the manifest and the assembled version must have the content digest the
trainer announced on the bus (:mod:`rollart.engines.weight_stream`), so a tampered byte is
refused, never served.

Protocol, one request per connection (buckets are tens of MB: a connection costs nothing
next to them), inside TLS when it is on: the client sends ``GET <token> <name>\\n``; the
server answers ``OK <size>\\n`` and the file's bytes, or ``ERR <reason>\\n``.
"""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import logging
import os
import re
import secrets
import socket
import socketserver
import ssl
import stat
import threading
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Annotated, Any, Literal
from urllib.parse import urlparse

import msgspec

from rollart.bus.base import ObjectTooLarge

from .weight_limits import BLOB_NAME_RE, StreamError, check_blob_name
from .weight_tls import PinMismatch, connect, server_context

__all__ = ["TOKEN_OBJECT", "BlobRefused", "TcpBlobs", "WeightAccess", "WeightServer",
           "advertised_host", "fetch_blob", "parse_tcp_uri", "tls_wanted", "token_reader"]

log = logging.getLogger(__name__)

_NAME = re.compile(BLOB_NAME_RE.encode())
TOKEN_RE = r"^[A-Za-z0-9_-]{16,128}$"
_TOKEN = re.compile(TOKEN_RE)
_SIZE = re.compile(r"^[0-9]{1,19}$")
_MAX_LINE = 512
STALL_S = 30.0
"""Seconds a read may receive nothing before it fails (a server gone mid-transfer)."""
REQUEST_S = 10.0
"""Seconds a client has to send its whole request line."""
MAX_CONNECTIONS = 64
"""Connections a weight server serves at once (``trainer.sync.max_connections``)."""
TOKEN_OBJECT = "weight-server.token"
"""The object of the run's weights store that holds the weight server's token: the plain
token (a cleartext server, as before TLS) or a :class:`WeightAccess` record (JSON)."""
_MAX_ACCESS = 1024
"""Bytes :data:`TOKEN_OBJECT` may hold (a record is ~150)."""
TLS_CHUNK = 1 << 20
"""Bytes a TLS connection reads from the file and encrypts at a time (one buffer per
connection: ``max_connections`` MiB at most)."""
_TLS_HANDSHAKE = b"\x16"
"""The first byte of a TLS client's first record (a handshake record)."""
_TLS_ONLY = b"ERR TLS only (trainer.sync.tls): this client has no certificate pinned\n"


class WeightAccess(msgspec.Struct, frozen=True):
    """What a generator needs to fetch from the weight server: its token and, when it
    serves TLS, the SHA-256 of its certificate (lowercase hex; "": cleartext)."""

    token: Annotated[str, msgspec.Meta(pattern=TOKEN_RE)]
    cert_sha256: Annotated[str, msgspec.Meta(pattern=r"^(|[0-9a-f]{64})$")] = ""


def tls_wanted(setting: bool | Literal["auto"], nats: Any) -> bool:
    """Whether the weight server serves TLS: ``trainer.sync.tls`` when true or false;
    ``auto``: when the run's NATS connection uses TLS (``nats`` is its
    :class:`~rollart.config.nats.NatsConfig`: ``nats.tls`` set, or a ``tls://``/``wss://``
    URL)."""
    if setting != "auto":
        return bool(setting)
    if nats is None:
        return False
    urls = [*(getattr(nats, "urls", None) or []), getattr(nats, "url", None) or ""]
    return getattr(nats, "tls", None) is not None or any(
        urlparse(u).scheme in ("tls", "wss") for u in urls if "://" in u)


class BlobRefused(OSError):
    """The weight server (or the client's own bound) refused a blob; ``reason`` is the
    server's word (``not found``, ``bad token``, ``busy``...) or ``too large``."""

    def __init__(self, msg: str, reason: str):
        super().__init__(msg)
        self.reason = reason


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
        while b"\n" not in line and len(line) < _MAX_LINE:
            left = deadline - time.monotonic()
            if left <= 0:
                raise TimeoutError
            sock.settimeout(left)
            c = sock.recv(_MAX_LINE - len(line))
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
            if first and first != _TLS_HANDSHAKE:  # a cleartext client: told so in cleartext
                sock.sendall(_TLS_ONLY)
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
            if not _NAME.match(name):
                sock.sendall(b"ERR bad name\n")
                return
            try:  # no link followed, nothing but a regular file (a FIFO would block)
                fd = os.open(self.root / name.decode(), os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK
                             | os.O_CLOEXEC)
            except OSError:
                sock.sendall(b"ERR not found\n")
                return
            with open(fd, "rb") as f:
                st = os.fstat(fd)
                if not stat.S_ISREG(st.st_mode):
                    sock.sendall(b"ERR not found\n")
                    return
                size = st.st_size
                sock.settimeout(STALL_S)
                sock.sendall(f"OK {size}\n".encode())
                self._send(sock, f, size)
        except OSError as e:  # the reader went away or stalled: its own error to report
            log.debug("weight server: a transfer ended early: %s", e)


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
        if len(head) > _MAX_LINE:
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
            if not _SIZE.match(rest):
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


def read_access(raw: bytes, where: str) -> WeightAccess:
    """The :class:`WeightAccess` in :data:`TOKEN_OBJECT`'s bytes: a JSON record, or the
    plain token of a cleartext server; ``StreamError`` for anything else (never echoed)."""
    if len(raw) > _MAX_ACCESS:
        raise StreamError(f"{TOKEN_OBJECT} in {where} is larger than {_MAX_ACCESS} bytes")
    if raw[:1] == b"{":
        try:
            return msgspec.json.decode(raw, type=WeightAccess)
        except msgspec.DecodeError as e:  # ValidationError too: names the field, not the value
            raise StreamError(f"{TOKEN_OBJECT} in {where} is not a weight server record "
                              f"({str(e)[:120]})") from None
    token = bytes(raw).decode("ascii", "replace").strip()
    if not _TOKEN.match(token):
        raise StreamError(f"{TOKEN_OBJECT} in {where} is not a weight server token")
    return WeightAccess(token=token)


def token_reader(bus: Any, bucket: str) -> Callable[[], Awaitable[WeightAccess]]:
    """A function that reads the weight server's token (and its pinned certificate, under
    TLS) from the run's weights store ``bucket`` (:data:`TOKEN_OBJECT`, put there by the
    trainer as it starts its server)."""

    async def read() -> WeightAccess:
        try:
            raw = await (await bus.object_store(bucket)).get(TOKEN_OBJECT, max_bytes=_MAX_ACCESS)
        except KeyError:
            raise StreamError(f"the weight server's token is not in the run's weights store "
                              f"{bucket} (yet): the trainer puts it there as it starts its "
                              f"server") from None
        except ObjectTooLarge:
            raise StreamError(f"{TOKEN_OBJECT} in {bucket} is larger than {_MAX_ACCESS} bytes: "
                              f"not a weight server record") from None
        return read_access(bytes(raw), bucket)

    return read


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

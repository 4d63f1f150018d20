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

This module is that protocol and what both ends share (limits, the access record, the
server's address); :mod:`~rollart.engines.weight_tcp_server` is the trainer's end and
:mod:`~rollart.engines.weight_tcp_client` the generators'.
"""

from __future__ import annotations

import contextlib
import re
import socket
from typing import Annotated, Any, Literal
from urllib.parse import urlparse

import msgspec

from .weight_limits import BLOB_NAME_RE, StreamError

__all__ = ["MAX_CONNECTIONS", "REQUEST_S", "STALL_S", "TLS_CHUNK", "TOKEN_OBJECT", "BlobRefused",
           "WeightAccess", "advertised_host", "read_access", "tls_wanted"]

NAME_PATTERN = re.compile(BLOB_NAME_RE.encode())
TOKEN_RE = r"^[A-Za-z0-9_-]{16,128}$"
TOKEN_PATTERN = re.compile(TOKEN_RE)
SIZE_PATTERN = re.compile(r"^[0-9]{1,19}$")
MAX_LINE = 512
STALL_S = 30.0
"""Seconds a read may receive nothing before it fails (a server gone mid-transfer)."""
REQUEST_S = 10.0
"""Seconds a client has to send its whole request line."""
MAX_CONNECTIONS = 64
"""Connections a weight server serves at once (``trainer.sync.max_connections``)."""
TOKEN_OBJECT = "weight-server.token"
"""The object of the run's weights store that holds the weight server's token: the plain
token (a cleartext server, as before TLS) or a :class:`WeightAccess` record (JSON)."""
MAX_ACCESS = 1024
"""Bytes :data:`TOKEN_OBJECT` may hold (a record is ~150)."""
TLS_CHUNK = 1 << 20
"""Bytes a TLS connection reads from the file and encrypts at a time (one buffer per
connection: ``max_connections`` MiB at most)."""
TLS_HANDSHAKE = b"\x16"
"""The first byte of a TLS client's first record (a handshake record)."""
TLS_ONLY = b"ERR TLS only (trainer.sync.tls): this client has no certificate pinned\n"


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


def read_access(raw: bytes, where: str) -> WeightAccess:
    """The :class:`WeightAccess` in :data:`TOKEN_OBJECT`'s bytes: a JSON record, or the
    plain token of a cleartext server; ``StreamError`` for anything else (never echoed)."""
    if len(raw) > MAX_ACCESS:
        raise StreamError(f"{TOKEN_OBJECT} in {where} is larger than {MAX_ACCESS} bytes")
    if raw[:1] == b"{":
        try:
            return msgspec.json.decode(raw, type=WeightAccess)
        except msgspec.DecodeError as e:  # ValidationError too: names the field, not the value
            raise StreamError(f"{TOKEN_OBJECT} in {where} is not a weight server record "
                              f"({str(e)[:120]})") from None
    token = bytes(raw).decode("ascii", "replace").strip()
    if not TOKEN_PATTERN.match(token):
        raise StreamError(f"{TOKEN_OBJECT} in {where} is not a weight server token")
    return WeightAccess(token=token)


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



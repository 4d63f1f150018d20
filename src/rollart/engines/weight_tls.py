"""TLS for the trainer's weight server (``trainer.sync.tls``), without a CA.

The run's certificates (``rollart secure init``) are the NATS server's: the trainer's host
has none of its own, and a CA key on every trainer host would be a worse secret to spread
than the one it protects. So the weight server makes a fresh self-signed certificate each
time it starts (ECDSA P-256) and the trainer publishes its SHA-256 next to the server's
token, in the run's weights object store (:data:`rollart.engines.weight_tcp.TOKEN_OBJECT`),
which reaches generators over the authenticated NATS connection. A client trusts no CA and
no host name: after the handshake it compares the peer's certificate with that pin, and
sends its token only to the server that holds the pinned key. That authenticates the server
and encrypts the channel, which is all a CA would add here.

What it departs from: the client's ``verify_mode`` is ``CERT_NONE`` on purpose (the pin is
the check, made by :func:`check_pin` before a byte of the request is sent); the certificate's
dates are not checked either (a pin names one key, for one launch of one server).
"""

from __future__ import annotations

import datetime
import hashlib
import hmac
import os
import re
import secrets
import socket
import ssl
import tempfile

from rollart.errors import ConfigError

from .weight_limits import StreamError

__all__ = ["CERT_SHA256_RE", "PinMismatch", "check_pin", "client_context", "connect",
           "server_context"]

CERT_SHA256_RE = r"^[0-9a-f]{64}$"
"""A pinned certificate: the lowercase hex SHA-256 of its DER form."""
_PIN = re.compile(CERT_SHA256_RE)


class PinMismatch(StreamError):
    """The weight server presented another certificate than the one pinned: nothing was
    sent to it and nothing read from it."""


def server_context() -> tuple[ssl.SSLContext, str]:
    """A server context holding a fresh self-signed certificate, TLS 1.3 only, and that
    certificate's SHA-256 (hex) to publish. ``ConfigError`` without the ``cryptography``
    package (the ``secure`` extra)."""
    try:  # deferred: an optional dependency (rollart[secure]), needed only with TLS on
        from cryptography import x509
        from cryptography.hazmat.primitives import hashes, serialization
        from cryptography.hazmat.primitives.asymmetric import ec
        from cryptography.x509.oid import NameOID
    except ImportError:
        raise ConfigError("trainer.sync.tls needs the cryptography package (pip install "
                          "'rollart[secure]'), or trainer.sync.tls: false for cleartext") from None
    key = ec.generate_private_key(ec.SECP256R1())
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "rollart weight server")])
    now = datetime.datetime.now(datetime.timezone.utc)
    cert = (x509.CertificateBuilder().subject_name(name).issuer_name(name)
            .public_key(key.public_key()).serial_number(x509.random_serial_number())
            .not_valid_before(now - datetime.timedelta(hours=1))
            .not_valid_after(now + datetime.timedelta(days=3650))  # the pin is the check
            .sign(key, hashes.SHA256()))
    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    ctx.minimum_version = ssl.TLSVersion.TLSv1_3
    # ssl loads a key only from a file: it lies there a moment, encrypted with a password
    # that never leaves this process, in a folder only this user may open
    password = secrets.token_bytes(32)
    pem = cert.public_bytes(serialization.Encoding.PEM) + key.private_bytes(
        serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
        serialization.BestAvailableEncryption(password))
    with tempfile.TemporaryDirectory(prefix="rollart-weight-tls-") as d:
        path = os.path.join(d, "server.pem")
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
        with open(fd, "wb") as f:
            f.write(pem)
        ctx.load_cert_chain(path, password=password)
    return ctx, hashlib.sha256(cert.public_bytes(serialization.Encoding.DER)).hexdigest()


def client_context() -> ssl.SSLContext:
    """A client context that trusts the pin alone (:func:`check_pin`), TLS 1.3 only."""
    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
    ctx.check_hostname = False
    ctx.verify_mode = ssl.CERT_NONE
    ctx.minimum_version = ssl.TLSVersion.TLSv1_3
    return ctx


def check_pin(sock: ssl.SSLSocket, pin: str, where: str) -> None:
    """``PinMismatch`` unless the peer of the handshaken ``sock`` holds the certificate
    whose SHA-256 is ``pin`` (compared in constant time)."""
    der = sock.getpeercert(binary_form=True) or b""
    want = bytes.fromhex(pin) if _PIN.match(pin) else b""
    if not want or not hmac.compare_digest(hashlib.sha256(der).digest(), want):
        raise PinMismatch(f"{where} presented a certificate other than the one the trainer "
                          f"published")


_CLIENT: ssl.SSLContext | None = None


def connect(s: socket.socket, where: str, pin: str, stall_s: float) -> ssl.SSLSocket | None:
    """``s`` inside TLS with the server that holds the pinned certificate (:class:`PinMismatch`
    for another, before a byte is sent); None when the server closed during the handshake
    (busy: it closes before a handshake, or going away); ``OSError`` for one that does not
    speak TLS or no handshake within ``stall_s``."""
    global _CLIENT
    if _CLIENT is None:
        _CLIENT = client_context()  # one per process: no CA to load
    tls = _CLIENT.wrap_socket(s, do_handshake_on_connect=False)
    try:
        tls.settimeout(stall_s)  # a deadline for the whole handshake
        tls.do_handshake()
    except (ConnectionResetError, ConnectionAbortedError, BrokenPipeError, ssl.SSLEOFError,
            ssl.SSLZeroReturnError):
        tls.close()
        return None
    except TimeoutError:
        tls.close()
        raise OSError(f"{where}: no TLS handshake within {stall_s:.0f}s") from None
    except ssl.SSLError as e:
        tls.close()
        raise OSError(f"{where} does not speak TLS 1.3 ({e.reason or e}), yet the trainer "
                      f"published a certificate for it: an older trainer's server, or another "
                      f"process on its port") from None
    try:
        check_pin(tls, pin, where)
    except PinMismatch:
        tls.close()
        raise
    return tls

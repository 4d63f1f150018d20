"""NATS URLs and listen addresses: checking them and showing them without their secrets.

A leaf (standard library only), so that the config's checks and the bus's connection code and
log lines share one :func:`redact` without importing each other.
"""

from __future__ import annotations

from collections.abc import Sequence
from urllib.parse import urlsplit, urlunsplit


def redact(url: str | Sequence[str] | None) -> str:
    """``url`` for display: a password or token in it becomes ``***``
    (``nats://u:***@h:4222``); several URLs are joined with commas."""
    if url is None:
        return ""
    if not isinstance(url, str):
        return ",".join(redact(u) for u in url)
    if "@" not in url:
        return url
    try:
        parts = urlsplit(url if "://" in url else f"nats://{url}")
    except ValueError:
        return "<a URL with credentials>"
    userinfo, _, hostport = parts.netloc.rpartition("@")
    user, sep, _ = userinfo.partition(":")
    shown = f"{user}:***" if sep else "***"  # user:password@, or token@
    out = urlunsplit(parts._replace(netloc=f"{shown}@{hostport}"))
    return out if "://" in url else out.split("://", 1)[1]


def check_nats_url(key: str, url: str, *, memory: bool = True) -> None:
    """Raise ``ValueError`` naming ``key`` unless ``url`` is a NATS URL (``nats://host:port``,
    ``tls://``, ``ws://``, ``wss://``, or ``host:port``; ``memory`` where allowed) without
    credentials in it. The message never repeats a password or token."""
    if memory and url == "memory":
        return
    shown = redact(url)
    if not url.strip():
        raise ValueError(f"{key} must be a NATS URL such as nats://host:4222 (it is empty)")
    try:
        parts = urlsplit(url if "://" in url else f"nats://{url}")
        parts.port  # noqa: B018 - raises ValueError on a bad port
    except ValueError as e:
        raise ValueError(f"{key}: {shown} is not a NATS URL ({e})") from None
    if parts.username is not None or parts.password is not None or "@" in parts.netloc:
        raise ValueError(
            f"{key}: {shown} holds credentials (user:password@ or token@), which would end up in "
            f"configs, logs and process lists; give them from a file or an environment variable "
            f"instead: nats.user with nats.password_file or nats.password_env (or nats.token_file "
            f"/ nats.token_env; on the command line --user and --password-file)")
    if parts.scheme not in ("nats", "tls", "ws", "wss") or not parts.hostname:
        raise ValueError(f"{key}: {shown} is not a NATS URL: write nats://HOST:PORT "
                         f"(or tls://, ws://, wss://)")


def split_listen(listen: str, key: str = "nats.listen") -> tuple[str, int]:
    """``HOST`` or ``HOST:PORT`` (``[::1]:4222`` for IPv6) as ``(host, port)``; port 0 when
    not given (the embedded server picks a free one)."""
    text = listen.strip()
    host, port = text, ""
    if text.startswith("["):
        end = text.find("]")
        if end < 0:
            raise ValueError(f"{key}: {listen!r} is not HOST or HOST:PORT (an unclosed '[')")
        host, rest = text[1:end], text[end + 1:]
        if rest and not rest.startswith(":"):
            raise ValueError(f"{key}: {listen!r} is not HOST or HOST:PORT")
        port = rest[1:]
    elif text.count(":") == 1:
        host, port = text.split(":")
    if not host:
        raise ValueError(f"{key}: {listen!r} has no host: write 127.0.0.1, 0.0.0.0:4222, ...")
    if port:
        if not port.isdigit() or not 0 <= int(port) <= 65535:
            raise ValueError(f"{key}: the port of {listen!r} must be a number in [0, 65535]")
    return host, int(port or 0)

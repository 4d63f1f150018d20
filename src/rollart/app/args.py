"""Command-line pieces every rollart command shares: the NATS flags, the bus a command
runs on, the event loop, quiet third-party logging."""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import logging
from collections.abc import Callable
from pathlib import Path

from rollart.bus.auth import resolve
from rollart.bus.connect import bus_from_config
from rollart.bus.memory import MemoryBus
from rollart.bus.server import EmbeddedServer
from rollart.config import RunConfig

log = logging.getLogger(__name__)


SECRETS_NOTE = ("secrets come only from files or environment variables (nats.password_env, "
                "nats.token_env), never from the command line")


def add_nats_args(p: argparse.ArgumentParser, *, url_help: str, required: bool = False) -> None:
    """``--nats URL`` and the credential flags (``--user``, ``--password-file``, ``--token-file``,
    ``--creds``, ``--tls-ca``) that override the config's ``nats:`` section on this host
    (:func:`nats_overrides` reads them back)."""
    p.add_argument("--nats", default=None, required=required, metavar="URL", help=url_help)
    p.add_argument("--js-domain", default=None, metavar="DOMAIN",
                   help="JetStream domain of the run's streams (nats.domain): the hub's, when "
                        "--nats is a site's leaf nats-server (`rollart cluster sites`)")
    g = p.add_argument_group(
        "NATS credentials", "override the config's nats: section on this host (one shared config "
        f"serves every host; each passes its own credential); {SECRETS_NOTE}")
    g.add_argument("--user", default=None, metavar="NAME",
                   help="user name (its password: --password-file, or the config's password_file / "
                        "password_env)")
    g.add_argument("--password-file", default=None, metavar="FILE",
                   help="file holding the password of --user (first line)")
    g.add_argument("--token-file", default=None, metavar="FILE", help="file holding an auth token")
    g.add_argument("--creds", default=None, metavar="FILE", help="NATS credentials file (JWT and NKey seed)")
    g.add_argument("--tls-ca", default=None, metavar="FILE",
                   help="CA certificate (PEM) that signed the server's certificate: connect with TLS")


def nats_overrides(args: argparse.Namespace) -> dict:
    """The NATS flags of ``args`` (:func:`add_nats_args`, and a node's ``--listen`` /
    ``--server-config``) as overrides for :func:`rollart.bus.auth.resolve`."""
    return {"url": getattr(args, "nats", None), "user": getattr(args, "user", None),
            "password_file": getattr(args, "password_file", None),
            "token_file": getattr(args, "token_file", None), "creds_file": getattr(args, "creds", None),
            "tls_ca": getattr(args, "tls_ca", None), "listen": getattr(args, "listen", None),
            "server_config": getattr(args, "server_config", None),
            "domain": getattr(args, "js_domain", None)}


@contextlib.asynccontextmanager
async def open_bus(cfg: RunConfig, nats: str | None, overrides: dict | None = None):
    """The bus a command runs on: ``memory``, a NATS URL, or an embedded server (default;
    listening on ``nats.listen``, started with ``nats.server_config``). ``overrides``: the
    command line's NATS flags (:func:`nats_overrides`); ``nats`` wins over their ``url``."""
    ns = resolve(cfg, {**(overrides or {}), **({"url": nats} if nats else {})})
    if ns.url == "memory":
        bus = MemoryBus()
        await bus.connect()
        try:
            yield bus
        finally:
            await bus.close()
        return
    server = bus = None
    if not ns.joins:
        host, port = ns.listen_address()
        server = EmbeddedServer(Path(cfg.run_dir) / cfg.run / "nats", host, port,
                                config_file=ns.server_config)
        server.start()  # in this thread: the server gets SIGTERM when it exits
        log.info("embedded nats-server at %s", server.url)
    try:
        bus = bus_from_config(ns, url=server.url if server else None, name=f"rollart-{cfg.run}",
                              local=server is not None, replicas=cfg.node.stream_replicas)
        await bus.connect()
        yield bus
    finally:
        if bus is not None:
            await bus.close()
        if server is not None:
            await asyncio.to_thread(server.stop)


def quiet_libraries() -> None:
    """No transformers progress bars or info lines in a command's output."""
    try:
        from transformers.utils import logging as hf_logging  # optional: the train extra

        hf_logging.disable_progress_bar()
        hf_logging.set_verbosity_error()
    except ImportError:
        pass


def event_loop_runner() -> Callable:
    """``uvloop.run`` where uvloop is installed (every platform but Windows), else
    ``asyncio.run``."""
    try:
        import uvloop  # a dependency everywhere but on Windows
    except ImportError:
        return asyncio.run
    return uvloop.run

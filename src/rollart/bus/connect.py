"""Building a :class:`~rollart.bus.nats.NatsBus` from a config: the one place that puts the
settings (:mod:`rollart.bus.auth`) and the bus (:mod:`rollart.bus.nats`) together, so that
neither imports the other::

    bus = bus_from_config(cfg, name="rollart-top", overrides={"user": "alice",
                                                               "password_file": "/etc/rollart/pw"})
    await bus.connect()
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from rollart.bus.auth import connect_options, resolve
from rollart.bus.nats import NatsBus
from rollart.config.urls import check_nats_url
from rollart.errors import ConfigError


def bus_from_config(settings: Any = None, *, url: str | Sequence[str] | None = None,
                    name: str = "rollart", overrides: Mapping[str, Any] | None = None,
                    local: bool = False, replicas: int | None = None, **bus_kwargs: Any) -> NatsBus:
    """A (not yet connected) :class:`~rollart.bus.nats.NatsBus` for ``settings`` (a RunConfig,
    a NatsConfig, a URL string or None) with the command-line ``overrides`` of
    :func:`~rollart.bus.auth.resolve`.

    ``url``: connect there instead of the configured URL (an embedded server's); ``local``:
    that server is this host's own (TLS checks the name ``localhost``). ``replicas``: the bus's
    :attr:`~rollart.bus.nats.NatsBus.replicas` (``node.stream_replicas``; None: that of
    ``settings`` when it is a RunConfig, else 1). ``bus_kwargs`` go to
    NatsBus (``connect_timeout``, ...). Raises ``ConfigError`` for a setting that cannot work
    (no URL, a URL with a password in it, an unreadable secret file, an unset variable)."""
    ns = resolve(settings, overrides)
    if url is not None:
        servers = [url] if isinstance(url, str) else list(url)
    else:
        servers = list(ns.urls) or ([ns.url] if ns.url else [])
    if not servers or servers == ["memory"]:
        raise ConfigError("no nats-server URL to connect to: give nats.url or --nats "
                          "(an embedded server is started by `rollart run` and `python -m rollart.node`)")
    for i, u in enumerate(servers):
        try:
            check_nats_url("--nats" if len(servers) == 1 else f"nats.urls[{i}]", u, memory=False)
        except ValueError as e:
            raise ConfigError(str(e)) from None
    bus = NatsBus(servers[0] if len(servers) == 1 else servers, name=name,
                  auth=connect_options(ns, local=local), settings=ns, domain=ns.domain,
                  **bus_kwargs)
    if replicas is None:
        replicas = getattr(getattr(settings, "node", None), "stream_replicas", None)
    if replicas is not None:
        bus.replicas = int(replicas)
    return bus

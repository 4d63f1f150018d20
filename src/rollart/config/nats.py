"""The ``nats:`` section of a run's config: where nats-server is, how to authenticate to it
(secrets only from files or environment variables) and how the embedded one listens."""

from __future__ import annotations

import re

from rollart.config.base import Base
from rollart.config.urls import check_nats_url, split_listen

_ENV_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")
_DOMAIN = re.compile(r"[A-Za-z0-9_-]{1,64}")


class NatsTlsConfig(Base):
    """TLS of the connections to nats-server."""

    ca: str | None = None
    """CA certificate file (PEM) that signed the server's certificate; empty: the system's
    CAs are trusted."""
    cert: str | None = None
    """Client certificate file (PEM), for a server that verifies its clients."""
    key: str | None = None
    """Private key file (PEM) of ``cert`` (empty: ``cert`` holds both)."""
    verify: bool = True
    """Check the server's certificate and its host name; ``false`` still encrypts but trusts
    any server (a man in the middle too): for tests only."""
    server_name: str | None = None
    """Host name the server's certificate must hold; default: the host of the URL
    (``localhost`` when a node connects to its own embedded server)."""

    def __post_init__(self) -> None:
        if self.key and not self.cert:
            raise ValueError("nats.tls.key needs nats.tls.cert: the client certificate it belongs to")


class NatsConfig(Base):
    """Where nats-server is, how to authenticate to it, and how the embedded one listens.
    Secrets come only from files or environment variables: no key holds a password or token."""

    url: str | None = None
    """Server URL to join (``nats://host:4222``, ``tls://host:4222``; ``memory``: the
    in-process bus); empty (and no ``urls``): start an embedded server. Never with
    ``user:password@``: see ``password_file``."""
    urls: list[str] = []
    """Several URLs of one nats-server cluster, instead of ``url``."""
    user: str | None = None
    """User name to authenticate as; its password comes from ``password_file`` or
    ``password_env``."""
    password_file: str | None = None
    """File holding the password of ``user`` (its first line; keep it ``chmod 600``)."""
    password_env: str | None = None
    """Name of the environment variable holding the password of ``user``."""
    token_file: str | None = None
    """File holding an auth token (instead of ``user`` and a password)."""
    token_env: str | None = None
    """Name of the environment variable holding an auth token."""
    nkey_seed_file: str | None = None
    """File holding the NKey seed (``SU...``) of a user the server knows by its public key."""
    creds_file: str | None = None
    """NATS credentials file (user JWT and NKey seed) of an operator/account setup."""
    tls: NatsTlsConfig | None = None
    """TLS settings; empty: plaintext, unless the server requires TLS (then the system's CAs
    are trusted)."""
    listen: str = "127.0.0.1"
    """Address the embedded server listens on: ``HOST`` or ``HOST:PORT`` (default port: a free
    one). Only a non-loopback address (``0.0.0.0:4222``) lets other hosts join, and it needs
    ``server_config`` with authorization."""
    domain: str | None = None
    """JetStream domain of the run's streams (``$JS.<domain>.API``): the hub's, for a node
    whose server is a site's leaf nats-server (``rollart cluster sites``; the hub's
    config names it in ``jetstream { domain }``); empty: the connected server's own
    JetStream. Nodes at the hub may set it too (the hub answers its own domain)."""
    server_config: str | None = None
    """nats-server config file the embedded server starts with (``-c``): users, TLS, accounts
    (``rollart secure init`` writes one); its listen address, store and JetStream are rollart's."""

    def __post_init__(self) -> None:
        if self.url is not None and self.urls:
            raise ValueError("nats.url and nats.urls: give one of them")
        if self.url is not None:
            check_nats_url("nats.url", self.url)
        for i, u in enumerate(self.urls):
            check_nats_url(f"nats.urls[{i}]", u, memory=False)
        for a, b in (("password_file", "password_env"), ("token_file", "token_env")):
            if getattr(self, a) and getattr(self, b):
                raise ValueError(f"nats.{a} and nats.{b}: give one of them")
        for name in ("password_env", "token_env"):
            v = getattr(self, name)
            if v is not None and not _ENV_NAME.fullmatch(v):  # never echo it: it may be the secret
                raise ValueError(f"nats.{name} must be the name of an environment variable "
                                 f"(letters, digits and '_'), not the secret itself")
        for name in ("user", "password_file", "token_file", "nkey_seed_file", "creds_file",
                     "server_config"):
            if getattr(self, name) == "":
                raise ValueError(f"nats.{name} is empty: leave it out, or give a value")
        has_password = bool(self.password_file or self.password_env)
        if has_password and not self.user:
            raise ValueError(f"nats.{'password_file' if self.password_file else 'password_env'} "
                             f"needs nats.user: the user the password belongs to")
        if self.user and not has_password:
            raise ValueError("nats.user needs its password: nats.password_file or nats.password_env")
        methods = [keys for keys in (
            [k for k in ("user", "password_file", "password_env") if getattr(self, k)],
            [k for k in ("token_file", "token_env") if getattr(self, k)],
            ["nkey_seed_file"] if self.nkey_seed_file else [],
            ["creds_file"] if self.creds_file else []) if keys]
        if len(methods) > 1:
            found = " and ".join("/".join(f"nats.{k}" for k in keys) for keys in methods)
            raise ValueError(f"{found}: give at most one way to authenticate (user and password, "
                             f"a token, an NKey seed or a credentials file)")
        split_listen(self.listen)
        if self.domain is not None and not _DOMAIN.fullmatch(self.domain):
            raise ValueError(f"nats.domain {self.domain!r}: a JetStream domain is one token of "
                             "letters, digits, '_' and '-' (the hub's jetstream { domain })")

    @property
    def joins(self) -> bool:
        """True when a URL is given: join that server instead of starting an embedded one."""
        return bool(self.url or self.urls)

    def listen_address(self) -> tuple[str, int]:
        """``listen`` as ``(host, port)`` (port 0: a free one)."""
        return split_listen(self.listen)

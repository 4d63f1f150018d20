"""Credentials and TLS for connections to nats-server. Imports no torch.

A config's ``nats:`` (a URL, or a :class:`~rollart.config.schema.NatsConfig` section) plus a
host's command-line flags become the settings (:func:`resolve`) and the ``nats.connect``
options (:func:`connect_options`) of a :class:`~rollart.bus.nats.NatsBus`, which
:func:`rollart.bus.connect.bus_from_config` builds from them::

    bus = bus_from_config(cfg, name="rollart-top", overrides={"user": "alice",
                                                               "password_file": "/etc/rollart/pw"})
    await bus.connect()

Secrets come only from files or environment variables, read when the bus is built; they are
handed to nats-py as callables (:class:`Secret`) whose ``repr`` never shows them, and no URL,
log line or error message carries one (:func:`redact`). A server that refuses the credentials,
or a TLS failure, is an :class:`AuthError` at once, never retried as if the server were down
(:func:`refusal_kind`, :func:`refusal_message`, used while connecting).

A leaf of the bus: it imports the config and :mod:`rollart.bus.base`, never the bus itself.
"""

from __future__ import annotations

import logging
import os
import ssl
from collections.abc import Mapping
from typing import Any

import msgspec
import nats.errors

from rollart.bus.base import BusError
from rollart.config.schema import NatsConfig, NatsTlsConfig, nats_settings
from rollart.config.urls import redact  # noqa: F401 - part of this module's API (redacted URLs)
from rollart.errors import ConfigError

log = logging.getLogger(__name__)

LOCAL_TLS_NAME = "localhost"
"""The name a node checks its own embedded server's certificate against (it connects by
127.0.0.1); ``rollart secure init`` always puts ``localhost`` and ``127.0.0.1`` in it."""

OVERRIDE_KEYS = ("url", "user", "password_file", "token_file", "creds_file", "tls_ca", "listen",
                 "server_config", "domain")
"""Keys of the command-line overrides (:func:`resolve`); None or absent: not given."""


class AuthError(BusError, ValueError):
    """The server refused this client (credentials), or TLS failed (an untrusted certificate,
    a server without TLS when TLS is configured): waiting longer cannot help."""


class Secret:
    """A password or token for nats-py (which calls it when it sends CONNECT); its ``repr``
    and ``str`` never show it."""

    __slots__ = ("_value",)

    def __init__(self, value: str) -> None:
        self._value = value

    def __call__(self) -> str:
        return self._value

    def __repr__(self) -> str:
        return "Secret('***')"

    __str__ = __repr__


class PlaintextRefused(nats.errors.Error):
    """TLS is configured but the server did not switch to TLS: the password stays unsent."""

    def __str__(self) -> str:
        return "nats: the server does not require TLS"


# -- display -------------------------------------------------------------------------


def describe(ns: NatsConfig) -> str:
    """How ``ns`` authenticates, for messages: ``user 'alice' (password from nats.password_file
    /etc/pw)``; never the secret."""
    if ns.user:
        src = (f"nats.password_file {ns.password_file}" if ns.password_file
               else f"nats.password_env {ns.password_env}")
        return f"user {ns.user!r} (password from {src})"
    if ns.token_file or ns.token_env:
        return (f"a token from nats.token_file {ns.token_file}" if ns.token_file
                else f"a token from nats.token_env {ns.token_env}")
    if ns.nkey_seed_file:
        return f"the NKey seed in nats.nkey_seed_file {ns.nkey_seed_file}"
    if ns.creds_file:
        return f"the credentials in nats.creds_file {ns.creds_file}"
    return "no credentials"


# -- settings: the config plus this host's flags ------------------------------------------


def resolve(settings: Any = None, overrides: Mapping[str, Any] | None = None) -> NatsConfig:
    """The :class:`NatsConfig` of ``settings`` (a RunConfig, a NatsConfig, a URL string or
    None) with command-line ``overrides`` applied (keys of :data:`OVERRIDE_KEYS`; a value of
    None is "not given"): ``url`` (``--nats``), ``user``, ``password_file``, ``token_file``,
    ``creds_file`` (``--creds``), ``tls_ca``, ``listen``, ``server_config``, ``domain``
    (``--js-domain``).

    A credential flag replaces the config's way to authenticate: ``--creds`` drops its user,
    password and token; ``--user``/``--password-file`` drop its token, NKey and credentials
    file (``--user`` alone keeps the config's password source, ``--password-file`` alone its
    user); ``--token-file`` drops the others. Raises ``ConfigError`` naming the key."""
    try:
        ns = nats_settings(settings)
    except (ValueError, msgspec.ValidationError) as e:
        raise ConfigError(str(e)) from None
    given = {k: v for k, v in (overrides or {}).items() if v is not None}
    unknown = set(given) - set(OVERRIDE_KEYS)
    if unknown:
        raise TypeError(f"unknown NATS override(s) {sorted(unknown)}; known: {OVERRIDE_KEYS}")
    if not given:
        return ns
    changes: dict[str, Any] = {}
    none = dict.fromkeys(("user", "password_file", "password_env", "token_file", "token_env",
                          "nkey_seed_file", "creds_file"))
    if "url" in given:
        changes.update(url=given["url"], urls=[])
    if "creds_file" in given:
        changes.update(none, creds_file=given["creds_file"])
    elif "token_file" in given:
        changes.update(none, token_file=given["token_file"])
    elif "user" in given or "password_file" in given:
        changes.update(token_file=None, token_env=None, nkey_seed_file=None, creds_file=None)
        if "user" in given:
            changes["user"] = given["user"]
        if "password_file" in given:
            changes.update(password_file=given["password_file"], password_env=None)
    if "tls_ca" in given:
        changes["tls"] = msgspec.structs.replace(ns.tls or NatsTlsConfig(), ca=given["tls_ca"])
    for k in ("listen", "server_config", "domain"):
        if k in given:
            changes[k] = given[k]
    try:
        return msgspec.structs.replace(ns, **changes)
    except ValueError as e:
        flags = ", ".join(f"--{k.replace('_', '-')}" for k in given if k != "url")
        raise ConfigError(f"{e} (with {flags or '--nats'} from the command line)") from None


# -- what nats.connect gets ------------------------------------------------------------


def _read_secret(key: str, path: str | None, env: str | None) -> Secret:
    if env:
        value = os.environ.get(env)
        if value is None:
            raise ConfigError(f"nats.{key}_env: the environment variable {env} is not set")
        if not value:
            raise ConfigError(f"nats.{key}_env: the environment variable {env} is empty")
        return Secret(value)
    assert path
    try:
        with open(os.path.expanduser(path), encoding="utf-8") as f:
            value = f.readline().rstrip("\r\n")
    except OSError as e:
        raise ConfigError(f"nats.{key}_file: cannot read {path}: {e.strerror or e}") from None
    except UnicodeDecodeError:
        raise ConfigError(f"nats.{key}_file: {path} is not a text file") from None
    if not value:
        raise ConfigError(f"nats.{key}_file: {path} is empty (the {key} is its first line)")
    return Secret(value)


def _check_file(key: str, path: str) -> str:
    full = os.path.expanduser(path)
    try:
        with open(full, "rb"):
            pass
    except OSError as e:
        raise ConfigError(f"{key}: cannot read {path}: {e.strerror or e}") from None
    return full


def tls_context(tls: NatsTlsConfig) -> ssl.SSLContext:
    """A client :class:`ssl.SSLContext`: trusts ``tls.ca`` (else the system's CAs), presents
    ``tls.cert``/``tls.key`` when given, verifies the server unless ``verify: false``."""
    ca = _check_file("nats.tls.ca", tls.ca) if tls.ca else None
    try:
        ctx = ssl.create_default_context(ssl.Purpose.SERVER_AUTH, cafile=ca)
    except ssl.SSLError as e:
        raise ConfigError(f"nats.tls.ca: {tls.ca} is not a PEM CA certificate ({e.reason or e})") from None
    if tls.cert:
        cert = _check_file("nats.tls.cert", tls.cert)
        key = _check_file("nats.tls.key", tls.key) if tls.key else None
        try:
            ctx.load_cert_chain(cert, key)
        except ssl.SSLError as e:
            raise ConfigError(f"nats.tls.cert / nats.tls.key: {tls.cert} and {tls.key or tls.cert} "
                              f"are not a PEM certificate and its key ({e.reason or e})") from None
    if not tls.verify:
        log.warning("nats.tls.verify is false: the server's certificate is not checked")
        ctx.check_hostname = False
        ctx.verify_mode = ssl.CERT_NONE
    return ctx


def inbox_prefix(user: str) -> str:
    """Where replies to ``user`` go: ``_INBOX_<user>`` instead of nats-py's shared ``_INBOX``,
    so that ``rollart secure`` permissions can let each user read its own replies only."""
    return f"_INBOX_{user}"


def connect_options(ns: NatsConfig, *, local: bool = False) -> dict[str, Any]:
    """The credential and TLS keyword arguments of ``nats.connect`` for ``ns``: ``user`` and
    ``password`` or ``token`` (as :class:`Secret`) and the user's ``inbox_prefix``, ``nkeys_seed``, ``user_credentials``,
    ``tls`` and ``tls_hostname``. ``local``: the server is this host's own embedded one,
    reached by 127.0.0.1, whose certificate is checked against ``localhost`` (unless
    ``nats.tls.server_name`` says otherwise). Reads the secrets now; a missing file or unset
    variable is a ``ConfigError`` naming the key."""
    out: dict[str, Any] = {}
    if ns.user:
        out["user"] = ns.user
        out["password"] = _read_secret("password", ns.password_file, ns.password_env)
        out["inbox_prefix"] = inbox_prefix(ns.user)
    elif ns.token_file or ns.token_env:
        out["token"] = _read_secret("token", ns.token_file, ns.token_env)
    elif ns.nkey_seed_file:
        out["nkeys_seed"] = _check_file("nats.nkey_seed_file", ns.nkey_seed_file)
    elif ns.creds_file:
        out["user_credentials"] = _check_file("nats.creds_file", ns.creds_file)
    if ns.tls is not None:
        out["tls"] = tls_context(ns.tls)
        name = ns.tls.server_name or (LOCAL_TLS_NAME if local else None)
        if name:
            out["tls_hostname"] = name
    return out


def has_credentials(options: Mapping[str, Any]) -> bool:
    """Whether ``nats.connect`` options carry credentials or TLS (a watcher needs the same)."""
    return any(k in options for k in ("user", "token", "nkeys_seed", "user_credentials", "tls"))


# -- while connecting ----------------------------------------------------------------------


def guard_plaintext(options: Mapping[str, Any], nc: Any) -> dict[str, Any]:
    """``options`` whose password or token, when TLS is configured, is only handed to nats-py
    once the server has switched the connection to TLS (it says so before CONNECT): a server
    (or a man in the middle) that does not is refused with :class:`PlaintextRefused`
    instead of getting the secret in plaintext."""
    out = dict(options)
    if "tls" not in out:
        return out
    for key in ("password", "token"):
        value = out.get(key)
        if value is None:
            continue

        def guarded(value=value) -> str:
            info = getattr(nc, "_server_info", None) or {}
            if not info.get("tls_required"):
                raise PlaintextRefused()
            return value() if callable(value) else value

        out[key] = guarded
    return out


_TRANSIENT_SSL = (ssl.SSLEOFError, ssl.SSLZeroReturnError, ssl.SSLSyscallError,
                  ssl.SSLWantReadError, ssl.SSLWantWriteError)


def refusal_kind(err: BaseException) -> str | None:
    """``auth``, ``untrusted``, ``tls`` or ``plaintext`` when ``err`` (from nats-py while
    connecting) says the server refused this client or TLS failed, which no retry can mend;
    None for anything else (a server that is not up, a timeout)."""
    if isinstance(err, PlaintextRefused):
        return "plaintext"
    if isinstance(err, nats.errors.AuthorizationError):
        return "auth"
    if isinstance(err, ssl.SSLCertVerificationError):
        return "untrusted"
    if isinstance(err, ssl.SSLError) and not isinstance(err, _TRANSIENT_SSL):
        return "tls"
    if isinstance(err, nats.errors.Error):
        text = str(err).lower()
        if "authorization violation" in text or ("authentication" in text
                                                 and ("expired" in text or "revoked" in text)):
            return "auth"
        if "tls required" in text:
            return "tls-required"
    return None


def refusal_message(err: BaseException, url: str, options: Mapping[str, Any],
                    settings: NatsConfig | None = None) -> str:
    """The one clear line for a refusal (:func:`refusal_kind`) by the server at ``url``
    (already redacted): who was refused, and which key or flag to check."""
    kind = refusal_kind(err)
    tls = settings.tls if settings is not None else None
    if kind == "auth":
        if "user" in options:
            src = "nats.password_file / nats.password_env"
            if settings is not None and settings.password_file:
                src = f"nats.password_file {settings.password_file}"
            elif settings is not None and settings.password_env:
                src = f"nats.password_env {settings.password_env}"
            return (f"authentication failed for user {options['user']!r} at {url}: the server refused "
                    f"the user name or password (check {src} and nats.user; on the command line "
                    f"--user / --password-file)")
        if "token" in options:
            return (f"authentication failed at {url}: the server refused the token (check "
                    f"nats.token_file / nats.token_env or --token-file"
                    f"{'; here: ' + describe(settings) if settings is not None else ''})")
        if "nkeys_seed" in options:
            return (f"authentication failed at {url}: the server does not accept the NKey seed in "
                    f"{options['nkeys_seed']} (check nats.nkey_seed_file: is its public key a user "
                    f"of the server?)")
        if "user_credentials" in options:
            return (f"authentication failed at {url}: the server refused the credentials file "
                    f"{options['user_credentials']} (check nats.creds_file or --creds)")
        return (f"authentication failed at {url}: the server requires credentials and none were "
                f"given (set nats.user with nats.password_file or nats.password_env, "
                f"nats.token_file, nats.nkey_seed_file or nats.creds_file; or pass --user NAME "
                f"--password-file FILE, --token-file FILE or --creds FILE)")
    reason = getattr(err, "verify_message", None) or getattr(err, "reason", None) or str(err)
    if kind == "untrusted":
        if "mismatch" in str(reason).lower():
            host = options.get("tls_hostname") or "the URL's host"
            return (f"TLS: the server certificate at {url} is not valid for {host} ({reason}): "
                    f"connect by a name the certificate holds, or set nats.tls.server_name")
        if tls is not None and tls.ca:
            return (f"TLS: server certificate not trusted (nats.tls.ca {tls.ca}) at {url}: it is "
                    f"not signed by that CA ({reason}); give the CA that signed the server's "
                    f"certificate (--tls-ca)")
        where = ("nats.tls.ca is not set, so only the system's CAs are trusted"
                 if "tls" in options else "the server requires TLS")
        return (f"TLS: server certificate not trusted (nats.tls.ca) at {url}: {where} ({reason}); "
                f"set nats.tls.ca (or --tls-ca) to the CA file that signed the server's certificate")
    if kind == "plaintext":
        return (f"TLS: nats.tls is set but the server at {url} does not require TLS, so the "
                f"credentials were not sent (in plaintext); turn TLS on in the server's config "
                f"(a tls block), or remove nats.tls")
    if kind == "tls-required":
        return (f"TLS: the server at {url} requires TLS: set nats.tls.ca (or --tls-ca) to the CA "
                f"file that signed its certificate")
    if kind == "tls":
        return (f"TLS handshake with {url} failed ({reason}): check nats.tls (ca, and cert/key "
                f"when the server verifies clients)")
    raise ValueError(f"not a refusal: {type(err).__name__}")

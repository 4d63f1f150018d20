"""The connection layer of :class:`rollart.bus.nats.NatsBus`: one nats-py client.

Connecting, reconnecting, outages and closing live here, with the translation of nats-py's
errors into the bus's (:func:`translated`), which every layer above uses.

- With ``max_reconnect_attempts=-1`` nats-py retries the *first* connect forever too: it is
  retried for about ``connect_timeout``, then reconnected forever once up.
- A server that refuses the client while connecting (credentials, TLS) is an
  :class:`~rollart.bus.auth.AuthError` at once, not retried; a password or token is sent only
  once the server has switched to TLS when TLS is configured
  (:func:`~rollart.bus.auth.guard_plaintext`). ``url``, log lines and errors never hold a
  password (:func:`~rollart.bus.auth.redact`).
- An outage is logged once (each failed attempt lands in ``error_cb`` too), a permission
  violation once a minute per subject; a reconnect stops every KV watcher so that its owner
  re-makes it (see :meth:`rollart.bus.nats_state.NatsKeyValue.watch`).
- :meth:`NatsConnection.close` is bounded on a dead server.
- ``domain``: the JetStream domain to reach (``$JS.<domain>.API``). A client of a site's leaf
  nats-server (``rollart cluster sites``) sets the hub's: a leaf server without
  JetStream forwards nothing of the plain ``$JS.API`` (nats-server denies it across a leaf
  link), so the plain API has no responders there, which :func:`translated` says with the fix.

The layers above register what they open on the connection (core subscriptions, pull
subscriptions, watchers) so that a reconnect or a close reaches them; they are typed here by
the protocols :class:`OpenSubscription` and :class:`OpenWatch`, not imported.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import ssl
from collections.abc import Sequence
from time import monotonic
from typing import Any, Protocol

import nats.errors
import nats.js.errors
from nats.aio.client import Client as NATS

from rollart.bus.auth import AuthError, guard_plaintext, refusal_kind, refusal_message
from rollart.bus.base import BusError, BusTimeout, NoResponders
from rollart.config.urls import redact

log = logging.getLogger(__name__)


JS_HINT = ("a site's leaf nats-server has none of its own: set nats.domain (--js-domain) to "
           "the hub's JetStream domain; with it set, the site's link to the hub may be down")


@contextlib.contextmanager
def translated(what: str):
    """Re-raise nats-py (and socket) errors as bus errors."""
    try:
        yield
    except BusError:
        raise
    except nats.errors.NoRespondersError as err:
        raise NoResponders(f"{what}: no responders") from err
    except nats.js.errors.ServiceUnavailableError as err:
        raise BusError(f"{what}: no JetStream answers on this server ({JS_HINT})") from err
    except (TimeoutError, nats.errors.TimeoutError) as err:
        raise BusTimeout(f"{what}: timed out") from err
    except (nats.errors.Error, OSError) as err:
        raise BusError(f"{what}: {type(err).__name__}: {err}") from err


def headers_of(msg) -> dict[str, str]:
    """A nats-py message's headers as a plain dict (empty when it has none)."""
    return dict(msg.headers) if msg.headers else {}


@contextlib.contextmanager
def replicas_hint(what: str, replicas: int):
    """A JetStream refusal of ``replicas`` copies (a single server, or a cluster with fewer
    servers) as a :class:`BusError` that names ``node.stream_replicas``."""
    try:
        yield
    except nats.js.errors.APIError as err:
        text = str(getattr(err, "description", "") or err).lower()
        if replicas > 1 and ("replica" in text or "insufficient resources" in text
                             or "clustered" in text or "no suitable peers" in text):
            raise BusError(
                f"{what}: {replicas} replicas refused by the nats-server ({err}): replicas > 1 "
                f"need a JetStream cluster of at least {replicas} servers (`rollart cluster "
                f"init`); set node.stream_replicas to 1 for a single server") from err
        raise


class OpenSubscription(Protocol):
    """A core subscription on the connection
    (:class:`rollart.bus.nats_consumers.NatsSubscription`)."""

    async def unsubscribe(self) -> None: ...

    def cancel(self) -> None: ...


class OpenWatch(Protocol):
    """A live KV watcher on the connection (:class:`rollart.bus.nats_state.KeyWatch`)."""

    async def stop(self, restart: bool = False) -> None: ...


class NatsConnection:
    """One nats-py connection with JetStream, and the settings of the client on it; the base
    of :class:`rollart.bus.nats.NatsBus`, which adds the bus protocol."""

    def __init__(self, url: str | Sequence[str], *, name: str = "rollart", connect_timeout: float = 5.0,
                 reconnect_time_wait: float = 0.25, ack_timeout: float = 5.0, drain_timeout: float = 10.0,
                 auth: dict | None = None, settings=None, domain: str | None = None) -> None:
        self._servers = [url] if isinstance(url, str) else list(url)
        self.url = redact(self._servers)
        """The server URL(s) for display: never with a password or token in it."""
        self.auth = dict(auth or {})
        """Extra ``nats.connect`` options: credentials and TLS (:func:`rollart.bus.auth.connect_options`)."""
        self.settings = settings
        """The :class:`~rollart.config.schema.NatsConfig` the options came from (error messages
        name its keys), or None."""
        self.domain = domain or None
        """JetStream domain whose API this client calls (None: the server's own JetStream)."""
        self.name = name
        self.connect_timeout = connect_timeout
        self.reconnect_time_wait = reconnect_time_wait
        self.ack_timeout = ack_timeout
        self.drain_timeout = drain_timeout
        self.object_stall_s = 15.0
        """Seconds an object read waits for its next chunk
        (:meth:`rollart.bus.nats_state.NatsObjectStore.get`)."""
        self._nc: NATS | None = None
        self._js = None
        self._subs: list[OpenSubscription] = []
        self._pull_subs: set[Any] = set()  # nats-py pull subscriptions of our consumers
        self._watches: set[OpenWatch] = set()
        self._closed = False
        self._outage_logged = False
        self._outage_since: float | None = None
        """monotonic() when the connection was lost (None while connected): :attr:`outage_s`."""
        self._violations: dict[str, float] = {}
        """Permission violation text -> monotonic() it was last logged (once a minute each)."""
        self._denied: dict[str, float] = {}
        """Permission violation text -> monotonic() it was last seen (:meth:`denied_since`)."""

    async def connect(self) -> None:
        if self._nc is not None:
            return
        nc = NATS()
        # With max_reconnect_attempts=-1 nats-py retries the *first* connect forever
        # too; retry it for about connect_timeout, then reconnect forever once up.
        attempts = max(1, math.ceil(self.connect_timeout / max(self.reconnect_time_wait, 0.01)))
        refused: list[BaseException] = []
        connecting = True

        async def on_error(err: Exception) -> None:
            # A refusal (credentials, TLS) while connecting ends the attempts at once: nats-py
            # raises the error from connect() when reconnecting is off after its error_cb.
            if connecting and refusal_kind(err) is not None:
                refused.append(err)
                nc.options["allow_reconnect"] = False
                return
            if refused:  # closing the refused connection: nothing to report
                log.debug("nats %s: %s: %s", self.url, type(err).__name__, err)
                return
            await self._on_error(err)

        try:
            with translated(f"connect to {self.url}"):
                await nc.connect(
                    servers=self._servers, name=self.name, connect_timeout=self.connect_timeout,
                    reconnect_time_wait=self.reconnect_time_wait, max_reconnect_attempts=attempts,
                    error_cb=on_error, disconnected_cb=self._on_disconnected, reconnected_cb=self._on_reconnected,
                    drain_timeout=self.drain_timeout, **guard_plaintext(self.auth, nc),
                )
        except BusError as err:
            if not refused:
                raise
            # A failed TLS handshake has closed the socket already (and nats-py's close would
            # wait forever for the plaintext stream's end); else close the refused connection.
            if not isinstance(refused[0], ssl.SSLError):
                self._closed = True  # no "disconnected" line for a connection that never was
                try:
                    with contextlib.suppress(Exception):
                        await asyncio.wait_for(nc.close(), 2.0)
                finally:
                    self._closed = False
            raise AuthError(refusal_message(refused[0], self.url, self.auth, self.settings)) from err
        finally:
            connecting = False
        nc.options["max_reconnect_attempts"] = -1
        self._nc, self._js, self._closed, self._outage_logged = nc, nc.jetstream(domain=self.domain), False, False

    def denied_since(self, subject: str, since: float) -> bool:
        """Whether the server refused this credential ``subject`` (a permissions violation,
        which nats-py reports only to the error callback: the request itself just times
        out) at or after ``since`` (``monotonic()``): a refusal, not a slow server."""
        needle = f'"{subject.lower()}"'
        return any(t >= since and needle in text for text, t in self._denied.items())

    async def _on_error(self, err: Exception) -> None:
        text = str(err)
        if "permissions violation" in text.lower():  # not an outage: say each subject once a minute
            seen = self._violations
            now = monotonic()
            if len(self._denied) > 1000:
                self._denied.clear()
            self._denied[text.lower()] = now
            if now - seen.get(text, -1e9) > 60.0:
                if len(seen) > 1000:
                    seen.clear()
                seen[text] = now
                log.warning("nats %s: %s (this credential may not do that: see `rollart secure "
                            "show`)", self.url, text)
            return
        # Logged once per outage: every failed reconnect attempt also lands here.
        if not self._outage_logged:
            self._outage_logged = True
            log.warning("nats %s: %s: %s", self.url, type(err).__name__, err)
        else:
            log.debug("nats %s: %s: %s", self.url, type(err).__name__, err)

    async def _on_disconnected(self) -> None:
        # nats-py calls this once per outage (before its reconnect attempts) and on close.
        if not self._closed:
            if self._outage_since is None:
                self._outage_since = monotonic()
            log.warning("nats %s: disconnected; reconnecting", self.url)

    async def _on_reconnected(self) -> None:
        self._outage_logged = False
        since, self._outage_since = self._outage_since, None
        if since is None:
            log.info("nats %s: reconnected", self.url)
        else:
            log.info("nats %s: reconnected after %.1fs", self.url, monotonic() - since)
        for rec in list(self._watches):
            await rec.stop(restart=True)

    @property
    def api_prefix(self) -> str:
        """The JetStream API's subject prefix: ``$JS.API``, or ``$JS.<domain>.API``."""
        return f"$JS.{self.domain}.API" if self.domain else "$JS.API"

    @property
    def outage_s(self) -> float:
        """Seconds since the connection was lost (nats-py keeps reconnecting meanwhile);
        0 while connected, before :meth:`connect` and after :meth:`close`."""
        nc = self._nc
        if nc is None or self._closed or nc.is_connected:
            self._outage_since = None
            return 0.0
        since = self._outage_since
        if since is None:  # lost without a callback yet (or nats-py gave up and closed)
            since = self._outage_since = monotonic()
        return monotonic() - since

    async def close(self) -> None:
        """Drain and close. Bounded on a dead server: handlers get ``drain_timeout``, nats-py's
        drain is skipped while disconnected (it would only wait), and its close gets a few
        seconds (it cancels the reconnect loop)."""
        nc, self._nc = self._nc, None
        self._outage_since = None
        if nc is None or self._closed:
            return
        self._closed = True
        subs, self._subs = self._subs, []
        try:
            # Stop taking requests, let running handlers reply, then flush and close.
            await asyncio.wait_for(
                asyncio.gather(*(s.unsubscribe() for s in subs), return_exceptions=True), self.drain_timeout
            )
        except TimeoutError:
            log.warning("nats %s: handlers still running after %.1fs; cancelling them", self.url, self.drain_timeout)
        for rec in list(self._watches):
            await rec.stop()  # ends the watch iterators
        for sub in list(self._pull_subs):
            # nats-py's drain waits until each subscription's queue is marked done,
            # which fetch never does for what it takes from a pull inbox (nor for
            # late status messages nobody reads): drop pull inboxes first.
            with contextlib.suppress(nats.errors.Error):
                await sub.unsubscribe()
        self._pull_subs.clear()
        try:
            if nc.is_connected:
                # nats-py bounds its drain by drain_timeout, then flushes (10 s at most)
                await asyncio.wait_for(nc.drain(), self.drain_timeout + 12.0)
        except Exception as err:  # drain failing must not keep the connection open
            log.warning("nats %s: drain failed (%s: %s); closing", self.url, type(err).__name__, err)
        finally:
            if not nc.is_closed:
                if not nc.is_connected and isinstance(getattr(nc, "_pending", None), list):
                    # What was queued during an outage cannot reach the server; nats-py's close
                    # would write it to the dead socket (RuntimeError) and skip its clean-up.
                    nc._pending, nc._pending_data_size = [], 0
                try:
                    await asyncio.wait_for(nc.close(), 2 * self.reconnect_time_wait + 3.0)
                except Exception as err:  # noqa: BLE001 - closing a dead connection: give up on it
                    log.warning("nats %s: close failed (%s: %s)", self.url, type(err).__name__, err)
            for sub in subs:
                sub.cancel()

    @property
    def connected(self) -> bool:
        return self._nc is not None and self._nc.is_connected

    def _client(self) -> NATS:
        if self._nc is None:
            raise BusError("the bus is not connected (call connect() first)")
        return self._nc

    def _jetstream(self):
        self._client()
        return self._js

"""The bus on NATS JetStream (nats-py).

Every nats-py exception is translated at this boundary: timeouts become
:class:`BusTimeout`, "nobody listens" becomes :class:`NoResponders`, and anything
else (connection trouble, JetStream API errors) becomes :class:`BusError`, so
callers retry with backoff without knowing nats-py. A server that refuses the client while
connecting (credentials, TLS) is a :class:`rollart.bus.auth.AuthError` at once, not retried;
``url``, log lines and errors never hold a password (:func:`rollart.bus.auth.redact`).

Notes that shaped the code (measured with nats-server 2.15, nats-py 2.16):

- The client reconnects by itself after the server is killed and restarted on the
  same store and port; durable consumers survive on disk and an existing pull
  subscription keeps working (its inbox is re-subscribed on reconnect). A fetch
  during the outage times out and returns ``[]``. Should a fetch fail for any other
  reason, the consumer re-binds (re-creating the durable if needed) on the next call.
- Binding an existing durable brings its ``ack_wait``, ``max_deliver`` and
  ``max_ack_pending`` to the spec (the server applies a new ``ack_wait`` to deliveries
  already outstanding too); a different filter subject or deliver policy is a
  :class:`BusError` naming the setting (see :func:`rollart.bus.base.consumer_changes`).
- Acks, naks, terms and progress are sent as requests: the server answers each once
  it has applied it, so a caller that got ``ack()`` back knows the server has it.
- Handlers of core subscriptions run concurrently, one task per message (a service
  in a queue group must not serialise its requests); a failing handler is logged.
- A KV watch is re-made after every reconnect (see ``_NatsKeyValue.watch``).
- One fetch at a time per consumer object: nats-py mixes up concurrent fetches on
  one pull subscription. Replicas each bind their own (same durable).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import math
import ssl
from time import monotonic
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence

import nats.errors
import nats.js.errors
from nats.aio.client import Client as NATS
from nats.js.api import AckPolicy, ConsumerConfig, DeliverPolicy, RetentionPolicy, StorageType, StreamConfig

from rollart.bus.auth import AuthError, guard_plaintext, redact, refusal_kind, refusal_message
from rollart.bus.base import (
    Bus, BusError, BusTimeout, ConsumerSpec, Delivery, KeyValue, KVEntry, NoResponders, ObjectStore,
    PullConsumer, Request, Retention, StreamSpec, Subscription, consumer_changes,
)

log = logging.getLogger(__name__)

_STREAM_NAME_IN_USE = 10058  # "stream name already in use with a different configuration"

KV_HISTORY = 16
"""Revisions kept per key. A watch is a server-side consumer that may lag the writer; with a
history of 1, a revision overwritten before the consumer delivered it is gone and the
watcher never sees it (measured: ~1% of put-put watches on a loaded 2-core host skipped the
middle revision). Keeping 16 means a watcher misses a change only when 16 newer ones of the
same key land while it lags."""


@contextlib.contextmanager
def _translated(what: str):
    """Re-raise nats-py (and socket) errors as bus errors."""
    try:
        yield
    except BusError:
        raise
    except nats.errors.NoRespondersError as err:
        raise NoResponders(f"{what}: no responders") from err
    except (TimeoutError, nats.errors.TimeoutError) as err:
        raise BusTimeout(f"{what}: timed out") from err
    except (nats.errors.Error, OSError) as err:
        raise BusError(f"{what}: {type(err).__name__}: {err}") from err


def _headers(msg) -> dict[str, str]:
    return dict(msg.headers) if msg.headers else {}


# -- durable -------------------------------------------------------------------------
class _NatsDelivery(Delivery):
    __slots__ = ("_nc", "_reply", "_timeout", "data", "headers", "num_delivered", "stored_at",
                 "stream_seq", "subject")

    def __init__(self, msg, nc: NATS, timeout: float) -> None:
        meta = msg.metadata
        self.subject = msg.subject
        self.data = msg.data
        self.headers = _headers(msg)
        self.stream_seq = meta.sequence.stream
        self.num_delivered = meta.num_delivered
        self.stored_at = meta.timestamp.timestamp()  # from the ack subject: when it was stored
        self._nc = nc
        self._reply = msg.reply
        self._timeout = timeout

    async def _send(self, payload: bytes, what: str) -> None:
        # A request, not a publish: the server replies once it has applied the ack.
        with _translated(f"{what} of {self.subject}#{self.stream_seq}"):
            await self._nc.request(self._reply, payload, timeout=self._timeout)

    async def ack(self) -> None:
        await self._send(b"+ACK", "ack")

    async def nak(self, delay: float | None = None) -> None:
        payload = b"-NAK"
        if delay:
            payload += b" " + json.dumps({"delay": int(delay * 1e9)}).encode()
        await self._send(payload, "nak")

    async def term(self) -> None:
        await self._send(b"+TERM", "term")

    async def in_progress(self) -> None:
        await self._send(b"+WPI", "in_progress")

    def __repr__(self) -> str:
        return f"<Delivery {self.subject} seq={self.stream_seq} n={self.num_delivered}>"


def _limit(n: int) -> int:
    return n if n > 0 else -1  # -1: no limit (0 would mean "the server's default" here)


def _spec_of(durable: str, c: ConsumerConfig) -> ConsumerSpec:
    """The settings of an existing consumer, as a :class:`ConsumerSpec`."""
    dp = getattr(c.deliver_policy, "value", c.deliver_policy)
    return ConsumerSpec(durable=durable, filter_subject=c.filter_subject or "",
                        ack_wait=c.ack_wait or 0.0, max_deliver=c.max_deliver or -1,
                        max_ack_pending=c.max_ack_pending or -1, deliver_all=dp in (None, "all"))


def _consumer_dict(ci) -> dict:
    """The fields of :meth:`rollart.bus.base.Bus.consumers_info` from a nats-py ConsumerInfo."""
    delivered, floor = ci.delivered, ci.ack_floor
    return {
        "name": ci.name,
        "filter_subject": (ci.config.filter_subject if ci.config is not None else None) or "",
        "num_pending": ci.num_pending or 0,
        "num_ack_pending": ci.num_ack_pending or 0,
        "num_redelivered": ci.num_redelivered or 0,
        "num_waiting": ci.num_waiting or 0,
        "delivered_stream_seq": (delivered.stream_seq or 0) if delivered is not None else 0,
        "ack_floor_stream_seq": (floor.stream_seq or 0) if floor is not None else 0,
    }


class _NatsPullConsumer(PullConsumer):
    def __init__(self, bus: NatsBus, stream: str, spec: ConsumerSpec) -> None:
        self._bus = bus
        self._stream = stream
        self._spec = spec
        self._sub = None

    async def _bind(self) -> None:
        js = self._bus._jetstream()
        spec = self._spec
        config = ConsumerConfig(
            name=spec.durable, durable_name=spec.durable, ack_policy=AckPolicy.EXPLICIT, ack_wait=spec.ack_wait,
            max_deliver=_limit(spec.max_deliver), max_ack_pending=_limit(spec.max_ack_pending),
            filter_subject=spec.filter_subject,
            deliver_policy=DeliverPolicy.ALL if spec.deliver_all else DeliverPolicy.NEW,
            inactive_threshold=spec.inactive_threshold,
        )
        what = f"consumer {self._stream}/{spec.durable}"
        with _translated(what):
            try:
                ci = await js.consumer_info(self._stream, spec.durable)
            except nats.js.errors.NotFoundError:
                ci = None
                try:
                    await js.add_consumer(self._stream, config)
                except nats.js.errors.APIError as err:
                    # Another replica may have created it meanwhile: bind to that one.
                    try:
                        ci = await js.consumer_info(self._stream, spec.durable)
                    except nats.js.errors.NotFoundError:
                        raise err from None
                    log.debug("%s: created concurrently (%s); binding", what, err)
            if ci is not None:  # it existed: bring its settings to spec (or say why not)
                changes = consumer_changes(self._stream, _spec_of(spec.durable, ci.config), spec)
                if changes:
                    log.info("%s: updating %s", what,
                             ", ".join(f"{k} {old} -> {new}" for k, (old, new) in changes.items()))
                    await js.add_consumer(self._stream, config)  # create-or-update
            self._sub = await js.pull_subscribe_bind(durable=spec.durable, stream=self._stream)
        self._bus._pull_subs.add(self._sub)

    async def fetch(self, batch: int, timeout: float) -> list[Delivery]:
        if self._sub is None:
            await self._bind()
        sub = self._sub
        try:
            msgs = await sub.fetch(max(1, batch), timeout=max(timeout, 0.01))
        except (TimeoutError, nats.errors.TimeoutError):
            return []  # nothing there (or the server is unreachable right now)
        except nats.errors.Error as err:
            # The subscription may be unusable now: bind afresh on the next call.
            await self._unbind()
            raise BusError(f"fetch from {self._stream}/{self._spec.durable}: {type(err).__name__}: {err}") from err
        nc, ack_timeout = self._bus._client(), self._bus.ack_timeout
        return [_NatsDelivery(m, nc, ack_timeout) for m in msgs]

    async def _unbind(self) -> None:
        sub, self._sub = self._sub, None
        if sub is not None:
            self._bus._pull_subs.discard(sub)
            with contextlib.suppress(nats.errors.Error):
                await sub.unsubscribe()

    async def info(self) -> dict:
        with _translated(f"info of {self._stream}/{self._spec.durable}"):
            ci = await self._bus._jetstream().consumer_info(self._stream, self._spec.durable)
        return {
            "num_pending": ci.num_pending or 0,
            "num_ack_pending": ci.num_ack_pending or 0,
            "num_redelivered": ci.num_redelivered or 0,
            "num_waiting": ci.num_waiting or 0,
        }


# -- core --------------------------------------------------------------------------
class _NatsSubscription(Subscription):
    def __init__(self, subject: str, handler: Callable[[Request], Awaitable[None]], bus: NatsBus) -> None:
        self._subject = subject
        self._handler = handler
        self._bus = bus
        self._nc = bus._client()
        self._sub = None
        self._tasks: set[asyncio.Task] = set()

    async def _on_msg(self, msg) -> None:
        # Runs in nats-py's per-subscription loop: hand off so requests overlap.
        task = asyncio.get_running_loop().create_task(self._handle(msg))
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _handle(self, msg) -> None:
        respond = None
        if msg.reply:
            reply = msg.reply

            async def respond(data: bytes, headers: dict[str, str] | None) -> None:
                with _translated(f"reply to {msg.subject}"):
                    await self._nc.publish(reply, data, headers=headers)

        req = Request(subject=msg.subject, data=msg.data, headers=_headers(msg), reply=msg.reply or None,
                      _respond=respond)
        try:
            await self._handler(req)
        except asyncio.CancelledError:
            raise
        except Exception:
            log.exception("handler for %s failed on a message from %s", self._subject, msg.subject)

    async def unsubscribe(self) -> None:
        """Stop receiving; handlers already running finish."""
        if self in self._bus._subs:
            self._bus._subs.remove(self)
        if self._sub is not None:
            sub, self._sub = self._sub, None
            with contextlib.suppress(nats.errors.Error):
                await sub.unsubscribe()
        if self._tasks:
            await asyncio.gather(*list(self._tasks), return_exceptions=True)

    def cancel(self) -> None:
        for task in list(self._tasks):
            task.cancel()


# -- state -------------------------------------------------------------------------
class _Watch:
    """One live nats-py key watcher; stopped on reconnect (to be re-made) or on close."""

    __slots__ = ("restart", "watcher")

    def __init__(self, watcher) -> None:
        self.watcher = watcher
        self.restart = False

    async def stop(self, restart: bool = False) -> None:
        self.restart = restart
        with contextlib.suppress(nats.errors.Error):  # already stopped
            await self.watcher.stop()  # also wakes the iterator with a stop marker


class _NatsKeyValue(KeyValue):
    def __init__(self, kv, bucket: str, bus: NatsBus) -> None:
        self._kv = kv
        self._bucket = bucket
        self._bus = bus

    async def get(self, key: str) -> KVEntry | None:
        with _translated(f"kv get {self._bucket}/{key}"):
            try:
                e = await self._kv.get(key)
            except nats.js.errors.NotFoundError:  # missing, deleted or purged
                return None
        return KVEntry(key=key, value=e.value, revision=e.revision)

    async def put(self, key: str, value: bytes) -> int:
        with _translated(f"kv put {self._bucket}/{key}"):
            return await self._kv.put(key, value)

    async def delete(self, key: str) -> None:
        with _translated(f"kv delete {self._bucket}/{key}"):
            await self._kv.delete(key)

    async def watch(self, key: str) -> AsyncIterator[KVEntry]:
        # nats-py watches through an in-memory ordered consumer, which a server restart
        # loses; nats-py notices only after missing heartbeats for ~10 s. So the bus
        # stops every watcher on reconnect and this loop makes a new one, skipping
        # revisions already yielded. A re-watch replays the key's kept history
        # (KV_HISTORY revisions), so changes made during the outage are not skipped.
        what = f"kv watch {self._bucket}/{key}"
        last, delay, first = 0, 0.05, True
        while True:
            try:
                with _translated(what):
                    watcher = await self._kv.watch(key, include_history=last > 0)
            except BusError as err:
                if first or self._bus._closed:
                    raise  # the first watch fails loudly
                log.warning("%s: re-watch failed (%s); retrying", what, err)
                await asyncio.sleep(delay)
                delay = min(delay * 2, 2.0)
                continue
            first, delay = False, 0.05
            rec = _Watch(watcher)
            self._bus._watches.add(rec)
            try:
                async for e in watcher:
                    if e is None or e.revision <= last:  # None: nats-py's "initial values done"
                        continue
                    last = e.revision
                    deleted = e.operation in ("DEL", "PURGE")
                    yield KVEntry(key=e.key, value=None if deleted else e.value, revision=e.revision, deleted=deleted)
            finally:
                self._bus._watches.discard(rec)
                if not rec.restart:
                    await rec.stop()
            if not rec.restart or self._bus._closed:
                return


class _NatsObjectStore(ObjectStore):
    def __init__(self, obs, bucket: str, bus: "NatsBus") -> None:
        self._obs = obs
        self._bucket = bucket
        self._bus = bus

    async def put(self, name: str, data: bytes) -> None:
        with _translated(f"object put {self._bucket}/{name}"):
            await self._obs.put(name, data)

    async def get(self, name: str) -> bytes:
        """The object's bytes. Unlike nats-py's ``get``, which waits forever for a chunk that
        never comes (an object deleted or replaced while it is read: a trainer with
        ``keep_weights: 1`` purges v1 as it publishes v2), a read that receives no chunk for
        ``stall_s`` stops: :class:`KeyError` if the object is gone or replaced meanwhile,
        else :class:`BusTimeout`. The digest is checked off the event loop."""
        what = f"object get {self._bucket}/{name}"
        with _translated(what):
            info = await self._info(name)
            if info.is_link() or not info.size:
                return (await self._obs.get(name)).data
            stall_s = self._bus.object_stall_s
            sub = await self._bus._jetstream().subscribe(f"$O.{self._bucket}.C.{info.nuid}",
                                                        ordered_consumer=True)
            chunks, got = [], 0
            try:
                while got < info.size:
                    try:
                        msg = await sub.next_msg(timeout=stall_s)
                    except nats.errors.TimeoutError:
                        now = await self._info(name, missing_ok=True)
                        if now is None or now.nuid != info.nuid:
                            raise KeyError(f"{name} (deleted or replaced while it was read)") from None
                        raise BusTimeout(f"{what}: no chunk for {stall_s:.1f}s after "
                                         f"{got} of {info.size} bytes") from None
                    chunks.append(msg.data)
                    got += len(msg.data)
            finally:
                with contextlib.suppress(nats.errors.Error):
                    await sub.unsubscribe()
        data = b"".join(chunks)
        if not await asyncio.to_thread(_object_digest_ok, data, info.digest):
            raise BusError(f"{what}: the bytes read do not match the object's digest")
        return data

    async def _info(self, name: str, missing_ok: bool = False):
        try:
            return await self._obs.get_info(name)
        except nats.js.errors.NotFoundError:  # missing or deleted
            if missing_ok:
                return None
            raise KeyError(name) from None

    async def delete(self, name: str) -> None:
        with _translated(f"object delete {self._bucket}/{name}"):
            try:
                await self._obs.delete(name)
            except nats.js.errors.NotFoundError:
                pass


def _object_digest_ok(data: bytes, digest: str | None) -> bool:
    """Whether ``data`` matches a nats object digest (``SHA-256=<base64url>``; none: yes)."""
    import base64
    import hashlib

    if not digest:
        return True
    kind, _, value = digest.partition("=")
    if kind.upper() != "SHA-256":
        return True  # a scheme this client does not know: nats-py would not check it either
    return hashlib.sha256(data).digest() == base64.urlsafe_b64decode(value + "=" * (-len(value) % 4))


# -- the bus -----------------------------------------------------------------------
class NatsBus(Bus):
    """A :class:`Bus` on one NATS connection with JetStream."""

    def __init__(self, url: str | Sequence[str], *, name: str = "rollart", connect_timeout: float = 5.0,
                 reconnect_time_wait: float = 0.25, ack_timeout: float = 5.0, drain_timeout: float = 10.0,
                 auth: dict | None = None, settings=None) -> None:
        self._servers = [url] if isinstance(url, str) else list(url)
        self.url = redact(self._servers)
        """The server URL(s) for display: never with a password or token in it."""
        self.auth = dict(auth or {})
        """Extra ``nats.connect`` options: credentials and TLS (:func:`rollart.bus.auth.connect_options`)."""
        self.settings = settings
        """The :class:`~rollart.config.schema.NatsConfig` the options came from (error messages
        name its keys), or None."""
        self.name = name
        self.connect_timeout = connect_timeout
        self.reconnect_time_wait = reconnect_time_wait
        self.ack_timeout = ack_timeout
        self.drain_timeout = drain_timeout
        self.object_stall_s = 15.0
        """Seconds an object read waits for its next chunk (see ``_NatsObjectStore.get``)."""
        self._nc: NATS | None = None
        self._js = None
        self._subs: list[_NatsSubscription] = []
        self._pull_subs: set = set()  # nats-py pull subscriptions of our consumers
        self._watches: set[_Watch] = set()
        self._closed = False
        self._outage_logged = False
        self._outage_since: float | None = None
        """monotonic() when the connection was lost (None while connected): :attr:`outage_s`."""
        self._violations: dict[str, float] = {}
        """Permission violation text -> monotonic() it was last logged (once a minute each)."""

    # -- connection ---------------------------------------------------------------
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
            with _translated(f"connect to {self.url}"):
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
        self._nc, self._js, self._closed, self._outage_logged = nc, nc.jetstream(), False, False

    async def _on_error(self, err: Exception) -> None:
        text = str(err)
        if "permissions violation" in text.lower():  # not an outage: say each subject once a minute
            seen = self._violations
            now = monotonic()
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

    # -- durable --------------------------------------------------------------------
    replicas: int = 1
    """Copies of each KV bucket and object store this bus creates (``node.stream_replicas``,
    set by :func:`rollart.bus.auth.bus_from_config`); more than 1 needs a nats-server cluster of
    at least that many servers. Streams take theirs from :attr:`StreamSpec.replicas`. An
    existing bucket keeps the replicas it was made with."""

    async def ensure_stream(self, spec: StreamSpec, *, update: bool = True) -> bool:
        retention = RetentionPolicy.WORK_QUEUE if spec.retention == Retention.WORKQUEUE else RetentionPolicy.LIMITS
        config = StreamConfig(name=spec.name, subjects=list(spec.subjects), retention=retention,
                              storage=StorageType.FILE, duplicate_window=spec.duplicate_window, max_age=spec.max_age,
                              max_bytes=spec.max_bytes if spec.max_bytes > 0 else -1,  # -1: no limit
                              num_replicas=spec.replicas)
        js = self._jetstream()
        with _translated(f"ensure stream {spec.name}"), _replicas_hint(f"stream {spec.name}", spec.replicas):
            try:
                await js.add_stream(config)
            except nats.js.errors.BadRequestError as err:
                if err.err_code != _STREAM_NAME_IN_USE:
                    raise
                if not update:  # it exists with other settings: not ours to change
                    return False
                await js.update_stream(config)
        return True

    async def publish(self, subject: str, data: bytes, *, headers: dict[str, str] | None = None,
                      msg_id: str | None = None, timeout: float = 5.0) -> int:
        hdrs = dict(headers) if headers else {}
        if msg_id is not None:
            hdrs["Nats-Msg-Id"] = msg_id
        with _translated(f"publish to {subject}"):
            # On a duplicate msg_id the server answers with the first message's sequence.
            ack = await self._jetstream().publish(subject, data, timeout=timeout, headers=hdrs or None)
        return ack.seq

    async def pull_consumer(self, stream: str, spec: ConsumerSpec) -> PullConsumer:
        consumer = _NatsPullConsumer(self, stream, spec)
        await consumer._bind()
        return consumer

    async def stream_info(self, stream: str) -> dict:
        with _translated(f"info of stream {stream}"):
            si = await self._jetstream().stream_info(stream)
        st = si.state
        return {"messages": st.messages, "first_seq": st.first_seq, "last_seq": st.last_seq, "bytes": st.bytes}

    async def consumers_info(self, stream: str) -> list[dict]:
        with _translated(f"consumers of stream {stream}"):
            js, out, offset = self._jetstream(), [], 0
            while True:  # the server lists at most 256 per request
                page = await js.consumers_info(stream, offset=offset or None)
                out += [_consumer_dict(ci) for ci in page]
                offset += len(page)
                if len(page) < 256:
                    return out

    async def delete_stream(self, stream: str) -> None:
        with _translated(f"delete stream {stream}"):
            try:
                await self._jetstream().delete_stream(stream)
            except nats.js.errors.NotFoundError:
                pass

    # -- core -----------------------------------------------------------------------
    async def publish_core(self, subject: str, data: bytes, *, headers: dict[str, str] | None = None) -> None:
        with _translated(f"publish to {subject}"):
            await self._client().publish(subject, data, headers=headers)

    async def subscribe(self, subject: str, handler: Callable[[Request], Awaitable[None]], *,
                        queue: str | None = None) -> Subscription:
        nc = self._client()
        sub = _NatsSubscription(subject, handler, self)
        with _translated(f"subscribe to {subject}"):
            sub._sub = await nc.subscribe(subject, queue=queue or "", cb=sub._on_msg)
            # The server knows the interest when this returns. Twice: nats-py writes a
            # PING straight to the socket, ahead of the SUB still queued for its
            # flusher task, so the first PONG proves nothing; the second PING follows it.
            await nc.flush()
            await nc.flush()
        self._subs.append(sub)
        return sub

    async def request(self, subject: str, data: bytes, *, headers: dict[str, str] | None = None,
                      timeout: float = 5.0) -> Request:
        with _translated(f"request to {subject}"):
            msg = await self._client().request(subject, data, timeout=timeout, headers=headers)
        return Request(subject=msg.subject, data=msg.data, headers=_headers(msg))

    # -- state ----------------------------------------------------------------------
    async def key_value(self, bucket: str) -> KeyValue:
        js = self._jetstream()
        with _translated(f"kv bucket {bucket}"):
            try:
                kv = await js.key_value(bucket)
            except nats.js.errors.BucketNotFoundError:
                with _replicas_hint(f"kv bucket {bucket}", self.replicas):
                    kv = await js.create_key_value(bucket=bucket, history=KV_HISTORY, direct=True,
                                                   replicas=self.replicas)
        return _NatsKeyValue(kv, bucket, self)

    async def object_store(self, bucket: str) -> ObjectStore:
        js = self._jetstream()
        with _translated(f"object store {bucket}"):
            try:
                obs = await js.object_store(bucket)
            except nats.js.errors.BucketNotFoundError:
                with _replicas_hint(f"object store {bucket}", self.replicas):
                    obs = await js.create_object_store(bucket, replicas=self.replicas)
        return _NatsObjectStore(obs, bucket, self)


@contextlib.contextmanager
def _replicas_hint(what: str, replicas: int):
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

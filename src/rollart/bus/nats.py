"""The bus on NATS JetStream (nats-py).

Every nats-py exception is translated at this boundary: timeouts become
:class:`BusTimeout`, "nobody listens" becomes :class:`NoResponders`, and anything
else (connection trouble, JetStream API errors) becomes :class:`BusError`, so
callers retry with backoff without knowing nats-py. A server that refuses the client while
connecting (credentials, TLS) is a :class:`rollart.bus.auth.AuthError` at once, not retried;
``url``, log lines and errors never hold a password (:func:`rollart.bus.auth.redact`).

:class:`NatsBus` is the bus protocol on top of its layers, one module each:

- :mod:`rollart.bus.nats_connection`: the nats-py client (connect, reconnect, outages,
  close) and the error translation;
- :mod:`rollart.bus.nats_consumers`: durable pull consumers, deliveries and their acks,
  core subscriptions;
- :mod:`rollart.bus.nats_state`: KV buckets, their watches, object stores.

Notes that shaped the code (measured with nats-server 2.15, nats-py 2.16):

- The client reconnects by itself after the server is killed and restarted on the
  same store and port; durable consumers survive on disk and an existing pull
  subscription keeps working (its inbox is re-subscribed on reconnect). A fetch
  during the outage times out and returns ``[]``.
- A publish during an outage may time out yet be stored after the reconnect: ``msg_id``
  (``Nats-Msg-Id``) lets the server drop the retry as a duplicate.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from time import monotonic

import nats.js.errors
from nats.js.api import RetentionPolicy, StorageType, StreamConfig

from rollart.bus.base import (
    Bus, BusError, BusTimeout, ConsumerSpec, DuplicateConflict, KeyValue, ObjectStore, PullConsumer, Request, Retention, StreamSpec, Subscription,
)
from rollart.bus.nats_connection import NatsConnection, headers_of, replicas_hint, translated
from rollart.bus.nats_consumers import NatsPullConsumer, NatsSubscription, consumer_dict
from rollart.bus.nats_state import open_key_value, open_object_store

_STREAM_NAME_IN_USE = 10058  # "stream name already in use with a different configuration"


class NatsBus(NatsConnection, Bus):
    """A :class:`Bus` on one NATS connection with JetStream (the connection, its settings and
    its life: :class:`~rollart.bus.nats_connection.NatsConnection`)."""

    # -- durable --------------------------------------------------------------------
    replicas: int = 1
    """Copies of each KV bucket and object store this bus creates (``node.stream_replicas``,
    set by :func:`rollart.bus.connect.bus_from_config`); more than 1 needs a nats-server
    cluster of at least that many servers. Streams take theirs from :attr:`StreamSpec.replicas`. An
    existing bucket keeps the replicas it was made with."""

    async def ensure_stream(self, spec: StreamSpec, *, update: bool = True) -> bool:
        retention = RetentionPolicy.WORK_QUEUE if spec.retention == Retention.WORKQUEUE else RetentionPolicy.LIMITS
        config = StreamConfig(name=spec.name, subjects=list(spec.subjects), retention=retention,
                              storage=StorageType.FILE, duplicate_window=spec.duplicate_window, max_age=spec.max_age,
                              max_bytes=spec.max_bytes if spec.max_bytes > 0 else -1,  # -1: no limit
                              num_replicas=spec.replicas)
        js = self._jetstream()
        since = monotonic()
        try:
            with translated(f"ensure stream {spec.name}"), replicas_hint(f"stream {spec.name}", spec.replicas):
                try:
                    await js.add_stream(config)
                except nats.js.errors.BadRequestError as err:
                    if err.err_code != _STREAM_NAME_IN_USE:
                        raise
                    if not update:  # it exists with other settings: not ours to change
                        return False
                    await js.update_stream(config)
        except BusTimeout:
            # a denied API request is never answered: without this it would look like a busy
            # server and be asked again for minutes; a refusal is permanent, said at once
            for verb in ("CREATE", "UPDATE"):
                if self.denied_since(f"{self.api_prefix}.STREAM.{verb}.{spec.name}", since):
                    raise BusError(f"ensure stream {spec.name}: this credential may not "
                                   f"{verb.lower()} it (see `rollart secure show`)") from None
            raise
        return True

    async def publish(self, subject: str, data: bytes, *, headers: dict[str, str] | None = None,
                      msg_id: str | None = None, timeout: float = 5.0) -> int:
        hdrs = dict(headers) if headers else {}
        if msg_id is not None:
            hdrs["Nats-Msg-Id"] = msg_id
        with translated(f"publish to {subject}"):
            # On a duplicate msg_id the server answers with the first message's sequence.
            ack = await self._jetstream().publish(subject, data, timeout=timeout, headers=hdrs or None)
        return ack.seq

    async def publish_once(self, subject: str, data: bytes, *, msg_id: str,
                           headers: dict[str, str] | None = None, timeout: float = 5.0) -> int:
        hdrs = {**(headers or {}), "Nats-Msg-Id": msg_id}
        js = self._jetstream()
        with translated(f"publish to {subject}"):
            ack = await js.publish(subject, data, timeout=timeout, headers=hdrs)
            if not ack.duplicate:
                return ack.seq
            try:
                stored = await js.get_msg(ack.stream, ack.seq)
            except nats.js.errors.NotFoundError:  # aged out: nothing left to compare
                return ack.seq
        if bytes(stored.data or b"") != bytes(data):
            raise DuplicateConflict(f"publish to {subject}: msg id {msg_id!r} already holds "
                                    f"other data (stream {ack.stream}, sequence {ack.seq})", ack.seq)
        return ack.seq

    async def pull_consumer(self, stream: str, spec: ConsumerSpec) -> PullConsumer:
        consumer = NatsPullConsumer(self, stream, spec)
        await consumer.bind()
        return consumer

    async def stream_info(self, stream: str) -> dict:
        with translated(f"info of stream {stream}"):
            si = await self._jetstream().stream_info(stream)
        st = si.state
        return {"messages": st.messages, "first_seq": st.first_seq, "last_seq": st.last_seq, "bytes": st.bytes}

    async def consumers_info(self, stream: str) -> list[dict]:
        with translated(f"consumers of stream {stream}"):
            js, out, offset = self._jetstream(), [], 0
            while True:  # the server lists at most 256 per request
                page = await js.consumers_info(stream, offset=offset or None)
                out += [consumer_dict(ci) for ci in page]
                offset += len(page)
                if len(page) < 256:
                    return out

    async def delete_stream(self, stream: str) -> None:
        with translated(f"delete stream {stream}"):
            try:
                await self._jetstream().delete_stream(stream)
            except nats.js.errors.NotFoundError:
                pass

    # -- core -----------------------------------------------------------------------
    async def publish_core(self, subject: str, data: bytes, *, headers: dict[str, str] | None = None) -> None:
        with translated(f"publish to {subject}"):
            await self._client().publish(subject, data, headers=headers)

    async def subscribe(self, subject: str, handler: Callable[[Request], Awaitable[None]], *,
                        queue: str | None = None) -> Subscription:
        sub = NatsSubscription(subject, handler, self)
        await sub.open(queue)
        return sub

    async def request(self, subject: str, data: bytes, *, headers: dict[str, str] | None = None,
                      timeout: float = 5.0) -> Request:
        with translated(f"request to {subject}"):
            msg = await self._client().request(subject, data, timeout=timeout, headers=headers)
        return Request(subject=msg.subject, data=msg.data, headers=headers_of(msg))

    # -- state ----------------------------------------------------------------------
    async def key_value(self, bucket: str) -> KeyValue:
        return await open_key_value(self, bucket, self.replicas)

    async def object_store(self, bucket: str, *, ttl: float = 0.0,
                           max_bytes: int = 0) -> ObjectStore:
        return await open_object_store(self, bucket, self.replicas, ttl=ttl, max_bytes=max_bytes)

    @property
    def server_name(self) -> str:
        nc = getattr(self, "_nc", None)
        info = getattr(nc, "_server_info", None) or {}
        name = str(info.get("server_name") or "")
        # a server without server_name in its config is named by its id: no name to show
        return "" if name == info.get("server_id") else name[:64]

    @property
    def max_payload(self) -> int:
        """The server's ``max_payload`` (from its INFO; nats-py's default before connecting)."""
        nc = getattr(self, "_nc", None)
        return int(nc.max_payload) if nc is not None else 0

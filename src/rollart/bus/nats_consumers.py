"""How a :class:`rollart.bus.nats.NatsBus` client receives: durable pull consumers (fetch,
then ack / nak / term / progress on each delivery) and core subscriptions.

- Binding an existing durable brings its ``ack_wait``, ``max_deliver`` and
  ``max_ack_pending`` to the spec (the server applies a new ``ack_wait`` to deliveries
  already outstanding too); a different filter subject or deliver policy is a
  :class:`BusError` naming the setting (see :func:`rollart.bus.base.consumer_changes`).
  Replicas of a work queue bind the same durable (one consumer per subject filter).
- A fetch during an outage times out and returns ``[]``; should a fetch fail for any other
  reason, the consumer re-binds (re-creating the durable if needed) on the next call.
- One fetch at a time per consumer object: nats-py mixes up concurrent fetches on
  one pull subscription. Replicas each bind their own (same durable).
- Acks, naks, terms and progress are sent as requests: the server answers each once
  it has applied it, so a caller that got ``ack()`` back knows the server has it.
- Handlers of core subscriptions run concurrently, one task per message (a service
  in a queue group must not serialise its requests); a failing handler is logged.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
from collections.abc import Awaitable, Callable

import nats.errors
import nats.js.errors
from nats.aio.client import Client as NATS
from nats.js.api import AckPolicy, ConsumerConfig, DeliverPolicy

from rollart.bus.base import (
    BusError, ConsumerSpec, Delivery, PullConsumer, Request, Subscription, consumer_changes,
)
from rollart.bus.nats_connection import NatsConnection, headers_of, translated

log = logging.getLogger(__name__)


class NatsDelivery(Delivery):
    __slots__ = ("_nc", "_reply", "_timeout", "data", "headers", "num_delivered", "stored_at",
                 "stream_seq", "subject")

    def __init__(self, msg, nc: NATS, timeout: float) -> None:
        meta = msg.metadata
        self.subject = msg.subject
        self.data = msg.data
        self.headers = headers_of(msg)
        self.stream_seq = meta.sequence.stream
        self.num_delivered = meta.num_delivered
        self.stored_at = meta.timestamp.timestamp()  # from the ack subject: when it was stored
        self._nc = nc
        self._reply = msg.reply
        self._timeout = timeout

    async def _send(self, payload: bytes, what: str) -> None:
        # A request, not a publish: the server replies once it has applied the ack.
        with translated(f"{what} of {self.subject}#{self.stream_seq}"):
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


def consumer_dict(ci) -> dict:
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


DRAIN_TIMEOUT_S = 1.0
"""How long a non-lingering pull waits for the server's answer (it comes at once unless the
connection is down)."""


def _can_drain(sub) -> bool:
    """The nats-py internals :meth:`NatsPullConsumer._drain` uses are there (else fetch
    falls back to nats-py's own, lingering, batch pull)."""
    inner = getattr(sub, "_sub", None)
    return (all(hasattr(sub, a) for a in ("_nms", "_deliver"))
            and all(hasattr(inner, a) for a in ("_pending_queue", "_pending_size")))


def _consumed(sub, msg) -> None:
    """The accounting nats-py's ``next_msg`` does for a message taken off the queue."""
    sub._sub._pending_size -= len(msg.data)
    sub._sub._pending_queue.task_done()


def _take_queued(sub, n: int) -> list:
    """Up to ``n`` messages already in the subscription's queue (status messages of earlier
    pulls are dropped, as nats-py's fetch does)."""
    queue, out = sub._sub._pending_queue, []
    while len(out) < n and not queue.empty():
        msg = queue.get_nowait()
        _consumed(sub, msg)
        if not (msg.headers and msg.headers.get("Status")):
            out.append(msg)
    return out


class NatsPullConsumer(PullConsumer):
    def __init__(self, bus: NatsConnection, stream: str, spec: ConsumerSpec) -> None:
        self._bus = bus
        self._stream = stream
        self._spec = spec
        self._sub = None

    async def bind(self) -> None:
        """Bind the durable, creating it or bringing its settings to the spec."""
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
        with translated(what):
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
            await self.bind()
        sub = self._sub
        try:
            if not _can_drain(sub):
                msgs = await sub.fetch(max(1, batch), timeout=max(timeout, 0.01))
            else:
                msgs = _take_queued(sub, batch)  # delivered under an earlier pull
                if not msgs:  # idle: wait for one (a lingering pull for one message)
                    msgs = await sub.fetch(1, timeout=max(timeout, 0.01))
                    msgs += _take_queued(sub, batch - len(msgs))
                if len(msgs) < batch:  # and take what else is there, without waiting
                    msgs += await self._drain(sub, batch - len(msgs))
        except (TimeoutError, nats.errors.TimeoutError):
            return []  # nothing there (or the server is unreachable right now)
        except nats.errors.Error as err:
            # The subscription may be unusable now: bind afresh on the next call.
            await self._unbind()
            raise BusError(f"fetch from {self._stream}/{self._spec.durable}: {type(err).__name__}: {err}") from err
        nc, ack_timeout = self._bus._client(), self._bus.ack_timeout
        return [NatsDelivery(m, nc, ack_timeout) for m in msgs]

    async def _drain(self, sub, n: int) -> list:
        """Up to ``n`` messages the server holds for this consumer now, without lingering.

        nats-py's ``fetch(n)`` on an empty client queue sends its pull with ``expires`` as
        well as ``no_wait``; the server then keeps the request open, and the messages that
        come in meanwhile are returned only when ``n`` are in or some pull's status comes:
        on a trainer run the last completion of a step reached the trainer up to 0.45 s
        after it was stored (fetch timeout 0.5 s). A pull with ``no_wait`` and no
        ``expires`` is answered at once: what the consumer has, then a 404 (or 408) status
        that ends it. The messages are read off the subscription's queue directly
        (nats-py's ``next_msg`` makes a task, a uuid4 and a ``wait_for`` for each)."""
        await self._bus._client().publish(sub._nms, json.dumps({"batch": n, "no_wait": True}).encode(),
                                          reply=sub._deliver)
        queue, out = sub._sub._pending_queue, []
        try:
            async with asyncio.timeout(DRAIN_TIMEOUT_S):
                while len(out) < n:
                    msg = queue.get_nowait() if not queue.empty() else await queue.get()
                    _consumed(sub, msg)
                    status = msg.headers.get("Status") if msg.headers else None
                    if status is None:
                        out.append(msg)
                    elif status in ("404", "408"):
                        break  # the end of this pull (or of an older one: the rest comes later)
                    # other statuses (heartbeats, 409 limits) say nothing about this pull's end
        except TimeoutError:
            pass  # no answer (a reconnect): the rest comes with a later fetch
        return out

    async def _unbind(self) -> None:
        sub, self._sub = self._sub, None
        if sub is not None:
            self._bus._pull_subs.discard(sub)
            with contextlib.suppress(nats.errors.Error):
                await sub.unsubscribe()

    async def info(self) -> dict:
        with translated(f"info of {self._stream}/{self._spec.durable}"):
            ci = await self._bus._jetstream().consumer_info(self._stream, self._spec.durable)
        return {
            "num_pending": ci.num_pending or 0,
            "num_ack_pending": ci.num_ack_pending or 0,
            "num_redelivered": ci.num_redelivered or 0,
            "num_waiting": ci.num_waiting or 0,
        }


# -- core subscriptions ----------------------------------------------------------
class NatsSubscription(Subscription):
    def __init__(self, subject: str, handler: Callable[[Request], Awaitable[None]], bus: NatsConnection) -> None:
        self._subject = subject
        self._handler = handler
        self._bus = bus
        self._nc = bus._client()
        self._sub = None
        self._tasks: set[asyncio.Task] = set()

    async def open(self, queue: str | None) -> None:
        """Subscribe on the server (in ``queue``'s group); the server knows the interest when
        this returns."""
        nc = self._nc
        with translated(f"subscribe to {self._subject}"):
            self._sub = await nc.subscribe(self._subject, queue=queue or "", cb=self._on_msg)
            # Twice: nats-py writes a PING straight to the socket, ahead of the SUB still
            # queued for its flusher task, so the first PONG proves nothing; the second
            # PING follows it.
            await nc.flush()
            await nc.flush()
        self._bus._subs.append(self)

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
                with translated(f"reply to {msg.subject}"):
                    await self._nc.publish(reply, data, headers=headers)

        req = Request(subject=msg.subject, data=msg.data, headers=headers_of(msg), reply=msg.reply or None,
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

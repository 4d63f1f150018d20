"""The bus protocol: the only way actors talk.

Two implementations honour it: :class:`rollart.bus.nats.NatsBus` (nats-py over
JetStream) and :class:`rollart.bus.memory.MemoryBus` (in-process). Both pass the
same contract suite in ``tests/contract``. Payloads are ``bytes``; encoding is the
caller's job (see :mod:`rollart.bus.codec`). This module imports no torch.
"""

from __future__ import annotations

import abc
import enum
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field


class BusError(Exception):
    """Base class of every error a bus raises."""


class BusTimeout(BusError, TimeoutError):
    """A request got no reply, or a publish got no ack, in time."""


class NoResponders(BusError):
    """A request was sent to a subject nobody serves."""


class ObjectTooLarge(BusError):
    """An object read with ``max_bytes`` refused: the object is larger (by its info or by
    the chunks that came), or a link, whose target's size the bound cannot cover."""


class DuplicateConflict(BusError):
    """A publish whose msg id the stream already holds for *other* data (``seq``): someone
    else published under that id first, and the server's dedupe dropped this message."""

    def __init__(self, message: str, seq: int) -> None:
        super().__init__(message)
        self.seq = seq


class Retention(str, enum.Enum):
    LIMITS = "limits"
    """Messages stay until limits (age, count) remove them; many consumers may read."""
    WORKQUEUE = "workqueue"
    """A message is removed once acked; one consumer per subject filter."""


@dataclass(frozen=True)
class StreamSpec:
    name: str
    subjects: tuple[str, ...]
    retention: Retention = Retention.LIMITS
    duplicate_window: float = 120.0
    """Seconds during which a repeated ``msg_id`` is stored only once."""
    max_age: float = 0.0
    """Seconds a message is kept; 0 keeps it forever."""
    max_bytes: int = 0
    """Bytes the stream may hold; past it the oldest messages are discarded (a consumer's
    pending deliveries of them included); 0 for no limit."""
    replicas: int = 1
    """Copies of the stream kept on different servers of a nats-server cluster
    (``node.stream_replicas``); more than 1 needs a cluster of at least that many servers.
    MemoryBus keeps one copy whatever this says."""


@dataclass(frozen=True)
class ConsumerSpec:
    durable: str
    filter_subject: str
    ack_wait: float = 30.0
    """Seconds before an un-acked delivery is redelivered."""
    max_deliver: int = 5
    """Deliveries of one message at most; -1 for no limit."""
    max_ack_pending: int = 1000
    """Deliveries outstanding (not yet acked) at most: the backpressure knob."""
    deliver_all: bool = True
    """Start at the first stored message (True) or only new ones (False)."""
    inactive_threshold: float | None = None
    """Seconds without a fetch after which the server deletes the durable (its delivery state;
    the messages stay); None: never. For one-off consumers (an evaluation's scheduler), so a
    long run's streams do not collect them. Fixed once the durable exists."""


UPDATABLE_CONSUMER_SETTINGS = ("ack_wait", "max_deliver", "max_ack_pending")
"""What binding an existing durable with a different :class:`ConsumerSpec` changes in place
(as JetStream does). ``filter_subject`` and ``deliver_all`` are fixed once it exists."""


def _limit(n: int) -> int:
    return n if n > 0 else -1  # 0 and -1 both mean "no limit"


def consumer_changes(stream: str, have: ConsumerSpec, want: ConsumerSpec) -> dict[str, tuple]:
    """``{setting: (old, new)}`` of the updatable settings in which ``want`` differs from the
    existing durable ``have``; :class:`BusError` naming the durable and the setting when a
    fixed one differs."""
    for name in ("filter_subject", "deliver_all"):
        old, new = getattr(have, name), getattr(want, name)
        if old != new:
            raise BusError(
                f"durable consumer {want.durable!r} of stream {stream!r} exists with {name}={old!r}; "
                f"{name} of an existing durable cannot change (to {new!r}): delete the consumer "
                f"(or the run's stream) or use another durable name")
    out: dict[str, tuple] = {}
    for name in UPDATABLE_CONSUMER_SETTINGS:
        old, new = getattr(have, name), getattr(want, name)
        if name == "ack_wait":  # seconds (nanoseconds on the wire)
            changed = abs(old - new) > 1e-6
        else:
            old, new = _limit(old), _limit(new)
            changed = old != new
        if changed:
            out[name] = (old, new)
    return out


@dataclass(frozen=True)
class KVEntry:
    key: str
    value: bytes | None
    revision: int
    deleted: bool = False


class Delivery(abc.ABC):
    """One delivery of a stored message to a pull consumer."""

    subject: str
    data: bytes
    headers: dict[str, str]
    stream_seq: int
    num_delivered: int
    stored_at: float
    """When the stream stored the message (Unix seconds): ``time.time() - stored_at`` is how long
    it waited for a consumer (the queue wait that traces record)."""

    @abc.abstractmethod
    async def ack(self) -> None: ...

    @abc.abstractmethod
    async def nak(self, delay: float | None = None) -> None: ...

    @abc.abstractmethod
    async def term(self) -> None: ...

    @abc.abstractmethod
    async def in_progress(self) -> None: ...


@dataclass
class Request:
    """One request received by a service subscription."""

    subject: str
    data: bytes
    headers: dict[str, str] = field(default_factory=dict)
    reply: str | None = None
    _respond: Callable[[bytes, dict[str, str] | None], Awaitable[None]] | None = None

    async def respond(self, data: bytes, headers: dict[str, str] | None = None) -> None:
        if self._respond is None:
            raise BusError(f"request on {self.subject!r} has no reply subject")
        await self._respond(data, headers)


class PullConsumer(abc.ABC):
    @abc.abstractmethod
    async def fetch(self, batch: int, timeout: float) -> list[Delivery]:
        """Up to ``batch`` deliveries; returns early with what is there, ``[]`` on timeout."""

    @abc.abstractmethod
    async def info(self) -> dict:
        """``num_pending`` (not yet delivered) and ``num_ack_pending`` (delivered, un-acked)."""


class Subscription(abc.ABC):
    @abc.abstractmethod
    async def unsubscribe(self) -> None: ...


class KeyValue(abc.ABC):
    @abc.abstractmethod
    async def get(self, key: str) -> KVEntry | None: ...

    @abc.abstractmethod
    async def put(self, key: str, value: bytes) -> int:
        """Store and return the new revision."""

    @abc.abstractmethod
    async def delete(self, key: str) -> None: ...

    @abc.abstractmethod
    def watch(self, key: str) -> AsyncIterator[KVEntry]:
        """Current value first (if any), then every change, until the iterator is closed.

        Revisions arrive in order, each once. NatsBus keeps the last ``KV_HISTORY`` (16)
        revisions of a key: a watcher that lags by more changes than that skips the
        overwritten ones and sees the latest, so treat a value as a state, not an event."""


class ObjectStore(abc.ABC):
    @abc.abstractmethod
    async def put(self, name: str, data: bytes) -> None: ...

    @abc.abstractmethod
    async def get(self, name: str, *, max_bytes: int | None = None) -> bytes:
        """Raise ``KeyError`` when the object does not exist. ``max_bytes``: refuse
        (:class:`ObjectTooLarge`) an object larger than that before reading more of it, and
        read it into one buffer of its size (a ``bytearray``), not chunks and a copy."""

    @abc.abstractmethod
    async def delete(self, name: str) -> None: ...

    async def exists(self, name: str) -> bool:
        """Whether an object ``name`` is stored (a put of a name that exists replaces it)."""
        try:
            await self.get(name)
        except KeyError:
            return False
        return True


class Bus(abc.ABC):
    """What an actor sees of the messaging system."""

    url: str = ""
    max_payload: int = 0
    """Bytes one message (data and headers) may have at most: the server's ``max_payload``
    (NatsBus reads it from the server's INFO), 0 when unknown. Larger blobs go through an
    object store (:meth:`object_store`), which chunks them."""

    @property
    def server_name(self) -> str:
        """The ``server_name`` of the nats-server this bus is connected to now: at a site
        (``rollart cluster sites``), the site's name; "" when unknown or in memory."""
        return ""

    async def __aenter__(self) -> "Bus":
        await self.connect()
        return self

    async def __aexit__(self, *exc) -> None:
        await self.close()

    @abc.abstractmethod
    async def connect(self) -> None: ...

    @abc.abstractmethod
    async def close(self) -> None:
        """Flush what is pending and disconnect."""

    @property
    @abc.abstractmethod
    def connected(self) -> bool: ...

    @property
    def outage_s(self) -> float:
        """Seconds since the connection to the server was lost and not yet re-made; 0 while
        connected (and for a bus that cannot lose its server). A node stops once this passes
        ``node.bus_outage_max``."""
        return 0.0

    # -- durable (JetStream) --------------------------------------------------
    @abc.abstractmethod
    async def ensure_stream(self, spec: StreamSpec, *, update: bool = True) -> bool:
        """Create the stream, or update it to ``spec``; idempotent. With ``update=False`` an
        existing stream is left as it is (a host without the right to change it). Returns
        False when the stream exists with other settings and was left as it is."""

    @abc.abstractmethod
    async def publish(
        self,
        subject: str,
        data: bytes,
        *,
        headers: dict[str, str] | None = None,
        msg_id: str | None = None,
        timeout: float = 5.0,
    ) -> int:
        """Store ``data`` in the stream that owns ``subject``; return its stream sequence.

        A repeated ``msg_id`` within the stream's duplicate window is stored once and
        returns the first sequence. Raises :class:`BusTimeout` when no ack came.
        """

    @abc.abstractmethod
    async def publish_once(self, subject: str, data: bytes, *, msg_id: str,
                           headers: dict[str, str] | None = None, timeout: float = 5.0) -> int:
        """:meth:`publish` under ``msg_id``, sure that what the stream holds under that id is
        ``data``: a duplicate ack for the same bytes (a retry of this publish) returns the
        first sequence; one for other bytes raises :class:`DuplicateConflict`. (A stored copy
        that has aged out of the stream cannot be compared and counts as the same.)"""

    @abc.abstractmethod
    async def pull_consumer(self, stream: str, spec: ConsumerSpec) -> PullConsumer:
        """Create or bind the durable ``spec.durable``; many callers may bind the same one."""

    @abc.abstractmethod
    async def stream_info(self, stream: str) -> dict:
        """``messages`` (stored now), ``first_seq``, ``last_seq``."""

    async def consumers_info(self, stream: str) -> list[dict]:
        """Each durable consumer of ``stream``, as JetStream's consumer info reports it:
        ``name``, ``filter_subject``, ``num_pending`` (matching messages not yet delivered),
        ``num_ack_pending`` (delivered, not yet acked), ``num_redelivered`` (of those, the
        ones delivered more than once), ``num_waiting`` (pull requests waiting),
        ``delivered_stream_seq`` (stream sequence of the last message delivered) and
        ``ack_floor_stream_seq`` (every message up to it is acked). :class:`BusError` when
        the stream does not exist (or the bus cannot list consumers)."""
        raise BusError(f"{type(self).__name__} cannot list the consumers of {stream!r}")

    @abc.abstractmethod
    async def delete_stream(self, stream: str) -> None: ...

    # -- core (fire and forget, request/reply) --------------------------------
    @abc.abstractmethod
    async def publish_core(
        self, subject: str, data: bytes, *, headers: dict[str, str] | None = None
    ) -> None:
        """At-most-once publish to live subscribers; nothing is stored."""

    @abc.abstractmethod
    async def subscribe(
        self,
        subject: str,
        handler: Callable[[Request], Awaitable[None]],
        *,
        queue: str | None = None,
    ) -> Subscription:
        """Call ``handler`` for each message; one member of a ``queue`` group gets each."""

    @abc.abstractmethod
    async def request(
        self,
        subject: str,
        data: bytes,
        *,
        headers: dict[str, str] | None = None,
        timeout: float = 5.0,
    ) -> Request:
        """Send and await one reply; :class:`BusTimeout` or :class:`NoResponders`."""

    # -- state ------------------------------------------------------------------
    @abc.abstractmethod
    async def key_value(self, bucket: str) -> KeyValue: ...

    @abc.abstractmethod
    async def object_store(self, bucket: str, *, ttl: float = 0.0,
                           max_bytes: int = 0) -> ObjectStore:
        """Object store ``bucket``, created when missing; ``ttl``: seconds an object created
        in a new bucket is kept (0: forever; an existing bucket keeps its own; MemoryBus keeps
        every object while the process lives); ``max_bytes``: bytes a new bucket may hold
        (0: no limit; MemoryBus: none), past which a put is refused (the bucket keeps what it
        has)."""

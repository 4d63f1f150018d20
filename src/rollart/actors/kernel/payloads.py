"""Payloads larger than one bus message: they travel through the run's trajectory object store.

A nats-server refuses a message above its ``max_payload`` (1 MiB by default, ~65k tokens of
a ``rollout.completed``). A publisher whose encoded message is larger than its inline limit
(:func:`inline_limit`: ``rollout.inline_max_bytes``, at most the server's ``max_payload``
less :data:`HEADROOM`) puts the encoded bytes in the object store :func:`rollart.messages.
traj_bucket` under a name made of the trajectory id and the payload's SHA-256
(:func:`object_name`), then publishes on the same subject, under the same msg id, a
:class:`rollart.messages.PayloadRef` with the header ``Rollart-Payload: object``
(:func:`offload`). So:

- **no duplicate**: the reference is a function of the payload (its digest), so a retried
  publish is the same bytes and the stream's dedupe drops it, while another payload under the
  same msg id is another reference: :meth:`rollart.bus.Bus.publish_once` sees the conflict
  as for an inline message. A put retried after a lost reply finds the object and skips it;
- **at least once**: the object is stored before the reference is published, and the
  reference is an ordinary stream message (acked, redelivered, dead-lettered as any);
- **one message**: a consumer's runtime (:func:`fetch_payload`, called by
  :class:`rollart.actors.kernel.runtime.ConsumerLoop` before it decodes) reads the object, checks its
  size and digest and hands the handler the decoded message. A reference that does not
  decode, names another bucket or type, or whose object is missing or corrupt is permanent
  (:class:`PayloadError`: dead-lettered with a reason starting ``payload:``); a bus error while
  reading is transient (nak with backoff, redelivered).

Objects are not deleted by rollart: the trainer may need a completion again (a resume re-reads
what no checkpoint covers) and several consumers read each one. The bucket is created with a
time to live equal to the events stream's ``node.events_max_age``, so an object lives as long
as the reference that names it, and with a size limit (``node.traj_store_max_bytes``,
:data:`TRAJ_STORE_MAX_BYTES` by default): a writer cannot fill the server's disk, and a full
bucket refuses the next put (the publisher retries, then its error names the setting).

A reference comes from another process (an env credential writes the bucket), so it is
checked before anything is read: its name is the one :func:`object_name` makes of its
digest; the size it announces is at most :data:`MAX_OBJECT_BYTES`;
the object's own info may not announce more than the reference (nor be a link), and its
chunks are read into one buffer of that size, refused past it (:meth:`rollart.bus.
ObjectStore.get` with ``max_bytes``). So a reader never holds more than the reference's
size, itself bounded, whatever the store holds.
"""

from __future__ import annotations

import asyncio
import hashlib
import re

from rollart import messages as m
from rollart.bus import Bus, BusError, ObjectTooLarge
from rollart.bus.codec import DecodeError, decode, encode

HEADROOM = 64 * 1024
"""Bytes of a message's ``max_payload`` left for its headers (msg id, traceparent)."""
DEFAULT_MAX_PAYLOAD = 1024 * 1024
"""nats-server's default ``max_payload``, assumed when a bus does not know its server's."""
MAX_OBJECT_BYTES = 64 << 20
"""The cap on one offloaded payload: a reference that announces more is refused before any
read, and :func:`offload` refuses to write more. A valid message stays below it: at most
``MAX_TOKENS`` (4M) tokens of ~15 bytes each (~60 MiB)."""
TRAJ_STORE_MAX_BYTES = 1 << 30
"""Default size limit of the run's trajectory store (``node.traj_store_max_bytes``).
nats-server reserves it from its store when the bucket is made (once per run)."""
OBJECT = "object"
"""Value of the :data:`rollart.messages.PAYLOAD_HEADER` header: the payload is an object."""
_UNSAFE = re.compile(r"[^-_.A-Za-z0-9]")
_NAME = re.compile(r"traj-[-_.A-Za-z0-9]{0,150}-[0-9a-f]{32}")


class PayloadError(Exception):
    """A reference that cannot become its message, for good: dead-letter it with ``reason``."""

    def __init__(self, reason: str) -> None:
        super().__init__(reason)
        self.reason = reason


def inline_limit(bus: Bus, configured: int | None) -> int:
    """Bytes an encoded message may have to go inline: ``configured``
    (``rollout.inline_max_bytes``; None: no limit of its own), at most the server's
    ``max_payload`` less :data:`HEADROOM`."""
    cap = max(0, (bus.max_payload or DEFAULT_MAX_PAYLOAD) - HEADROOM)
    return cap if configured is None else min(configured, cap)


def object_name(traj_id: str, sha256: str) -> str:
    """``traj-<traj_id>-<first 32 hex of the digest>``, characters outside ``[-_.A-Za-z0-9]``
    of the id replaced by ``_`` (the digest keeps two ids that map alike apart)."""
    return f"traj-{_UNSAFE.sub('_', traj_id)[:150]}-{sha256[:32]}"


async def _sha256(data: bytes) -> str:
    if len(data) < (1 << 20):
        return hashlib.sha256(data).hexdigest()
    return await asyncio.to_thread(lambda: hashlib.sha256(data).hexdigest())


async def offload(bus: Bus, run: str, msg: m.Message, data: bytes, *, ttl: float = 0.0,
                  max_bytes: int = TRAJ_STORE_MAX_BYTES) -> tuple[bytes, dict[str, str]]:
    """Put ``data`` (``msg`` encoded) in the run's trajectory object store (created with
    objects kept ``ttl`` seconds, ``max_bytes`` in all) unless it is there already; return
    the body and headers of the message that refers to it. Bus errors are raised (the caller
    retries); :class:`PayloadError` for a payload over :data:`MAX_OBJECT_BYTES` (every
    reader would refuse it)."""
    if len(data) > MAX_OBJECT_BYTES:
        raise PayloadError(f"payload: {len(data)} bytes of {msg.traj_id} is over the cap on "
                           f"one payload ({MAX_OBJECT_BYTES} bytes)")
    digest = await _sha256(data)
    bucket = m.traj_bucket(run)
    name = object_name(msg.traj_id, digest)
    store = await bus.object_store(bucket, ttl=ttl, max_bytes=max_bytes)
    if not await store.exists(name):  # a retry after a lost reply: stored already
        try:
            await store.put(name, data)
        except BusError as e:
            raise BusError(f"{e} (a full trajectory store refuses puts: it holds "
                           f"node.traj_store_max_bytes, {max_bytes or 'no limit'} bytes, "
                           "for node.events_max_age)") from e
    ref = m.PayloadRef(
        bucket=bucket, name=name, size=len(data), sha256=digest, type=type(msg).__name__,
        traj_id=msg.traj_id, group_id=getattr(msg, "group_id", ""),
        group_index=getattr(msg, "group_index", -1), eval=getattr(msg, "eval", False),
        tokens=len(getattr(msg, "token_ids", ())), reward=getattr(msg, "reward", 0.0),
        success=getattr(msg, "success", False), stop_reason=getattr(msg, "stop_reason", ""))
    return encode(ref), {m.PAYLOAD_HEADER: OBJECT}


def reference(headers: dict[str, str] | None) -> str | None:
    """The :data:`rollart.messages.PAYLOAD_HEADER` value of a message (None: inline)."""
    return (headers or {}).get(m.PAYLOAD_HEADER)


def decode_ref(data: bytes) -> m.PayloadRef:
    """The reference a message body holds; :class:`PayloadError` when it is not one."""
    try:
        ref = decode(m.PayloadRef, data)
        m.validate(ref)
    except (DecodeError, m.Invalid) as e:
        raise PayloadError(f"payload: malformed reference: {e}") from None
    return ref


async def fetch_payload(bus: Bus, run: str, msg_type: type, headers: dict[str, str] | None,
                        data: bytes, *, max_bytes: int = MAX_OBJECT_BYTES
                        ) -> tuple[bytes, m.PayloadRef]:
    """The encoded payload a reference message (``headers``, ``data``) names, checked
    against its size (at most ``max_bytes``, before any read) and digest, and the reference. :class:`PayloadError` when it cannot be
    had (never will); bus errors (transient) are raised as they are."""
    kind = reference(headers)
    if kind != OBJECT:
        raise PayloadError(f"payload: unknown {m.PAYLOAD_HEADER} header {kind!r} (known: {OBJECT!r})")
    ref = decode_ref(data)
    if ref.type != msg_type.__name__:
        raise PayloadError(f"payload: the reference is to a {ref.type}, this subject carries "
                           f"{msg_type.__name__}")
    if ref.bucket != m.traj_bucket(run):
        raise PayloadError(f"payload: the reference names bucket {ref.bucket!r}, not the run's "
                           f"trajectory store {m.traj_bucket(run)!r}")
    if not _NAME.fullmatch(ref.name) or not ref.name.endswith(ref.sha256[:32]):
        raise PayloadError("payload: malformed reference: the name is not the one rollart "
                           "makes of its digest (traj-<id>-<first 32 hex of sha256>)")
    if not 0 <= ref.size <= max_bytes:
        raise PayloadError(f"payload: the reference announces {ref.size} bytes, over the cap on "
                           f"one payload ({max_bytes} bytes)")
    store = await bus.object_store(ref.bucket)
    try:
        blob = await store.get(ref.name, max_bytes=ref.size)
    except KeyError:
        raise PayloadError(f"payload: object {ref.bucket}/{ref.name} of {ref.traj_id} is missing "
                           f"(never stored, deleted, or expired with the bucket's ttl)") from None
    except ObjectTooLarge as e:
        raise PayloadError(f"payload: object {ref.bucket}/{ref.name} is larger than the "
                           f"{ref.size} bytes its reference announces, or not an object "
                           f"({e})") from None
    if len(blob) != ref.size:
        raise PayloadError(f"payload: object {ref.bucket}/{ref.name} holds {len(blob)} bytes, "
                           f"the reference says {ref.size} (corrupt or replaced)")
    if await _sha256(blob) != ref.sha256:
        raise PayloadError(f"payload: object {ref.bucket}/{ref.name} does not match the "
                           f"reference's sha256 (corrupt or replaced)")
    return blob, ref


def check_matches(msg: object, ref: m.PayloadRef) -> None:
    """:class:`PayloadError` unless the decoded payload is the trajectory ``ref`` names."""
    for f in ("traj_id", "group_id", "group_index", "eval"):
        if hasattr(msg, f) and getattr(msg, f) != getattr(ref, f):
            raise PayloadError(f"payload: the object's {f} {getattr(msg, f)!r} differs from the "
                               f"reference's {getattr(ref, f)!r}")

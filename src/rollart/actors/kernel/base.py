"""Actors: classes whose decorated methods handle subjects.

A handler's settings (durable name, ack_wait, max_inflight, max_deliver, pool) are
data recorded by the decorator; config overrides them per actor (``Actor(settings=)``,
merged key by key by :meth:`Actor.configured`).
Importing a module registers nothing: a :class:`rollart.node.Node` finds handlers by
inspecting the actor instances it is given.

Outcomes of a durable handler:

- return → ack
- ``raise Retry(delay)`` → nak with that delay
- ``raise Reject(reason)``, or a payload that fails to decode → term + dead letter
- any other exception → nak with backoff; dead letter once ``max_deliver`` is reached
"""

from __future__ import annotations

import dataclasses
import inspect
import logging
import os
import re
import socket
import typing
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, ClassVar, Self

from rollart import messages as m
from rollart.actors.kernel import payloads
from rollart.actors.kernel.settings import constructor_args, merged, merged_handlers
from rollart.aio import retry
from rollart.bus import Bus, BusError, DuplicateConflict
from rollart.bus.codec import decode, encode
from rollart.config import ActorConfig, RunConfig
from rollart.telemetry import tracing

log = logging.getLogger(__name__)

ERROR_HEADER = "Rollart-Error"


class Retry(Exception):
    """Raise from a handler to have the message redelivered after ``delay`` seconds."""

    def __init__(self, delay: float | None = None, reason: str = ""):
        super().__init__(reason or f"retry in {delay}s")
        self.delay = delay


class Reject(Exception):
    """Raise from a handler: the message is invalid; never retry, dead-letter it."""

    def __init__(self, reason: str):
        super().__init__(reason)
        self.reason = reason


class RemoteError(Exception):
    """A service answered a request with an error."""


@dataclass(frozen=True)
class HandlerSettings:
    kind: str
    """``consume`` (durable pull consumer) or ``serve`` (request/reply, queue group)."""
    subject: str
    """Key of :data:`rollart.messages.SUBJECTS`."""
    durable: str | None = None
    ack_wait: float = 30.0
    max_deliver: int = 5
    max_inflight: int = 16
    max_ack_pending: int | None = None
    heartbeat: float | None = None
    """Seconds between automatic ``in_progress`` signals; default ``ack_wait / 3``."""
    queue: str | None = None
    pool: str | None = None
    """Pool token of pooled subjects; None means the actor's pool."""
    direct: str | None = None
    """``serve`` only: a per-replica subject (:data:`rollart.messages.DIRECT_SUBJECTS`) the
    handler answers too, on the replica's own token and without a queue group, for an actor
    whose ``progress`` reporter is for this subject (it announces the token); None: none."""
    inactive_threshold: float | None = None
    """Seconds without a fetch after which the server deletes the durable (one-off
    consumers such as an evaluation's scheduler); None: kept for the run's lifetime."""
    deliver_new: bool = False
    """A new durable gets only the messages stored after it was created, not the stream's
    backlog: for a one-off consumer whose messages all follow its own start (an
    evaluation's scheduler binds before it publishes a request, and read every earlier
    outcome of the run otherwise: one more delivery and ack per trajectory trained so far,
    at every evaluation)."""

    def override(self, values: dict[str, Any]) -> "HandlerSettings":
        known = {f.name for f in dataclasses.fields(self)} - {"kind", "subject"}
        bad = set(values) - known
        if bad:
            raise ValueError(f"unknown handler setting(s) {sorted(bad)}; allowed: {sorted(known)}")
        return dataclasses.replace(self, **values)


_ATTR = "__rollart_handler__"


def consume(subject: str, **settings: Any) -> Callable:
    """Mark ``async def handler(self, msg: T, delivery)`` as a durable consumer of ``subject``."""
    return _mark("consume", subject, settings)


def serve(subject: str, **settings: Any) -> Callable:
    """Mark ``async def handler(self, msg: T) -> Reply`` as a request/reply service."""
    return _mark("serve", subject, settings)


def _mark(kind: str, subject: str, settings: dict[str, Any]) -> Callable:
    if subject not in m.SUBJECTS:
        raise ValueError(f"unknown subject {subject!r}; known: {sorted(m.SUBJECTS)}")
    spec = HandlerSettings(kind=kind, subject=subject, **settings)

    def deco(fn: Callable) -> Callable:
        if not inspect.iscoroutinefunction(fn):
            raise TypeError(f"handler {fn.__qualname__} must be `async def`")
        setattr(fn, _ATTR, spec)
        return fn

    return deco


@dataclass
class BoundHandler:
    name: str
    fn: Callable
    settings: HandlerSettings
    msg_type: type
    subject: str
    """Full subject (run and pool filled in)."""


@dataclass(kw_only=True, eq=False)
class Actor:
    """Base of every role. Subclasses set ``role`` and decorate handlers.

    ``settings`` maps handler method name to overrides of its decorator settings.
    """

    role: ClassVar[str] = "actor"
    run: str = "default"
    pool: str = "default"
    name: str = ""
    settings: dict[str, dict[str, Any]] = field(default_factory=dict)
    bus: Bus | None = field(default=None, init=False, repr=False)
    progress: Any = field(default=None, init=False, repr=False)
    """A service's :class:`~rollart.actors.kernel.progress.ProgressReporter` (made in
    ``setup``): the runtime lists the requests of its subject there while they are held;
    None for an actor that reports no progress."""

    def __post_init__(self) -> None:
        if not self.name:
            self.name = self.role
        m.check_token("run", self.run)
        m.check_token("pool", self.pool)

    # -- lifecycle hooks -------------------------------------------------------
    async def setup(self) -> None:
        """Called once the bus is attached, before any handler is bound."""

    async def main(self) -> None:
        """Optional long-running loop, run in the node's task group."""

    async def teardown(self) -> None:
        """Called after handlers stopped, before the node releases the bus."""

    def draining(self) -> None:
        """Called when the node stops fetching: release handlers that would otherwise wait
        past the grace period for something that is not coming (e.g. held deliveries)."""

    # -- introspection ---------------------------------------------------------
    @classmethod
    def handler_specs(cls) -> dict[str, HandlerSettings]:
        """Handler method name -> its decorator's settings, for every handler of the class."""
        return {name: spec for name, fn in inspect.getmembers(cls, predicate=inspect.isfunction)
                if (spec := getattr(fn, _ATTR, None)) is not None}

    @classmethod
    def checked_settings(cls, settings: dict[str, dict[str, Any]]) -> dict[str, HandlerSettings]:
        """Every handler's effective settings (decorator, then ``settings``); a ValueError
        that names an unknown handler or an unknown setting of one."""
        specs = cls.handler_specs()
        unknown = set(settings) - set(specs)
        if unknown:
            raise ValueError(
                f"settings for unknown handler(s) {sorted(unknown)} of {cls.__name__}; "
                f"handlers: {sorted(specs)}")
        out = {}
        for name, spec in specs.items():
            try:
                out[name] = spec.override(settings.get(name, {}))
            except ValueError as e:
                raise ValueError(f"{cls.__name__}.{name}: {e}") from None
        return out

    def handlers(self) -> list[BoundHandler]:
        out = []
        for name, spec in self.checked_settings(self.settings).items():
            d = m.SUBJECTS[spec.subject]
            pool = (spec.pool or self.pool) if d.pooled else None
            if spec.kind == "consume" and spec.durable is None:
                # a pooled subject's durable is the pool's own (``env-on-request-cpu``): two
                # pools on one name would fight over one consumer's filter subject
                tail = f"-{pool}" if pool not in (None, "default") else ""
                spec = dataclasses.replace(
                    spec, durable=f"{self.role}-{name}".replace("_", "-") + tail)
            out.append(
                BoundHandler(
                    name=name,
                    fn=getattr(self, name),
                    settings=spec,
                    msg_type=_first_param_type(getattr(type(self), name)),
                    subject=m.subject(self.run, spec.subject, pool),
                )
            )
        return out

    @classmethod
    def from_config(cls, run_cfg: RunConfig, actor_cfg: ActorConfig, *, pool: str,
                    index: int = 0) -> "Actor":
        """Build from a RunConfig and this role's ActorConfig (:meth:`configured`).

        Roles that read other config sections override this.
        """
        name = f"{cls.role}-{pool}-{index}" if actor_cfg.replicas > 1 else ""
        return cls.configured(actor_cfg, {"run": run_cfg.run, "pool": pool, "name": name})

    @classmethod
    def configured(cls, actor_cfg: ActorConfig, defaults: dict[str, Any], *,
                   handlers: dict[str, dict[str, Any]] | None = None) -> Self:
        """``cls`` built from what its role reads of the config, with ``actor_cfg`` merged
        over it key by key (:mod:`.settings`, one meaning for every role): ``defaults`` are
        constructor arguments, with ``actors.<role>.args`` over them; ``handlers`` are
        settings per handler, with ``actors.<role>.handlers`` over them, and over those a
        ``settings`` argument among the args (a builder's per-run handler settings). An
        unknown argument, handler or handler setting is a ValueError that names it."""
        args = dict(actor_cfg.args)
        settings = merged_handlers(handlers or {},
                                   {h: hc.overrides() for h, hc in actor_cfg.handlers.items()},
                                   args.pop("settings", None) or {})
        cls.checked_settings(settings)
        kw = merged(defaults, args, allowed=constructor_args(cls),
                    what=f"argument(s) of {cls.__name__} (actors.{cls.role}.args)")
        try:
            return cls(settings=settings, **kw)
        except TypeError as e:
            raise ValueError(f"bad args for {cls.__name__}: {e}") from e

    def settings_of(self, handler: str) -> HandlerSettings:
        """The effective settings of one handler (decorator, then config overrides)."""
        for h in self.handlers():
            if h.name == handler:
                return h.settings
        raise KeyError(handler)

    def overrides_main(self) -> bool:
        return type(self).main is not Actor.main

    # -- helpers for handlers --------------------------------------------------
    def subject(self, name: str, pool: str | None = None) -> str:
        d = m.SUBJECTS[name]
        return m.subject(self.run, name, (pool or self.pool) if d.pooled else None)

    async def publish(self, name: str, msg: m.Message, *, msg_id: str | None = None,
                      pool: str | None = None, headers: dict[str, str] | None = None,
                      once: bool = False, inline_max: int = -1, store_ttl: float = 0.0,
                      store_max_bytes: int = payloads.TRAJ_STORE_MAX_BYTES) -> int:
        """Publish ``msg`` durably on subject ``name``; checks the subject's type. With
        tracing on, the headers carry the current span's ``traceparent`` (unless given).
        ``once`` (with a ``msg_id``): :meth:`rollart.bus.Bus.publish_once`, which raises
        :class:`rollart.bus.DuplicateConflict` when other data holds the id.
        ``inline_max`` >= 0 (:func:`rollart.actors.kernel.payloads.inline_limit`): an encoded message
        larger than that goes to the run's trajectory object store (objects kept
        ``store_ttl`` seconds, ``store_max_bytes`` in all) and the stream gets a reference
        (:mod:`rollart.actors.kernel.payloads`); -1: always inline."""
        d = m.SUBJECTS[name]
        if not isinstance(msg, d.type):
            raise TypeError(f"{name} carries {d.type.__name__}, not {type(msg).__name__}")
        assert self.bus is not None, "actor is not attached to a bus"
        subj = self.subject(name, pool)
        if tracing.enabled() and not (headers and tracing.TRACEPARENT in headers):
            headers = tracing.inject(dict(headers or {})) or None
        data = encode(msg)
        if d.stream is not None and 0 <= inline_max < len(data):
            data, extra = await payloads.offload(self.bus, self.run, msg, data, ttl=store_ttl,
                                                 max_bytes=store_max_bytes)
            headers = {**(headers or {}), **extra}
        kw = {"headers": headers} if headers else {}  # none: the call as before tracing
        if d.stream is None:
            await self.bus.publish_core(subj, data, **kw)
            return 0
        if once and msg_id is not None:
            return await self.bus.publish_once(subj, data, msg_id=msg_id, **kw)
        return await self.bus.publish(subj, data, msg_id=msg_id, **kw)

    async def publish_patiently(self, name: str, msg: m.Message, *, msg_id: str | None = None,
                                pool: str | None = None, deadline: float = 300.0,
                                headers: dict[str, str] | None = None, once: bool = False,
                                inline_max: int = -1, store_ttl: float = 0.0,
                                store_max_bytes: int = payloads.TRAJ_STORE_MAX_BYTES) -> int:
        """:meth:`publish`, retrying bus errors with backoff for up to ``deadline`` seconds
        (a msg id makes the retries safe); logs once, raises the last error after that. A
        :class:`rollart.bus.DuplicateConflict` (``once``) is raised at once."""
        return await retry(
            lambda: self.publish(name, msg, msg_id=msg_id, pool=pool, headers=headers, once=once,
                                 inline_max=inline_max, store_ttl=store_ttl,
                                 store_max_bytes=store_max_bytes),
            retry_on=BusError, fatal=DuplicateConflict, what=f"{self.name}: publish on {name}",
            deadline=deadline, base=0.2, cap=5.0, logger=log)

    async def request(self, name: str, msg: m.Message, *, pool: str | None = None,
                      timeout: float = 30.0) -> Any:
        """Request/reply on service subject ``name``; returns the decoded reply."""
        assert self.bus is not None, "actor is not attached to a bus"
        kw = {"headers": h} if (h := tracing.headers()) else {}
        rep = await self.bus.request(self.subject(name, pool), encode(msg), timeout=timeout, **kw)
        if ERROR_HEADER in rep.headers:
            raise RemoteError(f"{name}: {rep.headers[ERROR_HEADER]}")
        return decode(m.REPLY_TYPES[name], rep.data)


def replica_suffix() -> str:
    """``<host>-<pid>``: makes replica names (and the msg ids built from them) unique
    across hosts and processes, as subject-safe characters."""
    host = re.sub(r"[^A-Za-z0-9_-]", "-", socket.gethostname())[:32] or "host"
    return f"{host}-{os.getpid()}"


def _first_param_type(fn: Callable) -> type:
    hints = typing.get_type_hints(fn)
    params = [p for p in inspect.signature(fn).parameters if p != "self"]
    if not params or params[0] not in hints:
        raise TypeError(f"handler {fn.__qualname__} must annotate its message parameter")
    return hints[params[0]]


"""Config Structs. Every field has a docstring; unknown keys are errors."""

from __future__ import annotations

from typing import Any

import msgspec


class Base(msgspec.Struct, forbid_unknown_fields=True, kw_only=True, frozen=True):
    pass


class HandlerConfig(Base):
    """Deployment overrides for one actor handler; unset fields keep the decorator's value."""

    durable: str | None = None
    """Durable consumer name (replicas sharing it split the work)."""
    ack_wait: float | None = None
    """Seconds before an un-acked delivery is redelivered."""
    max_deliver: int | None = None
    """Deliveries before a failing message is dead-lettered."""
    max_inflight: int | None = None
    """Messages handled concurrently by one replica."""
    max_ack_pending: int | None = None
    """Un-acked deliveries across all replicas (backpressure)."""
    heartbeat: float | None = None
    """Seconds between automatic in_progress signals (default ack_wait / 3)."""
    queue: str | None = None
    """Queue group of a request/reply service."""
    pool: str | None = None
    """Pool token for pooled subjects (default: the node's pool)."""

    def overrides(self) -> dict[str, Any]:
        return {f: getattr(self, f) for f in self.__struct_fields__ if getattr(self, f) is not None}


class ActorConfig(Base):
    """One role as deployed."""

    type: str | None = None
    """Import path ``pkg.module:Class``; default: the built-in class of the role."""
    args: dict[str, Any] = {}
    """Keyword arguments for the actor's constructor."""
    handlers: dict[str, HandlerConfig] = {}
    """Per-handler overrides, keyed by handler method name."""
    replicas: int = 1
    """Instances of this actor per node."""


class NodeConfig(Base):
    grace: float = 10.0
    """Seconds in-flight handlers may take to finish when the node drains."""
    heartbeat_every: float = 5.0
    """Seconds between node heartbeats (0 disables)."""


class RunConfig(Base):
    """A whole run: what ``rollart run`` and ``python -m rollart.node`` read."""

    run: str = "default"
    """Run name; one subject token (letters, digits, '_' or '-')."""
    nats: str | None = None
    """NATS URL to join; empty starts an embedded server."""
    run_dir: str = "runs"
    """Folder under which ``<run>/`` holds the store, logs, metrics and checkpoints."""
    node: NodeConfig = NodeConfig()
    """Node settings."""
    actors: dict[str, ActorConfig] = {}
    """Roles by name (``env``, ``generate``, ``reward``, ``trainer``, ``scheduler`` or custom)."""

"""How roles are deployed: the ``actors:`` and ``node:`` sections of a run's config (which
class serves a role, its replicas and handler overrides; a node's timings, stream limits and
child processes)."""

from __future__ import annotations

import math
import os
import re
from typing import Any

import msgspec

from rollart.config.base import Base, in_range, subject_token


class HandlerConfig(Base):
    """Deployment overrides for one actor handler; unset fields keep the decorator's value."""

    durable: str | None = None
    """Durable consumer name (replicas sharing it split the work)."""
    ack_wait: float | None = None
    """Seconds before an un-acked delivery is redelivered."""
    max_deliver: int | None = None
    """Deliveries before a failing message is dead-lettered (-1: no limit)."""
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

    def __post_init__(self) -> None:
        in_range(self, "", "ack_wait heartbeat", gt=0)
        in_range(self, "", "max_inflight max_ack_pending", ge=1)
        if self.max_deliver is not None and not (self.max_deliver == -1 or self.max_deliver >= 1):
            raise ValueError(f"max_deliver must be -1 (no limit) or >= 1 (it is {self.max_deliver})")
        if self.heartbeat is not None and self.ack_wait is not None and self.heartbeat >= self.ack_wait:
            raise ValueError(f"heartbeat must be < ack_wait ({self.ack_wait:g}), or a live handler's "
                             f"delivery is redelivered (it is {self.heartbeat:g})")
        for name in ("durable", "queue", "pool"):
            subject_token("", name, getattr(self, name))

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
    """Instances of this role on each node that hosts it (``rollart run``: on its one host);
    the only replica setting of a role. 0: none, e.g. ``actors.reward.replicas: 0`` when no
    env needs a reward ``scorer``."""

    def __post_init__(self) -> None:
        in_range(self, "", "replicas", ge=0)
        if self.type is not None and not re.fullmatch(r"[\w.]+:[\w.]+", self.type):
            raise ValueError(f"type must be an import path 'pkg.module:Class' (it is {self.type!r})")


LOCAL_PROCESS_ROLES = ("env", "generate", "reward")
"""The roles ``node.local_processes`` may put in a child process of ``rollart run``."""


SMALL_HOST_CORES = 2
"""Usable cores up to which ``node.local_processes`` defaults to one child process."""


def usable_cores() -> int:
    """The cores this process may run on (its CPU affinity where the OS says, else all)."""
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return os.cpu_count() or 1


def default_local_processes(cores: int | None = None) -> list[list[str]]:
    """``node.local_processes`` by default: on a host with at most :data:`SMALL_HOST_CORES`
    usable cores, generation, envs and reward share one child process, where every turn's
    engine call is a function call (``rollout.local_calls``) instead of two trips through
    nats-server (measured on 2 cores, benchmarks/README.md "CPU per turn" and "Learning":
    less plumbing per turn, fewer seconds per step than two children); on a bigger host,
    generation gets a child of its own and envs with reward another (not measured against
    one child: this machine has 2 cores)."""
    n = usable_cores() if cores is None else cores
    if n <= SMALL_HOST_CORES:
        return [["generate", "env", "reward"]]
    return [["generate"], ["env", "reward"]]


def _check_local_processes(groups: list[list[str]]) -> None:
    """``node.local_processes``: lists of known roles, none empty, no role twice."""
    key = "node.local_processes"
    allowed = ", ".join(repr(r) for r in LOCAL_PROCESS_ROLES)
    seen: set[str] = set()
    for i, group in enumerate(groups):
        if not group:
            raise ValueError(f"{key}[{i}] is empty: give each process at least one role "
                             f"({allowed}), or drop the entry")
        for role in group:
            if role in ("trainer", "scheduler"):
                raise ValueError(f"{key}[{i}]: {role!r} always stays in the `rollart run` process; "
                                 f"a child process may serve {allowed}")
            if role not in LOCAL_PROCESS_ROLES:
                raise ValueError(f"{key}[{i}]: unknown role {role!r}; allowed: {allowed}")
            if role in seen:
                raise ValueError(f"{key}: role {role!r} is given twice; each role runs in one "
                                 f"process")
            seen.add(role)


class NodeConfig(Base):
    grace: float = 10.0
    """Seconds in-flight handlers may take to finish when the node drains."""
    heartbeat_every: float = 5.0
    """Seconds between node heartbeats (0 disables)."""
    events_max_age: float = 7 * 24 * 3600.0
    """Seconds the run's events stream (``ROLLART_<run>``: completed trajectories with their
    token lists, status and dead letters) keeps a message; older ones are discarded (0: kept
    forever; else at least 60). Must outlast what the trainer has not yet covered by a
    checkpoint: a ``rollout.completed`` it has read but not checkpointed is read again from
    the stream on ``--resume``, so a run stopped for longer than this loses those
    trajectories. The default (7 days) cannot drop them in a running job."""
    events_max_bytes: int = 0
    """Bytes the events stream may hold; past it the oldest messages are discarded
    (0: no byte limit, the default; else at least 1 MiB). nats-server reserves this much of
    its store (``max_file_store``: by default 75% of the free disk) for the stream up front,
    whatever it holds: with a default of several GiB every run would claim that much, and a
    small disk or a server shared by a few runs would refuse the next run's stream
    ("insufficient storage resources"). So by default ``events_max_age`` bounds the stream.
    A value must hold every trajectory not yet covered by a trainer checkpoint: about
    ``checkpoint_every x batch_groups x group_size x`` the size of one ``rollout.completed``
    (~15 bytes per token: a 1,000-token trajectory is ~15 KB, a 64-trajectory step ~1 MB)."""
    traj_store_max_bytes: int = 1 << 30
    """Bytes the run's trajectory object store (``ROLLART_<run>_TRAJ``: completions too large
    for one message, kept ``events_max_age``) may hold; past it a put is refused, so a writer
    cannot fill the server's disk (the refusal names this setting). nats-server reserves it
    from its store when the bucket is made (at the run's first such completion); at least
    64 MiB (one payload at most). A bucket that exists keeps its own limit."""
    bus_outage_max: float = 600.0
    """Seconds a node keeps trying to reconnect to a nats-server it lost; past that it drains
    and stops with one message naming the server (``python -m rollart.node`` and ``rollart run``
    exit with status 4). Shorter outages are ridden out: the client reconnects by itself and
    unacknowledged work is redelivered. 0: wait for the server forever."""
    stream_replicas: int = 1
    """Copies of the run's streams, KV buckets and object stores, each on another server of a
    nats-server cluster (1 to 5; `rollart cluster init` writes the configs of one). 3 lets
    the run go on through the loss of one server; more than 1 needs a cluster of at least
    that many servers (a single server refuses it). Streams and buckets that exist keep
    theirs, except a stream that the trainer's host updates."""
    local_processes: list[list[str]] = msgspec.field(default_factory=lambda: default_local_processes())
    """How ``rollart run`` spreads the roles over processes of this host when its bus is a
    nats-server (the embedded one, or ``--nats URL``): one child process
    (``python -m rollart.node``; its output in ``runs/<run>/logs/<roles>.log``, such as
    ``env-reward.log``) per list, with
    those roles; the trainer, the scheduler and any role not listed stay in the ``rollart
    run`` process. The default depends on the host's usable cores
    (:func:`default_local_processes`): up to 2, one child for generation, envs and reward,
    whose turns then call the engine in-process (``rollout.local_calls``); more, generation
    in one child and envs with reward in another, so that they do not share one Python
    interpreter. Roles: ``env``, ``generate``, ``reward``, each at most once. ``[]``: one
    process, as ``rollart run --single-process`` (and ``--nats memory``, which cannot cross
    processes). A child that dies, or is stuck (``node.stuck_after``), is restarted (up to 3
    times within 10 minutes) and the work it held is redelivered."""
    stuck_after: float = 60.0
    """Seconds a child node process of ``rollart run`` (``node.local_processes``) may go
    without a heartbeat, once it has sent one, before ``rollart run`` takes it for stuck (its
    event loop blocked, or the process stopped), kills it and restarts it like a child that
    died. 0: never (also when ``heartbeat_every`` is 0); else at least 3 x ``heartbeat_every``,
    so a late heartbeat on a busy host is not taken for a stuck process."""

    def __post_init__(self) -> None:
        in_range(self, "node.", "grace heartbeat_every bus_outage_max stuck_after", ge=0)
        if self.stuck_after and self.heartbeat_every and self.stuck_after < 3 * self.heartbeat_every:
            raise ValueError(f"node.stuck_after must be 0 (never) or >= 3 x node.heartbeat_every "
                             f"({3 * self.heartbeat_every:g}) (it is {self.stuck_after:g})")
        in_range(self, "node.", "stream_replicas", ge=1, le=5)
        _check_local_processes(self.local_processes)
        if self.traj_store_max_bytes < 64 << 20:
            raise ValueError(f"node.traj_store_max_bytes must be >= {64 << 20} bytes (64 MiB, "
                             f"one payload at most) (it is {self.traj_store_max_bytes!r})")
        for name, low, unit in (("events_max_age", 60, "seconds"),
                                ("events_max_bytes", 1024**2, "bytes (1048576: 1 MiB, one message)")):
            v = getattr(self, name)
            if not (math.isfinite(v) and (v == 0 or v >= low)):
                raise ValueError(f"node.{name} must be 0 (no limit) or >= {low} {unit} "
                                 f"(it is {v!r})")

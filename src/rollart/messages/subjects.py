"""The subject table, stream and bucket names: where each wire type travels.

Subjects are ``rollart.<run>.<noun>.<verb>[.<pool>]``; a per-replica subject
(``generate.direct``) has one more token, the replica's: ``...<pool>.<replica>``. Each subject
carries exactly one message type, declared in :data:`SUBJECTS`; the monitor decodes by this
table.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from rollart.bus.base import Retention
from rollart.messages.fields import PREFIX
from rollart.messages.types import (
    CancelGroup,
    DeadLetter,
    GenerateRequest,
    GenerateResult,
    Message,
    NodeHeartbeat,
    PolicyLoaded,
    PolicyPublished,
    RewardRequest,
    RewardResult,
    RolloutCancelled,
    RolloutCompleted,
    RolloutRequested,
    ServiceProgress,
)

_TOKEN = re.compile(r"^[A-Za-z0-9_-]+$")
WORK_SUFFIX = "_WORK"
"""A run's work-queue stream is its events stream's name plus this: no run name may end with
it, or run ``a_WORK``'s events stream would be run ``a``'s work queue."""


def check_token(kind: str, value: str) -> str:
    """A run or pool name must be one subject token: letters, digits, ``_`` or ``-``. A run
    name also makes stream and bucket names (:func:`stream_name`, :func:`kv_bucket`, ...),
    which keep it as it is (NATS allows ``-`` in them), so that two runs never share one;
    the one name that would (a run ending in ``_WORK``) is refused."""
    if not _TOKEN.match(value or ""):
        raise ValueError(
            f"{kind} {value!r} is not a valid subject token: use letters, digits, '_' or '-'"
        )
    if kind == "run" and value.endswith(WORK_SUFFIX):
        raise ValueError(f"run {value!r} may not end with {WORK_SUFFIX!r}: its events stream "
                         f"would be run {value[:-len(WORK_SUFFIX)]!r}'s work queue")
    return value


@dataclass(frozen=True)
class SubjectDef:
    name: str
    """``<noun>.<verb>``, or ``dead``."""
    type: type[Message]
    pooled: bool = False
    stream: str | None = None
    """``work`` (work-queue stream), ``events`` (limits stream) or None (core only)."""
    doc: str = ""
    per_replica: bool = False
    """A pooled subject with one more token after the pool: one replica's own token
    (:data:`DIRECT_SUBJECTS`)."""


SUBJECTS: dict[str, SubjectDef] = {
    d.name: d
    for d in [
        SubjectDef("rollout.requested", RolloutRequested, pooled=True, stream="work",
                   doc="admitted trajectories; an EnvManager acks after completion"),
        SubjectDef("rollout.completed", RolloutCompleted, stream="events",
                   doc="finished trajectories; the trainer's durable input"),
        SubjectDef("rollout.cancelled", RolloutCancelled, stream="events",
                   doc="outcome of a redundant trajectory its group no longer needed"),
        SubjectDef("rollout.cancel", CancelGroup,
                   doc="command: stop the unfinished trajectories of a group"),
        SubjectDef("generate.request", GenerateRequest, pooled=True,
                   doc="request/reply to an LLMProxy queue group"),
        SubjectDef("generate.direct", GenerateRequest, pooled=True, per_replica=True,
                   doc="request/reply to one LLMProxy replica (no queue group): the next "
                       "turn of a trajectory it served"),
        SubjectDef("reward.request", RewardRequest, pooled=True,
                   doc="request/reply to a RewardService queue group"),
        SubjectDef("service.progress", ServiceProgress,
                   doc="each generate/reward replica, ~1/s: the request ids it holds"),
        SubjectDef("policy.published", PolicyPublished, stream="events",
                   doc="a new policy version is readable at uri"),
        SubjectDef("policy.loaded", PolicyLoaded, stream="events",
                   doc="a generation replica now serves this version"),
        SubjectDef("node.heartbeat", NodeHeartbeat, doc="liveness of each node"),
        SubjectDef("dead", DeadLetter, stream="events",
                   doc="messages that failed to decode, validate or process"),
    ]
}

REPLY_TYPES: dict[str, type[Message]] = {
    "generate.request": GenerateResult,
    "generate.direct": GenerateResult,
    "reward.request": RewardResult,
}

DIRECT_SUBJECTS: dict[str, str] = {"generate.request": "generate.direct"}
"""A service's per-replica subject: each replica also answers it on its own token, with no
queue group, so that a requester can send the next turn of a trajectory to the replica that
holds its KV cache (:class:`rollart.actors.kernel.service_client.ServiceClient`, ``affinity``)."""


def subject(run: str, name: str, pool: str | None = None, replica: str | None = None) -> str:
    """Full subject for ``name`` (a key of :data:`SUBJECTS`) in ``run``. A per-replica
    subject takes the ``replica`` token after the pool (None or ``*``: any replica)."""
    d = SUBJECTS[name]
    s = f"{PREFIX}.{check_token('run', run)}.{name}"
    if replica is not None and not d.per_replica:
        raise ValueError(f"subject {name!r} takes no replica")
    if d.pooled:
        if pool == ">":
            return f"{s}.>"
        s = f"{s}.{check_token('pool', pool)}" if pool not in (None, "*") else f"{s}.*"
        if d.per_replica:
            s += f".{check_token('replica', replica)}" if replica not in (None, "*") else ".*"
        return s
    if pool is not None:
        raise ValueError(f"subject {name!r} takes no pool")
    return s


def stream_name(run: str, kind: str) -> str:
    """``ROLLART_<run>`` for events, ``ROLLART_<run>_WORK`` for the work queue. The run name
    is kept as it is (``-`` too: ``exp-1`` and ``exp_1`` are two runs with two sets of
    streams and buckets, and a credential pinned to one has no grant on the other's)."""
    base = f"ROLLART_{check_token('run', run)}"
    return base if kind == "events" else f"{base}_{kind.upper()}"


def stream_subjects(run: str, kind: str) -> tuple[str, ...]:
    out = []
    for d in SUBJECTS.values():
        if d.stream == kind:
            out.append(subject(run, d.name, ">" if d.pooled else None))
    return tuple(out)


STREAM_RETENTION = {"events": Retention.LIMITS, "work": Retention.WORKQUEUE}


def lookup(full_subject: str) -> SubjectDef | None:
    """The definition a full subject belongs to, or None (used by the monitor)."""
    parts = full_subject.split(".")
    if len(parts) < 3 or parts[0] != PREFIX:
        return None
    rest = parts[2:]
    for n in (2, 1):
        d = SUBJECTS.get(".".join(rest[:n]))
        if d is not None and len(rest) == n + (1 if d.pooled else 0) + (1 if d.per_replica else 0):
            return d
    return None


# -- key-value state -------------------------------------------------------------

POLICY_KEY = "policy.version"
"""KV key holding the latest :class:`PolicyPublished` (encoded)."""

LEDGER_KEY = "trainer.ledger"
"""KV key holding the trainer's latest :class:`LedgerSummary` (encoded)."""

RUN_END_KEY = "run.end"
"""KV key holding the run's :class:`RunEnd` once its training is over (encoded)."""


def kv_bucket(run: str) -> str:
    """The run's KV bucket (policy version, scheduler state)."""
    return f"ROLLART_{check_token('run', run)}_STATE"


def object_bucket(run: str) -> str:
    """The run's object store (small model weights)."""
    return f"ROLLART_{check_token('run', run)}_OBJ"


def traj_bucket(run: str) -> str:
    """The run's trajectory object store: completions too large for one bus message
    (:class:`PayloadRef`). EnvManagers write it, the trainer and schedulers read it; a bucket
    apart from the weights' so that writing trajectories gives no hold on weights."""
    return f"ROLLART_{check_token('run', run)}_TRAJ"


PAYLOAD_HEADER = "Rollart-Payload"
"""Header of a message whose body is a :class:`PayloadRef` (value ``object``) instead of the
subject's type: its payload is in the object store the reference names."""

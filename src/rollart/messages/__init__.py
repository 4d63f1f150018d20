"""Every wire type and the subject table: the contract between actors. Read this first.

- :mod:`.types`: the messages, ``msgspec.Struct(frozen=True, kw_only=True)`` on msgpack;
  what a receiver accepts is in their field types and ``__post_init__``.
- :mod:`.fields`: those field types (ids, counts, token lists) and the limits.
- :mod:`.checks`: :func:`validate`, the few checks run after decoding (finite floats,
  printable names), and :func:`dead_request`.
- :mod:`.subjects`: which subject carries which type (:data:`SUBJECTS`), stream, KV and
  object-store names.

Import the package, not its modules (``from rollart import messages as m``; ``m.subject``,
``m.RolloutCompleted``): the split is for readers, the names are one namespace.
"""

from rollart.messages.checks import Invalid, dead_request, validate
from rollart.messages.fields import MAX_NEW_TOKENS, MAX_TOKENS, PREFIX
from rollart.messages.subjects import (
    DIRECT_SUBJECTS,
    LEDGER_KEY,
    PAYLOAD_HEADER,
    POLICY_KEY,
    REPLY_TYPES,
    RUN_END_KEY,
    STREAM_RETENTION,
    SUBJECTS,
    SubjectDef,
    check_token,
    kv_bucket,
    lookup,
    object_bucket,
    stream_name,
    stream_subjects,
    subject,
    traj_bucket,
)
from rollart.messages.types import (
    CancelGroup,
    DeadLetter,
    GenerateRequest,
    GenerateResult,
    LedgerSummary,
    Message,
    NodeHeartbeat,
    PayloadRef,
    PolicyLoaded,
    PolicyPublished,
    RewardRequest,
    RewardResult,
    RolloutCancelled,
    RolloutCompleted,
    RolloutRequested,
    RunEnd,
    SamplingParams,
    ServiceName,
    ServiceProgress,
    TurnRecord,
)

__all__ = [
    "DIRECT_SUBJECTS",
    "LEDGER_KEY",
    "MAX_NEW_TOKENS",
    "MAX_TOKENS",
    "PAYLOAD_HEADER",
    "POLICY_KEY",
    "PREFIX",
    "REPLY_TYPES",
    "RUN_END_KEY",
    "STREAM_RETENTION",
    "SUBJECTS",
    "CancelGroup",
    "DeadLetter",
    "GenerateRequest",
    "GenerateResult",
    "Invalid",
    "LedgerSummary",
    "Message",
    "NodeHeartbeat",
    "PayloadRef",
    "PolicyLoaded",
    "PolicyPublished",
    "RewardRequest",
    "RewardResult",
    "RolloutCancelled",
    "RolloutCompleted",
    "RolloutRequested",
    "RunEnd",
    "SamplingParams",
    "ServiceName",
    "ServiceProgress",
    "SubjectDef",
    "TurnRecord",
    "check_token",
    "dead_request",
    "kv_bucket",
    "lookup",
    "object_bucket",
    "stream_name",
    "stream_subjects",
    "subject",
    "traj_bucket",
    "validate",
]

"""What a receiver checks after decoding: the little that the types cannot say as clearly.

A float field must be finite (msgspec's bounds would word NaN or infinity as
``Expected `float` >= -1.797e+308``) and a name printable (``str.isprintable`` has no regex).
The runtime runs :func:`validate` on every durable and request delivery after decoding: a
stream message that fails is dead-lettered with ``invalid: <why>``, a request gets an error
reply, core messages are counted and dropped (``rollart.actors.kernel.runtime.decode_core``).
Everything else is checked while decoding (:mod:`.fields`, the types' ``__post_init__``).
Checks that need state (a ``min_version`` beyond the published policy) live in the handler
that has the state.
"""

from __future__ import annotations

import math
from collections.abc import Callable

from rollart.bus.codec import DecodeError, decode
from rollart.messages.types import (
    DeadLetter,
    GenerateRequest,
    GenerateResult,
    NodeHeartbeat,
    PayloadRef,
    PolicyLoaded,
    PolicyPublished,
    RewardRequest,
    RewardResult,
    RolloutCompleted,
    RolloutRequested,
    ServiceProgress,
)


class Invalid(ValueError):
    """A message that decodes but holds a value no correct sender produces."""


def validate(msg: object) -> None:
    """Raise :class:`Invalid` if ``msg`` (a decoded wire message) holds a float that is not
    finite or a name that is not printable."""
    check = _CHECKS.get(type(msg))
    if check is not None:
        check(msg)


def dead_request(dl: DeadLetter) -> RolloutRequested | None:
    """The rollout request a dead letter carries, if it carries one."""
    if ".rollout.requested." not in dl.subject:
        return None
    try:
        req = decode(RolloutRequested, dl.payload)
        validate(req)  # junk that was never a real request must not count as a lost member
        return req
    except (DecodeError, Invalid):
        return None


def _finite(name: str, v: float) -> None:
    if not math.isfinite(v):
        raise Invalid(f"{name} = {v!r} is not a finite number")


def _floats(name: str, xs: list[float]) -> None:
    # a sum is finite only if every term is (4x faster than testing each); an overflow
    # of finite terms falls back to testing each
    if not (math.isfinite(sum(xs)) or all(map(math.isfinite, xs))):
        raise Invalid(f"{name} holds NaN or infinity")


def _text(name: str, v: str) -> None:
    if not v.isprintable():
        raise Invalid(f"{name} {v[:80]!r} holds characters that are not printable")


def _rollout_requested(r: RolloutRequested) -> None:
    _text("env", r.env)
    _finite("created_at", r.created_at)


def _rollout_completed(r: RolloutCompleted) -> None:
    _floats("logprobs", r.logprobs)
    for i, t in enumerate(r.turns):
        _finite(f"turns[{i}].reward", t.reward)
    _finite("reward", r.reward)
    _floats("timings", list(r.timings.values()))
    _finite("finished_at", r.finished_at)


def _payload_ref(r: PayloadRef) -> None:
    _finite("reward", r.reward)
    _text("stop_reason", r.stop_reason)


def _generate_request(r: GenerateRequest) -> None:
    _finite("sampling.temperature", r.sampling.temperature)


def _generate_result(r: GenerateResult) -> None:
    _floats("logprobs", r.logprobs)


def _reward_request(r: RewardRequest) -> None:
    _text("scorer", r.scorer)


def _reward_result(r: RewardResult) -> None:
    _finite("score", r.score)


def _service_progress(p: ServiceProgress) -> None:
    _text("replica", p.replica)


def _policy_published(p: PolicyPublished) -> None:
    _finite("created_at", p.created_at)


def _policy_loaded(p: PolicyLoaded) -> None:
    _text("replica", p.replica)
    _finite("load_s", p.load_s)


def _node_heartbeat(h: NodeHeartbeat) -> None:
    _text("node_id", h.node_id)
    _finite("ts", h.ts)
    _finite("load", h.load)
    for role in h.roles:
        _text("roles", role)
    for k, v in h.hardware.items():
        _text("hardware", k)
        if isinstance(v, str):
            _text(f"hardware.{k}", v)
        else:
            _finite(f"hardware.{k}", v)
    for k in h.versions:
        _text("versions", k)
    for p in h.pools:
        _text("pools", p)


_CHECKS: dict[type, Callable] = {
    RolloutRequested: _rollout_requested, RolloutCompleted: _rollout_completed,
    GenerateRequest: _generate_request, GenerateResult: _generate_result,
    RewardRequest: _reward_request, RewardResult: _reward_result,
    ServiceProgress: _service_progress, PolicyPublished: _policy_published,
    PolicyLoaded: _policy_loaded, NodeHeartbeat: _node_heartbeat, PayloadRef: _payload_ref,
}

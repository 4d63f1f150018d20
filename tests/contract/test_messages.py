"""The wire contract in the types: what decoding refuses, what :func:`validate` adds, and
that a sender's construction checks only the rules between fields.

Every subject's junk is in ``tests/faults/test_fuzz_subjects.py``; here are the reasons a
receiver gives, which must name the field and what is wrong with it.
"""

from __future__ import annotations

from typing import get_args

import msgspec
import pytest

from rollart import messages as m
from rollart.bus.codec import DecodeError, decode, encode

TRAJ = dict(traj_id="g1-0", group_id="g1", env="main", seed=1, token_ids=[5, 6, 7],
            response_mask=[0, 1, 1], logprobs=[0.0, -0.5, -0.25], token_versions=[-1, 2, 2],
            turns=[m.TurnRecord(start=1, response_len=2, version=2)], min_version=2,
            max_version=2)


def receive(typ: type, doc: dict) -> str:
    """The reason a receiver gives for ``doc`` encoded as a ``typ`` (empty: accepted)."""
    try:
        m.validate(decode(typ, msgspec.msgpack.encode(doc)))
    except DecodeError as e:
        return f"malformed payload: {e}"
    except m.Invalid as e:
        return f"invalid: {e}"
    return ""


def doc_of(msg: m.Message, **change) -> dict:
    return {**msgspec.to_builtins(msg, builtin_types=(bytes,)), **change}


def test_the_package_is_one_namespace():
    assert m.RolloutCompleted.__module__ == "rollart.messages.types"
    assert set(m.__all__) <= set(dir(m))
    assert set(get_args(m.ServiceName)) == set(m.REPLY_TYPES)
    for d in m.SUBJECTS.values():
        assert issubclass(d.type, m.Message)


def test_a_valid_message_round_trips():
    done = m.RolloutCompleted(**TRAJ)
    assert decode(m.RolloutCompleted, encode(done)) == done
    assert receive(m.RolloutCompleted, doc_of(done)) == ""


@pytest.mark.parametrize("typ,base,change,says", [
    (m.RolloutRequested, dict(traj_id="t", group_id="g", env="e", seed=1), {"seed": -1},
     "Expected `int` >= 0 - at `$.seed`"),
    (m.RolloutRequested, dict(traj_id="t", group_id="g", env="e", seed=1), {"min_version": 2**64 - 1},
     "Expected `int` <= 9223372036854775807 - at `$.min_version`"),
    (m.RolloutRequested, dict(traj_id="t", group_id="g", env="e", seed=1), {"group_id": "a b"},
     "at `$.group_id`"),
    (m.RolloutRequested, dict(traj_id="t", group_id="g", env="e", seed=1), {"wave": 0},
     "wave_size = 0 is out of range [1, 2^63 - 1] (wave >= 0)"),
    (m.RolloutRequested, dict(traj_id="t", group_id="g", env="e", seed=1),
     {"wave": 0, "wave_size": 2}, "wave_id is empty (wave >= 0)"),
    (m.RolloutCompleted, TRAJ, {"logprobs": [0.0]},
     "token_ids, response_mask and logprobs differ in length (3, 3, 1)"),
    (m.RolloutCompleted, TRAJ, {"token_versions": [0]}, "token_versions has 1 entries for 3 tokens"),
    (m.RolloutCompleted, TRAJ, {"min_version": 3}, "max_version = 2 is below min_version = 3"),
    (m.RolloutCompleted, TRAJ, {"response_mask": [0, 1, 2]},
     "Expected `int` <= 1 - at `$.response_mask[2]`"),
    (m.RolloutCompleted, TRAJ, {"turns": [{"start": 2, "response_len": 2, "version": 2}]},
     "turns[0].response_len = 2 is out of range [0, 1]"),
    (m.GenerateRequest, dict(traj_id="t", prompt_ids=[1]), {"prompt_ids": []},
     "Expected `array` of length >= 1 - at `$.prompt_ids`"),
    (m.GenerateRequest, dict(traj_id="t", prompt_ids=[1]), {"sampling": {"top_p": 0.0}},
     "Expected `float` > 0.0 - at `$.sampling.top_p`"),
    (m.GenerateResult, dict(token_ids=[1, 2], logprobs=[0.0, 0.0], version=0),
     {"logprobs": [0.0]}, "1 logprobs for 2 tokens"),
    (m.ServiceProgress, dict(service="reward.request", replica="r"), {"service": "x"},
     "Invalid enum value 'x' - at `$.service`"),
    (m.DeadLetter, dict(subject="rollart.r.dead", payload=b"", reason="x", ts=1.0),
     {"kind": "whatever"}, "Invalid enum value 'whatever' - at `$.kind`"),
])
def test_decoding_refuses_what_the_types_say_and_names_the_field(typ, base, change, says):
    why = receive(typ, doc_of(typ(**base), **change))
    assert why.startswith(f"malformed payload: cannot decode {typ.__name__}: "), why
    assert says in why, why


@pytest.mark.parametrize("typ,base,change,says", [
    (m.RolloutCompleted, TRAJ, {"logprobs": [0.0, float("nan"), 0.0]},
     "invalid: logprobs holds NaN or infinity"),
    (m.RolloutCompleted, TRAJ, {"reward": float("inf")}, "invalid: reward = inf is not a finite number"),
    (m.RolloutCompleted, TRAJ, {"turns": [{"start": 1, "response_len": 2, "version": 2,
                                           "reward": float("nan")}]},
     "invalid: turns[0].reward = nan is not a finite number"),
    (m.GenerateRequest, dict(traj_id="t", prompt_ids=[1]),
     {"sampling": {"temperature": float("inf")}},
     "invalid: sampling.temperature = inf is not a finite number"),
    (m.RolloutRequested, dict(traj_id="t", group_id="g", env="e", seed=1), {"env": "a\x00"},
     "invalid: env 'a\\x00' holds characters that are not printable"),
])
def test_validate_refuses_non_finite_floats_and_unprintable_names(typ, base, change, says):
    assert receive(typ, doc_of(typ(**base), **change)) == says


def test_the_sum_shortcut_accepts_large_finite_logprobs():
    big = dict(TRAJ, logprobs=[0.0, -1.7e308, -1.7e308])  # their sum overflows to -inf
    assert receive(m.RolloutCompleted, doc_of(m.RolloutCompleted(**big))) == ""


def test_construction_checks_the_rules_between_fields_only():
    """A sender cannot build a trajectory whose lists disagree; a single field out of range
    is the receiver's to refuse (msgspec checks constraints on decode only)."""
    with pytest.raises(ValueError, match="differ in length"):
        m.RolloutCompleted(**dict(TRAJ, logprobs=[]))
    with pytest.raises(ValueError, match="wave_size"):
        m.RolloutRequested(traj_id="t", group_id="g", env="e", seed=1, wave=0)
    loose = m.RolloutRequested(traj_id="t", group_id="g", env="e", seed=-1)
    with pytest.raises(DecodeError, match=r"\$\.seed"):
        decode(m.RolloutRequested, encode(loose))


def test_ids_match_as_before_including_a_trailing_newline():
    """The id pattern is the validator's regex, searched as ``re.match`` did: a trailing
    newline passes (``$``), anything else outside the set fails."""
    base = m.CancelGroup(group_id="g")
    assert receive(m.CancelGroup, doc_of(base, group_id="g-1:a@b+c/d.e_f\n")) == ""
    for bad in ("", "x" * 201, "a\nb", "é"):
        assert "at `$.group_id`" in receive(m.CancelGroup, doc_of(base, group_id=bad)), bad
    assert receive(m.RewardRequest, doc_of(
        m.RewardRequest(traj_id="t", scorer="s", response=""), request_id="")) == ""


def test_dead_request_skips_junk_and_other_subjects():
    req = m.RolloutRequested(traj_id="t", group_id="g", env="e", seed=1)
    dl = m.DeadLetter(subject="rollart.r.rollout.requested.p", payload=encode(req), reason="x")
    assert m.dead_request(dl) == req
    bad = msgspec.structs.replace(dl, payload=msgspec.msgpack.encode(doc_of(req, seed=-1)))
    assert m.dead_request(bad) is None
    assert m.dead_request(msgspec.structs.replace(dl, subject="rollart.r.policy.loaded")) is None

"""Every subject of the subject table is safe against bad input (issue 8, item 7).

Junk is random bytes, a message of another subject's type, a map of random fields, or a
valid message with one field replaced by a wrong-typed or impossible value. The contract:

- a stream message that does not decode or validate is dead-lettered with a reason and
  acked, never retried, never a traceback;
- a request gets an error reply (and a dead letter);
- core-subject junk is counted and dropped (:data:`rollart.actors.kernel.runtime.CORE_JUNK`);
- nothing crashes: a short training run that receives junk on every subject finishes.

Hypothesis draws the junk (derandomized: the same payloads every run).
"""

from __future__ import annotations

import asyncio
import logging
import time
import uuid

import msgspec
import pytest
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import strategies as st

from rollart import messages as m
from rollart.bus.codec import DecodeError, decode, encode

RUN = "fuzzrun"  # names in the examples only; the live test uses a fresh run name

EXAMPLES: dict[str, m.Message] = {
    # valid and harmless: evaluation or unknown ids, an env no EnvManager has
    "rollout.requested": m.RolloutRequested(traj_id="fuzz-t", group_id="fuzz-g", env="nosuch",
                                            seed=1, eval=True, group_index=-1),
    "rollout.completed": m.RolloutCompleted(
        traj_id="fuzz-t", group_id="fuzz-g", env="main", seed=1, token_ids=[1, 2],
        response_mask=[0, 1], logprobs=[0.0, -0.5], token_versions=[-1, 0],
        turns=[m.TurnRecord(start=1, response_len=1, version=0)], eval=True, group_index=-1),
    "rollout.cancelled": m.RolloutCancelled(traj_id="fuzz-t", group_id="fuzz-g", group_index=-1),
    "rollout.cancel": m.CancelGroup(group_id="fuzz-g", keep=["fuzz-t"]),
    "generate.request": m.GenerateRequest(traj_id="fuzz-t", prompt_ids=[1, 2, 3],
                                          sampling=m.SamplingParams(max_new_tokens=2)),
    "generate.direct": m.GenerateRequest(traj_id="fuzz-t", prompt_ids=[1, 2, 3],
                                         sampling=m.SamplingParams(max_new_tokens=2)),
    "reward.request": m.RewardRequest(traj_id="fuzz-t", scorer="answer_match", response="1",
                                      answer="1"),
    "service.progress": m.ServiceProgress(service="generate.request", replica="fuzz@x",
                                          request_ids=["fuzz-1"]),
    "policy.published": m.PolicyPublished(version=0, uri="file:///nonexistent",
                                          digest="sha256:00"),
    "policy.loaded": m.PolicyLoaded(version=0, replica="fuzz"),
    "node.heartbeat": m.NodeHeartbeat(node_id="fuzz", host="h", pid=1, pool="default",
                                      roles=["env"], ts=1.0),
    "dead": m.DeadLetter(subject=f"rollart.{RUN}.policy.loaded", payload=b"x", reason="fuzz",
                          ts=1.0),
}

# one impossible value per kind of check, each on a message that is otherwise valid
IMPOSSIBLE = [
    ("rollout.requested", {"seed": -1}),
    ("rollout.requested", {"index_in_group": -3}),
    ("rollout.requested", {"min_version": -1}),
    ("rollout.requested", {"group_index": -2}),
    ("rollout.requested", {"min_version": 2**64 - 1}),
    ("rollout.requested", {"traj_id": ""}),
    ("rollout.requested", {"group_id": "no spaces"}),
    ("rollout.requested", {"wave": 0, "wave_size": 0}),
    ("rollout.requested", {"created_at": float("nan")}),
    ("rollout.completed", {"logprobs": [0.0]}),
    ("rollout.completed", {"response_mask": [0, 2]}),
    ("rollout.completed", {"token_ids": [1, -2]}),
    ("rollout.completed", {"logprobs": [0.0, float("nan")]}),
    ("rollout.completed", {"token_versions": [0]}),
    ("rollout.completed", {"min_version": 3, "max_version": 2}),
    ("rollout.completed", {"attempt": 0}),
    ("rollout.completed", {"reward": float("inf")}),
    ("rollout.completed", {"turns": [m.TurnRecord(start=1, response_len=5, version=0)]}),
    ("rollout.cancelled", {"group_index": -7}),
    ("rollout.cancel", {"group_id": "x" * 500}),
    ("rollout.cancel", {"keep": ["bad id\n"]}),
    ("generate.request", {"prompt_ids": []}),
    ("generate.request", {"prompt_ids": [1, 2**40]}),
    ("generate.request", {"sampling": m.SamplingParams(top_p=0.0)}),
    ("generate.request", {"sampling": m.SamplingParams(temperature=-1.0)}),
    ("generate.request", {"sampling": m.SamplingParams(max_new_tokens=2**62)}),
    ("generate.request", {"choices": [[]]}),
    ("reward.request", {"scorer": ""}),
    ("service.progress", {"service": "nosuch.service"}),
    ("service.progress", {"every": 0.0}),
    ("policy.published", {"version": -1}),
    ("policy.published", {"uri": "http://elsewhere/w"}),
    ("policy.published", {"digest": "md5:00"}),
    ("policy.loaded", {"load_s": -1.0}),
    ("node.heartbeat", {"ts": float("nan")}),
    ("node.heartbeat", {"node_id": ""}),
    ("dead", {"reason": ""}),
    ("dead", {"subject": "elsewhere.x"}),
    ("dead", {"kind": "whatever"}),
]


def rejected(name: str, payload: bytes) -> str | None:
    """Why a receiver of subject ``name`` rejects ``payload`` (None: it is valid)."""
    try:
        m.validate(decode(m.SUBJECTS[name].type, payload))
    except DecodeError as e:
        return f"malformed payload: {e}"
    except m.Invalid as e:
        return f"invalid: {e}"
    return None


def _builtins(msg: m.Message) -> dict:
    return msgspec.to_builtins(msg, builtin_types=(bytes,))


FIELD_JUNK = st.one_of(
    st.integers(min_value=-(2**63), max_value=2**64 - 1),
    st.floats(allow_nan=True, allow_infinity=True),
    st.text(max_size=12),
    st.binary(max_size=8),
    st.booleans(),
    st.none(),
    st.lists(st.integers(min_value=-(2**63), max_value=2**63 - 1), max_size=4),
    st.lists(st.floats(allow_nan=True), max_size=3),
    st.dictionaries(st.text(max_size=4), st.integers(-3, 3), max_size=2),
)


@st.composite
def payloads(draw) -> tuple[str, bytes]:
    """``(subject name, payload)``: junk, or (rarely) a payload that happens to be valid."""
    name = draw(st.sampled_from(sorted(m.SUBJECTS)))
    fields = list(m.SUBJECTS[name].type.__struct_fields__)
    kind = draw(st.sampled_from(["bytes", "other", "field", "map"]))
    if kind == "bytes":
        return name, draw(st.binary(max_size=64))
    if kind == "other":
        other = draw(st.sampled_from(sorted(set(EXAMPLES) - {name})))
        return name, encode(EXAMPLES[other])
    if kind == "field":
        doc = _builtins(EXAMPLES[name])
        doc[draw(st.sampled_from(fields))] = draw(FIELD_JUNK)
        return name, msgspec.msgpack.encode(doc)
    doc = draw(st.dictionaries(st.sampled_from([*fields, "zzz"]), FIELD_JUNK, max_size=6))
    return name, msgspec.msgpack.encode(doc)


# -- fast: the checks themselves ------------------------------------------------------


def test_examples_are_valid():
    for name, msg in EXAMPLES.items():
        assert isinstance(msg, m.SUBJECTS[name].type)
        assert rejected(name, encode(msg)) is None, name


@pytest.mark.parametrize("name,change", IMPOSSIBLE, ids=[f"{n}:{','.join(c)}" for n, c in IMPOSSIBLE])
def test_impossible_values_are_invalid(name, change):
    doc = _builtins(EXAMPLES[name])
    doc.update({k: _builtins(v) if isinstance(v, m.Message) else
                [_builtins(x) if isinstance(x, m.Message) else x for x in v] if isinstance(v, list) else v
                for k, v in change.items()})
    why = rejected(name, msgspec.msgpack.encode(doc))
    assert why is not None, f"{name} with {change} was accepted"


@settings(max_examples=300, derandomize=True, database=None, deadline=None)
@given(payloads())
def test_any_payload_decodes_validates_or_is_rejected(case):
    """Receivers only ever see DecodeError or Invalid from junk: a validator that raised
    anything else would turn junk into handler errors that are retried."""
    name, payload = case
    rejected(name, payload)  # raises only if a check itself crashes


def test_core_junk_is_counted_with_one_log_line_per_subject_and_minute(caplog):
    from types import SimpleNamespace

    from rollart.actors.kernel.runtime import CoreJunk, decode_core

    junk = CoreJunk(every=60.0)
    caplog.set_level(logging.WARNING, logger="rollart.actors.kernel.runtime")
    for i in range(50):
        subj = f"rollart.{RUN}.{'rollout.cancel' if i % 2 else 'node.heartbeat'}"
        typ = m.CancelGroup if i % 2 else m.NodeHeartbeat
        assert decode_core(typ, SimpleNamespace(subject=subj, data=b"\xc1junk"), junk) is None
    ok = SimpleNamespace(subject=f"rollart.{RUN}.rollout.cancel", data=encode(EXAMPLES["rollout.cancel"]))
    assert decode_core(m.CancelGroup, ok, junk) == EXAMPLES["rollout.cancel"]
    bad = SimpleNamespace(subject=ok.subject, data=encode(m.CancelGroup(group_id="no such id!")))
    assert decode_core(m.CancelGroup, bad, junk) is None
    assert junk.counts == {f"rollart.{RUN}.rollout.cancel": 26, f"rollart.{RUN}.node.heartbeat": 25}
    lines = [r for r in caplog.records if "dropped" in r.getMessage()]
    assert len(lines) == 2 and not any(r.exc_info for r in lines)


async def test_a_min_version_beyond_the_published_policy_is_rejected_at_once(memory_bus_only):
    """The EnvManager's watch may lag KV: it reads KV again before it rejects."""
    from types import SimpleNamespace

    from rollart.actors.kernel.base import Reject
    from rollart.actors.env.manager import EnvManager
    from rollart.actors.kernel.policy import set_policy

    bus, run = memory_bus_only, f"mv{uuid.uuid4().hex[:8]}"
    em = EnvManager(run=run, envs={}, rollout=SimpleNamespace(alpha=1), model_dir="")
    em.bus, em.version = bus, 0
    await set_policy(bus, run, m.PolicyPublished(version=5, uri="file:///w", digest="sha256:00"))
    req = EXAMPLES["rollout.requested"]
    await em._check_min_version(msgspec.structs.replace(req, min_version=7))  # 5 + alpha + 1
    assert em.version == 5
    with pytest.raises(Reject, match="invalid: min_version 8 is beyond"):
        await em._check_min_version(msgspec.structs.replace(req, min_version=8))


# -- slow: junk on every subject of a live training run -------------------------------


def _draw_junk(n: int) -> list[tuple[str, bytes]]:
    """``n`` draws of the strategy, derandomized, keeping the junk (valid draws dropped)."""
    out: list[tuple[str, bytes]] = []

    @settings(max_examples=n, derandomize=True, database=None, deadline=None,
              phases=[Phase.generate], suppress_health_check=list(HealthCheck))
    @given(payloads())
    def draw(case):
        if rejected(*case) is not None and case not in out:
            out.append(case)

    draw()
    return out


def _semantic_junk(run: str) -> list[tuple[str, bytes, str]]:
    """Messages that validate but that no sender of this run can produce: ``(subject name,
    payload, what the reason or error says)``."""
    ex = EXAMPLES
    return [
        ("rollout.requested", encode(msgspec.structs.replace(
            ex["rollout.requested"], env="main", traj_id="fuzz-mv", min_version=999)),
         "invalid: min_version"),
        ("policy.published", encode(msgspec.structs.replace(ex["policy.published"], version=999)),
         "invalid: policy.published"),
        ("policy.loaded", encode(msgspec.structs.replace(ex["policy.loaded"], version=999)),
         "invalid: policy.loaded"),
        ("generate.request", encode(msgspec.structs.replace(ex["generate.request"], min_version=999)),
         "invalid: min_version"),
        ("generate.request", encode(msgspec.structs.replace(ex["generate.request"],
                                                            prompt_ids=[1, 10**6])),
         "vocabulary"),
    ]


async def _dead_letters(bus, run: str, want: set[tuple[str, bytes]],
                        deadline: float) -> dict[tuple[str, bytes], str]:
    """Read the run's dead letters until every ``(subject, payload)`` of ``want`` is among
    them (or the deadline): ``(subject, payload) -> reason``."""
    from rollart.bus import ConsumerSpec

    c = await bus.pull_consumer(m.stream_name(run, "events"), ConsumerSpec(
        durable=f"probe-{uuid.uuid4().hex[:8]}", filter_subject=m.subject(run, "dead")))
    got: dict[tuple[str, bytes], str] = {}
    end = time.monotonic() + deadline
    while not want <= set(got) and time.monotonic() < end:
        for d in await c.fetch(256, timeout=0.5):
            await d.ack()
            if rejected("dead", d.data) is None:  # not the junk published on `dead` itself
                dl = decode(m.DeadLetter, d.data)
                got.setdefault((dl.subject, dl.payload), dl.reason)
    return got


@pytest.mark.slow
async def test_junk_on_every_subject_during_a_training_run(bus, tiny_model, tmp_path, caplog):
    from rollart.actors.kernel.base import ERROR_HEADER
    from rollart.actors.kernel.runtime import CORE_JUNK
    from rollart.config import RunConfig, convert
    from rollart.node.build import training_actors
    from rollart.node import Node

    caplog.set_level(logging.WARNING)
    run = f"fz{uuid.uuid4().hex[:8]}"
    junk = _draw_junk(80)
    semantic = _semantic_junk(run)
    assert {n for n, _ in junk} == set(m.SUBJECTS), "every subject gets junk"
    cases = [(n, p, "") for n, p in junk] + semantic
    cfg = convert({"run": run, "run_dir": str(tmp_path / "runs"),
                   "model": {"path": str(tiny_model)},
                   "envs": {"main": {"max_turns": 3}},
                   "rollout": {"group_size": 2, "batch_groups": 2, "alpha": 1},
                   "trainer": {"steps": 3, "lr": 1e-3}}, RunConfig)
    sched, trainer, actors = training_actors(cfg)
    stream_sent: dict[tuple[str, bytes], str] = {}
    core_sent: dict[str, int] = {}
    core_before = dict(CORE_JUNK.counts)

    async def send(batch) -> None:
        for name, payload, says in batch:
            d = m.SUBJECTS[name]
            subj = m.subject(run, name, "default" if d.pooled else None,
                             direct if d.per_replica else None)
            if d.stream is not None:
                await bus.publish(subj, payload)
                stream_sent[(subj, payload)] = says
            elif name in m.REPLY_TYPES:
                rep = await bus.request(subj, payload, timeout=20)
                err = rep.headers.get(ERROR_HEADER, "")
                assert err, f"{name}: junk was answered as if valid: {payload[:60]!r}"
                assert says in err, f"{name}: error reply {err!r} does not say {says!r}"
            else:
                await bus.publish_core(subj, payload)
                core_sent[subj] = core_sent.get(subj, 0) + 1

    t0 = time.monotonic()
    async with Node(bus, actors, heartbeat_every=0.5) as node:
        direct = next(a.progress.direct for a in actors if a.role == "generate")  # its own subject
        await send(cases[::2])  # half at the start, half once the first step is taken
        while trainer.version < 1 and not trainer.finished.is_set():
            await asyncio.sleep(0.05)
        await send(cases[1::2])
        await asyncio.wait_for(trainer.finished.wait(), 120)
        assert trainer.version == 3 and trainer.failure is None
        assert not node.ended_consumers(), "a consumer loop ended"
        dead = await _dead_letters(bus, run, set(stream_sent), deadline=30)
        end = time.monotonic() + 10
        while time.monotonic() < end and any(
                CORE_JUNK.counts.get(s, 0) - core_before.get(s, 0) < n for s, n in core_sent.items()):
            await asyncio.sleep(0.05)
    took = time.monotonic() - t0

    missing = [(s, p[:40]) for s, p in stream_sent if (s, p) not in dead]
    assert not missing, f"{len(missing)} junk stream message(s) not dead-lettered: {missing[:5]}"
    for key, says in stream_sent.items():
        assert dead[key], f"dead letter without a reason: {key}"
        assert says in dead[key], f"reason {dead[key]!r} does not say {says!r}"
    for s, n in core_sent.items():
        assert CORE_JUNK.counts.get(s, 0) - core_before.get(s, 0) >= n, f"core junk on {s} not counted"
    tracebacks = [r for r in caplog.records if r.exc_info]
    assert not tracebacks, f"traceback logged: {tracebacks[0].getMessage()}"
    import hashlib

    print(hashlib.sha256(repr(cases).encode()).hexdigest()[:12], end=" ")
    print(f"{len(cases)} junk messages ({len(stream_sent)} on streams, {sum(core_sent.values())} "
          f"core); run took {took:.1f}s")

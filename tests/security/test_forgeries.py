"""Forged messages from an unauthenticated client change nothing (issue 10, part 5).

Defence in depth alone: no permission checks anywhere, the forger is a plain extra client
on the same bus. Replayed against a live training run on a real nats-server:

- forged ``RolloutCompleted`` (reward 100; for a future group; with ids of a real group;
  of the wrong form) are dead-lettered ``not_admitted: ...``, never trained, and the real
  group they aimed at is trained with its own trajectories;
- zeroed weights in the run's object store with a KV ``policy.version`` record (version
  10^6, matching digest), and a forged version two ahead with a forged ledger summary that
  agrees, are never loaded; the scheduler never admits beyond the α bound of the true version;
- a core ``CancelGroup`` for an in-flight group does not stall training.

Plus the unit rules behind them: the trainer's admission check, conflicts of two copies of
one trajectory, the policy gate, and tampered object-store bytes.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
import uuid

import msgspec
import pytest

from rollart import messages as m
from rollart.actors.groups.admission import Admission, member_seed
from rollart.actors.groups.ledger import GroupLedger
from rollart.actors.kernel.policy import content_digest
from rollart.actors.kernel.policy_gate import PolicyGate
from rollart.bus import ConsumerSpec
from rollart.bus.codec import decode, encode
from tests.waiting import until

LOOP = asyncio.new_event_loop()


# -- helpers -----------------------------------------------------------------------------


def zeroed_weights(model_dir) -> bytes:
    """The tiny model's tensors, all zero, as safetensors bytes."""
    import torch
    from safetensors.torch import load_file, save

    sd = load_file(str(next(model_dir.glob("*.safetensors"))))
    return save({k: torch.zeros_like(v) for k, v in sd.items()})


def forged(rollout, g: int, i: int, *, reward: float = 1.0, turn_reward: float | None = None,
           **change) -> m.RolloutCompleted:
    """A completion of member ``i`` of group ``g`` as the scheduler would have named it."""
    gid = f"g{g:06d}"
    t = m.RolloutCompleted(
        traj_id=f"{gid}-{i}", group_id=gid, env="main", seed=member_seed(rollout, g, i),
        index_in_group=i, token_ids=[1, 2, 3], response_mask=[0, 1, 1],
        logprobs=[0.0, -0.1, -0.1], token_versions=[-1, 0, 0],
        turns=[m.TurnRecord(start=1, response_len=2, version=0,
                            reward=reward if turn_reward is None else turn_reward)],
        reward=reward, success=reward >= 1.0, group_index=g, finished_at=time.time())
    return msgspec.structs.replace(t, **change) if change else t


async def dead_letters(bus, run: str, want, deadline: float) -> dict[tuple[str, bytes], list[str]]:
    """The run's dead letters ``(subject, payload) -> reasons``, read until ``want(got)``
    holds or the deadline passes."""
    c = await bus.pull_consumer(m.stream_name(run, "events"), ConsumerSpec(
        durable=f"probe-{uuid.uuid4().hex[:8]}", filter_subject=m.subject(run, "dead")))
    got: dict[tuple[str, bytes], list[str]] = {}
    end = time.monotonic() + deadline
    while not want(got) and time.monotonic() < end:
        for d in await c.fetch(256, timeout=0.3):
            await d.ack()
            dl = decode(m.DeadLetter, d.data)
            got.setdefault((dl.subject, dl.payload), []).append(dl.reason)
    return got


# -- the live replay -----------------------------------------------------------------------


@pytest.mark.slow
async def test_forgeries_change_nothing_in_a_live_training_run(nats_server, tiny_model, tmp_path,
                                                               caplog):
    from rollart.actors.groups.admission import issued_key
    from rollart.actors.kernel.policy import set_policy
    from rollart.bus.nats import NatsBus
    from rollart.config import RunConfig, convert
    from rollart.node.build import training_actors
    from rollart.node import Node

    caplog.set_level(logging.WARNING)
    run, alpha, B, steps = f"forge{uuid.uuid4().hex[:8]}", 1, 2, 4
    cfg = convert({"run": run, "run_dir": str(tmp_path / "runs"),
                   "model": {"path": str(tiny_model)},
                   "envs": {"main": {"max_turns": 3}},
                   "rollout": {"group_size": 2, "batch_groups": B, "alpha": alpha},
                   "trainer": {"steps": steps, "lr": 1e-3, "weights": "object"}}, RunConfig)
    r = cfg.rollout
    sched, trainer, actors = training_actors(cfg)
    proxies = [a for a in actors if a.role == "generate"]
    loaded: list[tuple[str, int, str]] = []
    for p in proxies:  # every load, with its digest
        follow = p.policy_follow

        def record(pub, orig=follow.loaded_ok, name=p.name):
            loaded.append((name, pub.version, pub.digest))
            orig(pub)

        follow.loaded_ok = record

    bus = NatsBus(nats_server.url, name="rollart-run")
    evil = NatsBus(nats_server.url, name="forger")  # a plain extra client on the same server
    await bus.connect()
    await evil.connect()
    worst: list[str] = []

    async def watch_bound() -> None:
        while True:
            admitted = sched.admitted  # read first: v and lost only grow
            v, lost = trainer.version, trainer.ledger.lost
            if admitted > (v + alpha + 1) * B + lost:
                worst.append(f"admitted {admitted} > ({v} + {alpha} + 1) * {B} + {lost}")
            if sched.version > v:
                worst.append(f"scheduler at v{sched.version}, trainer at v{v}")
            await asyncio.sleep(0.005)

    t0 = time.monotonic()
    sent: dict[tuple[str, bytes], str] = {}
    zero = zeroed_weights(tiny_model)
    zero_digest = content_digest(zero)
    try:
        async with Node(bus, actors, heartbeat_every=0.5) as node, asyncio.TaskGroup() as tg:
            sampler = tg.create_task(watch_bound())
            # 0. a completion of a member of group 7 (admitted at v2 at the earliest) under the
            #    msg id its EnvManager will use: the server's dedupe would drop the real one
            comp = m.subject(run, "rollout.completed")
            early = encode(forged(r, 7, 0, reward=100.0))
            await evil.publish(comp, early, msg_id="out:g000007-0")
            sent[(comp, early)] = "not_admitted: "
            await until(lambda: trainer.version >= 1 or trainer.finished.is_set(), deadline=120, what="step 1")
            # the trainer puts back only records of keys it has written itself (before, the
            # key holds an earlier process's): forge once it announced v1 (on a loaded
            # machine the announcement can come well after the step)
            await until(lambda: trainer.kv_guard.own[m.POLICY_KEY] and trainer.kv_guard.own[m.LEDGER_KEY],
                        deadline=60, what="the trainer's own policy and ledger records")
            kv = await evil.key_value(m.kv_bucket(run))

            # 1. completions: a future group (well formed, reward 100), the ids of a real
            #    group still to be trained (reward 100), ids and versions of the wrong form
            comp = m.subject(run, "rollout.completed")
            cases = [forged(r, 12, i, reward=100.0) for i in range(2)]  # never issued
            cases += [forged(r, 6, i, reward=100.0, turn_reward=0.0) for i in range(2)]
            cases += [forged(r, 6, 0, traj_id="evil-0"),
                      forged(r, 6, 1, group_id="x000006", traj_id="x000006-1"),
                      forged(r, 6, 5, traj_id="g000006-5"),
                      forged(r, 6, 1, max_version=10**6, token_versions=[-1, 0, 10**6]),
                      forged(r, 6, 0, seed=424242)]
            for c in cases:
                payload = encode(c)
                await evil.publish(comp, payload)
                sent[(comp, payload)] = "not_admitted: "

            # 2. weights: zeroed tensors in the object store and a KV record v10^6 with their
            #    digest (and its policy.published announcement)
            store = await evil.object_store(m.object_bucket(run))
            await store.put("v1000000", zero)
            big = m.PolicyPublished(version=10**6, uri=f"obj://{m.object_bucket(run)}/v1000000",
                                    digest=zero_digest, created_at=time.time())
            await evil.publish(m.subject(run, "policy.published"), encode(big))
            sent[(m.subject(run, "policy.published"), encode(big))] = "invalid: policy.published"
            await set_policy(evil, run, big)

            # 3. a forged version three ahead: zeroed weights, its record and a ledger summary
            #    that agrees with it (a jump: held back until the trainer puts both back)
            summary = decode(m.LedgerSummary, (await kv.get(m.LEDGER_KEY)).value)
            # (three past the newest version anyone holds: the KV summary may still lag the
            # trainer, and the trainer may step while this is forged; a jump stays a jump)
            nxt = max(summary.version, sched.version, trainer.version) + 3
            await store.put("forged-next", zero)
            await kv.put(m.LEDGER_KEY, encode(msgspec.structs.replace(summary, version=nxt)))
            await set_policy(evil, run, m.PolicyPublished(
                version=nxt, uri=f"obj://{m.object_bucket(run)}/forged-next", digest=zero_digest))

            # 4. a core CancelGroup for a group in flight
            flying = [gid for gid, g in sched.groups.items()
                      if not g.ready and gid not in ("g000006", "g000007")]
            target = flying[-1] if flying else "g000005"
            await evil.publish_core(m.subject(run, "rollout.cancel"),
                                    encode(m.CancelGroup(group_id=target, reason="forged")))

            await asyncio.wait_for(trainer.finished.wait(), 180)
            assert trainer.version == steps and trainer.failure is None, trainer.failure
            assert not node.ended_consumers(), "a consumer loop ended"
            issued = int((await kv.get(issued_key())).value)
            kv_ledger = f"rollart.{run}.kv.{m.LEDGER_KEY}"
            dead = await dead_letters(
                evil, run, lambda got: set(sent) <= set(got) and any(
                    "not_admitted: policy v1000000" in why for whys in got.values()
                    for why in whys) and any(subj == kv_ledger for subj, _ in got), 30)
            sampler.cancel()
    finally:
        await evil.close()
        await bus.close()
    took = time.monotonic() - t0

    # nothing forged was trained; the real group 6 was, with its own trajectories
    rows = [json.loads(x) for x in (trainer.path / "metrics.jsonl").read_text().splitlines()]
    assert [row["step"] for row in rows] == list(range(1, steps + 1))
    ids = [t for row in rows for t in row["traj_ids"]]
    assert len(ids) == len(set(ids)) == steps * B * r.group_size
    assert not {"evil-0", "x000006-1", "g000006-5", "g000012-0", "g000012-1"} & set(ids)
    assert {"g000006-0", "g000006-1"} <= set(ids), "the real group 6 was trained"
    assert "g000007-0" in ids, "the forged msg id out:g000007-0 kept the real completion out"
    envs = [a for a in actors if a.role == "env"]
    assert sum(e.stats.get("msg_id_conflicts", 0) for e in envs) == 1
    assert all(row["reward"] <= 1.0 for row in rows), "a forged reward of 100 was trained"
    assert rows[-1]["count_not_admitted"] >= len(cases)
    # every forgery is reported: a dead letter with its reason
    missing = [s for s in sent if s not in dead]
    assert not missing, f"{len(missing)} forged message(s) not dead-lettered"
    for key, says in sent.items():
        assert any(why.startswith(says) for why in dead[key]), dead[key]
    assert all("was not issued" in dead[(comp, encode(c))][0] for c in cases[:2])
    assert "reward 100.0 is not what its turns add up to" in dead[(comp, encode(cases[2]))][0]
    refused = [why for why in dead[(m.subject(run, "policy.published"), encode(big))]
               if why.startswith("not_admitted: policy v1000000")]
    assert refused and all("refuse: policy v1000000 is beyond" in why for why in refused)
    restored = [why for (subj, _), whys in dead.items() if subj == kv_ledger for why in whys]
    assert restored and "written by another client than the trainer" in restored[0]
    # nothing forged was served, and admission kept the α bound of the true version
    assert loaded and all(d != zero_digest and v <= steps for _, v, d in loaded), loaded
    assert all(p.version <= steps for p in proxies)
    assert not worst, worst[:3]
    assert sched.version <= trainer.version and issued <= (steps + alpha + 1) * B + trainer.ledger.lost
    assert trainer.counts["kv_restored"] >= 2
    log = "\n".join(rec.getMessage() for rec in caplog.records)
    assert "was overwritten by another client" in log
    assert "not admitted" in log
    print(f"forgery replay: {len(cases) + 1} completions, 2 policy records, 1 cancel; "
          f"{len(loaded)} loads; run took {took:.1f}s")


# -- the trainer's admission check ------------------------------------------------------------


def _rollout(**kw):
    from rollart.config import RolloutConfig

    return RolloutConfig(**{"group_size": 2, "batch_groups": 2, "alpha": 1, **kw})


def _envs():
    from rollart.config import RunConfig, convert

    return dict(convert({"envs": {"main": {"max_turns": 3}}}, RunConfig).envs)


def _ledger(r) -> GroupLedger:
    return GroupLedger(group_size=r.group_size, redundancy=r.redundancy,
                       batch_groups=r.batch_groups, alpha=r.alpha, stale=r.stale, breaker=0)


@pytest.mark.parametrize("change,says", [
    ({}, None),
    ({"env": "other"}, "is not the training env"),
    ({"traj_id": "g000003-x"}, "is not member 1"),
    ({"group_id": "h000003", "traj_id": "h000003-1"}, "is not the id of group 3"),
    ({"index_in_group": 2, "traj_id": "g000003-2"}, "outside a group of 2"),
    ({"seed": 99}, "is not the task seed"),
    ({"max_version": 7}, "claims policy v7"),
    ({"turns": [m.TurnRecord(start=1, response_len=2, version=9, reward=1.0)]}, "claims policy v9"),
    ({"reward": 100.0, "turn_reward": 0.0}, "reward 100.0 is not what its turns add up to"),
    ({"group_index": 5, "group_id": "g000005", "traj_id": "g000005-1", "seed": 5},
     "group 5 was not issued"),
    ({"group_index": 10**9 + 301, "group_id": "g000003-r1", "traj_id": "g000003-r1-1"},
     "no group this trainer re-admitted"),
])
def test_admission_check(change, says):
    r = _rollout()
    a, led = Admission(r, _envs()), _ledger(r)
    msg = forged(r, 3, 1, **change)
    why = a.check(msg, ledger=led, version=2, issued=5, lost=0)
    assert (why is None) if says is None else (says in (why or "")), why


def test_admission_alpha_backstop_and_restarts():
    r = _rollout()
    a, led = Admission(r, _envs()), _ledger(r)
    # issued says 100 (forged), yet at v1 admission can have let in (1 + 1 + 1) * 2 + lost
    assert a.check(forged(r, 5, 0), ledger=led, version=1, issued=100, lost=0) is None
    assert "beyond what admission" in a.check(forged(r, 6, 0), ledger=led, version=1,
                                              issued=100, lost=0)
    assert a.check(forged(r, 6, 0), ledger=led, version=1, issued=100, lost=1) is None
    # a group the trainer re-admitted: its own id and seed
    led.restarted[10**9 + 301] = ("g000003-r1", 3)
    ok = forged(r, 3, 1, group_index=10**9 + 301, group_id="g000003-r1", traj_id="g000003-r1-1")
    assert a.check(ok, ledger=led, version=1, issued=0, lost=0) is None
    assert "task seed" in a.check(msgspec.structs.replace(ok, seed=4), ledger=led, version=1,
                                  issued=0, lost=0)
    assert led.load(led.state()) is None and led.restarted == {10**9 + 301: ("g000003-r1", 3)}


def test_reward_rule_follows_the_env_manager():
    r = _rollout()
    envs = _envs()
    pen = envs["main"].format_penalty
    a, led = Admission(r, envs), _ledger(r)
    turns = [m.TurnRecord(start=1, response_len=1, version=0, reward=0.0, format_ok=False),
             m.TurnRecord(start=2, response_len=1, version=0, reward=1.0)]
    ok = forged(r, 1, 0, turns=turns, reward=pen + 1.0)
    assert a.check(ok, ledger=led, version=0, issued=2, lost=0) is None
    cut = msgspec.structs.replace(ok, reward=pen + 1.0 + pen, stop_reason="env_timeout")
    assert a.check(cut, ledger=led, version=0, issued=2, lost=0) is None
    bad = msgspec.structs.replace(cut, stop_reason="terminated")
    assert "not what its turns add up to" in a.check(bad, ledger=led, version=0, issued=2, lost=0)
    scored = {**envs, "main": msgspec.structs.replace(envs["main"], scorer="answer_match")}
    a2 = Admission(r, scored)
    assert a2.check(forged(r, 1, 0, reward=0.5, success=False), ledger=led, version=0,
                    issued=2, lost=0) is None
    assert "does not follow from the score" in a2.check(
        forged(r, 1, 0, reward=0.5, success=True), ledger=led, version=0, issued=2, lost=0)


# -- conflicts: two different copies of one trajectory ---------------------------------------


def test_a_forged_copy_that_comes_first_does_not_push_the_real_one_out():
    r = _rollout()
    led = _ledger(r)
    fake = forged(r, 0, 0, reward=1.0)
    real = forged(r, 0, 0, reward=0.0, turn_reward=0.0)
    f1, f2, f3, f4 = (LOOP.create_future() for _ in range(4))
    assert led.add_completed(fake, f1) is None
    assert led.add_completed(real, f2) is None  # held too: both are dead-lettered later
    assert led.verdicts[f1] == led.verdicts[f2] and led.verdicts[f1].startswith("conflict:")
    g = led.open[0]
    assert g.members == [] and [t for t, _ in g.dead] == ["g000000-0"]
    assert led.add_completed(fake, f3) is None and led.verdicts[f3].startswith("conflict:")
    # the other member completes: the group settles (it failed: one completion of 2)
    assert led.add_completed(forged(r, 0, 1), f4) is None
    sel = led.select(0)
    assert [x.index for x in sel.failed] == [0] and not sel.batch
    futs = led.close(g, "failed")
    assert {f1, f2, f3, f4} <= set(futs)
    assert led.counts["conflicts"] == 3


def test_the_same_copy_again_is_a_duplicate_and_a_different_one_after_training_is_reported():
    r = _rollout(batch_groups=1)
    led = _ledger(r)
    a, b = forged(r, 0, 0), forged(r, 0, 1)
    for t in (a, b):
        assert led.add_completed(t, LOOP.create_future()) is None
    assert led.add_completed(a, LOOP.create_future()) == "duplicates"
    sel = led.select(0)
    assert [g.index for g in sel.batch] == [0]
    led.close(sel.batch[0], "trained")
    assert led.add_completed(a, LOOP.create_future()) == "late"  # a redelivery: fine
    other = msgspec.structs.replace(a, reward=0.0, turns=[m.TurnRecord(
        start=1, response_len=2, version=0, reward=0.0)])
    assert led.add_completed(other, LOOP.create_future()) == "conflicts"  # reported


def test_a_completion_after_a_cancel_of_the_same_trajectory_is_a_conflict():
    r = _rollout()
    led = _ledger(r)
    assert led.add_cancelled("g000000-0", 0, LOOP.create_future())
    assert led.add_completed(forged(r, 0, 0), LOOP.create_future()) == "conflicts"


# -- the policy gate ----------------------------------------------------------------------------


def pub(v: int, d: str = "tensors-sha256:aa") -> m.PolicyPublished:
    return m.PolicyPublished(version=v, uri=f"obj://b/v{v}", digest=d)


def test_gate_rules():
    g = PolicyGate(digests=True, settle_s=5.0)
    g.see_ledger(m.LedgerSummary(version=3, steps_total=10))
    g.see_announcement(pub(3))  # it follows announcements (rule 3c on)
    assert g.judge(pub(3), 0.0)[0] == "accept"  # fresh: the ledger agrees
    g.accept(pub(3))
    assert g.judge(pub(11), 0.0)[0] == "refuse"  # beyond trainer.steps
    assert g.judge(pub(4), 0.0)[:2] == ("wait", "the trainer's ledger reports v3, not v4")
    g.see_ledger(m.LedgerSummary(version=4, steps_total=10))
    verdict, why, due = g.judge(pub(4), 1.0)
    assert verdict == "settle" and "no policy.published" in why and due == 6.0
    g.see_announcement(pub(4))
    assert g.judge(pub(4), 1.0)[0] == "accept"
    g.accept(pub(4))
    # a jump: settles only if it stays (non-decreasing) for settle_s
    g.see_ledger(m.LedgerSummary(version=9, steps_total=10))
    for v in (7, 8, 9):
        g.see_announcement(pub(v))
    assert g.judge(pub(7), 10.0)[0] == "settle"
    assert g.judge(pub(8), 13.0)[0] == "settle"
    assert g.judge(pub(9), 15.0)[:1] == ("accept",)
    g.accept(pub(9))
    # other weights for a version: a correction while none were loaded, else it settles too
    g.see_announcement(pub(9, "tensors-sha256:bb"))
    assert g.judge(pub(9, "tensors-sha256:bb"), 20.0)[0] == "accept"
    g.loaded(pub(9))
    assert "replaces the loaded weights" in g.judge(pub(9, "tensors-sha256:bb"), 20.0)[1]
    # a record that goes back resets the clock of a jump
    g2 = PolicyGate(settle_s=5.0)
    g2.watched_from_start()
    assert g2.judge(pub(5), 0.0)[0] == "settle"
    assert g2.judge(pub(1), 4.0)[0] == "accept"
    assert g2.judge(pub(5), 6.0)[0] == "settle"
    # no trainer ledger (no trainer in this run): one version at a time, no announcement needed
    g3 = PolicyGate()
    g3.watched_from_start()
    assert g3.judge(pub(1), 0.0)[0] == "accept"


async def test_a_refused_record_is_reported_and_the_old_version_kept(memory_bus_only, tiny_model):
    """A proxy of a run with a trainer ledger: v10^6 is refused (log + dead letter), a forged
    next version without announcement is held back, the real next version loads."""
    from rollart.actors.generate.proxy import LLMProxy
    from rollart.actors.kernel.policy import set_policy
    from rollart.node import Node
    from tests.actors.sample_actors import collect, new_run

    bus, run = memory_bus_only, new_run()
    kv = await bus.key_value(m.kv_bucket(run))
    await kv.put(m.LEDGER_KEY, encode(m.LedgerSummary(version=0, steps_total=5)))
    proxy = LLMProxy(run=run, model_dir=str(tiny_model))
    async with Node(bus, [proxy], heartbeat_every=0):
        await until(lambda: proxy.gate.held == 0, deadline=10, what="the gate to start")
        store = await bus.object_store(m.object_bucket(run))
        zero = zeroed_weights(tiny_model)
        await store.put("z", zero)
        forged_pub = m.PolicyPublished(version=10**6, uri=f"obj://{m.object_bucket(run)}/z",
                                       digest=content_digest(zero))
        await set_policy(bus, run, forged_pub)
        dead = await collect(bus, run, "dead", 1, deadline=10)
        assert dead and "not_admitted: policy v1000000" in dead[0].reason
        assert proxy.version == 0
        # the real v1: announced, its record, then the ledger
        real = m.PolicyPublished(version=1, uri=f"obj://{m.object_bucket(run)}/z",
                                 digest=content_digest(zero))
        await bus.publish(m.subject(run, "policy.published"), encode(real))
        await set_policy(bus, run, real)
        await asyncio.sleep(0)
        assert proxy.version == 0  # the ledger does not report v1 yet
        await kv.put(m.LEDGER_KEY, encode(m.LedgerSummary(version=1, steps_total=5)))
        await until(lambda: proxy.version == 1, deadline=20, what="v1 loaded once the ledger reports it")


async def test_a_consistent_forgery_without_announcement_is_not_taken_at_once(memory_bus_only,
                                                                             tiny_model):
    """Rule 3c is on for every holder: a record and a ledger summary forged consistently for
    exactly the next version (what the gate could not tell from the trainer's before) are
    held back (settling) when no ``policy.published`` announced them; announced, the next
    real version loads at once."""
    from rollart.actors.generate.proxy import LLMProxy
    from rollart.actors.kernel.policy import set_policy
    from rollart.node import Node
    from tests.actors.sample_actors import new_run

    bus, run = memory_bus_only, new_run()
    kv = await bus.key_value(m.kv_bucket(run))
    await kv.put(m.LEDGER_KEY, encode(m.LedgerSummary(version=0, steps_total=5)))
    proxy = LLMProxy(run=run, model_dir=str(tiny_model))
    async with Node(bus, [proxy], heartbeat_every=0):
        await until(lambda: proxy.gate.held == 0, deadline=10, what="the gate to start")
        proxy.gate.settle_s = 3600.0  # the trainer, absent here, would put its record back
        store = await bus.object_store(m.object_bucket(run))
        zero = zeroed_weights(tiny_model)
        await store.put("z", zero)
        real = m.PolicyPublished(version=1, uri=f"obj://{m.object_bucket(run)}/z",
                                 digest=content_digest(zero))
        await bus.publish(m.subject(run, "policy.published"), encode(real))
        await kv.put(m.LEDGER_KEY, encode(m.LedgerSummary(version=1, steps_total=5)))
        await set_policy(bus, run, real)
        await until(lambda: proxy.version == 1, deadline=20, what="the announced v1 loaded")
        forged_pub = msgspec.structs.replace(real, version=2)
        await kv.put(m.LEDGER_KEY, encode(m.LedgerSummary(version=2, steps_total=5)))
        await set_policy(bus, run, forged_pub)
        await until(lambda: proxy.gate.reports.get("settle", 0) >= 1, deadline=20,
                    what="the unannounced v2 reported as settling", state=lambda: proxy.gate.reports)
        assert proxy.version == 1


async def test_tampered_object_store_bytes_are_refused_and_the_old_version_kept(
        bus, tiny_model, tmp_path):
    """Weights load only when their content digest matches the announcement: the bytes of
    v2 replaced in the object store (the announcement unchanged) are refused and reported
    (``policy.loaded`` with the error), and v1 keeps serving."""
    from rollart.actors.generate.proxy import LLMProxy
    from rollart.actors.kernel.policy import set_policy
    from rollart.node import Node
    from tests.actors.sample_actors import collect, new_run
    from tests.e2e.test_weight_sync import generate, perturbed_weights

    run = new_run()
    proxy = LLMProxy(run=run, name="gen-0", model_dir=str(tiny_model))
    async with Node(bus, [proxy], heartbeat_every=0):
        proxy.policy_follow.first_retry = 3600.0  # no retry within the test
        store = await bus.object_store(m.object_bucket(run))
        for v, scale in ((1, 0.3), (2, 0.6)):
            w = tmp_path / f"v{v}.safetensors"
            perturbed_weights(tiny_model, w, scale)
            data = w.read_bytes()
            digest = content_digest(data)
            if v == 2:  # tampered after the trainer wrote them: zeroed tensors
                data = zeroed_weights(tiny_model)
            await store.put(f"v{v:06d}", data)
            p = m.PolicyPublished(version=v, uri=f"obj://{m.object_bucket(run)}/v{v:06d}",
                                  digest=digest)
            await bus.publish(m.subject(run, "policy.published"), encode(p))
            await set_policy(bus, run, p)
            if v == 1:
                await until(lambda: proxy.version == 1, deadline=30, what="v1 loaded")
        reports = await collect(bus, run, "policy.loaded", 2, deadline=30)
        assert [(x.version, bool(x.error)) for x in reports] == [(1, False), (1, True)]
        assert "digest" in reports[1].error and "refusing" in reports[1].error
        assert proxy.version == 1 and (await generate(proxy, [1, 5, 6])).version == 1


"""The scheduler never admits past the α bound, whatever order trajectories complete in."""

from __future__ import annotations

import asyncio
import random
import time

import pytest
from hypothesis import given, strategies as st

from rollart import messages as m
from rollart.actors.kernel.policy import set_policy
from rollart.actors.groups.ledger import admissible
from rollart.actors.scheduler.actor import RolloutScheduler
from rollart.bus import ConsumerSpec
from rollart.bus.codec import decode
from rollart.config import RolloutConfig
from rollart.node import Node
from tests.actors.sample_actors import new_run



@given(v=st.integers(0, 50), alpha=st.integers(0, 4), batch=st.integers(1, 16),
       admitted=st.integers(0, 2000), lost=st.integers(0, 100))
def test_admissible_matches_the_bound(v, alpha, batch, admitted, lost):
    lost = min(lost, admitted)
    live = admitted - lost
    assert admissible(admitted, lost, v, alpha, batch) == (live + 1 <= (v + alpha + 1) * batch)
    assert admissible(admitted, lost, v, None, batch)


@pytest.mark.parametrize("seed,alpha", [(0, 0), (1, 1), (2, 1), (3, 2), (4, 0)])
async def test_admission_bound_under_random_completion_orders(memory_bus_only, seed, alpha):
    bus, rng, run = memory_bus_only, random.Random(seed), new_run()
    ro = RolloutConfig(group_size=2, batch_groups=3, alpha=alpha)
    sched = RolloutScheduler(run=run, rollout=ro, total_groups=24)
    async with Node(bus, [sched], heartbeat_every=0):
        work = await bus.pull_consumer(m.stream_name(run, "work"), ConsumerSpec(
            durable="test-env", filter_subject=m.subject(run, "rollout.requested", "default")))
        pending, group_done, v, ever_max = [], {}, 0, 0
        deadline = time.monotonic() + 60
        while v < 8 and time.monotonic() < deadline:
            for d in await work.fetch(64, timeout=0.05):
                pending.append(decode(m.RolloutRequested, d.data))
                await d.ack()
            bound = (v + alpha + 1) * ro.batch_groups
            assert sched.admitted <= bound, f"admitted {sched.admitted} > bound {bound} at v={v}"
            ever_max = max(ever_max, sched.admitted)
            if pending:  # complete one trajectory chosen at random
                req = pending.pop(rng.randrange(len(pending)))
                assert req.min_version >= max(0, req.admitted_version - alpha)
                await sched.bus.publish(m.subject(run, "rollout.completed"), encode_done(req))
                group_done[req.group_id] = group_done.get(req.group_id, 0) + 1
            full = sum(1 for n in group_done.values() if n == ro.group_size)
            if full >= (v + 1) * ro.batch_groups:  # the "trainer" takes a batch: v+1
                v += 1
                await set_policy(bus, run, m.PolicyPublished(version=v, uri="file:///x", digest="sha256:0"))
                end = time.monotonic() + 5
                while sched.version < v and time.monotonic() < end:
                    await asyncio.sleep(0.005)
        assert v == 8, "the pipeline must not deadlock under the bound"
        assert ever_max >= (alpha + 1) * ro.batch_groups, "the bound must not be stricter than α"


def encode_done(req: m.RolloutRequested) -> bytes:
    from rollart.bus.codec import encode

    return encode(m.RolloutCompleted(traj_id=req.traj_id, group_id=req.group_id, env=req.env,
                                      seed=req.seed, token_ids=[], response_mask=[], logprobs=[]))

"""Small actors used by the runtime and node tests (real actors, trivial work)."""

from __future__ import annotations

import asyncio
import time
import uuid
from dataclasses import dataclass, field

from rollart import messages as m
from rollart.actors.kernel.base import Actor, Reject, Retry, consume, serve
from rollart.bus import ConsumerSpec
from rollart.bus.codec import decode, encode


@dataclass(kw_only=True, eq=False)
class EchoEnv(Actor):
    """Completes each requested rollout at once; ``env`` selects a misbehaviour."""

    role = "echo"
    delay: float = 0.0
    calls: dict[str, int] = field(default_factory=dict)

    @consume("rollout.requested", ack_wait=5, max_deliver=3, max_inflight=4)
    async def on_request(self, req: m.RolloutRequested, delivery) -> None:
        self.calls[req.traj_id] = self.calls.get(req.traj_id, 0) + 1
        if req.env == "reject":
            raise Reject("env 'reject' is not allowed")
        if req.env == "fail":
            raise RuntimeError("boom")
        if req.env == "retry" and delivery.num_delivered < 2:
            raise Retry(0.05)
        delay = self.delay or (float(req.seed) / 1000 if req.env == "slow" else 0.0)
        if delay:
            await asyncio.sleep(delay)
        done = m.RolloutCompleted(traj_id=req.traj_id, group_id=req.group_id, env=req.env,
                                  seed=req.seed, token_ids=[1, 2], response_mask=[0, 1],
                                  logprobs=[0.0, -0.5], reward=float(req.seed),
                                  finished_at=time.time())
        await self.publish("rollout.completed", done, msg_id=f"done:{req.traj_id}")


@dataclass(kw_only=True, eq=False)
class ScoreService(Actor):
    role = "score"

    @serve("reward.request", max_inflight=8)
    async def score(self, req: m.RewardRequest) -> m.RewardResult:
        if req.scorer == "explode":
            raise ValueError("scorer exploded")
        return m.RewardResult(score=float(req.response == req.answer), replica=self.name)


def request(run: str, i: int, env: str = "ok", pool: str = "default") -> tuple[str, bytes]:
    msg = m.RolloutRequested(traj_id=f"t{i}", group_id=f"g{i}", env=env, seed=i)
    return m.subject(run, "rollout.requested", pool), encode(msg)


async def collect(bus, run: str, name: str, n: int, deadline: float = 10.0) -> list:
    """Read ``n`` messages of subject ``name`` from the run's event stream (or fewer by the deadline)."""
    d = m.SUBJECTS[name]
    c = await bus.pull_consumer(
        m.stream_name(run, d.stream),
        ConsumerSpec(durable=f"probe-{uuid.uuid4().hex[:8]}", filter_subject=m.subject(run, name)),
    )
    out = []
    end = time.monotonic() + deadline
    while len(out) < n and time.monotonic() < end:
        for dl in await c.fetch(n - len(out), timeout=min(0.5, max(0.05, end - time.monotonic()))):
            out.append(decode(d.type, dl.data))
            await dl.ack()
    return out


async def stored(bus, run: str, name: str) -> int:
    """How many messages of subject ``name`` the run's stream holds now: an absence check
    that reads the store instead of waiting for something not to arrive."""
    d = m.SUBJECTS[name]
    c = await bus.pull_consumer(
        m.stream_name(run, d.stream),
        ConsumerSpec(durable=f"count-{uuid.uuid4().hex[:8]}", filter_subject=m.subject(run, name)),
    )
    return int((await c.info())["num_pending"])


async def all_stored(bus, run: str, name: str) -> list:
    """Every message of subject ``name`` the run's stream holds now, decoded (no waiting for
    more: call it once the outcomes are in)."""
    return await collect(bus, run, name, await stored(bus, run, name), deadline=60.0)


def new_run() -> str:
    return f"r{uuid.uuid4().hex[:8]}"

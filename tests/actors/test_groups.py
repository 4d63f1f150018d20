"""One book of groups (issue 44): the trainer's ledger and the scheduler keep their records in
the same :class:`rollart.actors.groups.group.Group`, so the same outcomes give the same
state on both sides, and only the moves of :data:`MOVES` are allowed."""

from __future__ import annotations

import asyncio

import pytest
from hypothesis import given, settings, strategies as st

from rollart import messages as m
from rollart.actors.groups.group import CLOSED, LOST, MOVES, GroupState
from rollart.actors.groups.ledger import GroupLedger, HeldGroup
from rollart.actors.scheduler.issued import IssuedGroup

NEED, SIZE = 2, 4


def completion(tid: str) -> m.RolloutCompleted:
    return m.RolloutCompleted(traj_id=tid, group_id="g000000", env="main", seed=0, token_ids=[],
                              response_mask=[], logprobs=[], group_index=0)


def both(outcomes: list[tuple[int, str]]) -> tuple[HeldGroup, IssuedGroup]:
    """The ledger's and the scheduler's record of one group after ``(member, outcome)``s."""
    loop = asyncio.new_event_loop()
    try:
        held = HeldGroup(index=0, need=NEED, size=SIZE)
        issued = IssuedGroup(index=0, need=NEED, size=SIZE,
                             traj_ids=[f"g000000-{i}" for i in range(SIZE)])
        for i, what in outcomes:
            tid = f"g000000-{i}"
            if not issued.waits_for(tid):
                continue
            getattr(issued, what).append(tid)
            if what == "completed":
                held.members.append((completion(tid), loop.create_future()))
            elif what == "dead":
                held.dead.append((tid, "env_step: boom"))
            else:
                held.cancelled.append(tid)
        return held, issued
    finally:
        loop.close()


@settings(max_examples=200, deadline=None)
@given(st.lists(st.tuples(st.integers(0, SIZE - 1),
                          st.sampled_from(["completed", "dead", "cancelled"])), max_size=8))
def test_the_ledger_and_the_scheduler_see_the_same_state(outcomes):
    held, issued = both(outcomes)
    for attr in ("completions", "outcomes", "ready", "settled", "failed", "state"):
        assert getattr(held, attr) == getattr(issued, attr), attr
    first: dict[int, str] = {}  # a member's first outcome counts, later ones are ignored
    for i, what in outcomes:
        first.setdefault(i, what)
    n_done = sum(1 for w in first.values() if w == "completed")
    assert held.ready == (n_done >= NEED or len(first) >= SIZE)


def test_only_a_ready_group_closes_and_only_once():
    held, _ = both([(0, "completed")])
    assert held.state == GroupState.RUNNING
    with pytest.raises(ValueError, match="cannot move from running"):
        held.close("trained")
    held, _ = both([(0, "completed"), (1, "completed")])
    assert held.state == GroupState.READY and not held.failed
    with pytest.raises(ValueError, match="cannot close as failed"):
        held.close(GroupState.FAILED)
    assert held.close("trained") == GroupState.TRAINED == held.state
    with pytest.raises(ValueError, match="cannot move from trained"):
        held.close("dropped")
    with pytest.raises(ValueError):
        both([(0, "completed"), (1, "completed")])[0].close("archived")


def test_a_failed_group_closes_as_failed_only():
    held, issued = both([(0, "completed"), (1, "dead"), (2, "cancelled"), (3, "dead")])
    assert held.failed and issued.failed and held.settled
    with pytest.raises(ValueError, match="cannot close as trained"):
        held.close("trained")
    assert held.close("failed") == GroupState.FAILED


def test_moves_and_lost_states():
    assert MOVES[GroupState.RUNNING] == {GroupState.READY}
    assert MOVES[GroupState.READY] == CLOSED and not any(s in MOVES for s in CLOSED)
    assert GroupState.RESTARTED in CLOSED - LOST and GroupState.TRAINED not in LOST


def test_the_ledger_counts_lost_groups_by_the_same_states():
    """``lost`` (what the scheduler reads from the summary) grows by exactly :data:`LOST`."""
    loop = asyncio.new_event_loop()
    try:
        led = GroupLedger(group_size=NEED, redundancy=SIZE - NEED, batch_groups=1, alpha=0,
                          stale="drop", breaker=0)
        for g, state in enumerate(GroupState):
            if state not in CLOSED:
                continue
            failed = state == GroupState.FAILED
            for i in range(SIZE if failed else NEED):
                msg = m.RolloutCompleted(
                    traj_id=f"g{g:06d}-{i}", group_id=f"g{g:06d}", env="main", seed=0,
                    token_ids=[], response_mask=[], logprobs=[], group_index=g)
                if failed:
                    led.add_dead(msg.traj_id, g, "env_step: boom", loop.create_future())
                else:
                    led.add_completed(msg, loop.create_future())
            before = led.lost
            led.close(led.open[g], state)
            assert led.lost - before == (state in LOST), state
        assert not led.open
    finally:
        loop.close()

"""What a group is, the states it passes through, and who may move it: the one book of
groups that the trainer's ledger and the scheduler both keep their records in.

A group is ``size = group_size + redundancy`` trajectories of one task; it needs ``need =
group_size`` completions. Its life::

    running ──► ready ──► trained
                  ├─────► skipped    (rewards all equal, ``trainer.skip_uniform``)
                  ├─────► dropped    (beyond the α bound, ``stale: drop``)
                  ├─────► restarted  (beyond the α bound, ``stale: restart``: re-admitted)
                  └─────► failed     (every member has an outcome, fewer than 2 completed)

``running -> ready`` follows from the outcomes alone (``need`` completions, or one outcome
for every member), so both sides see it the same way from the same messages: the
scheduler to cancel the redundant members at once, the ledger to select a batch. Only the
trainer's ledger (:class:`rollart.actors.groups.ledger.GroupLedger`) closes a group
(:meth:`Group.close`); the scheduler's view goes no further than ready and settled (a
rollout without a trainer counts a settled group that :attr:`Group.failed` itself). Each
side keeps what only it sees in a subclass: the ledger the held deliveries
(:class:`rollart.actors.groups.ledger.HeldGroup`), the scheduler the trajectory ids it
issued, moved copies included (:class:`rollart.actors.scheduler.issued.IssuedGroup`).
"""

from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field

from rollart.actors.groups.admission import member_slot


class GroupState(enum.StrEnum):
    RUNNING = "running"
    READY = "ready"
    TRAINED = "trained"
    SKIPPED = "skipped"
    DROPPED = "dropped"
    RESTARTED = "restarted"
    FAILED = "failed"


CLOSED = frozenset({GroupState.TRAINED, GroupState.SKIPPED, GroupState.DROPPED,
                    GroupState.RESTARTED, GroupState.FAILED})
"""The states a group ends in (it leaves the ledger's open groups)."""
LOST = frozenset({GroupState.SKIPPED, GroupState.DROPPED, GroupState.FAILED})
"""Closed states that free the group's admission headroom (``lost``: it is never trained,
and its task is not taken up again; a restarted group's task is, under a new index)."""
MOVES: dict[GroupState, frozenset[GroupState]] = {
    GroupState.RUNNING: frozenset({GroupState.READY}),
    GroupState.READY: CLOSED,
}
"""Which state a group may move to from which: ``running -> ready`` by its outcomes,
``ready -> <closed>`` by the ledger; a closed group never moves again."""


@dataclass(eq=False, kw_only=True)
class Group:
    """One group and the outcomes of its members so far. A subclass says where the ids of
    completed, dead and cancelled members are kept (:meth:`completed_ids` and friends);
    the rules are here, once."""

    index: int
    need: int
    """Completions the group is delivered by (``rollout.group_size``)."""
    size: int
    """Members (``group_size + redundancy``)."""
    opened_at: float = field(default_factory=time.monotonic)
    closed: GroupState | None = None
    """How the group ended (one of :data:`CLOSED`); None while it is open."""

    def completed_ids(self) -> list[str]:
        raise NotImplementedError

    def dead_ids(self) -> list[str]:
        raise NotImplementedError

    def cancelled_ids(self) -> list[str]:
        raise NotImplementedError

    @property
    def completions(self) -> int:
        return len(self.completed_ids())

    @property
    def outcomes(self) -> int:
        """Members with an outcome: a member moved to another env pool (``<id>+<k>``,
        :func:`rollart.actors.groups.admission.member_id`) counts once, whichever copies
        reported."""
        ids = self.completed_ids() + self.dead_ids() + self.cancelled_ids()
        if not any("+" in t for t in ids):
            return len(ids)
        return len({member_slot(t) for t in ids})

    def seen(self, traj_id: str) -> bool:
        """``traj_id`` has an outcome here."""
        return (traj_id in self.completed_ids() or traj_id in self.dead_ids()
                or traj_id in self.cancelled_ids())

    @property
    def ready(self) -> bool:
        """Delivered: ``need`` completions, or an outcome for every member."""
        return self.completions >= self.need or self.outcomes >= self.size

    @property
    def settled(self) -> bool:
        """Every member has an outcome (nothing more will come, redundant ones included)."""
        return self.outcomes >= self.size

    @property
    def failed(self) -> bool:
        """Ready with fewer than 2 completions (or fewer than ``need``, when it is 1): no
        group advantage can be computed; such a group has every outcome in."""
        return self.ready and self.completions < min(2, self.need)

    @property
    def state(self) -> GroupState:
        if self.closed is not None:
            return self.closed
        return GroupState.READY if self.ready else GroupState.RUNNING

    def close(self, to: GroupState | str) -> GroupState:
        """Move the group to a closed state (:data:`MOVES`): only a ready group closes, and
        only once; ``failed`` only when it :attr:`failed`."""
        to = GroupState(to)
        if to not in MOVES.get(self.state, frozenset()):
            raise ValueError(f"group {self.index} cannot move from {self.state} to {to}")
        if (to == GroupState.FAILED) != self.failed:
            raise ValueError(f"group {self.index} with {self.completions} completion(s) "
                             f"cannot close as {to}")
        self.closed = to
        return to

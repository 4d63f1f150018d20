"""The scheduler's view of a group: what the trainer's ledger cannot know, or not soon enough.

The ledger (:mod:`rollart.actors.groups.ledger`) owns a training group's life and closes it.
The scheduler needs, before any ledger summary could tell it, when a group is ready (to
cancel its redundant members at once, and to start the next wave in ``batch`` mode) and
which trajectory ids it issued for it, moved copies included. It keeps them in the same
record (:class:`rollart.actors.groups.group.Group`), so the rules of ready, settled and
failed are the ledger's.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from rollart.actors.groups.group import Group


@dataclass(eq=False, kw_only=True)
class IssuedGroup(Group):
    """The scheduler's view of a group (:class:`rollart.actors.groups.group.Group`): the ids
    it issued and which of them reported what. It sees a group become ready and settled; the
    trainer's ledger closes it."""

    traj_ids: list[str]
    """The members' trajectory ids; a copy moved to another env pool replaces its original."""
    completed: list[str] = field(default_factory=list)
    cancelled: list[str] = field(default_factory=list)
    dead: list[str] = field(default_factory=list)
    done_at: float | None = None
    """``time.monotonic()`` when it became ready (delivered)."""

    def completed_ids(self) -> list[str]:
        return self.completed

    def dead_ids(self) -> list[str]:
        return self.dead

    def cancelled_ids(self) -> list[str]:
        return self.cancelled

    def waits_for(self, traj_id: str) -> bool:
        """``traj_id`` is a member issued here with no outcome yet."""
        return traj_id in self.traj_ids and not self.seen(traj_id)

"""Cancelled groups: which trajectories a ``rollout.cancel`` told to stop, remembered for
the requests of those groups still to come (:class:`CancelledGroups`, shared by the
EnvManager and the LLMProxy)."""

from __future__ import annotations

from collections.abc import Iterable, Iterator

CANCELLED_GROUPS_KEPT = 8192
"""Cancelled groups remembered (the newest), for their requests still to be delivered: far
more than admission lets be in flight at once, so memory stays bounded in a long run."""


class CancelledGroups:
    """Group id -> the members a ``rollout.cancel`` keeps (the group's completed ones); any
    other member of the group is cancelled. The newest ``kept`` groups are remembered
    (default :data:`CANCELLED_GROUPS_KEPT`)."""

    def __init__(self, kept: int | None = None):
        self.kept = CANCELLED_GROUPS_KEPT if kept is None else kept
        self._keep: dict[str, set[str]] = {}

    def add(self, group_id: str, keep: Iterable[str]) -> set[str]:
        """Record the cancel of ``group_id`` (as the newest); returns the members it keeps."""
        kept = set(keep)
        self._keep.pop(group_id, None)  # re-inserted as the newest
        self._keep[group_id] = kept
        while len(self._keep) > self.kept:
            del self._keep[next(iter(self._keep))]  # the oldest
        return kept

    def cancels(self, group_id: str, traj_id: str) -> bool:
        """Is ``traj_id`` (a member of ``group_id``) cancelled?"""
        keep = self._keep.get(group_id)
        return keep is not None and traj_id not in keep

    def keeps(self, group_id: str) -> set[str] | None:
        """The members the cancel of ``group_id`` keeps, None: the group is not cancelled."""
        return self._keep.get(group_id)

    def __len__(self) -> int:
        return len(self._keep)

    def __iter__(self) -> Iterator[str]:
        """The cancelled group ids, oldest first."""
        return iter(self._keep)

    def __contains__(self, group_id: object) -> bool:
        return group_id in self._keep

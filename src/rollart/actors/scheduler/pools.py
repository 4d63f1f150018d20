"""Where the scheduler sent each open trajectory: what the group ledger cannot know.

Several env pools (``mapping.env: [a, b]``): each request goes to the pool not reported
without a live node (:class:`rollart.actors.kernel.pool_watch.PoolWatch`) with the fewest of
this scheduler's trajectories still open per unit of ``pools.<name>.weight`` (join the
shortest queue, so a faster pool gets more). When a pool has lost every node, its open
trajectories are moved (:meth:`EnvPools.moves`): each is re-issued to a live pool as
``<id>+<k>`` (:func:`rollart.actors.groups.admission.member_id`), and its group waits for
the copy.
"""

from __future__ import annotations

import logging
import time
from collections import Counter
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field

import msgspec

from rollart import messages as m
from rollart.actors.groups.admission import MAX_MOVES, member_id
from rollart.actors.kernel.pool_watch import PoolWatch
from rollart.actors.scheduler.issued import IssuedGroup
from rollart.config import RunConfig

log = logging.getLogger(__name__)


@dataclass(eq=False)
class EnvPools:
    """The env pools of one scheduler and its trajectories open in each."""

    default: str | None = None
    """The pool of every request when there are not several (``mapping.env``; None: the
    scheduler's own pool)."""
    pools: list[str] = field(default_factory=list)
    """Every pool of ``mapping.env``, when it names more than one."""
    run_cfg: RunConfig | None = field(default=None, repr=False)
    """Where the pools' weights are declared."""
    watch: PoolWatch | None = field(default=None, repr=False)
    """Which pools have no live node (None: every pool counts as live)."""
    open_req: dict[str, tuple[str | None, m.RolloutRequested]] = field(default_factory=dict)
    """Trajectory id -> (env pool, request) while it has no outcome (several env pools)."""
    open_in: Counter[str | None] = field(default_factory=Counter)
    """Env pool -> trajectories open there."""
    sent_to: Counter[str | None] = field(default_factory=Counter)
    """Env pool -> requests sent there (moved copies included)."""

    @property
    def several(self) -> bool:
        return len(self.pools) > 1

    def weight(self, pool: str) -> float:
        p = self.run_cfg.pools.get(pool) if self.run_cfg is not None else None
        return float(p.weight) if p is not None else 1.0

    def pick(self, avoid: set[str] = frozenset()) -> str | None:
        """The env pool of the next request: with several, the one not reported missing (no
        live node for two heartbeat intervals) nor in ``avoid`` with the fewest open
        trajectories per unit of weight; with every pool missing, any of them (the request
        waits in its stream), unless ``avoid`` is given: then None."""
        if not self.several:
            return self.default
        pools = [p for p in self.pools if p not in avoid]
        missing = self.watch.missing if self.watch is not None else set()
        cands = [p for p in pools if p not in missing] or ([] if avoid else pools)
        if not cands:
            return None
        return min(cands, key=lambda p: ((self.open_in[p] + 1) / self.weight(p),
                                         self.pools.index(p)))

    def opened(self, tid: str, pool: str | None, req: m.RolloutRequested) -> None:
        self.sent_to[pool] += 1
        if self.several:
            self.open_req[tid] = (pool, req)
            self.open_in[pool] += 1

    def closed(self, tid: str) -> None:
        got = self.open_req.pop(tid, None)
        if got is not None:
            self.open_in[got[0]] -= 1

    def open_at(self, pool: str) -> Iterator[tuple[str, m.RolloutRequested]]:
        """The trajectories open in ``pool`` (a snapshot: the caller may open and close)."""
        for tid, (p, req) in list(self.open_req.items()):
            if p == pool and tid in self.open_req:
                yield tid, req

    def moves(self, pool: str, missing: set[str], groups: Mapping[str, IssuedGroup], *,
              name: str) -> Iterator[tuple[m.RolloutRequested, str]]:
        """The copies to publish for the open trajectories of ``pool`` (it lost every node),
        each with the live pool it goes to: the bookkeeping is done as each is yielded (the
        group waits for the copy). A trajectory whose group is ready, or that has an outcome,
        is closed instead; one moved :data:`MAX_MOVES` times stays."""
        moved: Counter[str] = Counter()
        for tid, req in self.open_at(pool):
            g = groups.get(req.group_id)
            if g is None or g.ready or not g.waits_for(tid):
                self.closed(tid)
                continue
            k = int(tid.rsplit("+", 1)[1]) + 1 if "+" in tid else 1
            if k > MAX_MOVES:
                log.warning("%s: %s was moved %d times already; it stays in pool %s",
                            name, tid, MAX_MOVES, pool)
                continue
            to = self.pick(avoid={pool} | missing)
            if to is None:
                log.warning("%s: env pool %s has no live node, and no other env pool has one: "
                            "its %d open trajectories wait", name, pool, self.open_in[pool])
                break
            new = member_id(req.group_id, req.index_in_group, k)
            copy = msgspec.structs.replace(req, traj_id=new, created_at=time.time())
            g.traj_ids[g.traj_ids.index(tid)] = new  # the group now waits for the copy
            self.closed(tid)
            self.opened(new, to, copy)
            moved[to] += 1
            yield copy, to
        if moved:
            log.warning("%s: env pool %s has no live node: moved %d open trajectories to %s",
                        name, pool, sum(moved.values()),
                        ", ".join(f"{p} ({n})" for p, n in sorted(moved.items())))

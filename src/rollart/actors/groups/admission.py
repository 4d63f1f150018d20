"""What the trainer takes: only a trajectory that admission issued (defence in depth).

A training completion is checked against what the scheduler can have issued (its id, seed
and group index), what the trainer can have announced (versions), and what the env
manager adds up (reward): :class:`Admission` says why another one is ``not_admitted``.
The names here (group ids, the issued-count key, member seeds) are the scheduler's rules,
shared so both sides derive them the same way. The group ledger
(:mod:`rollart.actors.groups.ledger`) holds the state; this module holds the rules.
"""

from __future__ import annotations

import hashlib
import math
from collections.abc import Mapping
from typing import Any, Protocol

from rollart import messages as m
from rollart.bus.codec import encode


TRAINING_PREFIX = "g"
"""Group id prefix of the training scheduler (``rollart.node.build.rollout_actors``)."""
RESTART_BASE = 10**9
"""Group indices from here on are the trainer's own re-admissions (``stale: restart``):
``RESTART_BASE + index * 100 + attempt``."""
CONFLICTS_REMEMBERED = 16384
"""Trained trajectories whose content fingerprint is kept, to report a later different copy."""


def group_id(index: int, prefix: str = TRAINING_PREFIX) -> str:
    """The id the scheduler gives group ``index`` (its members are ``<group id>-<i>``)."""
    return f"{prefix}{index:06d}"


MAX_MOVES = 8
"""How often the scheduler may move one member of a group to another env pool (its pool
lost every node): the moved copy is ``<group id>-<i>+<k>``, ``1 <= k <= MAX_MOVES``."""


def member_id(group: str, index: int, move: int = 0) -> str:
    """The trajectory id of member ``index`` of group ``group``; ``move`` > 0: its copy
    re-issued to another env pool for the ``move``-th time (:data:`MAX_MOVES`)."""
    return f"{group}-{index}" if move == 0 else f"{group}-{index}+{move}"


def member_slot(traj_id: str) -> str:
    """The member a trajectory id stands for (a moved copy's original id)."""
    return traj_id.split("+", 1)[0]


def _is_member(traj_id: str, group: str, index: int) -> bool:
    base = f"{group}-{index}"
    if traj_id == base:
        return True
    head, sep, k = traj_id.partition("+")
    return head == base and sep == "+" and k.isdigit() and k[0] != "0" and int(k) <= MAX_MOVES


def issued_key(prefix: str = TRAINING_PREFIX) -> str:
    """KV key of the number of groups a scheduler has issued: written *before* it publishes a
    group's requests (``scheduler.<prefix>.admitted`` is written after them)."""
    return f"scheduler.{prefix.strip('-') or 'g'}.issued"


def member_seed(rollout: Any, index: int, member: int, offset: int = 0) -> int:
    """The task seed of member ``member`` of group ``index`` (the scheduler's rule)."""
    base = rollout.seed + offset
    if rollout.same_seed_per_group:
        return base + index
    return base + index * (rollout.group_size + rollout.redundancy) + member


def fingerprint(msg: m.RolloutCompleted) -> bytes:
    """Content fingerprint of a completion (two deliveries of one stored message agree)."""
    return hashlib.blake2b(encode(msg), digest_size=16).digest()


class Readmissions(Protocol):
    """What :meth:`Admission.check` reads of the group ledger
    (:class:`rollart.actors.groups.ledger.GroupLedger`): the groups the trainer re-admitted."""

    @property
    def restarted(self) -> Mapping[int, tuple[str, int]]:
        """Group index -> ``(group id, seed)`` of each re-admitted group."""
        ...


class Admission:
    """Which training completions the trainer takes: only trajectories admission issued.

    A completion with ``group_index >= 0`` that is not ``eval`` is **not admitted** when any
    of these fails (each is a fact a correct sender cannot get wrong):

    1. *form*: ``env`` is the training env (``rollout.env``); ``0 <= index_in_group <
       group_size + redundancy`` (so a group has at most that many members); ``traj_id`` is
       ``<group_id>-<index_in_group>`` (or a moved copy's ``...+<k>``, :func:`member_id`);
       ``group_id`` is the scheduler's id of
       ``group_index`` (:func:`group_id`) or, for ``group_index >= RESTART_BASE``, the id of a
       group this trainer re-admitted (``stale: restart``, kept in the ledger);
    2. *task*: ``seed`` is the group's task seed (:func:`member_seed`, or the restarted
       group's seed);
    3. *versions*: no turn, token, ``max_version`` or ``admitted_version`` is beyond the
       newest version this trainer ever announced (a generator cannot have used it);
    4. *reward*: without a ``scorer`` the reward is what the env manager adds up (each turn's
       reward plus ``format_penalty`` per malformed turn; one more penalty for a last turn
       cut by ``env_timeout`` or ``max_time``); with one, ``success == (reward >= 0.99)``;
    5. *issued*: ``group_index`` < the scheduler's issued count (KV :func:`issued_key`,
       stored before the group's requests are published, so no real completion can be
       ahead of it; the trainer keeps the highest count it saw and reads KV again before
       refusing);
    6. *α bound*: ``group_index < (V + α + 1) * B + lost`` with the trainer's own newest
       announced version ``V`` and lost count: admission cannot have let it in (a backstop
       for a forged issued count).

    :meth:`check` returns None or why (the trainer dead-letters ``not_admitted: <why>``).
    """

    def __init__(self, rollout: Any, envs: dict[str, Any]):
        self.rollout = rollout
        self.envs = envs
        self.size = rollout.group_size + rollout.redundancy

    def check(self, msg: m.RolloutCompleted, *, ledger: Readmissions, version: int,
              issued: int | None, lost: int) -> str | None:
        r, g, i = self.rollout, msg.group_index, msg.index_in_group
        if msg.env != r.env or msg.env not in self.envs:
            return f"env {msg.env!r} is not the training env {r.env!r}"
        if not 0 <= i < self.size:
            return (f"index_in_group {i} is outside a group of {self.size} "
                    f"(group_size + redundancy)")
        if g >= RESTART_BASE:
            known = ledger.restarted.get(g)
            if known is None:
                return f"group_index {g} is no group this trainer re-admitted"
            gid, seed = known[0], known[1]
        else:
            gid, seed = group_id(g), member_seed(r, g, i)
        if msg.group_id != gid:
            return f"group_id {msg.group_id!r} is not the id of group {g} ({gid!r})"
        if not _is_member(msg.traj_id, gid, i):
            return f"traj_id {msg.traj_id!r} is not member {i} of group {gid!r} ({gid}-{i!s})"
        if msg.seed != seed:
            return f"seed {msg.seed} is not the task seed of {msg.traj_id} ({seed})"
        top = max([msg.max_version, msg.admitted_version, *msg.token_versions,
                   *(t.version for t in msg.turns)])
        if top > version:
            return f"it claims policy v{top}; the trainer announced at most v{version}"
        why = self._reward(msg)
        if why:
            return why
        if g < RESTART_BASE:
            if issued is None or g >= issued:
                return f"group {g} was not issued (the scheduler issued {issued or 0} groups)"
            bound = (version + r.alpha + 1) * r.batch_groups + lost
            if g >= bound:
                return (f"group {g} is beyond what admission can have let in at v{version} "
                        f"((v + alpha + 1) * batch_groups + lost = {bound})")
        return None

    def _reward(self, msg: m.RolloutCompleted) -> str | None:
        env = self.envs[msg.env]
        if getattr(env, "scorer", None):
            if msg.success != (msg.reward >= 0.99):
                return f"success {msg.success} does not follow from the score {msg.reward}"
            return None
        penalty = float(getattr(env, "format_penalty", 0.0))
        total = 0.0
        for t in msg.turns:
            if not t.format_ok:
                total += penalty
            total += t.reward
        cut = msg.stop_reason in ("env_timeout", "max_time")  # in a step: its turn is not recorded
        options = [total] + ([total + penalty] if cut else [])
        if not any(math.isclose(msg.reward, x, rel_tol=1e-9, abs_tol=1e-9) for x in options):
            return (f"reward {msg.reward} is not what its turns add up to ({total}); "
                    f"rewards are summed by the env manager")
        return None

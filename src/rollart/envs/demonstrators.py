"""Built-in demonstrators: scripted policies that play an env, for SFT data (``rollart demos``).

A demonstrator plays one episode at a time from what the policy sees: it is built for one
env instance (``factory(env, rng)``; an oracle that needs hidden state, e.g. a reasoning
task's answer, may read it from ``env``), told each reset (:meth:`Demonstrator.reset`) and
asked for each move (:meth:`Demonstrator.act`) with the observation text and the env's
legal actions (None for free text). It answers the assistant's text, e.g. ``"R"``.

They are registered by env type and name (:data:`DEMONSTRATORS`, :func:`register`), so
demonstrators for Sokoban or reasoning tasks are added beside the FrozenLake ones:

- ``frozenlake`` / ``bfs``: the oracle, the first move of a shortest path to G that avoids
  every hole (ties: L, D, R, U order); it replans each turn, so a slippery lake is fine.
- ``frozenlake`` / ``heuristic``: one step of look-ahead: a random move toward G whose cell is
  not a hole, else a random move that changes the position and is not a hole, else any
  move. It wanders into dead ends and loops; on random 4x4 maps it succeeds 0.89 of the
  time (256 task seeds, ``rollart demos frozenlake-random --policy heuristic``, which prints
  the success rate; bfs: 1.0 in 6.0 moves on average, the heuristic 6.4).

Both read the grid from the observation (``P`` is the player, ``G`` the goal, ``H`` a hole,
rows top to bottom, see :mod:`rollart.envs.frozenlake`).

- ``sokoban`` / ``bfs``: the solver, the first move of a shortest solution (fewest moves,
  walks and pushes alike; ties in L, D, R, U order), found by breadth-first search over
  (player, boxes) states of the room read from the observation; it replans each turn. In a
  room it cannot solve (a box pushed into a corner by someone else) it walks to a free cell.

- ``reasoning_gym`` / ``answer``: the dataset's own reference answer of the current item
  (read from the env: the policy never sees it).

A ``pkg.module:Name`` policy is imported instead: a factory ``(env, rng) -> Demonstrator``.
"""

from __future__ import annotations

import importlib
import random
from collections import deque
from typing import Any, Callable, Protocol

from rollart.envs.base import MOVES
from rollart.envs.sokoban import Room


class Demonstrator(Protocol):
    """A scripted policy for one env instance."""

    def reset(self, observation: str, info: dict[str, Any]) -> None:
        """A new episode starts with this observation."""
        ...

    def act(self, observation: str, legal: list[str] | None) -> str:
        """The assistant's text for this turn (one of ``legal`` when it is given)."""
        ...


Factory = Callable[[Any, random.Random], Demonstrator]

DEMONSTRATORS: dict[str, dict[str, Factory]] = {}
"""Env type (as in ``envs.<name>.type``) -> demonstrator name -> factory."""


def register(env_type: str, name: str) -> Callable[[Factory], Factory]:
    """Decorator: register ``factory`` as demonstrator ``name`` of ``env_type``."""
    def deco(factory: Factory) -> Factory:
        DEMONSTRATORS.setdefault(env_type, {})[name] = factory
        return factory

    return deco


def demonstrator_names(env_type: str) -> list[str]:
    """The registered demonstrators of ``env_type`` (sorted)."""
    return sorted(DEMONSTRATORS.get(env_type, {}))


def make_demonstrator(env_type: str, name: str, env: Any, rng: random.Random) -> Demonstrator:
    """Demonstrator ``name`` for ``env`` (of type ``env_type``); ``name`` may also be an
    import path ``pkg.module:factory``. ``ValueError`` lists what exists."""
    if ":" in name:
        mod, _, attr = name.partition(":")
        try:
            factory = getattr(importlib.import_module(mod), attr)
        except (ImportError, AttributeError) as e:
            raise ValueError(f"demonstrator {name!r}: cannot import it: {e}") from None
        return factory(env, rng)
    found = DEMONSTRATORS.get(env_type, {})
    if name not in found:
        have = ", ".join(f"{t}: {', '.join(sorted(d))}" for t, d in sorted(DEMONSTRATORS.items()))
        raise ValueError(f"no demonstrator {name!r} for env type {env_type!r}; built in: {have} "
                         f"(or give an import path pkg.module:factory)")
    return found[name](env, rng)


# -- FrozenLake ------------------------------------------------------------------


def parse_grid(observation: str) -> tuple[list[str], tuple[int, int], tuple[int, int] | None]:
    """A FrozenLake observation -> (rows, player position, goal position or None)."""
    rows = ["".join(ch for ch in r if ch.isalpha()) for r in observation.strip().splitlines()]
    rows = [r for r in rows if r]  # cells drawn with a separator (``cell_sep``) or without
    player = goal = None
    for r, row in enumerate(rows):
        for c, ch in enumerate(row):
            if ch == "P":
                player = (r, c)
            elif ch == "G":
                goal = (r, c)
    if player is None or not rows:
        raise ValueError(f"not a FrozenLake observation (no P): {observation!r:.80}")
    return rows, player, goal


def _moved(rows: list[str], pos: tuple[int, int], move: str) -> tuple[int, int]:
    """The cell ``move`` leads to (a move into the edge stays put, as the env does)."""
    dr, dc = MOVES[move]
    return (min(max(pos[0] + dr, 0), len(rows) - 1), min(max(pos[1] + dc, 0), len(rows[0]) - 1))


def _distances(rows: list[str], goal: tuple[int, int]) -> dict[tuple[int, int], int]:
    """Moves from each cell to ``goal`` over cells that are not holes (BFS from the goal)."""
    dist = {goal: 0}
    todo = deque([goal])
    while todo:
        r, c = todo.popleft()
        for dr, dc in MOVES.values():
            q = (r + dr, c + dc)
            if (0 <= q[0] < len(rows) and 0 <= q[1] < len(rows[0]) and q not in dist
                    and rows[q[0]][q[1]] != "H"):
                dist[q] = dist[(r, c)] + 1
                todo.append(q)
    return dist


class FrozenLakeBFS:
    """The first move of a shortest hole-free path to G (ties in L, D, R, U order)."""

    def __init__(self, env: Any = None, rng: random.Random | None = None) -> None:
        pass

    def reset(self, observation: str, info: dict[str, Any]) -> None:
        pass

    def act(self, observation: str, legal: list[str] | None) -> str:
        rows, pos, goal = parse_grid(observation)
        if goal is None:  # on G already (the episode is over)
            return next(iter(MOVES))
        dist = _distances(rows, goal)
        best = min(MOVES, key=lambda m: dist.get(_moved(rows, pos, m), 1 << 30))
        return best


class FrozenLakeHeuristic:
    """One step of look-ahead: toward G and not into a hole (see the module docstring)."""

    def __init__(self, env: Any = None, rng: random.Random | None = None) -> None:
        self.rng = rng or random.Random(0)

    def reset(self, observation: str, info: dict[str, Any]) -> None:
        pass

    def act(self, observation: str, legal: list[str] | None) -> str:
        rows, pos, goal = parse_grid(observation)
        if goal is None:
            return next(iter(MOVES))

        def safe(m: str) -> bool:
            r, c = _moved(rows, pos, m)
            return rows[r][c] != "H"

        def gap(p: tuple[int, int]) -> int:
            return abs(p[0] - goal[0]) + abs(p[1] - goal[1])

        toward = [m for m in MOVES if safe(m) and gap(_moved(rows, pos, m)) < gap(pos)]
        if toward:
            return self.rng.choice(toward)
        moving = [m for m in MOVES if safe(m) and _moved(rows, pos, m) != pos]
        return self.rng.choice(moving or list(MOVES))


register("frozenlake", "bfs")(FrozenLakeBFS)
register("frozenlake", "heuristic")(FrozenLakeHeuristic)


# -- Sokoban ---------------------------------------------------------------------


def sokoban_plan(observation: str | Room, limit: int = 200_000) -> list[str] | None:
    """A shortest move sequence (letters of :data:`MOVES`) that solves the Sokoban room in
    ``observation`` (the legend of :mod:`rollart.envs.sokoban`, or a parsed :class:`Room`),
    ``[]`` when it is solved, None when no solution exists within ``limit`` visited states.
    Steps follow the env's own rule (:meth:`Room.after`)."""
    room = observation if isinstance(observation, Room) else _room(observation)
    if room.solved():
        return []
    start = (room.player, frozenset(room.boxes))
    back: dict[Any, tuple[Any, str] | None] = {start: None}
    todo = deque([start])
    while todo and len(back) < limit:
        state = todo.popleft()
        for m, d in MOVES.items():
            new = room.after(*state, d)
            if new is None or new in back:
                continue
            back[new] = (state, m)
            if new[1] == room.targets:
                path = []
                while back[new] is not None:
                    new, m = back[new]
                    path.append(m)
                return path[::-1]
            todo.append(new)
    return None


def _room(observation: str) -> Room:
    return Room.parse([r for r in observation.strip().splitlines() if r])


class SokobanBFS:
    """The first move of a shortest solution (see the module docstring)."""

    def __init__(self, env: Any = None, rng: random.Random | None = None) -> None:
        pass

    def reset(self, observation: str, info: dict[str, Any]) -> None:
        pass

    def act(self, observation: str, legal: list[str] | None) -> str:
        room = _room(observation)
        plan = sokoban_plan(room)
        if plan:
            return plan[0]
        for m, d in MOVES.items():  # unsolvable (or solved): a walk, not a push
            out = room.after(room.player, room.boxes, d)
            if out is not None and out[1] == room.boxes:
                return m
        return next(iter(MOVES))


register("sokoban", "bfs")(SokobanBFS)


# -- reasoning_gym ---------------------------------------------------------------


class ReasoningGymAnswer:
    """The reference answer of the item the env serves (:class:`rollart.envs.reasoning.
    ReasoningGymEnv` keeps it in ``entry``)."""

    def __init__(self, env: Any = None, rng: random.Random | None = None) -> None:
        if env is None or not hasattr(env, "entry"):
            raise ValueError("the reasoning_gym 'answer' demonstrator reads the env's current "
                             "item: it needs a reasoning_gym env")
        self.env = env

    def reset(self, observation: str, info: dict[str, Any]) -> None:
        pass

    def act(self, observation: str, legal: list[str] | None) -> str:
        entry = self.env.entry
        if not entry or entry.get("answer") is None:
            raise ValueError("reasoning_gym 'answer' demonstrator: the item has no reference answer")
        return str(entry["answer"])


register("reasoning_gym", "answer")(ReasoningGymAnswer)

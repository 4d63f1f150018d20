"""FrozenLake as text, written from scratch (no gymnasium).

Grid cells: ``S`` start, ``F`` frozen (safe), ``H`` hole, ``G`` goal; the player is drawn
as ``P``. The observation is the grid, one row per line, e.g. for the classic map::

    PFFF
    FHFH
    FFFH
    HFFG
"""

from __future__ import annotations

import random
from collections import deque
from typing import Any

from rollart.envs.base import MOVES, normalize_move

CLASSIC_MAPS: dict[int, list[str]] = {
    4: ["SFFF", "FHFH", "FFFH", "HFFG"],
    8: ["SFFFFFFF", "FFFFFFFF", "FFFHFFFF", "FFFFFHFF",
        "FFFHFFFF", "FHHFFFHF", "FHFFHFHF", "FFFHFFFG"],
}

INSTRUCTION = (
    "FrozenLake. Walk from your position P to the goal G without stepping into a hole H. "
    "F is safe ice, S the start. Rows are listed top to bottom. "
    "Moves: L left, D down, R right, U up. "
    "Reply with one move inside <answer></answer>, e.g. <answer>R</answer>."
)


def shortest_path_len(grid: list[str]) -> int | None:
    """Moves on the shortest S->G path avoiding holes (non-slippery), or None if none."""
    rows, cols = len(grid), len(grid[0])
    start = next((r, c) for r in range(rows) for c in range(cols) if grid[r][c] == "S")
    dist = {start: 0}
    todo = deque([start])
    while todo:
        r, c = todo.popleft()
        if grid[r][c] == "G":
            return dist[(r, c)]
        for dr, dc in MOVES.values():
            nr, nc = r + dr, c + dc
            if 0 <= nr < rows and 0 <= nc < cols and grid[nr][nc] != "H" and (nr, nc) not in dist:
                dist[(nr, nc)] = dist[(r, c)] + 1
                todo.append((nr, nc))
    return None


def random_map(rng: random.Random, size: int, p_frozen: float, max_len: int) -> list[str]:
    """A size x size map, S top-left, G bottom-right, each other cell frozen with
    probability ``p_frozen``; redrawn until G is reachable in at most ``max_len`` moves."""
    for _ in range(100_000):
        cells = [["F" if rng.random() < p_frozen else "H" for _ in range(size)] for _ in range(size)]
        cells[0][0], cells[-1][-1] = "S", "G"
        grid = ["".join(row) for row in cells]
        n = shortest_path_len(grid)
        if n is not None and n <= max_len:
            return grid
    raise ValueError(f"frozenlake: no solvable {size}x{size} map found with p_frozen={p_frozen}; raise 'p_frozen'")


def _check_map(grid: Any) -> list[str]:
    if not isinstance(grid, (list, tuple)) or not grid or not all(isinstance(r, str) for r in grid):
        raise ValueError("frozenlake arg 'map' must be a non-empty list of strings")
    grid = [r.strip().upper() for r in grid]
    if len({len(r) for r in grid}) != 1 or not grid[0]:
        raise ValueError("frozenlake arg 'map' rows must all have the same non-zero length")
    flat = "".join(grid)
    if set(flat) - set("SFHG") or flat.count("S") != 1 or flat.count("G") != 1:
        raise ValueError("frozenlake arg 'map' may hold only S, F, H, G, with exactly one S and one G")
    return grid


class FrozenLakeEnv:
    """Text FrozenLake.

    Args:
        size: side of the square map (default 4); fixed maps exist for 4 and 8, other sizes
            need ``random_map``.
        map: an explicit map, list of equal-length strings over S/F/H/G (overrides size).
        random_map: draw a new solvable map on every reset, seeded by the reset seed.
        p_frozen: probability that a random-map cell is frozen (default 0.8).
        slippery: if true the intended move happens with probability 1/3 and each
            perpendicular move with 1/3 (seeded by the reset seed).
        max_steps: steps before truncation (default rows + columns, i.e. 8 for 4x4).
            Random maps are always solvable within it (when not slippery).
        instruction: override the instruction text.
        cell_sep: drawn between the cells of a row (default none: ``PFFF``). With ``"|"``
            (``P|F|F|F``) every cell is a token of its own for a byte-level BPE tokenizer,
            which otherwise merges a row's letters into pieces of varying length (``P``,
            ``FFF``), so a cell's column is not a fixed token offset.

    Reward 1.0 on reaching G (terminated, success), 0.0 otherwise; a hole terminates. An
    unknown action is a no-op with reward 0 and ``info["valid_action"] = False``; it still
    uses up a step.
    """

    def __init__(self, *, size: int = 4, map: list[str] | None = None, random_map: bool = False,
                 p_frozen: float = 0.8, slippery: bool = False, max_steps: int | None = None,
                 instruction: str | None = None, cell_sep: str = "") -> None:
        if not isinstance(cell_sep, str) or any(ch.isalnum() or ch in "\r\n" for ch in cell_sep):
            raise ValueError(f"frozenlake arg 'cell_sep' must be a string without letters, digits "
                             f"or line breaks, got {cell_sep!r}")
        self.cell_sep = cell_sep
        if map is not None:
            if random_map:
                raise ValueError("frozenlake args 'map' and 'random_map' are exclusive")
            self._fixed: list[str] | None = _check_map(map)
            size = max(len(self._fixed), len(self._fixed[0]))
        elif random_map:
            if not isinstance(size, int) or size < 2:
                raise ValueError(f"frozenlake arg 'size' must be an int >= 2, got {size!r}")
            self._fixed = None
        elif size in CLASSIC_MAPS:
            self._fixed = CLASSIC_MAPS[size]
        else:
            raise ValueError(f"frozenlake arg 'size'={size!r} has no fixed map (have "
                             f"{sorted(CLASSIC_MAPS)}); set random_map: true or give 'map'")
        if not 0.0 < p_frozen <= 1.0:
            raise ValueError(f"frozenlake arg 'p_frozen' must be in (0, 1], got {p_frozen!r}")
        if max_steps is not None and (not isinstance(max_steps, int) or max_steps < 1):
            raise ValueError(f"frozenlake arg 'max_steps' must be a positive int, got {max_steps!r}")
        self.size = size
        self.p_frozen = p_frozen
        self.slippery = bool(slippery)
        rows, cols = (len(self._fixed), len(self._fixed[0])) if self._fixed else (size, size)
        self.max_steps = max_steps if max_steps is not None else rows + cols
        if random_map and 2 * (size - 1) > self.max_steps:
            raise ValueError(f"frozenlake arg 'max_steps'={self.max_steps} is too small for a "
                             f"random {size}x{size} map (needs >= {2 * (size - 1)})")
        self.instruction = instruction or INSTRUCTION
        self.grid: list[str] = []
        self.pos = (0, 0)
        self.steps = 0
        self.done = True
        self._rng = random.Random(0)

    def reset(self, seed: int) -> tuple[str, dict[str, Any]]:
        """New episode; the map (if random) and the slip RNG are seeded by ``seed``."""
        self.grid = self._fixed or random_map(random.Random(seed), self.size, self.p_frozen, self.max_steps)
        self._rng = random.Random(f"slip:{seed}")
        self.pos = next((r, c) for r, row in enumerate(self.grid) for c, ch in enumerate(row) if ch == "S")
        self.steps = 0
        self.done = False
        return self.render(), {"valid_action": True, "success": False}

    def step(self, action: str) -> tuple[str, float, bool, bool, dict[str, Any]]:
        """Move one cell; see the class docstring for rewards."""
        if self.done:
            raise RuntimeError("frozenlake: step() before reset() or after the episode ended")
        self.steps += 1
        move = normalize_move(action) if isinstance(action, str) else None
        if move is not None:
            if self.slippery:
                order = list(MOVES)  # L, D, R, U: neighbours in this cycle are perpendicular
                i = order.index(move)
                move = order[(i + self._rng.choice((-1, 0, 1))) % 4]
            dr, dc = MOVES[move]
            r = min(max(self.pos[0] + dr, 0), len(self.grid) - 1)
            c = min(max(self.pos[1] + dc, 0), len(self.grid[0]) - 1)
            self.pos = (r, c)
        cell = self.grid[self.pos[0]][self.pos[1]]
        success = cell == "G"
        terminated = cell in "GH"
        truncated = not terminated and self.steps >= self.max_steps
        self.done = terminated or truncated
        info = {"valid_action": move is not None, "success": success, "cell": cell}
        return self.render(), 1.0 if success else 0.0, terminated, truncated, info

    def legal_actions(self) -> list[str]:
        """Always ``["L", "D", "R", "U"]``."""
        return list(MOVES)

    def render(self) -> str:
        """The grid with the player as ``P``, rows joined by newlines (cells by ``cell_sep``)."""
        rows = list(self.grid)
        r, c = self.pos
        rows[r] = rows[r][:c] + "P" + rows[r][c + 1:]
        return "\n".join(self.cell_sep.join(row) for row in rows)

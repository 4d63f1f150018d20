from collections import Counter, deque

import pytest

from rollart.envs.frozenlake import CLASSIC_MAPS, FrozenLakeEnv

MOVES = {"L": (0, -1), "D": (1, 0), "R": (0, 1), "U": (-1, 0)}


def bfs_len(grid):
    """Independent solver: shortest S->G path length avoiding holes, or None."""
    start = next((r, c) for r, row in enumerate(grid) for c, ch in enumerate(row) if ch == "S")
    seen, todo = {start: 0}, deque([start])
    while todo:
        r, c = todo.popleft()
        if grid[r][c] == "G":
            return seen[(r, c)]
        for dr, dc in MOVES.values():
            q = (r + dr, c + dc)
            if 0 <= q[0] < len(grid) and 0 <= q[1] < len(grid[0]) and grid[q[0]][q[1]] != "H" and q not in seen:
                seen[q] = seen[(r, c)] + 1
                todo.append(q)
    return None


def play(env, actions):
    out = None
    for a in actions:
        out = env.step(a)
    return out


def test_classic_map_render_and_win():
    env = FrozenLakeEnv()
    obs, info = env.reset(0)
    assert obs == "PFFF\nFHFH\nFFFH\nHFFG"
    assert info["success"] is False
    rewards = []
    for a in ["D", "D", "R", "R", "D"]:
        obs, r, term, trunc, info = env.step(a)
        rewards.append(r)
        assert not term and not trunc and info["valid_action"]
    obs, r, term, trunc, info = env.step("R")
    assert (r, term, trunc, info["success"]) == (1.0, True, False, True)
    assert rewards == [0.0] * 5
    assert obs.splitlines()[-1] == "HFFP"
    with pytest.raises(RuntimeError):
        env.step("L")


def test_words_are_accepted_case_insensitively():
    env = FrozenLakeEnv()
    env.reset(0)
    obs, *_ = env.step(" Right ")
    assert obs.splitlines()[0] == "SPFF"
    obs, *_ = env.step("DOWN")
    assert obs.splitlines()[1] == "FPFH"  # drawn over the hole: we fell in


def test_hole_terminates_without_reward():
    env = FrozenLakeEnv()
    env.reset(0)
    _, r, term, trunc, info = play(env, ["R", "D"])
    assert (r, term, trunc, info["success"], info["cell"]) == (0.0, True, False, False, "H")


def test_invalid_action_is_a_counted_noop():
    env = FrozenLakeEnv()
    obs0, _ = env.reset(0)
    obs, r, term, trunc, info = env.step("jump!")
    assert obs == obs0 and r == 0.0 and not term and not trunc
    assert info["valid_action"] is False
    assert env.steps == 1


def test_truncation_at_max_steps_default_8():
    env = FrozenLakeEnv()
    env.reset(0)
    for i in range(7):
        assert env.step("L")[3] is False  # bumping the wall is allowed
    _, r, term, trunc, info = env.step("L")
    assert trunc and not term and r == 0.0 and info["success"] is False


def test_legal_actions():
    assert FrozenLakeEnv().legal_actions() == ["L", "D", "R", "U"]


def test_random_maps_solvable_and_deterministic():
    env = FrozenLakeEnv(random_map=True, size=5, p_frozen=0.6)
    maps = set()
    for seed in range(60):
        env.reset(seed)
        grid = list(env.grid)
        n = bfs_len(grid)
        assert n is not None and n <= env.max_steps, grid
        assert grid[0][0] == "S" and grid[-1][-1] == "G" and len(grid) == 5
        env.reset(seed)
        assert env.grid == grid
        maps.add(tuple(grid))
    assert len(maps) > 40


def test_custom_map_and_validation():
    env = FrozenLakeEnv(map=["SG"])
    env.reset(0)
    assert env.step("R")[1] == 1.0
    assert env.max_steps == 3
    for bad in (["SFF", "FG"], ["SXG"], ["SFF"], "SFG"):
        with pytest.raises(ValueError, match="'map'"):
            FrozenLakeEnv(map=bad)
    with pytest.raises(ValueError, match="'size'"):
        FrozenLakeEnv(size=5)
    with pytest.raises(ValueError, match="'p_frozen'"):
        FrozenLakeEnv(random_map=True, p_frozen=0)
    assert FrozenLakeEnv(size=8).reset(0)[0].count("\n") == 7 and 8 in CLASSIC_MAPS


def test_slippery_distribution_and_determinism():
    env = FrozenLakeEnv(map=["FFF", "FSF", "FFG"], slippery=True)
    counts = Counter()
    for seed in range(1500):
        env.reset(seed)
        first = env.step("U")
        counts[env.pos] += 1
        env.reset(seed)
        assert env.step("U") == first
    assert set(counts) == {(0, 1), (1, 0), (1, 2)}  # up, left, right; never down
    for n in counts.values():
        assert 0.28 < n / 1500 < 0.39, counts


def test_not_slippery_by_default():
    env = FrozenLakeEnv(map=["FFF", "FSF", "FFG"])
    for seed in range(20):
        env.reset(seed)
        env.step("U")
        assert env.pos == (0, 1)

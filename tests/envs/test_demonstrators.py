"""The built-in demonstrators and ``rollart demos``'s episodes, played on real envs."""

from __future__ import annotations

import asyncio
import json
import random

import pytest

from rollart.app.demos import write_demos
from rollart.config import EnvConfig
from rollart.envs import make_env
from rollart.envs.demonstrators import demonstrator_names, make_demonstrator
from rollart.envs.frozenlake import FrozenLakeEnv

RANDOM = {"random_map": True}


def _shortest(env: FrozenLakeEnv) -> int:
    """Moves of a shortest hole-free path from the player to G: a BFS of the test's own over
    the env's grid (not the demonstrator's)."""
    grid, start = env.grid, env.pos
    seen, frontier, n = {start}, [start], 0
    while frontier:
        if any(grid[r][c] == "G" for r, c in frontier):
            return n
        nxt = []
        for r, c in frontier:
            for q in ((r - 1, c), (r + 1, c), (r, c - 1), (r, c + 1)):
                if (0 <= q[0] < len(grid) and 0 <= q[1] < len(grid[0]) and q not in seen
                        and grid[q[0]][q[1]] != "H"):
                    seen.add(q)
                    nxt.append(q)
        frontier, n = nxt, n + 1
    raise AssertionError("no path to G")


def test_bfs_walks_a_shortest_safe_path_and_the_heuristic_only_avoids_holes(tmp_path):
    assert demonstrator_names("frozenlake") == ["bfs", "heuristic"]
    seeds = list(range(128))
    cfg = EnvConfig(type="frozenlake", args=RANDOM, max_turns=16)
    bfs = asyncio.run(write_demos(cfg, "bfs", seeds, tmp_path / "bfs.jsonl", quiet=True))
    heur = asyncio.run(write_demos(cfg, "heuristic", seeds, tmp_path / "h.jsonl", quiet=True))
    assert bfs["success_rate"] == 1.0
    lines = [json.loads(x) for x in (tmp_path / "bfs.jsonl").read_text().splitlines()]
    for line in lines[:32]:
        env = make_env("frozenlake", RANDOM)
        env.reset(line["seed"])
        assert line["turns"] == _shortest(env), line["seed"]
        assert line["constrained"] and line["messages"][0]["role"] == "system"
        assert [m["role"] for m in line["messages"][1:]] == ["user", "assistant"] * line["turns"]
    # one step of look-ahead: worse than the oracle, far better than a random walk (~1%)
    assert 0.5 < heur["success_rate"] < 1.0, heur


def test_a_demonstrator_answers_a_legal_move_and_a_bad_name_lists_what_exists():
    env = make_env("frozenlake", RANDOM)
    demo = make_demonstrator("frozenlake", "heuristic", env, random.Random(0))
    obs, info = env.reset(3)
    demo.reset(obs, info)
    assert demo.act(obs, env.legal_actions()) in env.legal_actions()
    with pytest.raises(ValueError, match=r"no demonstrator 'oracle' .* frozenlake: bfs, heuristic"):
        make_demonstrator("frozenlake", "oracle", env, random.Random(0))
    with pytest.raises(ValueError, match="cannot import it"):
        make_demonstrator("frozenlake", "no_such_pkg:factory", env, random.Random(0))


def test_cell_sep_draws_one_token_per_cell_and_the_demonstrators_read_it(tmp_path):
    plain, spaced = make_env("frozenlake", RANDOM), make_env("frozenlake", RANDOM | {"cell_sep": "|"})
    obs, _ = plain.reset(7)
    sep_obs, _ = spaced.reset(7)
    assert sep_obs == "\n".join("|".join(row) for row in obs.splitlines()) and sep_obs.startswith("P|")
    # the tiny model's tokenizer: a cell per token (without the separator a row's letters merge)
    from rollart.engines.tiny import _builtin_corpus, _train_tokenizer
    tok = _train_tokenizer(512, _builtin_corpus())
    pieces = [p for p in tok.encode(sep_obs).tokens if p not in ("|", "Ċ")]
    assert pieces == [ch for ch in obs if ch != "\n"], pieces
    # the same episodes, move for move, whatever the drawing
    seeds = list(range(64))
    a = asyncio.run(write_demos(EnvConfig(type="frozenlake", args=RANDOM), "bfs", seeds,
                                tmp_path / "a.jsonl", quiet=True))
    b = asyncio.run(write_demos(EnvConfig(type="frozenlake", args=RANDOM | {"cell_sep": "|"}), "bfs",
                                seeds, tmp_path / "b.jsonl", quiet=True))
    moves = [[[m["content"] for m in json.loads(x)["messages"] if m["role"] == "assistant"]
              for x in (tmp_path / f).read_text().splitlines()] for f in ("a.jsonl", "b.jsonl")]
    assert a["success_rate"] == b["success_rate"] == 1.0 and moves[0] == moves[1]
    with pytest.raises(ValueError, match="cell_sep"):
        make_env("frozenlake", RANDOM | {"cell_sep": "x"})


SOKOBAN = {"width": 6, "height": 6, "num_boxes": 1, "num_walls": 2, "gen_steps": 20, "max_steps": 20}


def _solvable_within(env, moves: int) -> bool:
    """Whether some sequence of ``moves`` moves solves the room ``env`` is in: every sequence
    tried on a copy of the room (the test's own search, not the demonstrator's)."""
    import itertools

    from rollart.envs.base import MOVES
    from rollart.envs.sokoban import Room

    start = env.room.render().splitlines()
    for seq in itertools.product(MOVES.values(), repeat=moves):
        room = Room.parse(start)
        for d in seq:
            room.move(d)
            if room.solved():
                return True
    return False


def test_the_sokoban_solver_solves_every_generated_room_in_the_fewest_moves(tmp_path):
    from rollart.envs.demonstrators import sokoban_plan

    assert demonstrator_names("sokoban") == ["bfs"]
    cfg = EnvConfig(type="sokoban", args=SOKOBAN, max_turns=20)
    out = asyncio.run(write_demos(cfg, "bfs", list(range(64)), tmp_path / "s.jsonl", quiet=True))
    assert out["success_rate"] == 1.0, out
    lines = [json.loads(x) for x in (tmp_path / "s.jsonl").read_text().splitlines()]
    checked = 0
    for line in lines:
        assert 1 <= line["turns"] <= SOKOBAN["gen_steps"] and line["stop"] == "terminated"
        if line["turns"] <= 5:  # no shorter solution exists: all 4^(n-1) sequences fail
            env = make_env("sokoban", SOKOBAN)
            env.reset(line["seed"])
            assert not _solvable_within(env, line["turns"] - 1), line["seed"]
            checked += 1
    assert checked >= 32
    assert sokoban_plan("#####\n#P*_#\n#####") == []
    # the box in a corner off its target: no solution; the solver walks instead of failing
    stuck = "#####\n#B__#\n#_P_#\n#__T#\n#####"
    assert sokoban_plan(stuck) is None
    demo = make_demonstrator("sokoban", "bfs", None, random.Random(0))
    assert demo.act(stuck, ["L", "D", "R", "U"]) in ("L", "D", "R", "U")


def test_free_text_demonstrations_write_the_move_as_the_pattern_reads_it(tmp_path):
    from rollart.app.demos import play_demo

    answer = EnvConfig(type="frozenlake", args=RANDOM, max_turns=16, constrain=False,
                       action_pattern=r"<answer>(.*?)</answer>")
    out = asyncio.run(write_demos(answer, "bfs", list(range(16)), tmp_path / "t.jsonl", quiet=True))
    assert out["success_rate"] == 1.0 and out["mean_reward"] == 1.0  # no format penalty
    lines = [json.loads(x) for x in (tmp_path / "t.jsonl").read_text().splitlines()]
    said = [m["content"] for line in lines for m in line["messages"] if m["role"] == "assistant"]
    assert said and all(t in {f"<answer>{m}</answer>" for m in "LDRU"} for t in said), said[:4]
    assert not any(line["constrained"] for line in lines)
    # a template of the user's, parsed back with the pattern
    out = asyncio.run(write_demos(answer, "bfs", [0], tmp_path / "u.jsonl", quiet=True,
                                  fmt="I go {action}. <answer>{action}</answer>"))
    first = json.loads((tmp_path / "u.jsonl").read_text())["messages"][2]["content"]
    assert first.startswith("I go ") and out["mean_reward"] == 1.0
    # a template the pattern cannot read back fails, naming both; so does one without {action}
    env = make_env("frozenlake", RANDOM)
    with pytest.raises(ValueError, match=r"does not parse back .* action_pattern"):
        asyncio.run(play_demo(env, answer, make_demonstrator("frozenlake", "bfs", env, random.Random(0)),
                              0, fmt="go {action}"))
    from rollart.config import ConfigError
    with pytest.raises(ConfigError, match="no {action} field"):
        asyncio.run(write_demos(answer, "bfs", [0], tmp_path / "v.jsonl", quiet=True, fmt="go"))
    assert not (tmp_path / "v.jsonl").exists()
    # without a pattern the move is the whole text, as before
    bare = EnvConfig(type="frozenlake", args=RANDOM, max_turns=16, constrain=False)
    asyncio.run(write_demos(bare, "bfs", [0], tmp_path / "w.jsonl", quiet=True))
    first = json.loads((tmp_path / "w.jsonl").read_text())["messages"][2]["content"]
    assert first in "LDRU"


def test_the_reasoning_gym_demonstrator_answers_the_reference(tmp_path):
    pytest.importorskip("reasoning_gym")
    cfg = EnvConfig(type="reasoning_gym", max_turns=1, action_pattern=r"(\d+)",
                    args={"dataset": "basic_arithmetic",
                          "dataset_args": {"min_terms": 2, "max_terms": 2, "min_digits": 1, "max_digits": 2,
                                           "operators": ["+"], "allow_parentheses": False,
                                           "allow_negation": False}})
    out = asyncio.run(write_demos(cfg, "answer", list(range(32)), tmp_path / "r.jsonl", quiet=True))
    assert out["success_rate"] == 1.0, out
    for line in (tmp_path / "r.jsonl").read_text().splitlines()[:8]:
        msgs = json.loads(line)["messages"]
        a, b = (int(x) for x in msgs[1]["content"].removeprefix("Calculate ").rstrip(".").split(" + "))
        assert msgs[2]["content"] == str(a + b)
    with pytest.raises(ValueError, match="needs a reasoning_gym env"):
        make_demonstrator("reasoning_gym", "answer", make_env("frozenlake", RANDOM), random.Random(0))

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

from collections import deque

import pytest

from rollart.envs.sokoban import SokobanEnv

DIRS = {"L": (0, -1), "D": (1, 0), "R": (0, 1), "U": (-1, 0)}


def parse(obs):
    walls, boxes, targets, player = set(), set(), set(), None
    for r, row in enumerate(obs.splitlines()):
        for c, ch in enumerate(row):
            if ch == "#":
                walls.add((r, c))
            if ch in "B*":
                boxes.add((r, c))
            if ch in "T*+":
                targets.add((r, c))
            if ch in "P+":
                player = (r, c)
    return walls, frozenset(boxes), frozenset(targets), player


def solve(obs, limit):
    """Independent BFS over (player, boxes): a shortest move list, or None."""
    walls, boxes, targets, player = parse(obs)
    start = (player, boxes)
    prev = {start: None}
    todo = deque([(start, 0)])
    while todo:
        (p, bx), depth = todo.popleft()
        if bx == targets:
            path, s = [], (p, bx)
            while prev[s] is not None:
                s, a = prev[s]
                path.append(a)
            return path[::-1]
        if depth == limit:
            continue
        for a, (dr, dc) in DIRS.items():
            q = (p[0] + dr, p[1] + dc)
            if q in walls:
                continue
            nb = bx
            if q in bx:
                beyond = (q[0] + dr, q[1] + dc)
                if beyond in walls or beyond in bx:
                    continue
                nb = (bx - {q}) | {beyond}
            s = (q, nb)
            if s not in prev:
                prev[s] = ((p, bx), a)
                todo.append((s, depth + 1))
    return None


@pytest.mark.parametrize("args", [{}, {"num_boxes": 2, "width": 6, "height": 6, "gen_steps": 20, "max_steps": 30}])
def test_generated_rooms_are_solvable_and_the_env_agrees(args):
    env = SokobanEnv(**args)
    for seed in range(40):
        obs, info = env.reset(seed)
        walls, boxes, targets, player = parse(obs)
        assert len(boxes) == len(targets) == env.num_boxes and not boxes & targets
        path = solve(obs, env.max_steps)
        assert path, f"seed {seed} unsolvable:\n{obs}"
        for i, a in enumerate(path):
            obs, r, term, trunc, info = env.step(a)
            assert not trunc
            assert term == (i == len(path) - 1)
        assert r == 1.0 and info["success"] is True
        assert "B" not in obs and obs.count("*") == env.num_boxes


def test_same_seed_same_room():
    env = SokobanEnv()
    rooms = [env.reset(s)[0] for s in range(20)]
    assert rooms == [env.reset(s)[0] for s in range(20)]
    assert len(set(rooms)) > 15


def test_push_onto_target_solves():
    env = SokobanEnv(room=["######", "#P_BT#", "######"])
    obs, _ = env.reset(0)
    assert obs == "######\n#P_BT#\n######"
    obs, r, term, trunc, info = env.step("R")
    assert (obs, r, term, info["moved"]) == ("######\n#_PBT#\n######", -0.01, False, True)
    obs, r, term, trunc, info = env.step("R")
    assert obs == "######\n#__P*#\n######" and (r, term, trunc, info["success"]) == (1.0, True, False, True)


def test_walls_and_boxes_block():
    env = SokobanEnv(room=["########", "#PBB_TT#", "########"], step_penalty=-0.1)
    obs0, _ = env.reset(0)
    for a in ("U", "D", "L", "R"):  # walls on three sides, two boxes in a row on the right
        obs, r, term, trunc, info = env.step(a)
        assert obs == obs0 and r == -0.1 and info["moved"] is False and info["valid_action"] is True
    env = SokobanEnv(room=["#####", "#PB##", "#__T#", "#####"])
    obs0, _ = env.reset(0)
    obs, *_ , info = env.step("R")
    assert obs == obs0 and info["moved"] is False


def test_player_on_target_render_and_invalid_action():
    env = SokobanEnv(room=["#####", "#TP_#", "#_B_#", "#####"], max_steps=3)
    env.reset(0)
    obs, r, term, trunc, info = env.step("left")
    assert obs.splitlines()[1] == "#+__#"
    obs2, r, term, trunc, info = env.step("push harder")
    assert obs2 == obs and info["valid_action"] is False and r == -0.01 and not term and not trunc
    *_, trunc, info = env.step("U")
    assert trunc and info["success"] is False
    with pytest.raises(RuntimeError):
        env.step("U")


@pytest.mark.parametrize("kw,name", [({"step_penalty": -2}, "step_penalty"), ({"num_boxes": 0}, "num_boxes"),
                                     ({"gen_steps": 30, "max_steps": 10}, "max_steps"),
                                     ({"room": ["#P#", "#B"]}, "room"), ({"room": ["#PB#"]}, "room")])
def test_bad_args_name_the_arg(kw, name):
    with pytest.raises(ValueError, match=name):
        SokobanEnv(**kw)

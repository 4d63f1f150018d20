"""The generated expression tasks: each task's canonical answer passes its hidden tests and a
wrong one fails, the examples shown determine the task, held-out prompts never reach
training, and the demonstrator plays through ``rollart demos``' own episode loop."""

from __future__ import annotations

import asyncio
import json
import random
from concurrent.futures import ThreadPoolExecutor

import pytest

from rollart.actors.reward.actor import RULES
from rollart.app.demos import write_demos
from rollart.code import pyexpr
from rollart.code.pyexpr import HIDDEN, TASKS, PyExprEnv
from rollart.config import EnvConfig
from rollart.envs import make_env
from rollart.envs.base import HELDOUT_SEED_OFFSET


def test_canonical_answers_pass_and_wrong_ones_fail():
    code_tests = RULES["code_tests"]
    # every canonical answer passes; "x" (no task is the identity) fails a third of them
    pairs = [(t, e, 1.0) for t, (_, e, _) in TASKS.items()] + [(t, "x", 0.0) for t in list(TASKS)[::3]]
    with ThreadPoolExecutor(3) as ex:
        got = list(ex.map(lambda p: code_tests(p[1], "", {"suite": "pyexpr", "task": p[0]}), pairs))
    assert [p for p, g in zip(pairs, got) if g != p[2]] == []
    # an equivalent expression passes; the right value of the wrong type does not
    assert pyexpr.passes("mul:2", "x+x") and pyexpr.passes("rev", "''.join(reversed(x))")
    assert not pyexpr.passes("len", "str(len(x))")
    assert not pyexpr.passes("add:1", "__import__('os')._exit(0)")


def test_the_examples_determine_the_task():
    rng = random.Random(0)
    for task, (kind, _, fn) in TASKS.items():
        for _ in range(5):
            pairs = pyexpr.examples(task, rng)
            fits = [t for t, (k, _, f) in TASKS.items() if k == kind and t != task
                    and all(f(x) == y and type(f(x)) is type(y) for x, y in pairs)
                    and any(f(h) != fn(h) for h in HIDDEN[kind])]
            assert not fits, (task, pairs, fits)


def test_heldout_prompts_never_reach_training():
    env = PyExprEnv(heldout_share=0.1)
    train = {env.reset(s)[0] for s in range(3000)}
    held = [env.reset(HELDOUT_SEED_OFFSET + s) for s in range(300)]
    assert all(info["heldout"] for _, info in held)
    assert not train & {obs for obs, _ in held}
    assert len({obs for obs, _ in held}) > 290           # distinct new prompts
    assert len({info["task"] for _, info in held}) > 40  # of most of the tasks
    assert env.reset(7) == env.reset(7)                  # deterministic


def test_invalid_answers_are_not_run_and_bad_args_are_named():
    env = make_env("pyexpr", {"tasks": ["add:3"]})
    obs, info = env.reset(1)
    assert info["task"] == "add:3" and obs.count("\n") == 2
    for bad in ["", "x +", "return x + 3", "x" * 300]:
        env.reset(1)
        _, r, term, _, info = env.step(bad)
        assert (r, term, info["valid_action"]) == (0.0, True, False), bad
    env.reset(1)
    assert env.step("x + 3")[1] == 1.0
    words = PyExprEnv(tasks=pyexpr.WORD_TASKS)
    assert len(pyexpr.WORD_TASKS) == 16 and all(
        words.reset(s)[1]["task"] in pyexpr.WORD_TASKS and words.reset(s)[0].startswith("f('")
        for s in range(50))
    with pytest.raises(ValueError, match="unknown task ids"):
        PyExprEnv(tasks=["add:99"])
    with pytest.raises(ValueError, match="heldout_share"):
        PyExprEnv(heldout_share=0)


def test_the_demonstrator_writes_successful_demos(tmp_path):
    cfg = EnvConfig(type="pyexpr", max_turns=1)
    out = tmp_path / "demos.jsonl"
    summary = asyncio.run(write_demos(cfg, "solution", list(range(5_000_000, 5_000_030)), out, quiet=True))
    assert summary["success_rate"] == 1.0
    line = json.loads(out.read_text().splitlines()[0])
    assert [m["role"] for m in line["messages"]] == ["system", "user", "assistant"]
    assert line["messages"][0]["content"] == pyexpr.INSTRUCTION

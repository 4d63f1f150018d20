"""The HumanEval harness proved on the dataset itself: every canonical solution passes
through the ``code_tests`` scorer, broken ones (the body replaced by ``return None``, ``pass``
or a raise) and early exits pass none, and the env scores and splits as it says."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import pytest

from rollart import sandbox
from rollart.actors.reward.actor import RULES
from rollart.code import humaneval
from rollart.code.humaneval import HumanEvalEnv, problems
from rollart.config.sandbox import SandboxConfig
from rollart.envs import make_env
from rollart.envs.base import HELDOUT_SEED_OFFSET

BROKEN = ("    return None\n", "    pass\n", "    raise NotImplementedError\n")


def score_all(pairs: list[tuple[str, str]]) -> list[float]:
    """The reward service's scorer on each (task, completion), three at a time."""
    code_tests = RULES["code_tests"]
    with ThreadPoolExecutor(3) as ex:
        return list(ex.map(lambda p: code_tests(p[1], "", {"suite": "humaneval", "task": p[0]}), pairs))


def test_every_canonical_solution_passes_through_the_scorer():
    ps = problems()
    assert len(ps) == 164
    scores = score_all([(t, p["canonical_solution"]) for t, p in ps.items()])
    failed = [t for t, s in zip(ps, scores) if s != 1.0]
    assert not failed, f"canonical solutions failed: {failed}"


def test_broken_solutions_and_early_exits_pass_none():
    ps = list(problems())
    # every third problem gets a broken body (the three kinds in turn: each kind meets about
    # 18 problems), and a sample of problems a completion that ends the process early with
    # status 0 (the canonical test runs all 164: the harness's cost is per program)
    pairs = [(t, BROKEN[i % 3]) for i, t in enumerate(ps[::3])]
    pairs += [(t, "    import os\n    os._exit(0)\n") for t in ps[::16]]
    pairs += [(t, "    import sys\n    sys.exit(0)\n") for t in ps[1::16]]
    scores = score_all(pairs)
    passed = [p for p, s in zip(pairs, scores) if s != 0.0]
    assert not passed, f"broken solutions passed: {passed[:5]}"


def test_a_whole_function_in_a_fence_is_accepted():
    ps = problems()
    sample = list(ps)[::12]
    whole = [(t, f"Here it is:\n```python\n{ps[t]['prompt']}{ps[t]['canonical_solution']}```\n") for t in sample]
    assert score_all(whole) == [1.0] * len(sample)
    # a body without indentation is indented
    assert humaneval.passes("HumanEval/53", "return x + y")


def test_env_splits_scores_and_refuses_empty_completions():
    env = make_env("humaneval", {"heldout_share": 0.2})
    assert isinstance(env, HumanEvalEnv)
    assert set(env.heldout_ids).isdisjoint(env.train_ids)
    assert len(env.heldout_ids) + len(env.train_ids) == 164 and 15 <= len(env.heldout_ids) <= 50
    train = {env.reset(s)[1]["task"] for s in range(400)}
    held = {env.reset(HELDOUT_SEED_OFFSET + s)[1]["task"] for s in range(400)}
    assert train == set(env.train_ids) and held == set(env.heldout_ids)

    obs, info = env.reset(HELDOUT_SEED_OFFSET)
    task = info["task"]
    assert obs == problems()[task]["prompt"] and info["heldout"] and info["suite"] == "humaneval"
    _, r, term, _, info = env.step(problems()[task]["canonical_solution"])
    assert (r, term, info["success"], info["valid_action"]) == (1.0, True, True, True)
    env.reset(0)
    _, r, _, _, info = env.step("   \n")
    assert (r, info["valid_action"], info["success"]) == (0.0, False, False)
    with pytest.raises(RuntimeError, match="before reset"):
        env.step("pass")

    lazy = HumanEvalEnv(execute=False)  # the reward service's code_tests runs the tests
    lazy.reset(0)
    assert lazy.step("    return None\n")[1:3] == (0.0, True)
    with pytest.raises(ValueError, match="heldout_share"):
        HumanEvalEnv(heldout_share=1.5)


def test_a_sandbox_that_cannot_start_is_an_error_not_a_reward_of_zero():
    env = HumanEvalEnv()
    _, info = env.reset(3)
    sandbox.configure(SandboxConfig(python="/nonexistent/python3", warm=0, start_timeout_s=5))
    try:
        with pytest.raises(sandbox.SandboxError):
            env.step("    return 'a completion never run before'\n")
        with pytest.raises(sandbox.SandboxError):
            RULES["code_tests"]("    return 1 + 0 + 0\n", "", {"suite": "humaneval", "task": info["task"]})
    finally:
        sandbox.shutdown()
        sandbox.pool().start_warming()

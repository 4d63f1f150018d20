"""``trainer.schedule_clock``: the LR schedule stands still on a step with no signal (every
trajectory failed alike), so a stuck run keeps the learning rate it needs to climb out."""

from __future__ import annotations

import json
from pathlib import Path

import msgspec
import pytest

from rollart.actors.trainer.batch import advances_schedule, build_samples
from rollart.config import TrainerConfig
from rollart.messages import RolloutCompleted


def _traj(i: int, reward: float, success: bool) -> RolloutCompleted:
    return RolloutCompleted(traj_id=f"g-{i}", group_id="g", env="main", seed=0, index_in_group=i,
                            token_ids=[1, 2, 3], response_mask=[0, 0, 1], logprobs=[0.0, 0.0, -1.0],
                            reward=reward, success=success, min_version=0, max_version=0)


@pytest.mark.parametrize("rewards, successes, clock, moves", [
    ([0.0, 0.0], [False, False], "signal", False),   # all failed alike: no signal
    ([0.0, 1.0], [False, True], "signal", True),     # a signal
    ([0.0, 0.5], [False, False], "signal", True),    # partial credit differs: a signal
    ([1.0, 1.0], [True, True], "signal", True),      # all succeeded: a converged policy decays
    ([0.0, 0.0], [False, False], "steps", True),
])
def test_which_steps_move_the_schedule(rewards, successes, clock, moves):
    pytest.importorskip("torch")
    trajs = [_traj(i, r, s) for i, (r, s) in enumerate(zip(rewards, successes))]
    samples = build_samples(trajs, [0] * len(trajs), "drgrpo")
    assert advances_schedule(TrainerConfig(schedule_clock=clock), trajs, samples) is moves


@pytest.mark.parametrize("clock", ["signal", "steps"])
async def test_a_run_that_never_succeeds_holds_its_warmup(tmp_path, clock):
    """The quickstart with a goal out of reach (2 moves on a 4x4 map): no step carries a
    signal, so under ``signal`` the warm-up never moves (each step at 1/4 of the LR), each
    row says so, and the durable state counts them; under ``steps`` it warms up as before."""
    from rollart.app.launch import with_overrides
    from rollart.app.run import train
    from tests.e2e.test_learning import quickstart

    cfg = with_overrides(quickstart(tmp_path, f"clock-{clock}", 1), trainer={
        "steps": 3, "lr": 0.004, "warmup_steps": 4, "schedule_clock": clock, "eval_groups": 1},
        rollout={"batch_groups": 2, "group_size": 2})
    env = cfg.envs["main"]
    env = msgspec.structs.replace(env, args={**env.args, "map": ["SFFF", "FFFF", "FFFF", "FFFG"],
                                             "max_steps": 2})
    cfg = msgspec.structs.replace(cfg, envs={**cfg.envs, "main": env})
    summary = await train(cfg, nats="memory", resume=False, quiet=True)
    assert summary["steps"] == 3, summary
    folder = Path(cfg.run_dir) / cfg.run
    rows = [json.loads(x) for x in (folder / "metrics.jsonl").read_text().splitlines()]
    assert all(r["success"] == 0.0 for r in rows)
    lrs = [round(r["lr"] / 0.004, 6) for r in rows]
    if clock == "signal":
        assert lrs == [0.25, 0.25, 0.25]
        assert [r["schedule_held"] for r in rows] == [1.0, 1.0, 1.0]
        assert [r["count_schedule_held"] for r in rows] == [1, 2, 3]
    else:
        assert lrs == [0.25, 0.5, 0.75]
        assert [r["schedule_held"] for r in rows] == [0.0, 0.0, 0.0]
    state = json.loads((folder / "checkpoints" / "state.json").read_text())
    assert state["counts"]["schedule_held"] == (3 if clock == "signal" else 0)

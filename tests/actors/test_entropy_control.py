"""Adaptive entropy control (``trainer.entropy_target``): the coefficient after each step,
and a run that records it in its metrics and its durable state."""

from __future__ import annotations

import pytest

from rollart.actors.trainer.batch import loss_config, next_entropy_coef
from rollart.config import TrainerConfig

T = TrainerConfig(entropy_coef=0.01, entropy_target=0.2, entropy_coef_step=0.005, entropy_coef_max=0.03)


def test_the_coefficient_rises_below_the_target_and_falls_above_within_its_bounds():
    coef, seen = T.entropy_coef, []
    for _ in range(6):  # a collapsed policy: entropy far below the target
        coef = next_entropy_coef(T, coef, 0.01)
        seen.append(round(coef, 6))
    assert seen == [0.015, 0.02, 0.025, 0.03, 0.03, 0.03], "rises by the step up to the max"
    for _ in range(8):  # exploring again: above the target
        coef = next_entropy_coef(T, coef, 0.9)
    assert coef == 0.0, "falls by the step, never below 0"
    assert next_entropy_coef(T, 0.02, float("nan")) == 0.02, "no measured entropy: unchanged"
    assert next_entropy_coef(T, 0.02, None) == 0.02


def test_without_a_target_the_coefficient_is_the_configs():
    fixed = TrainerConfig(entropy_coef=0.01)
    assert next_entropy_coef(fixed, 0.01, 0.0) == 0.01
    assert loss_config(fixed).entropy_coef == 0.01
    assert loss_config(fixed, 0.04).entropy_coef == 0.04


@pytest.mark.timeout(300)
async def test_a_run_records_each_steps_coefficient_and_keeps_the_next_one(tmp_path):
    """A short quickstart run with a target above any entropy it reaches: the coefficient in
    the metrics rises by the step every step from the config's, and the durable state holds
    the one the next step would use (what a resume continues with)."""
    import json
    from pathlib import Path

    from rollart.app.launch import with_overrides
    from rollart.app.run import train
    from tests.e2e.test_learning import quickstart

    cfg = with_overrides(quickstart(tmp_path, "entropy-ctl", 1), trainer={
        "steps": 3, "entropy_coef": 0.01, "entropy_target": 5.0, "entropy_coef_step": 0.02,
        "entropy_coef_max": 1.0, "eval_groups": 1},
        rollout={"batch_groups": 2, "group_size": 2})
    summary = await train(cfg, nats="memory", resume=False, quiet=True)
    assert summary["steps"] == 3, summary
    folder = Path(cfg.run_dir) / cfg.run
    rows = [json.loads(x) for x in (folder / "metrics.jsonl").read_text().splitlines()]
    assert [round(r["entropy_coef"], 6) for r in rows] == [0.01, 0.03, 0.05]
    assert all(r["entropy"] < 5.0 for r in rows)
    state = json.loads((folder / "checkpoints" / "state.json").read_text())
    assert round(state["entropy_coef"], 6) == 0.07

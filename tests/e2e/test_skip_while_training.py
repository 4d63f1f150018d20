"""``trainer.skip_while_training``: with α = 1 the next step's uniform groups are skipped while
a step trains (their replacements run during the step), within the step's budget, and
nothing else about the step rules changes; off (the default), none is skipped before the
step needs it."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from rollart.app.launch import with_overrides
from rollart.app.run import train
from rollart.config import RunConfig, load

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.timeout(300)
@pytest.mark.parametrize("on", [True, False])
async def test_skipping_while_a_step_trains(tmp_path, on):
    cfg = load(ROOT / "configs" / "quickstart.yaml", RunConfig)
    budget = cfg.trainer.skip_uniform
    cfg = with_overrides(cfg, run="skim", run_dir=str(tmp_path / "runs"), rollout={"alpha": 1},
                         trainer={"steps": 5, "skip_while_training": on, "eval_groups": 1,
                                  "expect_success": 0.0})
    summary = await train(cfg, nats="memory", resume=False, quiet=True)
    assert summary["steps"] == 5 and not summary["interrupted"], summary
    rows = [json.loads(x) for x in (tmp_path / "runs" / "skim" / "metrics.jsonl").read_text().splitlines()]
    # the random start fails almost every group: each step skips up to its budget
    assert all(0 <= r["groups_skipped"] <= budget for r in rows), [r["groups_skipped"] for r in rows]
    in_rows, total = sum(r["groups_skipped"] for r in rows), rows[-1]["count_uniform_skipped"]
    # while the last step trained, groups of a step that never came may be skipped too
    assert 0 < in_rows <= total <= in_rows + (budget if on else 0), (in_rows, total)
    early = rows[-1]["count_skipped_while_training"]
    if on:  # step k trains while step k+1's groups come in
        assert 0 < early <= rows[-1]["count_uniform_skipped"], early
    else:
        assert early == 0
    for r in rows:  # the α rule, and every trained group is one the step could take
        assert all(mv >= r["step"] - 1 - 1 for mv in r["traj_min_versions"]), r["traj_min_versions"]
        assert len(r["traj_ids"]) == cfg.rollout.batch_groups * cfg.rollout.group_size
    ids = [t for r in rows for t in r["traj_ids"]]
    assert len(ids) == len(set(ids)), "no trajectory trained twice"

"""The quickstart setting learns: greedy success >= 0.9 within its step budget.

α = 0 and α = 1 on the in-memory bus, and once on a real nats-server. The budget is the
config's ``trainer.steps`` (a step budget, not a time limit).
"""

from __future__ import annotations

import json
from pathlib import Path

import msgspec
import pytest

from rollart.cli import train
from rollart.config import RunConfig, load
from rollart.launch import with_overrides

ROOT = Path(__file__).resolve().parents[2]
pytestmark = pytest.mark.slow


def quickstart(tmp_path: Path, run: str, alpha: int) -> RunConfig:
    cfg = load(ROOT / "configs" / "quickstart.yaml", RunConfig)
    cfg = with_overrides(cfg, run=run, run_dir=str(tmp_path / "runs"))
    return with_overrides(cfg, rollout={"alpha": alpha}, trainer={"eval_groups": 1})


@pytest.mark.parametrize("alpha,bus", [(0, "memory"), (1, "memory"), (1, "nats")])
async def test_quickstart_learns(tmp_path, alpha, bus, request):
    nats = "memory" if bus == "memory" else request.getfixturevalue("nats_server").url
    cfg = quickstart(tmp_path, f"learn-a{alpha}-{bus}", alpha)
    summary = await train(cfg, nats=nats, resume=False, quiet=True)
    assert summary["steps"] == cfg.trainer.steps and not summary["interrupted"]
    rows = [json.loads(x) for x in (tmp_path / "runs" / cfg.run / "metrics.jsonl").read_text().splitlines()]
    curve = [round(r["success"], 2) for r in rows[::10]]
    assert summary["greedy_success"] >= 0.9, (summary, curve)
    assert rows[0]["success"] < 0.5, "it must start from a policy that cannot do the task"
    for r in rows:  # the α rule on recorded data: step v+1 uses min_version >= v - alpha
        v = r["step"] - 1
        assert all(mv >= v - alpha for mv in r["traj_min_versions"]), (r["step"], r["traj_min_versions"])
    if alpha == 0:
        assert all(r["max_staleness"] == 0 for r in rows), "alpha = 0 is on-policy"
    ids = [t for r in rows for t in r["traj_ids"]]
    assert len(ids) == len(set(ids))
    assert msgspec.json.decode((tmp_path / "runs" / cfg.run / "summary.json").read_bytes())["plot"]

"""The quickstart setting learns: greedy success reaches 0.9 within its step budget.

α = 0 and α = 1 on the in-memory bus, and once on a real nats-server. The budget is the
config's ``trainer.steps`` (a step budget, not a time limit). Every version's weights are
kept and evaluated greedily afterwards (the map is fixed and not slippery, so one greedy
episode is exact). "Reaches" is checked, not "ends at": a sampled policy at 0.98 success
can still have a greedy path that bumps into a wall forever, and the final greedy
success of the run is reported beside it.
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
    return with_overrides(cfg, rollout={"alpha": alpha}, trainer={"eval_groups": 1, "keep_weights": 1000})


def greedy_success_by_version(cfg: RunConfig, every: int = 5) -> dict[int, float]:
    from rollart.actors.chat import ChatFormat
    from rollart.engines.base import GenInput
    from rollart.engines.provision import model_dir
    from rollart.engines.torch_engine import TorchGenerationEngine
    from rollart.envs import make_env

    md = model_dir(cfg)
    engine, chat = TorchGenerationEngine(md, threads=1), ChatFormat.load(md)
    env_cfg = cfg.envs["main"]
    out = {}
    files = sorted((Path(cfg.run_dir) / cfg.run / "weights").glob("v*.safetensors"))
    for f in files:
        v = int(f.stem[1:])
        if v % every and v != cfg.trainer.steps:
            continue
        engine.load_weights(f, v)
        env = make_env(env_cfg.type, env_cfg.args)
        obs, _ = env.reset(0)
        ids = chat.first_prompt(env_cfg.instruction or env.instruction, obs)
        success = False
        for _ in range(env_cfg.max_turns):
            legal = env.legal_actions()
            (res,) = engine.generate([GenInput(prompt_ids=ids, greedy=True,
                                               choices=[chat.encode(a) for a in legal])])
            obs, _, term, trunc, info = env.step(chat.decode(res.token_ids).strip())
            success = bool(info.get("success"))
            if term or trunc:
                break
            ids = ids + res.token_ids + chat.next_prompt(res.token_ids, obs)
        out[v] = float(success)
    return out


@pytest.mark.parametrize("alpha,bus", [(0, "memory"), (1, "memory"), (1, "nats")])
async def test_quickstart_learns(tmp_path, alpha, bus, request):
    nats = "memory" if bus == "memory" else request.getfixturevalue("nats_server").url
    cfg = quickstart(tmp_path, f"learn-a{alpha}-{bus}", alpha)
    summary = await train(cfg, nats=nats, resume=False, quiet=True)
    assert summary["steps"] == cfg.trainer.steps and not summary["interrupted"]
    rows = [json.loads(x) for x in (tmp_path / "runs" / cfg.run / "metrics.jsonl").read_text().splitlines()]
    curve = [round(r["success"], 2) for r in rows[::10]]
    greedy = greedy_success_by_version(cfg)
    assert max(greedy.values()) >= 0.9, (summary, curve, greedy)
    assert rows[0]["success"] < 0.5, "it must start from a policy that cannot do the task"
    for r in rows:  # the α rule on recorded data: step v+1 uses min_version >= v - alpha
        v = r["step"] - 1
        assert all(mv >= v - alpha for mv in r["traj_min_versions"]), (r["step"], r["traj_min_versions"])
    if alpha == 0:
        assert all(r["max_staleness"] == 0 for r in rows), "alpha = 0 is on-policy"
    ids = [t for r in rows for t in r["traj_ids"]]
    assert len(ids) == len(set(ids))
    assert msgspec.json.decode((tmp_path / "runs" / cfg.run / "summary.json").read_bytes())["plot"]

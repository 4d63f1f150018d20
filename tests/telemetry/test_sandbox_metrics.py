"""Sandbox start latency and the env-init share of trajectory time, where an operator looks:
``rollart top`` (from the env hosts' heartbeats and the completions) and ``rollart report``
(from ``metrics.jsonl``), beside the paper's 15%."""

from __future__ import annotations

import json
import time

from rich.console import Console

from rollart import messages as m
from rollart.app.monitor import RunMonitor
from rollart.app.queues import snapshot
from rollart.app.report import env_init_share, report
from rollart.bus.codec import encode
from rollart.telemetry.sandboxes import summary


def heartbeat(node: str, stats: dict[str, float]) -> bytes:
    return encode(m.NodeHeartbeat(node_id=node, host="h", pid=1, pool="cpu", roles=["env"],
                                  ts=time.time(), stats=stats))


def test_top_shows_the_env_hosts_sandboxes_and_the_env_init_share():
    run, now = "r1", time.monotonic()
    mon = RunMonitor(run)
    assert mon.sandboxes(now) == "" and mon.env_init_share() is None
    mon.observe(m.subject(run, "node.heartbeat"), heartbeat("n1", {
        "sandbox.warm_hits": 8, "sandbox.cold_starts": 2, "sandbox.start_failures": 1,
        "sandbox.ready": 2, "sandbox.lent": 3, "sandbox.warm_target": 2,
        "sandbox.acquire_p50_s": 0.0004, "sandbox.acquire_p99_s": 0.030,
        "sandbox.start_p50_s": 0.025, "sandbox.start_p99_s": 0.040,
        "env-cpu-1.sandbox_failures": 2}), now=now)
    mon.observe(m.subject(run, "node.heartbeat"), heartbeat("n2", {
        "sandbox.warm_hits": 2, "sandbox.cold_starts": 0, "sandbox.start_p99_s": 0.090,
        "env-cpu-2.sandbox_failures": 1}), now=now)
    line = mon.sandboxes(now)
    assert line.startswith("10 warm / 2 cold acquires (p50 0 ms, p99 30 ms)"), line
    assert "start p50 25 ms p99 90 ms" in line  # the worst host's
    assert "1 start failures, 2 ready, 3 lent, 3 sandbox failures" in line
    done = m.RolloutCompleted(traj_id="t", group_id="g", env="e", seed=0, index_in_group=0,
                              token_ids=[1], response_mask=[1], logprobs=[0.0], token_versions=[0],
                              reward=1.0, success=True, stop_reason="terminated",
                              timings={"reset": 1.0, "generate": 2.5, "step": 0.5, "reward": 0.0,
                                       "wait": 0.0})
    mon.observe(m.subject(run, "rollout.completed"), encode(done), now=now)
    assert mon.env_init_share() == 0.25
    con = Console(width=250, record=True, file=open("/dev/null", "w"))
    con.print(mon.render())
    text = con.export_text()
    assert "25.0% of trajectory time (paper: 15% of a healthy step)" in text
    assert "10 warm / 2 cold acquires" in text
    snap = snapshot(mon, now)
    assert snap["env_init_share"] == 0.25 and snap["sandboxes"] == line


def test_the_report_gives_the_env_init_share_beside_the_papers(tmp_path):
    run = tmp_path / "r"
    run.mkdir()
    rows = [{"step": s, "reward": 0.5, "success": 0.5, "wall_s": float(s), "traj_generate_s": 0.6,
             "traj_step_s": 0.2, "traj_reset_s": 0.2} for s in range(1, 4)]
    rows[1].update(summary([{"sandbox.warm_hits": 30, "sandbox.cold_starts": 2,
                             "sandbox.start_p50_s": 0.04, "sandbox.start_p99_s": 0.05,
                             "sandbox.acquire_p50_s": 0.0001, "sandbox.acquire_p99_s": 0.045,
                             "env-x.sandbox_failures": 1}]))
    (run / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    assert abs(env_init_share(rows) - 0.2) < 1e-9
    assert env_init_share([{"step": 1}]) is None
    text, files = report(run, tmp_path / "out")
    assert "env init (the env, its sandbox, the reset): 20.0% of trajectory time" in text
    assert ("sandboxes (env hosts, at step 2): 30 warm / 2 cold acquires (p50 0 ms, p99 45 ms), "
            "start p50 40 ms p99 50 ms, 0 start failures, 0 ready, 0 lent, 1 sandbox failures") in text
    md = files["report.md"].read_text()
    assert "20.0% of trajectory time, from `metrics.jsonl` (the paper: 15% of a healthy step)" in md
    assert "Sandboxes (env hosts, at step 2): 30 warm / 2 cold" in md
    assert summary([{"sandbox.warm_target": 2, "env-x.sandbox_failures": 0}]) == {}  # none used

"""OpenTelemetry metrics (the ``tracing:`` section's exporter): off installs nothing; on, a
training run's counters and histograms match what the run did, and OTLP reaches a collector."""

from __future__ import annotations

import asyncio
import collections
import contextlib
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from rollart.config import RunConfig, convert
from rollart.config.tracing import TracingConfig
from rollart.node import Node
from rollart.telemetry import otel_metrics, tracing
from tests.actors.sample_actors import EchoEnv, collect, new_run, request
from tests.telemetry.otlp_receiver import OtlpReceiver

ROOT = Path(__file__).resolve().parents[2]


def totals(path: Path) -> dict[str, list[dict]]:
    """Metric name -> the last record of each of its series (values are cumulative)."""
    last: dict[tuple, dict] = {}
    for r in map(json.loads, path.read_text().splitlines()):
        key = (r["name"], json.dumps(r["attributes"], sort_keys=True), r["resource"]["process.pid"])
        if key not in last or r["time_ns"] >= last[key]["time_ns"]:
            last[key] = r
    out: dict[str, list[dict]] = collections.defaultdict(list)
    for r in last.values():
        out[r["name"]].append(r)
    return out


def test_exporter_none_installs_nothing_and_helpers_do_nothing(tmp_path):
    from opentelemetry import metrics

    before = metrics.get_meter_provider()
    stop = otel_metrics.setup_metrics(TracingConfig(), "rollart-test", tmp_path)
    try:
        assert not otel_metrics.enabled()
        assert metrics.get_meter_provider() is before
        assert isinstance(otel_metrics.busy("reward-x"), contextlib.nullcontext)
        otel_metrics.trajectory("completed", "main")
        otel_metrics.staleness([0, 1])
        otel_metrics.redelivery("d", "s")
        otel_metrics.dead_letter("env_setup: x")
        otel_metrics.engine_batch(3, 1, "default")
        otel_metrics.trainer_step(0.5)
        otel_metrics.drop_busy("reward-x")
        assert not otel_metrics.busy_replicas()
    finally:
        stop()
    assert metrics.get_meter_provider() is before
    assert list(tmp_path.iterdir()) == []


def test_without_opentelemetry_metrics_are_off_and_say_what_to_install(tmp_path):
    code = (
        "import sys; sys.modules['opentelemetry'] = None\n"
        "import rollart.actors.reward.actor, rollart.actors.kernel.runtime, rollart.actors.kernel.service\n"
        "from rollart.config.tracing import TracingConfig\n"
        "from rollart.telemetry import otel_metrics, tracing\n"
        "otel_metrics.setup_metrics(TracingConfig(), 'x', '.')()\n"
        "otel_metrics.trajectory('completed', 'main')\n"
        "try:\n"
        "    otel_metrics.setup_metrics(TracingConfig(exporter='jsonl'), 'x', '.')\n"
        "except tracing.TracingUnavailable as e:\n"
        "    print(e)\n")
    env = dict(os.environ, PYTHONPATH=f"{ROOT / 'src'}{os.pathsep}{ROOT}")
    r = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, env=env, capture_output=True,
                       text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    assert "tracing.exporter 'jsonl'" in r.stdout and "pip install 'rollart[trace]'" in r.stdout
    assert list(tmp_path.iterdir()) == []


def test_config_checks_metrics_interval():
    for bad in (0, -1.0, float("nan"), float("inf")):
        with pytest.raises(Exception, match=r"tracing\.metrics_interval_s"):
            convert({"tracing": {"metrics_interval_s": bad}}, RunConfig)
    assert convert({"tracing": {"metrics_interval_s": 0.5}}, RunConfig).tracing.metrics_interval_s == 0.5


async def test_a_training_run_writes_metrics_that_match_it(memory_bus_only, tiny_model, tmp_path):
    from rollart.app.launch import drive_training
    from rollart.node.build import training_actors
    from rollart.node import Node

    run = new_run()
    cfg = convert({"run": run, "run_dir": str(tmp_path / "runs"), "model": {"path": str(tiny_model)},
                   "envs": {"main": {"type": "frozenlake", "max_turns": 4}},
                   "rollout": {"group_size": 4, "batch_groups": 2, "alpha": 1},
                   "trainer": {"steps": 2, "eval_groups": 1},
                   "tracing": {"exporter": "jsonl", "metrics_interval_s": 0.2}}, RunConfig)
    run_path = tmp_path / "runs" / run
    stop_tracing = tracing.setup_tracing(cfg, "rollart-test", run_path)
    stop = otel_metrics.setup_metrics(cfg, "rollart-test", run_path)
    try:
        sched, trainer, actors = training_actors(cfg)
        proxies = [a for a in actors if a.role == "generate"]
        async with Node(memory_bus_only, actors, heartbeat_every=0) as node:
            summary = await asyncio.wait_for(
                drive_training(memory_bus_only, cfg, node, trainer, sched, proxies=proxies), 240)
    finally:
        await asyncio.to_thread(stop)  # the last export
        await asyncio.to_thread(stop_tracing)
    assert summary["steps"] == 2 and not otel_metrics.enabled()
    lines = [json.loads(x) for x in (run_path / "otel-metrics.jsonl").read_text().splitlines()]
    assert len({r["time_ns"] for r in lines}) > 1, "exported periodically, not only at exit"
    assert {r["resource"]["service.name"] for r in lines} == {"rollart-test"}
    got = totals(run_path / "otel-metrics.jsonl")
    rows = [json.loads(x) for x in (run_path / "metrics.jsonl").read_text().splitlines()]
    trained = sum(len(r["traj_ids"]) for r in rows)

    env = next(a for a in actors if a.role == "env")
    outcomes = collections.Counter()
    for r in got["rollart.trajectories"]:
        assert r["kind"] == "counter" and r["attributes"]["env"] == "main"
        outcomes[r["attributes"]["outcome"]] += r["value"]
    assert outcomes["completed"] == env.stats["completed"]
    assert outcomes["cancelled"] == env.stats.get("cancelled", 0)
    assert outcomes["completed"] >= trained + summary["trajectories"]  # + the evaluation's

    (st,) = got["rollart.staleness"]
    assert st["kind"] == "histogram" and st["count"] == trained
    assert st["sum"] == pytest.approx(sum(r["staleness"] * len(r["traj_ids"]) for r in rows))
    steps = [s for s in map(json.loads, (run_path / "traces.jsonl").read_text().splitlines())
             if s["name"] == "trainer.step"]
    by_k = [sum(c) for c in zip(*[s["attributes"]["staleness"] + [0] * 8 for s in steps])]
    assert sum(by_k) == trained and sum(k * n for k, n in enumerate(by_k)) == st["sum"]
    assert st["buckets"][0] == by_k[0] and st["bounds"][0] == 0  # bucket 0: staleness 0

    rows_h, = got["rollart.engine.batch_rows"]
    waiting, = got["rollart.engine.waiting"]
    assert rows_h["sum"] == sum(p.batcher.items for p in proxies) > 0
    assert rows_h["count"] == waiting["count"] == sum(p.batcher.batches for p in proxies)
    assert rows_h["attributes"] == {"pool": "default"}

    (step_s,) = got["rollart.trainer.step_s"]
    assert step_s["count"] == 2 and step_s["sum"] > 0
    busy = got["rollart.reward.busy_fraction"]  # frozenlake has no scorer: idle
    assert busy and all(r["kind"] == "gauge" and r["value"] == 0 for r in busy)


async def test_redeliveries_and_dead_letters_are_counted(memory_bus_only, tmp_path):
    bus, run = memory_bus_only, new_run()
    stop = otel_metrics.setup_metrics(TracingConfig(exporter="jsonl"), "rollart-test", tmp_path)
    try:
        actor = EchoEnv(run=run, settings={"on_request": {"max_deliver": 3}})
        async with Node(bus, [actor], heartbeat_every=0):
            await bus.publish(*request(run, 1, env="reject"))
            await bus.publish(*request(run, 2, env="retry"))  # delivered twice
            await bus.publish(*request(run, 3, env="fail"))  # three times, then dead
            assert len(await collect(bus, run, "rollout.completed", 1)) == 1
            assert len(await collect(bus, run, "dead", 2, deadline=20)) == 2
    finally:
        stop()
    got = totals(tmp_path / "otel-metrics.jsonl")
    red = got["rollart.redeliveries"]
    assert sum(r["value"] for r in red) == 3
    assert {r["attributes"]["durable"] for r in red} == {"echo-on-request"}
    assert {r["attributes"]["subject"] for r in red} == {f"rollart.{run}.rollout.requested.default"}
    dead = {r["attributes"]["kind"]: r for r in got["rollart.dead_letters"]}
    assert {k: r["value"] for k, r in dead.items()} == {"permanent": 1, "exhausted": 1}
    assert dead["exhausted"]["attributes"]["reason"].startswith("failed 3 times")


async def test_reward_busy_fraction_reports_a_service_until_it_stops(memory_bus_only, tmp_path):
    from rollart import messages as m
    from rollart.actors.reward.actor import RewardService

    stop = otel_metrics.setup_metrics(TracingConfig(exporter="jsonl"), "rollart-test", tmp_path)
    try:
        svc = RewardService(run=new_run(), name="reward-busy")
        async with Node(memory_bus_only, [svc], heartbeat_every=0):
            outs = await asyncio.gather(*[svc.request("reward.request", m.RewardRequest(
                traj_id=f"t{i}", scorer="answer_match", response="4", answer="4")) for i in range(30)])
        assert all(o.score == 1.0 for o in outs)
    finally:
        stop()
    (busy,) = got = totals(tmp_path / "otel-metrics.jsonl")["rollart.reward.busy_fraction"]
    assert busy["attributes"] == {"replica": "reward-busy"} and 0 < busy["value"] <= 1, got
    assert not otel_metrics.busy_replicas()


def test_otlp_http_metrics_reach_a_collector(monkeypatch):
    with OtlpReceiver() as rx:
        monkeypatch.setenv("OTEL_EXPORTER_OTLP_ENDPOINT", rx.url)
        monkeypatch.setenv("OTEL_EXPORTER_OTLP_HEADERS", "x-rollart-test=yes")
        monkeypatch.setenv("OTEL_RESOURCE_ATTRIBUTES", "deployment.environment=ci")
        cfg = convert({"tracing": {"exporter": "otlp"}}, RunConfig)
        stop = otel_metrics.setup_metrics(cfg, "rollart-otlp-test", None)
        try:
            for outcome in ("completed", "completed", "cancelled"):
                otel_metrics.trajectory(outcome, "main")
            otel_metrics.staleness([0, 1, 1])
            otel_metrics.engine_batch(4, 2, "default")
            otel_metrics.trainer_step(1.5)
        finally:
            stop()  # the last export
    assert rx.got and all(p == "/v1/metrics" for p, _, _ in rx.got)
    assert all({k.lower(): v for k, v in h.items()}.get("x-rollart-test") == "yes" for _, _, h in rx.got)
    found: dict[str, object] = {}
    for _, req, _ in rx.got:
        for rm in req.resource_metrics:
            res = {a.key: a.value.string_value for a in rm.resource.attributes}
            assert res["service.name"] == "rollart-otlp-test" and res["deployment.environment"] == "ci"
            for sm in rm.scope_metrics:
                for mt in sm.metrics:
                    found[mt.name] = mt
    traj = found["rollart.trajectories"]
    by = {next(a.value.string_value for a in p.attributes if a.key == "outcome"): p.as_int
          for p in traj.sum.data_points}
    assert by == {"completed": 2, "cancelled": 1} and traj.sum.is_monotonic
    (st,) = found["rollart.staleness"].histogram.data_points
    assert (st.count, st.sum) == (3, 2.0)
    (rows,) = found["rollart.engine.batch_rows"].histogram.data_points
    assert (rows.count, rows.sum) == (1, 4.0)
    assert found["rollart.trainer.step_s"].unit == "s"

"""Tracing (the config's ``tracing:`` section): off costs nothing and installs nothing; on, the
spans of a run form connected trees across processes, and OTLP reaches a collector."""

from __future__ import annotations

import asyncio
import collections
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from rollart.config import RunConfig, convert
from rollart.config.tracing import TracingConfig
from rollart.telemetry import tracing
from tests.actors.sample_actors import collect, new_run
from tests.telemetry.otlp_receiver import OtlpReceiver

ROOT = Path(__file__).resolve().parents[2]


async def test_exporter_none_installs_nothing_and_a_run_works(memory_bus_only, tiny_model, tmp_path):
    from opentelemetry import trace

    from rollart.node.build import rollout_actors
    from rollart.node import Node

    before = trace.get_tracer_provider()
    stop = tracing.setup_tracing(TracingConfig(), "rollart-test", tmp_path)
    try:
        assert not tracing.enabled()
        assert isinstance(trace.get_tracer_provider(), trace.ProxyTracerProvider)
        assert trace.get_tracer_provider() is before
        assert tracing.headers() is None and tracing.extract({"traceparent": "x"}) is None
        with tracing.span("x") as sp:
            assert sp is None
        cfg = convert({"run": new_run(), "model": {"path": str(tiny_model)},
                       "envs": {"main": {"type": "frozenlake", "max_turns": 4}},
                       "rollout": {"group_size": 2, "batch_groups": 1}}, RunConfig)
        sched, actors = rollout_actors(cfg, groups=1, bounded=False, keep_results=True)
        async with Node(memory_bus_only, actors, heartbeat_every=0):
            await asyncio.wait_for(sched.all_done.wait(), 120)
        done = await collect(memory_bus_only, cfg.run, "rollout.completed", 2, deadline=2)
        assert len(done) == 2
    finally:
        stop()
    assert not (tmp_path / "traces.jsonl").exists()


def test_without_opentelemetry_rollart_imports_and_tracing_says_what_to_install(tmp_path):
    code = (
        "import sys; sys.modules['opentelemetry'] = None\n"
        "import rollart.actors.env.manager, rollart.actors.generate.proxy, rollart.actors.trainer.actor\n"
        "import rollart.app.cli, rollart.node\n"
        "from rollart.config.tracing import TracingConfig\n"
        "from rollart.telemetry import tracing\n"
        "tracing.setup_tracing(TracingConfig(), 'x', '.')()\n"
        "assert tracing.tracer() is None and tracing.headers() is None\n"
        "try:\n"
        "    tracing.setup_tracing(TracingConfig(exporter='jsonl'), 'x', '.')\n"
        "except tracing.TracingUnavailable as e:\n"
        "    print(e)\n")
    env = dict(os.environ, PYTHONPATH=f"{ROOT / 'src'}{os.pathsep}{ROOT}")
    r = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, env=env, capture_output=True,
                       text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    assert "tracing.exporter 'jsonl'" in r.stdout and "pip install 'rollart[trace]'" in r.stdout


def test_config_checks_sample_and_grpc_needs_its_package(tmp_path):
    with pytest.raises(Exception, match=r"tracing\.sample"):
        convert({"tracing": {"sample": 1.5}}, RunConfig)
    cfg = convert({"tracing": {"exporter": "otlp", "otlp_protocol": "grpc"}}, RunConfig)
    try:
        import opentelemetry.exporter.otlp.proto.grpc  # noqa: F401
    except ImportError:
        with pytest.raises(tracing.TracingUnavailable, match=r"tracing\.otlp_protocol 'grpc'.*pip install"):
            tracing.setup_tracing(cfg, "x", tmp_path)
        assert not tracing.enabled()


def test_jsonl_spans_propagate_through_headers(tmp_path):
    stop = tracing.setup_tracing(TracingConfig(exporter="jsonl"), "svc", tmp_path)
    try:
        with tracing.span("a", {"k": 1}):
            heads = tracing.headers()
        with tracing.attached(heads):
            with tracing.span("b"):
                pass
        with tracing.span("c", links=[heads]):
            pass
    finally:
        stop()
    assert not tracing.enabled()
    spans = {s["name"]: s for s in map(json.loads, (tmp_path / "traces.jsonl").read_text().splitlines())}
    a, b, c = spans["a"], spans["b"], spans["c"]
    tp = heads["traceparent"]
    assert tp.startswith(f"00-{a['trace_id']}-{a['span_id']}-") and int(tp[-2:], 16) & 1  # sampled
    assert b["parent_id"] == a["span_id"] and b["trace_id"] == a["trace_id"]
    assert c["parent_id"] is None and c["links"] == [{"trace_id": a["trace_id"], "span_id": a["span_id"]}]
    assert a["attributes"] == {"k": 1} and a["end_ns"] >= a["start_ns"] > 0
    assert a["resource"] == {"service.name": "svc", "host.name": a["resource"]["host.name"],
                             "process.pid": os.getpid()}


@pytest.mark.slow
def test_a_run_on_two_nodes_writes_connected_trace_trees(tmp_path, tiny_model, nats_server):
    """A trainer node and a generator node (separate processes) on one nats-server: each
    sampled trajectory is one tree, the generator's span a child of the env's ``generate``."""
    run = new_run()
    cfg = tmp_path / "run.yaml"
    cfg.write_text(
        f"run: {run}\n"
        f"run_dir: {tmp_path / 'runs'}\n"
        f"model: {{path: '{tiny_model}'}}\n"
        "node: {heartbeat_every: 0.5}\n"
        "envs: {main: {type: frozenlake, max_turns: 4}}\n"
        "rollout: {group_size: 4, batch_groups: 2, alpha: 1}\n"
        "trainer: {steps: 2, eval_groups: 1}\n"
        "tracing: {exporter: jsonl}\n")
    env = dict(os.environ, PYTHONPATH=f"{ROOT}{os.pathsep}{os.environ.get('PYTHONPATH', '')}")
    node = [sys.executable, "-m", "rollart.node", "--config", str(cfg), "--nats", nats_server.url]
    gen = subprocess.Popen([*node, "--roles", "generate"], cwd=tmp_path, env=env,
                           stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        r = subprocess.run([*node, "--roles", "scheduler,env,reward,trainer"], cwd=tmp_path,
                           env=env, capture_output=True, text=True, timeout=240)
        assert r.returncode == 0, r.stdout + r.stderr
        out, _ = gen.communicate(timeout=60)
        assert gen.returncode == 0, out
    finally:
        if gen.poll() is None:
            gen.kill()
            gen.wait()
    spans = [json.loads(line) for line in
             (tmp_path / "runs" / run / "traces.jsonl").read_text().splitlines()]
    by_trace = collections.defaultdict(list)
    for s in spans:
        by_trace[s["trace_id"]].append(s)
    names = collections.Counter(s["name"] for s in spans)
    assert names["trainer.step"] == 2 and names["policy.load"] >= 2, names
    trajs = [s for s in spans if s["name"] == "trajectory"]
    assert len(trajs) >= 16, names
    services = {s["name"]: s["resource"]["service.name"] for s in spans}
    assert services["trajectory"] == "rollart-node:scheduler,env,reward,trainer"
    assert services["generate.request"] == "rollart-node:generate"
    checked = 0
    for t in trajs:
        tree = by_trace[t["trace_id"]]
        ids = {s["span_id"]: s for s in tree}
        assert t["parent_id"] is None and t["attributes"]["outcome"] in ("completed", "cancelled")
        assert 0 <= t["attributes"]["queue_wait_s"] < 240  # stored in JetStream -> picked up
        assert all(s["parent_id"] in ids for s in tree if s is not t), "orphan spans"
        kinds = collections.Counter(s["name"] for s in tree)
        assert kinds["env.reset"] == 1 and kinds["generate"] >= 1, kinds
        if t["attributes"]["outcome"] != "completed":
            continue
        for g in (s for s in tree if s["name"] == "generate"):
            assert {"turn", "pool", "route", "prompt_tokens", "version"} <= set(g["attributes"])
            served = [s for s in tree if s["name"] == "generate.request" and s["parent_id"] == g["span_id"]]
            assert len(served) >= 1, "the generator's span is a child of the env's generate"
            assert served[0]["resource"]["process.pid"] != g["resource"]["process.pid"]
            wait_ns = served[0]["attributes"]["queue_wait_s"] * 1e9  # arrival -> engine batch
            assert 0 <= wait_ns <= served[0]["end_ns"] - served[0]["start_ns"]
            checked += 1
    assert checked >= 16
    steps = [s for s in spans if s["name"] == "trainer.step"]
    traj_ids = {t["span_id"] for t in trajs}
    for st in steps:
        assert len(st["links"]) == 8 and all(ln["span_id"] in traj_ids for ln in st["links"])
        kids = {s["name"] for s in by_trace[st["trace_id"]] if s["parent_id"] == st["span_id"]}
        assert {"get_batch", "train", "checkpoint", "publish"} <= kids, kids


def test_otlp_http_reaches_a_collector(monkeypatch):
    with OtlpReceiver() as rx:
        monkeypatch.setenv("OTEL_EXPORTER_OTLP_ENDPOINT", rx.url)
        cfg = convert({"tracing": {"exporter": "otlp"}}, RunConfig)
        stop = tracing.setup_tracing(cfg, "rollart-otlp-test", None)
        try:
            with tracing.span("trainer.step", {"version": 3}):
                with tracing.span("train"):
                    pass
        finally:
            stop()  # flushes
    assert rx.got and all(p == "/v1/traces" for p, _, _ in rx.got)
    names, services = set(), set()
    for _, req, _ in rx.got:
        for rs in req.resource_spans:
            services |= {a.value.string_value for a in rs.resource.attributes if a.key == "service.name"}
            for ss in rs.scope_spans:
                names |= {s.name for s in ss.spans}
    assert names == {"trainer.step", "train"} and services == {"rollart-otlp-test"}


def test_otlp_grpc_reaches_a_collector(monkeypatch):
    """``otlp_protocol: grpc``: spans reach a real gRPC server implementing the OTLP trace
    service (the official ``opentelemetry-proto`` stubs)."""
    from concurrent import futures

    import grpc
    from opentelemetry.proto.collector.trace.v1 import trace_service_pb2, trace_service_pb2_grpc

    got = []

    class Service(trace_service_pb2_grpc.TraceServiceServicer):
        def Export(self, request, context):  # noqa: N802 - the generated name
            got.append(request)
            return trace_service_pb2.ExportTraceServiceResponse()

    server = grpc.server(futures.ThreadPoolExecutor(max_workers=2))
    trace_service_pb2_grpc.add_TraceServiceServicer_to_server(Service(), server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    try:
        monkeypatch.setenv("OTEL_EXPORTER_OTLP_ENDPOINT", f"http://127.0.0.1:{port}")
        monkeypatch.setenv("OTEL_EXPORTER_OTLP_INSECURE", "true")
        cfg = convert({"tracing": {"exporter": "otlp", "otlp_protocol": "grpc"}}, RunConfig)
        stop = tracing.setup_tracing(cfg, "rollart-grpc-test", None)
        try:
            with tracing.span("trajectory", {"traj_id": "g1-0"}):
                with tracing.span("env.reset"):
                    pass
        finally:
            stop()  # flushes
    finally:
        server.stop(None)
    names = {s.name for req in got for rs in req.resource_spans for ss in rs.scope_spans
             for s in ss.spans}
    assert names == {"trajectory", "env.reset"}, names

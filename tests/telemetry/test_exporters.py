"""One OpenTelemetry exporter chooser (rollart.telemetry.tracing.choose_exporter): spans and
metrics go where ``tracing.exporter`` says, by the same rule, with the real SDK classes."""

from __future__ import annotations

import pytest

from rollart.config import RunConfig, convert
from rollart.telemetry import otel_metrics, tracing

pytest.importorskip("opentelemetry.sdk")

SIGNALS = {"trace": (tracing.JsonlSpanExporter, "traces.jsonl"),
           "metric": (otel_metrics._jsonl_exporter, "otel-metrics.jsonl")}


def chosen(exporter: str, signal: str, run_dir=None, protocol: str = "http"):
    cfg = convert({"tracing": {"exporter": exporter, "otlp_protocol": protocol}}, RunConfig).tracing
    jsonl, name = SIGNALS[signal]
    return tracing.choose_exporter(cfg, run_dir, signal=signal, jsonl=jsonl, jsonl_name=name)


@pytest.mark.parametrize("protocol", ["http", "grpc"])
def test_both_signals_get_the_same_kind_of_exporter(protocol, tmp_path):
    if protocol == "grpc":
        pytest.importorskip("opentelemetry.exporter.otlp.proto.grpc")
    for signal, infix in (("trace", "Span"), ("metric", "Metric")):
        console = chosen("console", signal)
        assert type(console).__name__ == f"Console{infix}Exporter"
        otlp = chosen("otlp", signal, protocol=protocol)
        assert type(otlp).__name__ == f"OTLP{infix}Exporter"
        assert f".proto.{protocol}." in type(otlp).__module__
        jsonl = chosen("jsonl", signal, tmp_path)
        jsonl.shutdown()
        assert (tmp_path / SIGNALS[signal][1]).exists()


def test_jsonl_needs_the_run_folder():
    for signal in SIGNALS:
        with pytest.raises(ValueError, match="tracing.exporter 'jsonl' needs the run's folder"):
            chosen("jsonl", signal)

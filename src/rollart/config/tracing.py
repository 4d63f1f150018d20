"""The ``tracing:`` section of a run's config: OpenTelemetry spans of trajectories, generation
and trainer steps (see :mod:`rollart.telemetry.tracing`), and metrics exported the same way
(:mod:`rollart.telemetry.otel_metrics`). Off by default (``exporter: none``: no SDK is
installed and the spans and metrics cost nothing)."""

from __future__ import annotations

import math
from typing import Literal

from rollart.config.base import Base


class TracingConfig(Base):
    exporter: Literal["none", "console", "jsonl", "otlp"] = "none"
    """Where spans and metrics go: ``none`` (neither), ``console`` (stdout), ``jsonl``
    (``<run_dir>/<run>/traces.jsonl``, one span a line; ``otel-metrics.jsonl``) or ``otlp`` (an OpenTelemetry
    collector; the standard ``OTEL_EXPORTER_OTLP_*`` environment variables apply). Needs
    ``pip install 'rollart[trace]'``."""
    otlp_protocol: Literal["http", "grpc"] = "http"
    """OTLP transport: ``http`` (protobuf over HTTP, port 4318) or ``grpc`` (port 4317; needs
    ``pip install opentelemetry-exporter-otlp-proto-grpc``)."""
    sample: float = 1.0
    """Fraction of traces kept, in [0, 1] (by trace id; a span follows its parent's choice)."""
    metrics_interval_s: float = 10.0
    """Seconds between two exports of the OpenTelemetry metrics (same exporter as the spans;
    ``jsonl``: ``otel-metrics.jsonl``); the last export is at exit."""

    def __post_init__(self) -> None:
        if not (math.isfinite(self.sample) and 0.0 <= self.sample <= 1.0):
            raise ValueError(f"tracing.sample must be in [0, 1] (it is {self.sample!r})")
        if not (math.isfinite(self.metrics_interval_s) and self.metrics_interval_s > 0):
            raise ValueError(f"tracing.metrics_interval_s must be > 0 (it is "
                             f"{self.metrics_interval_s!r})")


class TelemetryConfig(Base):
    """The ``telemetry:`` section: the run's curves in the tools researchers look at, besides
    ``metrics.jsonl`` (:mod:`rollart.telemetry.loggers`). Off by default."""

    loggers: list[Literal["tensorboard", "wandb", "mlflow"]] = []
    """Where every step's metrics also go: ``tensorboard`` (``<run_dir>/<run>/tensorboard``;
    needs ``tensorboard``), ``wandb`` (offline in ``<run_dir>/<run>/wandb`` unless
    ``WANDB_API_KEY`` is set; needs ``wandb``), ``mlflow`` (``mlflow_uri``; needs ``mlflow``
    or ``mlflow-skinny``). ``pip install 'rollart[loggers]'`` installs all three."""
    wandb_project: str = "rollart"
    """The wandb project of the run (the run's name is the wandb run's name and id)."""
    mlflow_uri: str = ""
    """MLflow tracking URI; empty: a folder store, ``<run_dir>/<run>/mlruns``."""
    mlflow_experiment: str = "rollart"
    """The MLflow experiment the run logs under."""

    def __post_init__(self) -> None:
        if len(set(self.loggers)) != len(self.loggers):
            raise ValueError(f"telemetry.loggers names a logger twice: {self.loggers}")

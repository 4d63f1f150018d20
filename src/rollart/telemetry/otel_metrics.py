"""OpenTelemetry metrics (the config's ``tracing:`` section, exported the same ways as spans).

:func:`setup_metrics` installs an SDK meter provider for this process (only when
``tracing.exporter`` is not ``none``), read every ``tracing.metrics_interval_s`` seconds by
the SDK's reader thread and flushed at shutdown. Until then every helper here is one module
global None check, and ``opentelemetry`` is imported only by :func:`setup_metrics`. The
provider is this module's own: the global one (``opentelemetry.metrics``) is never replaced.

Instruments (cumulative): ``rollart.trajectories`` {outcome, env}, ``rollart.staleness``,
``rollart.redeliveries`` {durable, subject}, ``rollart.dead_letters`` {reason, kind},
``rollart.engine.batch_rows`` and ``rollart.engine.waiting`` {pool},
``rollart.reward.busy_fraction`` {replica}, ``rollart.trainer.step_s``.
"""

from __future__ import annotations

import contextlib
import json
import os
import socket
import threading
import time
from collections.abc import Callable, Iterable
from pathlib import Path
from types import SimpleNamespace
from typing import Any

from rollart.telemetry.tracing import PIP, TracingUnavailable, choose_exporter

_m: Any = None
"""The instruments while metrics are set up, else None (every helper is then a no-op)."""
_busy: dict[str, Busy] = {}
"""Replica name -> its :class:`Busy` (the ``rollart.reward.busy_fraction`` gauge reads them)."""
_NULL = contextlib.nullcontext()


def enabled() -> bool:
    return _m is not None


def trajectory(outcome: str, env: str) -> None:
    """One trajectory ended on an EnvManager: ``completed``, ``cancelled`` (its group no
    longer needed it), ``rejected`` (dead-lettered), ``error`` (retried) or ``interrupted``."""
    if _m is not None:
        _m.trajectories.add(1, {"outcome": outcome, "env": env})


def staleness(values: Iterable[int]) -> None:
    """The staleness (policy versions) of each sample of a trainer step."""
    if _m is not None:
        for v in values:
            _m.staleness.record(v)


def redelivery(durable: str, subject: str) -> None:
    """A consumer got a JetStream message delivered more than once."""
    if _m is not None:
        _m.redeliveries.add(1, {"durable": durable, "subject": subject})


def reason_kind(reason: str) -> str:
    """The stable leading token of a failure reason (``env_setup: ...`` → ``env_setup``):
    dead letters are counted by it here, in the trainer's ledger and in ``rollart top``."""
    head = reason.split(":", 1)[0].strip()
    if head and len(head) <= 40 and " " not in head:
        return head
    return " ".join(reason.split()[:4])[:60] or "unknown"


def dead_letter(reason: str, kind: str = "permanent") -> None:
    """A dead letter was published (``reason``: counted by its kind, ``env_setup: ...`` ->
    ``env_setup``)."""
    if _m is not None:
        _m.dead_letters.add(1, {"reason": reason_kind(reason), "kind": kind})


def engine_batch(rows: int, waiting: int, pool: str) -> None:
    """An engine call of ``rows`` requests; ``waiting``: requests left queued when it was cut."""
    if _m is not None:
        a = {"pool": pool}
        _m.batch_rows.record(rows, a)
        _m.waiting.record(waiting, a)


def trainer_step(seconds: float) -> None:
    if _m is not None:
        _m.step_s.record(seconds)


class Busy:
    """A context manager around work (overlapping work counts once): the seconds during which
    at least one piece was in hand. Entered on the event loop, read by the reader's thread."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._n, self._since, self._total = 0, 0.0, 0.0
        self.gone = False
        """Its service stopped: reported once more, then forgotten."""
        self._seen = (0.0, time.monotonic())  # busy seconds and time at the last reading

    def __enter__(self) -> None:
        with self._lock:
            if self._n == 0:
                self._since = time.monotonic()
            self._n += 1

    def __exit__(self, *exc: object) -> None:
        with self._lock:
            self._n -= 1
            if self._n == 0:
                self._total += time.monotonic() - self._since

    def fraction(self) -> float:
        """The busy fraction of the wall time since the last call."""
        with self._lock:
            now = time.monotonic()
            total = self._total + (now - self._since if self._n else 0.0)
        (before, at), self._seen = self._seen, (total, now)
        return (total - before) / max(now - at, 1e-9)


def busy(replica: str) -> Any:
    """What a service wraps its work in (``with busy:``): a :class:`Busy` that the gauge
    ``rollart.reward.busy_fraction`` reports as ``replica``; a null context when off."""
    if _m is None:
        return _NULL
    _busy[replica] = b = Busy()
    return b


def busy_replicas() -> list[str]:
    """The replicas whose busy fraction is still reported (dropped ones until their last export)."""
    return list(_busy)


def drop_busy(replica: str) -> None:
    """The service stopped: its last interval is still reported at the next export."""
    b = _busy.get(replica)
    if b is not None:
        b.gone = True


# -- set-up ------------------------------------------------------------------------
def setup_metrics(cfg: Any, service_name: str, run_dir: str | Path | None) -> Callable[[], None]:
    """Install the meter provider ``cfg`` (a :class:`rollart.config.TracingConfig`, or a
    RunConfig) asks for; returns a callable that flushes and shuts it down (call it at exit).
    ``exporter: none``: installs nothing, returns a no-op. ``run_dir``: the run's folder
    (``jsonl`` appends to ``otel-metrics.jsonl`` there)."""
    global _m
    cfg = getattr(cfg, "tracing", cfg)
    if cfg is None or cfg.exporter == "none":
        return lambda: None
    try:  # optional dependency: the OpenTelemetry SDK, only once metrics are set up
        from opentelemetry.metrics import Observation
        from opentelemetry.sdk.metrics import MeterProvider
        from opentelemetry.sdk.metrics.export import PeriodicExportingMetricReader
        from opentelemetry.sdk.resources import Resource
    except ImportError as e:
        raise TracingUnavailable(
            f"tracing.exporter {cfg.exporter!r} needs the OpenTelemetry SDK, which is not "
            f"installed ({e}): {PIP}, or set tracing.exporter: none") from None

    resource = Resource.create({"service.name": service_name, "host.name": socket.gethostname(),
                                "process.pid": os.getpid()})
    exporter = choose_exporter(cfg, run_dir, signal="metric", jsonl=_jsonl_exporter,
                               jsonl_name="otel-metrics.jsonl")
    reader = PeriodicExportingMetricReader(exporter,
                                           export_interval_millis=cfg.metrics_interval_s * 1e3)
    provider = MeterProvider(resource=resource, metric_readers=[reader])
    meter = provider.get_meter("rollart")

    def busy_fraction(options: Any) -> list[Any]:
        out = []
        for r, b in list(_busy.items()):
            out.append(Observation(b.fraction(), {"replica": r}))
            if b.gone and _busy.get(r) is b:
                del _busy[r]
        return out

    i = SimpleNamespace()
    i.trajectories = meter.create_counter(
        "rollart.trajectories", "{trajectory}", "Trajectories ended on EnvManagers, by outcome")
    i.staleness = meter.create_histogram(
        "rollart.staleness", "{version}", "Per trained sample: trained version minus the oldest "
        "policy version of its tokens", explicit_bucket_boundaries_advisory=[0, 1, 2, 3, 4, 8, 16])
    i.redeliveries = meter.create_counter(
        "rollart.redeliveries", "{message}", "JetStream messages delivered more than once")
    i.dead_letters = meter.create_counter(
        "rollart.dead_letters", "{message}", "Dead letters published, by reason kind")
    rows = [1, 2, 4, 8, 16, 32, 64, 128, 256, 512]
    i.batch_rows = meter.create_histogram(
        "rollart.engine.batch_rows", "{request}", "Requests per generation engine call",
        explicit_bucket_boundaries_advisory=rows)
    i.waiting = meter.create_histogram(
        "rollart.engine.waiting", "{request}", "Requests left waiting when an engine batch was cut",
        explicit_bucket_boundaries_advisory=[0, *rows])
    i.step_s = meter.create_histogram(
        "rollart.trainer.step_s", "s", "Trainer step wall time (batch wait, train, checkpoint, "
        "publish)", explicit_bucket_boundaries_advisory=[0.1, 0.5, 1, 2, 5, 10, 30, 60, 120, 300, 600])
    meter.create_observable_gauge(
        "rollart.reward.busy_fraction", [busy_fraction], "1",
        "Fraction of wall time a RewardService had a request in hand, per export interval")
    _busy.clear()
    _m = mine = i

    def shutdown() -> None:
        global _m
        current = _m is mine
        if current:
            _m = None
        provider.shutdown()  # a last collection and export
        if current:
            _busy.clear()

    return shutdown


def point_records(data: Any) -> list[dict[str, Any]]:
    """The data points of an SDK ``MetricsData`` as JSON-able dicts (``otel-metrics.jsonl``)."""
    from opentelemetry.sdk.metrics.export import Histogram, Sum  # optional dependency

    out = []
    for rm in data.resource_metrics:
        res = rm.resource.attributes
        resource = {k: res.get(k) for k in ("service.name", "host.name", "process.pid")}
        for sm in rm.scope_metrics:
            for mt in sm.metrics:
                d = mt.data
                kind = ("histogram" if isinstance(d, Histogram) else
                        "counter" if isinstance(d, Sum) and d.is_monotonic else
                        "sum" if isinstance(d, Sum) else "gauge")
                for p in d.data_points:
                    r = {"name": mt.name, "kind": kind, "unit": mt.unit,
                         "attributes": dict(p.attributes or {})}
                    if kind == "histogram":
                        r.update(count=p.count, sum=p.sum, min=p.min, max=p.max,
                                 bounds=list(p.explicit_bounds), buckets=list(p.bucket_counts))
                    else:
                        r["value"] = p.value
                    r.update(start_ns=getattr(p, "start_time_unix_nano", None),
                             time_ns=p.time_unix_nano, resource=resource)
                    out.append(r)
    return out


def _jsonl_exporter(path: Path) -> Any:
    """A metric exporter appending one JSON object per data point per export (from the
    reader's thread, never on the event loop); processes sharing a run folder append to the
    same file, each export one ``write`` on an ``O_APPEND`` descriptor. Values are cumulative
    since the process started: a series' last line (per ``resource.process.pid``) is its total."""
    from opentelemetry.sdk.metrics.export import MetricExporter, MetricExportResult  # optional dependency

    class JsonlMetricExporter(MetricExporter):
        def __init__(self, p: Path) -> None:
            super().__init__()
            p.parent.mkdir(parents=True, exist_ok=True)
            self._fd = os.open(p, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
            self._lock = threading.Lock()

        def export(self, metrics_data: Any, timeout_millis: float = 10_000, **kw: Any) -> Any:
            data = "".join(json.dumps(r, default=str) + "\n" for r in point_records(metrics_data))
            with self._lock:
                if self._fd < 0:
                    return MetricExportResult.FAILURE
                if data:
                    os.write(self._fd, data.encode())
            return MetricExportResult.SUCCESS

        def force_flush(self, timeout_millis: float = 10_000) -> bool:
            return True

        def shutdown(self, timeout_millis: float = 30_000, **kw: Any) -> None:
            with self._lock:
                if self._fd >= 0:
                    os.close(self._fd)
                    self._fd = -1

    return JsonlMetricExporter(path)

"""OpenTelemetry tracing (the config's ``tracing:`` section).

:func:`setup_tracing` installs an SDK tracer provider for this process (only when
``tracing.exporter`` is not ``none``); every helper here is a cheap no-op until then, and
``opentelemetry`` is imported only by :func:`setup_tracing` (it is the optional extra
``rollart[trace]``). The provider is this module's own: rollart never replaces the global
one (``opentelemetry.trace.get_tracer_provider()``).

Context crosses processes in message headers as W3C ``traceparent``: :func:`headers` (or
:func:`inject`) on the sending side, :func:`extract` / :func:`attached` / ``span(...,
parent=headers)`` on the receiving side.

Spans: ``trajectory`` (children ``env.reset``, ``generate`` per turn, ``env.step``,
``reward``) on the EnvManager; ``generate.request`` (a child of the EnvManager's
``generate``), ``generate.batch`` and ``policy.load`` on the generator; ``trainer.step``
(children ``get_batch``, ``train``, ``checkpoint``, ``publish``; links to the trajectories
it trained) on the trainer.
"""

from __future__ import annotations

import contextlib
import importlib
import json
import os
import socket
import threading
from pathlib import Path
from typing import Any, Callable

TRACEPARENT = "traceparent"
PIP = "pip install 'rollart[trace]'"

_tracer: Any = None
"""The SDK tracer while tracing is set up, else None (every helper is then a no-op)."""
_NULL = contextlib.nullcontext()


class TracingUnavailable(ValueError):
    """Tracing is configured but its packages are not installed."""


def enabled() -> bool:
    return _tracer is not None


def tracer() -> Any:
    """The tracer of this process: the SDK's once :func:`setup_tracing` installed one, else the
    API's no-op tracer (``opentelemetry`` installed) or None."""
    if _tracer is not None:
        return _tracer
    try:  # optional dependency: opentelemetry (rollart[trace])
        from opentelemetry import trace
    except ImportError:
        return None
    return trace.NoOpTracer()


def span(name: str, attributes: dict[str, Any] | None = None, *, parent: Any = None,
         links: list[dict[str, str]] | None = None) -> Any:
    """A context manager: span ``name``, current inside it (``with span(...) as sp``: the span,
    or None when tracing is off). ``parent``: headers with a ``traceparent`` (or a context);
    None: the current span. ``links``: headers of spans to link to."""
    if _tracer is None:
        return _NULL
    ctx = extract(parent) if isinstance(parent, dict) else parent
    return _tracer.start_as_current_span(name, context=ctx, attributes=attributes,
                                         links=_links(links) if links else None)


def _links(headers: list[dict[str, str]]) -> list[Any]:
    from opentelemetry import trace  # optional dependency

    out = []
    for h in headers:
        sc = trace.get_current_span(extract(h)).get_span_context()
        if sc.is_valid:
            out.append(trace.Link(sc))
    return out


def add_links(sp: Any, headers: list[dict[str, str]]) -> None:
    """Link span ``sp`` (None: tracing off) to the spans whose headers are given."""
    if sp is None or _tracer is None:
        return
    for link in _links(headers):
        sp.add_link(link.context)


def inject(headers: dict[str, str]) -> dict[str, str]:
    """Add the current context's ``traceparent`` to ``headers`` (nothing when tracing is off)."""
    if _tracer is not None:
        from opentelemetry.propagate import inject as _inject  # optional dependency

        _inject(headers)
    return headers


def headers() -> dict[str, str] | None:
    """The current context as headers (``{"traceparent": ...}``), or None when tracing is off
    or no span is current."""
    if _tracer is None:
        return None
    return inject({}) or None


def extract(headers: dict[str, str] | None) -> Any:
    """The context carried by ``headers`` (None when tracing is off)."""
    if _tracer is None:
        return None
    from opentelemetry.propagate import extract as _extract  # optional dependency

    return _extract(headers or {})


def attached(headers: dict[str, str] | None) -> Any:
    """A context manager making the context in ``headers`` current (a null one when tracing
    is off or the headers carry none)."""
    if _tracer is None or not headers or TRACEPARENT not in headers:
        return _NULL
    return _Attached(headers)


class _Attached:
    def __init__(self, headers: dict[str, str]) -> None:
        self.headers = headers

    def __enter__(self) -> None:
        from opentelemetry import context  # optional dependency

        self.token = context.attach(extract(self.headers))

    def __exit__(self, *exc: Any) -> None:
        from opentelemetry import context  # optional dependency

        context.detach(self.token)


# -- set-up ------------------------------------------------------------------------
def setup_tracing(cfg: Any, service_name: str, run_dir: str | Path | None) -> Callable[[], None]:
    """Install the tracer provider ``cfg`` (a :class:`rollart.config.TracingConfig`, or a
    RunConfig) asks for; returns a callable that flushes and shuts it down (call it at exit).
    ``exporter: none``: installs nothing, returns a no-op. ``run_dir``: the run's folder
    (``jsonl`` writes ``traces.jsonl`` there)."""
    global _tracer
    cfg = getattr(cfg, "tracing", cfg)
    if cfg is None or cfg.exporter == "none":
        return lambda: None
    try:  # optional dependency: opentelemetry (rollart[trace])
        from opentelemetry import trace
        from opentelemetry.sdk.resources import Resource
        from opentelemetry.sdk.trace import TracerProvider
        from opentelemetry.sdk.trace.export import BatchSpanProcessor
        from opentelemetry.sdk.trace.sampling import ParentBased, TraceIdRatioBased
    except ImportError as e:
        raise TracingUnavailable(
            f"tracing.exporter {cfg.exporter!r} needs the OpenTelemetry SDK, which is not "
            f"installed ({e}): {PIP}, or set tracing.exporter: none") from None
    exporter = choose_exporter(cfg, run_dir, signal="trace", jsonl=JsonlSpanExporter,
                               jsonl_name="traces.jsonl")
    resource = Resource.create({"service.name": service_name, "host.name": socket.gethostname(),
                                "process.pid": os.getpid()})
    provider = TracerProvider(resource=resource,
                              sampler=ParentBased(TraceIdRatioBased(cfg.sample)))
    provider.add_span_processor(BatchSpanProcessor(exporter))
    _tracer = provider.get_tracer("rollart")
    del trace
    mine = _tracer

    def shutdown() -> None:
        global _tracer
        if _tracer is mine:
            _tracer = None
        provider.shutdown()  # flushes

    return shutdown


_SIGNALS = {"trace": ("opentelemetry.sdk.trace.export", "Span"),
            "metric": ("opentelemetry.sdk.metrics.export", "Metric")}
"""Per OpenTelemetry signal: the SDK module of its console exporter, its class names' infix."""


def choose_exporter(cfg: Any, run_dir: str | Path | None, *, signal: str,
                    jsonl: Callable[[Path], Any], jsonl_name: str) -> Any:
    """The OpenTelemetry exporter of ``tracing.exporter`` for one signal (``"trace"`` or
    ``"metric"``): spans and metrics go to the same place, chosen here once. ``jsonl(path)``
    makes the signal's JSON-lines exporter, writing ``<run_dir>/<jsonl_name>``; ``otlp``
    takes its endpoint, headers and timeout from the ``OTEL_EXPORTER_OTLP_*`` variables."""
    sdk_module, kind = _SIGNALS[signal]
    if cfg.exporter == "console":  # optional dependency: the SDK (checked by the caller)
        return getattr(importlib.import_module(sdk_module), f"Console{kind}Exporter")()
    if cfg.exporter == "jsonl":
        if run_dir is None:
            raise ValueError("tracing.exporter 'jsonl' needs the run's folder")
        return jsonl(Path(run_dir) / jsonl_name)
    proto = cfg.otlp_protocol
    try:  # optional dependency: the OTLP exporter of this protocol
        module = importlib.import_module(f"opentelemetry.exporter.otlp.proto.{proto}.{signal}_exporter")
    except ImportError:
        if proto == "grpc":
            raise TracingUnavailable(
                "tracing.otlp_protocol 'grpc' needs the OTLP gRPC exporter, which is not "
                "installed: pip install opentelemetry-exporter-otlp-proto-grpc, or set "
                "tracing.otlp_protocol: http") from None
        raise TracingUnavailable(
            f"tracing.exporter 'otlp' needs the OTLP HTTP exporter, which is not installed: "
            f"{PIP}") from None
    return getattr(module, f"OTLP{kind}Exporter")()


def span_record(s: Any) -> dict[str, Any]:
    """One finished SDK span as a JSON-able dict (a line of ``traces.jsonl``)."""
    ctx, parent = s.context, s.parent
    res = s.resource.attributes if s.resource is not None else {}
    return {
        "name": s.name, "trace_id": f"{ctx.trace_id:032x}", "span_id": f"{ctx.span_id:016x}",
        "parent_id": f"{parent.span_id:016x}" if parent is not None else None,
        "start_ns": s.start_time, "end_ns": s.end_time, "kind": s.kind.name,
        "status": s.status.status_code.name,
        "attributes": dict(s.attributes or {}),
        "links": [{"trace_id": f"{ln.context.trace_id:032x}",
                   "span_id": f"{ln.context.span_id:016x}"} for ln in (s.links or ())],
        "resource": {k: res.get(k) for k in ("service.name", "host.name", "process.pid")},
    }


def _jsonl_exporter_base() -> type:
    from opentelemetry.sdk.trace.export import SpanExporter  # optional dependency

    return SpanExporter


class JsonlSpanExporter:
    """Appends finished spans to a file, one JSON object a line (called from the SDK's batch
    processor thread, never on the event loop). Processes sharing a run folder append to the
    same file: each batch is one ``write`` on an ``O_APPEND`` descriptor."""

    def __new__(cls, path: Path) -> Any:
        base = _jsonl_exporter_base()

        class _Exporter(base):  # type: ignore[misc, valid-type]
            def __init__(self, p: Path) -> None:
                p.parent.mkdir(parents=True, exist_ok=True)
                self.path = p
                self._fd = os.open(p, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
                self._lock = threading.Lock()

            def export(self, spans: Any) -> Any:
                from opentelemetry.sdk.trace.export import SpanExportResult  # optional dependency

                data = "".join(json.dumps(span_record(s), default=str) + "\n" for s in spans)
                with self._lock:
                    if self._fd < 0:
                        return SpanExportResult.FAILURE
                    os.write(self._fd, data.encode())
                return SpanExportResult.SUCCESS

            def shutdown(self) -> None:
                with self._lock:
                    if self._fd >= 0:
                        os.close(self._fd)
                        self._fd = -1

            def force_flush(self, timeout_millis: int = 30000) -> bool:
                return True

        return _Exporter(path)

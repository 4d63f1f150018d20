"""An in-test OTLP/HTTP receiver: a real HTTP server that decodes what the OTLP exporters POST
(``/v1/traces``, ``/v1/metrics``) with opentelemetry-proto and answers as a collector does."""

from __future__ import annotations

import http.server
import threading


def _messages(path: str):
    if path == "/v1/metrics":
        from opentelemetry.proto.collector.metrics.v1.metrics_service_pb2 import (
            ExportMetricsServiceRequest,
            ExportMetricsServiceResponse,
        )

        return ExportMetricsServiceRequest, ExportMetricsServiceResponse
    from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import (
        ExportTraceServiceRequest,
        ExportTraceServiceResponse,
    )

    return ExportTraceServiceRequest, ExportTraceServiceResponse


class OtlpReceiver:
    """``with OtlpReceiver() as rx``: ``rx.url`` to export to; ``rx.got``: (path, decoded
    request, headers) per POST, in arrival order."""

    def __init__(self) -> None:
        self.got: list[tuple[str, object, dict[str, str]]] = []
        got = self.got

        class Handler(http.server.BaseHTTPRequestHandler):
            def do_POST(self):  # noqa: N802 - http.server's name
                req_type, resp_type = _messages(self.path)
                req = req_type()
                req.ParseFromString(self.rfile.read(int(self.headers["Content-Length"])))
                got.append((self.path, req, dict(self.headers)))
                data = resp_type().SerializeToString()
                self.send_response(200)
                self.send_header("Content-Type", "application/x-protobuf")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def log_message(self, *a):
                pass

        self._srv = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self._srv.server_port}"

    def __enter__(self) -> OtlpReceiver:
        threading.Thread(target=self._srv.serve_forever, daemon=True).start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._srv.shutdown()
        self._srv.server_close()

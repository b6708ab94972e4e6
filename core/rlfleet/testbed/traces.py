"""An OTLP/HTTP trace receiver for the bed: what the operators export, decoded and kept.

The operators export spans with the standard OpenTelemetry SDK wherever
`OTEL_EXPORTER_OTLP_ENDPOINT` points; this receiver takes the protocol's own protobuf
(`ExportTraceServiceRequest` on `POST /v1/traces`) so tests can read the spans back.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

from google.protobuf.message import DecodeError
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import (
    ExportTraceServiceRequest,
    ExportTraceServiceResponse,
)
from opentelemetry.proto.common.v1.common_pb2 import AnyValue


@dataclass(frozen=True)
class Span:
    service: str
    name: str
    trace_id: str
    span_id: str
    parent_id: str  # empty for a trace's root
    attributes: dict[str, str | int | float | bool]
    seconds: float  # from its start to its end


def _value(value: AnyValue) -> str | int | float | bool:
    return getattr(value, value.WhichOneof("value") or "string_value")


def decode(body: bytes) -> list[Span]:
    request = ExportTraceServiceRequest.FromString(body)
    spans = []
    for resource_spans in request.resource_spans:
        resource = {a.key: _value(a.value) for a in resource_spans.resource.attributes}
        for scope_spans in resource_spans.scope_spans:
            for span in scope_spans.spans:
                spans.append(
                    Span(
                        service=str(resource.get("service.name", "")),
                        name=span.name,
                        trace_id=span.trace_id.hex(),
                        span_id=span.span_id.hex(),
                        parent_id=span.parent_span_id.hex(),
                        attributes={a.key: _value(a.value) for a in span.attributes},
                        seconds=(span.end_time_unix_nano - span.start_time_unix_nano) / 1e9,
                    )
                )
    return spans


class TraceReceiver:
    """Listens on loopback; `env` points an OpenTelemetry SDK at it."""

    def __init__(self) -> None:
        self.spans: list[Span] = []
        self.rejected = 0
        lock = threading.Lock()
        receiver = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:
                body = self.rfile.read(int(self.headers.get("Content-Length", 0)))
                if self.path != "/v1/traces":
                    self.send_error(404)
                    return
                try:
                    spans = decode(body)
                except DecodeError:  # a malformed export: counted, and refused
                    with lock:
                        receiver.rejected += 1
                    self.send_error(400)
                    return
                with lock:
                    receiver.spans.extend(spans)
                reply = ExportTraceServiceResponse().SerializeToString()
                self.send_response(200)
                self.send_header("Content-Type", "application/x-protobuf")
                self.send_header("Content-Length", str(len(reply)))
                self.end_headers()
                self.wfile.write(reply)

            def log_message(self, *args) -> None:
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    @property
    def env(self) -> dict[str, str]:
        return {
            "OTEL_EXPORTER_OTLP_ENDPOINT": f"http://127.0.0.1:{self.server.server_port}",
            "OTEL_BSP_SCHEDULE_DELAY": "500",  # export within half a second, not five
        }

    def close(self) -> None:
        self.server.shutdown()

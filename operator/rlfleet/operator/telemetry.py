"""The operator's Prometheus metrics and OpenTelemetry tracing."""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager

from opentelemetry import trace
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import BatchSpanProcessor
from prometheus_client import Counter, Gauge, Histogram, start_http_server

from rlfleet.api.meta import Condition

RECONCILE_SECONDS = Histogram(
    "rlfleet_operator_reconcile_seconds",
    "Time one reconcile of one object took",
    ["kind"],
    buckets=(0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10),
)
RECONCILE_ERRORS = Counter(
    "rlfleet_operator_reconcile_errors_total", "Reconciles that raised", ["kind"]
)
GPUS_LENT = Gauge(
    "rlfleet_operator_gpus_lent", "GPUs a pool lends, as decided", ["namespace", "pool"]
)
REGION_REACHABLE = Gauge(
    "rlfleet_operator_region_reachable",
    "1 when the hub reached the region on its last try, per run",
    ["namespace", "run", "region"],
)
RECLAIM_DEADLINE_EXCEEDED = Counter(
    "rlfleet_operator_reclaim_deadline_exceeded_total",
    "Rollout pods killed because a reclaim outlasted the pool's reclaimDeadlineSeconds",
    ["namespace", "pool"],
)
# Every condition the operator writes, so each one on-call acts on can be alerted on by
# name; the reason is one CamelCase word of a fixed set, never the message.
CONDITION = Gauge(
    "rlfleet_operator_condition",
    "1 when the object's condition is True, else 0 (False or Unknown: the reason says)",
    ["kind", "namespace", "name", "type", "reason"],
)
_said: dict[tuple[str, str, str, str], str] = {}  # (kind, namespace, name, type) -> reason
_said_lock = threading.Lock()

tracer = trace.get_tracer("rlfleet.operator")


def conditions(kind: str, namespace: str, name: str, written: Sequence[Condition]) -> None:
    """The object's conditions as `rlfleet_operator_condition`; a condition's series under
    its former reason goes, so one (kind, namespace, name, type) has one series."""
    with _said_lock:
        for c in written:
            key = (kind, namespace, name, c.type)
            former = _said.get(key)
            if former is not None and former != c.reason:
                CONDITION.remove(*key, former)
            _said[key] = c.reason
            CONDITION.labels(*key, c.reason).set(1 if c.status == "True" else 0)


def forget(kind: str, namespace: str, name: str) -> None:
    """Drops a deleted object's condition series."""
    with _said_lock:
        for key in [k for k in _said if k[:3] == (kind, namespace, name)]:
            CONDITION.remove(*key, _said.pop(key))


def start(role: str, cluster: str, metrics_port: int) -> None:
    if metrics_port:
        start_http_server(metrics_port)
    provider = TracerProvider(
        resource=Resource.create(
            {"service.name": f"rlfleet-operator-{role}", "k8s.cluster.name": cluster}
        )
    )
    # The standard OTEL_EXPORTER_OTLP_* variables say where spans go; without them, nowhere.
    if os.environ.get("OTEL_EXPORTER_OTLP_ENDPOINT") or os.environ.get(
        "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT"
    ):
        from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter

        provider.add_span_processor(BatchSpanProcessor(OTLPSpanExporter()))
    trace.set_tracer_provider(provider)


@contextmanager
def reconciling(kind: str, namespace: str, name: str) -> Iterator[None]:
    """Times, counts and traces one reconcile."""
    started = time.perf_counter()
    with tracer.start_as_current_span(
        f"reconcile {kind}", attributes={"k8s.namespace.name": namespace, "rlfleet.name": name}
    ):
        try:
            yield
        except Exception:
            RECONCILE_ERRORS.labels(kind).inc()
            raise
        finally:
            RECONCILE_SECONDS.labels(kind).observe(time.perf_counter() - started)

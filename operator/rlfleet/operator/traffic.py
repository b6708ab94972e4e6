"""Reads an InferencePool's traffic signal: a Prometheus-format endpoint or a query."""

from __future__ import annotations

import httpx
from opentelemetry import trace
from prometheus_client.parser import text_string_to_metric_families

from rlfleet.api.inferencepool import TrafficSignal

_tracer = trace.get_tracer("rlfleet.operator")
# One client for every pool's reads: a client per read builds a TLS context each time,
# CPU that every other reconcile in the process waits for.
_client = httpx.Client()


class TrafficUnknown(Exception):
    """The signal could not be read; the message says why."""


def read_load(signal: TrafficSignal, timeout_s: float) -> float:
    """The load summed over the serving pods (every series of the metric)."""
    if signal.metrics_url:
        url, params = signal.metrics_url, None
    else:
        assert signal.prometheus_url and signal.prometheus_query  # the CRD's rules
        url = f"{signal.prometheus_url.rstrip('/')}/api/v1/query"
        params = {"query": signal.prometheus_query}
    try:
        with _tracer.start_as_current_span("traffic GET", attributes={"url.full": url}):
            response = _client.get(url, params=params, timeout=timeout_s)
            response.raise_for_status()
        if signal.metrics_url:
            return _sum_metric(response.text, signal.metric)
        return sum(float(r["value"][1]) for r in response.json()["data"]["result"])
    except (httpx.HTTPError, ValueError, KeyError, TypeError) as error:
        raise TrafficUnknown(f"{type(error).__name__}: {error}") from error


def _sum_metric(text: str, metric: str) -> float:
    values = [
        sample.value
        for family in text_string_to_metric_families(text)
        for sample in family.samples
        if sample.name == metric
    ]
    if not values:
        raise ValueError(f"the endpoint exports no {metric}")
    return float(sum(values))

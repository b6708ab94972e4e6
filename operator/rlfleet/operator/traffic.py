"""Reads an InferencePool's traffic signal: a Prometheus-format endpoint or a query."""

from __future__ import annotations

import httpx
from prometheus_client.parser import text_string_to_metric_families

from rlfleet.api.inferencepool import TrafficSignal


class TrafficUnknown(Exception):
    """The signal could not be read; the message says why."""


def read_load(signal: TrafficSignal, timeout_s: float) -> float:
    """The load summed over the serving pods (every series of the metric)."""
    try:
        if signal.metrics_url:
            response = httpx.get(signal.metrics_url, timeout=timeout_s)
            response.raise_for_status()
            return _sum_metric(response.text, signal.metric)
        assert signal.prometheus_url and signal.prometheus_query  # the CRD's rules
        response = httpx.get(
            f"{signal.prometheus_url.rstrip('/')}/api/v1/query",
            params={"query": signal.prometheus_query},
            timeout=timeout_s,
        )
        response.raise_for_status()
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

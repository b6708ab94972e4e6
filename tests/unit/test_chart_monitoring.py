"""The chart's on-call kit: its alerts and dashboard query only metrics the components
export, each alert links a section of the on-call guide, and both are off by default.
Renders the chart with `helm template`; no cluster."""

from __future__ import annotations

import importlib
import json
import re
import subprocess

import pytest
from conftest import ROOT
from prometheus_client import REGISTRY

from rlfleet.api.meta import API_VERSION, Condition
from rlfleet.operator import telemetry
from rlfleet.operator.kube import Kube
from rlfleet.testbed.fleet import rendered_chart

# Every module that defines a component's Prometheus metrics.
METRIC_MODULES = (
    "rlfleet.operator.telemetry",
    "rlfleet.operator.conductor",
    "rlfleet.trainer.metrics",
    "rlfleet.rollout.engine.metrics",
    "rlfleet.rollout.production.collector",
    "rlfleet.rollout.production.capture",
    "rlfleet.rollout.production.feedback",
    "rlfleet.rollout.production.versions",
    "rlfleet.weightsync.metrics",
)
SAMPLES = {
    "counter": ("_total", "_created"),
    "gauge": ("",),
    "histogram": ("_bucket", "_count", "_sum", "_created"),
    "summary": ("", "_count", "_sum", "_created"),
    "info": ("_info",),
}
# PromQL's own words: functions, aggregations and operators.
PROMQL = {
    "sum", "rate", "increase", "max", "min", "and", "or", "unless",
    "label_replace", "histogram_quantile",
}  # fmt: skip
ON = [
    "--set", "metrics.prometheusRule.enabled=true",
    "--set", "metrics.dashboard.enabled=true",
    "--set", "metrics.prometheusRule.runbookBaseUrl=https://docs.example/rlfleet/",
]  # fmt: skip


def exported() -> set[str]:
    """The sample names of every metric the components define, read from the registry."""
    for module in METRIC_MODULES:
        importlib.import_module(module)
    return {
        family.name + suffix
        for family in REGISTRY.collect()
        if family.name.startswith("rlfleet_")
        for suffix in SAMPLES[family.type]
    }


def named(expr: str) -> set[str]:
    """The metric names an expression reads: its words outside strings, label matchers,
    ranges and by/on label lists, less PromQL's own."""
    bare = re.sub(r'"[^"]*"|\{[^}]*\}|\[[^\]]*\]|\b(by|on|without|ignoring)\s*\([^)]*\)', " ", expr)
    return set(re.findall(r"[a-zA-Z_:][a-zA-Z0-9_:]*", bare)) - PROMQL


def render(*values: str) -> list[dict]:
    return rendered_chart(*values, release="r")


def anchors() -> set[str]:
    """The mkdocs anchors of the on-call guide's headings."""
    text = (ROOT / "docs" / "guides" / "oncall.md").read_text()
    headings = re.findall(r"^#{2,6} (.+)$", text, re.MULTILINE)
    return {re.sub(r"[^a-z0-9]+", "-", h.lower()).strip("-") for h in headings}


def test_every_alert_reads_exported_metrics_and_links_its_runbook() -> None:
    names, sections = exported(), anchors()
    (rule,) = [d for d in render(*ON) if d["kind"] == "PrometheusRule"]
    alerts = [r for g in rule["spec"]["groups"] for r in g["rules"]]
    runbooks = set()
    for alert in alerts:
        read = named(alert["expr"])
        assert read and read <= names, (alert["alert"], read - names)
        url = alert["annotations"]["runbook_url"]
        page, _, anchor = url.partition("#")
        assert page == "https://docs.example/rlfleet/guides/oncall/", url
        assert anchor in sections, (alert["alert"], anchor)
        runbooks.add(anchor)
    # One alert for every condition the guide's Alerts section says on-call acts on.
    assert runbooks == {
        "run-stalled",
        "region-unreachable",
        "reclaim-past-its-deadline",
        "staleness-at-its-bound",
        "weight-sync-stalled",
        "canary-rolled-back",
        "feedback-held-back",
    }


def test_the_dashboard_parses_and_reads_exported_metrics() -> None:
    names = exported()
    (config,) = [d for d in render(*ON) if d["kind"] == "ConfigMap" and "rlfleet.json" in d["data"]]
    assert config["metadata"]["labels"]["grafana_dashboard"] == "1"
    dashboard = json.loads(config["data"]["rlfleet.json"])
    exprs = [t["expr"] for p in dashboard["panels"] for t in p.get("targets", [])]
    # A variable's label_values(series, label): the series is the expression.
    queries = [v["query"]["query"] for v in dashboard["templating"]["list"] if v["type"] == "query"]
    exprs += [re.sub(r"^label_values\((.*), *\w+\)$", r"\1", q) for q in queries]
    assert exprs
    for expr in exprs:
        read = named(expr)
        assert read and read <= names, (expr, read - names)


def test_alerts_without_a_runbook_address_are_refused_naming_the_value() -> None:
    with pytest.raises(subprocess.CalledProcessError) as refused:
        render("--set", "metrics.prometheusRule.enabled=true")
    assert "/metrics/prometheusRule': missing property 'runbookBaseUrl'" in refused.value.stderr


def test_neither_renders_by_default() -> None:
    kinds = [d["kind"] for d in render()]
    assert "PrometheusRule" not in kinds
    assert not [d for d in render() if "grafana_dashboard" in d["metadata"].get("labels", {})]


class _Unwritten(Kube):
    """A Kube whose writes go nowhere: write_status's own logic, no API server."""

    def __init__(self) -> None:
        self.patches: list[dict] = []

    def merge_patch(self, ref, patch: dict, subresource: str = "") -> dict:
        self.patches.append(patch)
        return {}


def _said(type_: str, status: str, reason: str) -> Condition:
    return Condition(
        type=type_, status=status, reason=reason, last_transition_time="2026-01-01T00:00:00Z"
    )


def _gauge(**labels: str) -> float | None:
    return REGISTRY.get_sample_value("rlfleet_operator_condition", labels)


def test_writing_a_condition_sets_its_gauge_under_one_reason() -> None:
    from rlfleet.api.rlrun import RLRunStatus

    kube = _Unwritten()
    run = {
        "apiVersion": API_VERSION,
        "kind": "RLRun",
        "metadata": {"namespace": "team-a", "name": "gauged"},
    }
    key = {"kind": "RLRun", "namespace": "team-a", "name": "gauged", "type": "WeightSyncStalled"}
    kube.write_status(
        run, RLRunStatus(conditions=[_said("WeightSyncStalled", "True", "NoNewVersion")])
    )
    assert _gauge(**key, reason="NoNewVersion") == 1
    run["status"] = kube.patches[-1]["status"]
    # Cleared: the series under the old reason goes, so an alert on it resolves.
    cleared = RLRunStatus(conditions=[_said("WeightSyncStalled", "False", "VersionsLanding")])
    kube.write_status(run, cleared)
    assert _gauge(**key, reason="VersionsLanding") == 0
    assert _gauge(**key, reason="NoNewVersion") is None
    # A status that says it already is not written again, and the gauge still says it.
    run["status"] = kube.patches[-1]["status"]
    assert not kube.write_status(run, cleared)
    assert _gauge(**key, reason="VersionsLanding") == 0
    telemetry.forget("RLRun", "team-a", "gauged")
    assert _gauge(**key, reason="VersionsLanding") is None

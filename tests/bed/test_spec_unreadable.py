"""Spec fields a schema cannot fully check, on the bed's real API server and a real region
operator: a model uri no pod can read is refused by the API server (a CEL rule), and an
off-peak window in a time zone that does not exist is accepted by the schema (it knows no
zone names) but said at once, in a condition and a Warning event that name the field, while
the pool lends nothing it cannot place in time; never a crash loop."""

from __future__ import annotations

import json
import subprocess
import sys
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest
import yaml
from conftest import ROOT, Kubectl, wait_for

from rlfleet.local.files import write_secret
from rlfleet.testbed.bed import BedInfo
from rlfleet.testbed.fleet import serving_deployment

REGION = "region-a"
FIELD = "spec.offPeakWindows[1].timeZone"


@pytest.fixture
def namespace(kubectl: Kubectl) -> Iterator[str]:
    name = f"spec-{uuid.uuid4().hex[:6]}"
    for context in ("hub", REGION):
        kubectl.run(context, "create", "namespace", name)
    yield name
    for context in ("hub", REGION):
        kubectl.run(context, "delete", "namespace", name, "--wait=false", check=False)


@pytest.mark.usefixtures("crds_installed")
def test_a_model_uri_no_pod_can_read_is_refused_naming_the_field(
    kubectl: Kubectl, namespace: str
) -> None:
    run = yaml.safe_load((ROOT / "examples" / "rlrun.yaml").read_text())
    run["spec"]["model"] = {"uri": "not a uri"}
    refused = kubectl.run(
        "hub", "-n", namespace, "apply", "-f", "-", stdin=yaml.safe_dump(run), check=False
    )
    assert refused.returncode != 0 and "spec.model.uri" in refused.stderr, refused.stderr
    assert "file:///" in refused.stderr, refused.stderr  # it says what it takes


@pytest.fixture
def region_operator(bed: BedInfo, namespace: str, tmp_path: Path) -> Iterator[Path]:
    """The region's operator, as `python -m rlfleet.operator` runs it, watching the test's
    namespace only; yields its log."""
    config = tmp_path / "operator.yaml"
    config.write_text(
        yaml.safe_dump(
            {
                "role": "region",
                "cluster": REGION,
                "namespace": namespace,
                "watch_namespaces": [namespace],
                "resync_seconds": 1,
                "traffic_timeout_seconds": 1,
                "metrics_port": 0,
                "health_port": 0,
            }
        )
    )
    kubeconfig = tmp_path / "kubeconfig"
    write_secret(kubeconfig, bed.kubeconfigs[REGION].read_text())
    log = tmp_path / "operator.log"
    with log.open("w") as out:
        process = subprocess.Popen(
            [sys.executable, "-m", "rlfleet.operator", str(config)],
            stdout=out,
            stderr=subprocess.STDOUT,
            env={"KUBECONFIG": str(kubeconfig), "PATH": "/usr/bin:/bin"},
        )
    try:
        yield log
    finally:
        process.terminate()
        process.wait(timeout=30)


@pytest.mark.usefixtures("crds_installed")
def test_an_unknown_time_zone_is_a_condition_and_a_warning_naming_the_field(
    kubectl: Kubectl, namespace: str, region_operator: Path
) -> None:
    pool = yaml.safe_load((ROOT / "examples" / "inferencepool.yaml").read_text())
    serving = serving_deployment(pool["spec"]["serving"]["deploymentName"], 2, 8)
    pool["spec"]["serving"]["replicas"] = 2
    pool["spec"]["traffic"]["metricsUrl"] = "http://127.0.0.1:1/metrics"  # refused at once
    pool["spec"]["offPeakWindows"] = [
        {"start": "00:00", "end": "23:59", "timeZone": "Europe/Paris"},
        {"start": "22:00", "end": "06:00", "timeZone": "Mars/Olympus"},
    ]
    for document in (serving, pool):
        kubectl.run(REGION, "-n", namespace, "apply", "-f", "-", stdin=yaml.safe_dump(document))
    name = pool["metadata"]["name"]

    def ready() -> dict | None:
        got = json.loads(
            kubectl.run(REGION, "-n", namespace, "get", "ipool", name, "-o", "json").stdout
        )
        conditions = got.get("status", {}).get("conditions", [])
        found = next((c for c in conditions if c["type"] == "Ready"), None)
        return found if found and found["reason"] == "InvalidSpec" else None

    condition = wait_for("the pool's Ready condition to say InvalidSpec", ready, timeout=60)
    assert condition["status"] == "False"
    assert FIELD in condition["message"] and "Mars/Olympus" in condition["message"]
    assert "offPeakWindows[0]" not in condition["message"]  # Europe/Paris is a zone

    def warned() -> list[dict]:
        events = json.loads(
            kubectl.run(
                REGION,
                "-n",
                namespace,
                "get",
                "events",
                "--field-selector",
                f"involvedObject.name={name},reason=InvalidSpec",
                "-o",
                "json",
            ).stdout
        )["items"]
        return events

    events = wait_for("a Warning event InvalidSpec", warned, timeout=30)
    assert all(e["type"] == "Warning" and FIELD in e["message"] for e in events), events
    lending = json.loads(
        kubectl.run(REGION, "-n", namespace, "get", "ipool", name, "-o", "json").stdout
    )["status"]
    assert lending.get("lentReplicas", 0) == 0, lending
    log = region_operator.read_text()
    assert "Traceback" not in log, log[-3000:]

"""`rlfleet run FILE --operator --detach` as `make bed` types it, on the session's bed:
the command makes its model, the run goes through the operators and is left training
with its columns filled, a scripted traffic spike takes region-a's GPUs back, and when
`rlfleet dev down` stops it the run leaves its report and takes its namespace and
streams away. Only what the command adds is asserted here, on a short run: the same
plane's finer steps (a drained worker, training going on with the other region, the GPUs
lent again and a new worker when traffic falls) are `test_operator_local.py`'s."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import nats.js.errors
import yaml
from conftest import ROOT, rules_suite, run_streams

from rlfleet.launch.pods import run_key
from rlfleet.local.binaries import binary
from rlfleet.testbed import detached
from rlfleet.testbed.bed import BedInfo
from rlfleet.testbed.fleet import HUB

REGIONS = ["region-a", "region-b"]


def kubectl(bed: BedInfo, cluster: str, *args: str) -> str:
    return subprocess.run(
        [binary("kubectl"), f"--kubeconfig={bed.kubeconfig}", f"--context={cluster}", *args],
        capture_output=True,
        text=True,
        check=True,
    ).stdout


def status(bed: BedInfo, cluster: str, namespace: str, kind: str, field: str) -> str:
    """A status field of the namespace's one object of `kind`: what its column shows."""
    return kubectl(
        bed, cluster, "-n", namespace, "get", kind, f"-o=jsonpath={{.items[0].status.{field}}}"
    )


def wait_for(found, what: str, timeout_s: float = 300.0):
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if value := found():
            return value
        time.sleep(1.0)
    raise AssertionError(f"no {what} in {timeout_s:.0f}s")


def test_a_detached_run_fills_its_columns_loses_a_regions_worker_and_reports_when_stopped(
    bed: BedInfo, tmp_path
) -> None:
    """`make bed`'s run: started detached, it returns once the hub reports a version, trains
    on until `rlfleet dev down` stops it as Ctrl-C would, and then reports."""
    # `test_operator_local.py` ran this example on the bed too: a run of the same name in
    # another namespace is another run, with streams of its own.
    document = yaml.safe_load((ROOT / "examples" / "local.yaml").read_text())
    name = document["metadata"]["name"]
    # Flow, not learning, is under test: sixteen tasks make the whole-suite evaluations
    # of the starting model and the last version quick.
    document["spec"]["rollout"]["taskSuite"] = str(rules_suite(tmp_path / "rules-16.jsonl", 16))
    example = tmp_path / "local.yaml"
    example.write_text(yaml.safe_dump(document))
    run = tmp_path / "run"
    started = subprocess.run(
        [
            *(sys.executable, "-m", "rlfleet.cli", "run", str(example)),
            *("--operator", "--detach", "--bed", str(bed.state_dir), "--state", str(run)),
            # The spike starts soon after the first step and outlasts the test: region-a's
            # pod is taken and no new one starts (test_operator_local.py asserts the GPUs'
            # return). The budget outlasts it too: the run trains until it is stopped.
            *("--warmup-steps", "20", "--minutes", "60", "--spike", "region-a:0.1-60"),
        ],
        capture_output=True,
        text=True,
        timeout=1200,
        env=os.environ | {"COLUMNS": "250"},  # the run's log: rich wraps lines at the width
    )
    assert started.returncode == 0, started.stdout + started.stderr
    assert "training: version" in started.stdout
    (detached_run,) = detached.recorded(bed.state_dir)
    try:
        namespace = detached_run.namespace
        assert detached_run.alive()  # left training

        # What `kubectl get rlfleet` shows an on-call engineer, filled in.
        assert status(bed, HUB, namespace, "rlrun", "phase") == "Running"
        assert int(status(bed, HUB, namespace, "rlrun", "policyVersion")) >= 1
        wait_for(
            lambda: (
                status(bed, "region-b", namespace, "inferencepool", "lentReplicas") not in ("", "0")
            ),
            "region-b's replica lent",
        )
        log = Path(detached_run.log)

        def output() -> str:
            return " ".join(log.read_text().split())

        wait_for(lambda: "is gone: stopping rollout-region-a-" in output(), "reclaim")
        wait_for(
            lambda: (
                status(bed, "region-a", namespace, "inferencepool", "lentReplicas") in ("0", "")
            ),
            "region-a's replica back in service",
        )

        # `rlfleet dev down` stops it as Ctrl-C would: it reports, and deletes its namespace.
        assert detached.stop_all(bed.state_dir) == [detached_run]
    finally:
        detached.stop_all(bed.state_dir)  # a failed check leaves no run on the session's bed
    assert not detached_run.alive()
    assert detached.recorded(bed.state_dir) == []
    summary = json.loads((run / "report" / "summary.json").read_text())
    assert summary["steps"] > 0
    assert summary["reward_from"] == "evaluation"
    assert summary["evaluated_version"] == summary["policy_version"]

    # One local worker per rollout pod, named after it: region-a's was stopped when the
    # spike took its pod.
    workers = {region: sorted((run / "logs").glob(f"rollout-{region}-*.log")) for region in REGIONS}
    assert [len(workers[region]) for region in REGIONS] == [1, 1]
    assert "is gone: stopping rollout-region-b-" not in output()

    # The run's namespace is deleted in every cluster it reached.
    for cluster in [HUB, *REGIONS]:
        phase = kubectl(
            bed, cluster, "get", "namespace", namespace, "--ignore-not-found",
            "-o=jsonpath={.status.phase}",
        )  # fmt: skip
        assert phase in ("", "Terminating")

    async def streams_left() -> list[str]:
        nc = await bed.nats.hub.connect()
        try:
            found = []
            for stream in run_streams(run_key(namespace, name)):
                with contextlib.suppress(nats.js.errors.NotFoundError):
                    found.append((await nc.jetstream().stream_info(stream)).config.name)
            return found
        finally:
            await nc.close()

    # The hub deleted the run's streams with the run: the bed's NATS keeps nothing of it.
    assert asyncio.run(streams_left()) == []

"""`rlfleet run FILE --operator` as a user types it, on the session's bed: the command
makes its model, the run goes through the operators, a scripted traffic spike takes
region-a's GPUs back, and the command leaves its report and takes its namespace and
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

import nats.js.errors
import pytest
import yaml
from conftest import ROOT, rules_suite, run_streams

from rlfleet.launch import run_key
from rlfleet.local.binaries import binary
from rlfleet.testbed.bed import BedInfo
from rlfleet.testbed.fleet import HUB

pytestmark = pytest.mark.bed

REGIONS = ["region-a", "region-b"]


def test_a_run_through_the_operators_reports_and_loses_a_regions_worker_in_a_spike(
    bed: BedInfo, tmp_path
) -> None:
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
    done = subprocess.run(
        [
            *(sys.executable, "-m", "rlfleet.cli", "run", str(example)),
            *("--operator", "--bed", str(bed.state_dir), "--state", str(run)),
            # Flow, not learning, is under test. The spike starts soon after the first step
            # and outlasts the budget: region-a's pod is taken, with time to spare, and no
            # new one starts (test_operator_local.py asserts the GPUs' return).
            *("--warmup-steps", "20", "--minutes", "0.5", "--spike", "region-a:0.1-1"),
        ],
        capture_output=True,
        text=True,
        timeout=1500,
        env=os.environ | {"COLUMNS": "250"},  # rich wraps its log lines at the width
    )
    output = " ".join((done.stdout + done.stderr).split())
    assert done.returncode == 0, output[-4000:]

    summary = json.loads((run / "report" / "summary.json").read_text())
    assert summary["steps"] > 0
    assert summary["reward_from"] == "evaluation"
    assert summary["evaluated_version"] == summary["policy_version"]

    # One local worker per rollout pod, named after it: region-a's was stopped when the
    # spike took its pod.
    workers = {region: sorted((run / "logs").glob(f"rollout-{region}-*.log")) for region in REGIONS}
    assert [len(workers[region]) for region in REGIONS] == [1, 1]
    assert "is gone: stopping rollout-region-a-" in output
    assert "is gone: stopping rollout-region-b-" not in output

    # The run's namespace is deleted in every cluster it reached.
    namespace = output.split("in namespace ")[1].split()[0]
    for cluster in [HUB, *REGIONS]:
        phase = subprocess.run(
            [
                *(binary("kubectl"), f"--kubeconfig={bed.kubeconfig}"),
                *(f"--context={cluster}", "get", "namespace", namespace, "--ignore-not-found"),
                "-o=jsonpath={.status.phase}",
            ],
            capture_output=True,
            text=True,
            check=True,
        ).stdout
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

"""`rlfleet run FILE --operator`'s own decisions: which serving fleet a run borrows from,
and when a scripted traffic spike holds a region's GPUs back. The run itself, on the bed,
is `test_operator_local.py`."""

from __future__ import annotations

import subprocess
import sys

import pytest
import yaml
from conftest import ROOT

from rlfleet.api.rlrun import RLRunSpec
from rlfleet.local.operated import GPUS_PER_REPLICA, POOL, Spike, borrowing


def test_a_spike_is_a_region_and_a_window_in_minutes_of_training() -> None:
    spike = Spike.parse("region-a:2-4.5")
    assert spike == Spike("region-a", 120.0, 270.0)
    assert [spike.busy(s) for s in (119.0, 120.0, 269.0, 270.0)] == [False, True, True, False]


@pytest.mark.parametrize("text", ["region-a", "region-a:4-2", ":1-2", "region-a:x-2", "a:-1-2"])
def test_a_malformed_spike_is_refused_with_the_expected_form(text: str) -> None:
    with pytest.raises(ValueError, match="REGION:FROM-TO"):
        Spike.parse(text)


def test_regions_with_no_pool_borrow_one_replica_of_the_beds_serving_fleet() -> None:
    document = yaml.safe_load((ROOT / "examples" / "local.yaml").read_text())
    document["spec"]["rollout"]["regions"].append(
        {"name": "region-c", "maxGpus": 16, "inferencePools": ["batch"]}
    )
    regions = RLRunSpec.model_validate(borrowing(document)["spec"]).rollout.regions
    assert [(r.name, r.max_gpus, r.inference_pools) for r in regions] == [
        ("region-a", GPUS_PER_REPLICA, [POOL]),
        ("region-b", GPUS_PER_REPLICA, [POOL]),
        ("region-c", 16, ["batch"]),  # what the user named is left alone
    ]
    assert document["spec"]["rollout"]["regions"][0] == {"name": "region-a", "maxGpus": 1}


@pytest.mark.parametrize(
    ("spike", "error"),
    [
        ("region-a:3", "expected REGION:FROM-TO in minutes"),
        ("region-z:1-2", "--spike in region-z: not a region of tiny-moe-local"),
    ],
)
def test_the_cli_refuses_a_bad_spike_before_starting_anything(
    spike: str, error: str, tmp_path
) -> None:
    done = subprocess.run(
        [
            *(sys.executable, "-m", "rlfleet.cli", "run", str(ROOT / "examples" / "local.yaml")),
            *("--operator", "--bed", str(tmp_path / "bed"), "--spike", spike),
            *("--state", str(tmp_path / "run")),
        ],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 2
    assert error in " ".join((done.stdout + done.stderr).split())
    assert not (tmp_path / "bed").exists() and not (tmp_path / "run").exists()

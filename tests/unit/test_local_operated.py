"""`rlfleet run FILE --operator`'s own decisions: which serving fleet a run borrows from,
and when a scripted traffic spike holds a region's GPUs back; and how its pod binding
stops the processes it started. The run itself, on the bed, is `test_operator_local.py`."""

from __future__ import annotations

import sys
import time

import pytest
import yaml
from conftest import ROOT

from rlfleet import cli
from rlfleet.api.meta import COMPONENT_LABEL, RUN_LABEL
from rlfleet.api.rlrun import RLRunSpec
from rlfleet.local.plan import Process
from rlfleet.local.processes import Supervisor
from rlfleet.testbed.operated import GPUS_PER_REPLICA, POOL, Binding, Spike, borrowing
from rlfleet.testbed.pods import PodRunner, live_pods, process_for


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
    spike: str, error: str, tmp_path, capsys: pytest.CaptureFixture[str]
) -> None:
    """In this process, so that whatever it started would be seen here (this is a unit
    test: starting a server fails it)."""
    with pytest.raises(SystemExit) as done:
        cli.main(
            [
                *("run", str(ROOT / "examples" / "local.yaml")),
                *("--operator", "--bed", str(tmp_path / "bed"), "--spike", spike),
                *("--state", str(tmp_path / "run")),
            ]
        )
    assert done.value.code == 2
    said = capsys.readouterr()
    assert error in " ".join((said.out + said.err).split())
    assert not (tmp_path / "bed").exists() and not (tmp_path / "run").exists()


# A trainer that takes half a second to finish its step once told to stop.
FINISHES_ITS_STEP = """
import pathlib, signal, sys, time
config = pathlib.Path(sys.argv[-1])
def finish(*_):
    time.sleep(0.5)
    config.with_suffix(".finished").write_text("")
    sys.exit(0)
signal.signal(signal.SIGTERM, finish)
config.with_suffix(".ready").write_text("")
while True:
    time.sleep(0.1)
"""


def test_stopping_the_pod_binding_lets_each_process_finish_before_it_exits(tmp_path) -> None:
    # The processes die with the thread that started them (PR_SET_PDEATHSIG): stopped only
    # after it ended, the trainer was killed with a step half published.
    config = tmp_path / "trainer.json"
    trainer = Process("trainer", [sys.executable, "-c", FINISHES_ITS_STEP, str(config)], {}, {})
    pod = {
        "metadata": {"name": "trainer-0", "labels": {RUN_LABEL: "run", COMPONENT_LABEL: "trainer"}},
        "spec": {"containers": [{"env": []}]},
        "status": {"phase": "Running"},
    }
    runner = PodRunner(
        "run", {"trainer": trainer}, lambda _: [pod], ["hub"], Supervisor(tmp_path, attached=True)
    )
    binding = Binding(runner)
    deadline = time.monotonic() + 60
    while not config.with_suffix(".ready").exists():
        binding.check_alive()
        assert time.monotonic() < deadline, "the pod's process never started"
        time.sleep(0.1)
    binding.stop()
    assert config.with_suffix(".finished").exists()


def test_each_pod_of_a_production_run_stands_for_its_planned_process() -> None:
    """A production run's hub pods (trainer, evaluator, collector, conductor) each start
    the local run's process of that name; a pod of no such component starts nothing."""

    def pod(name: str, component: str) -> dict:
        labels = {RUN_LABEL: "run", COMPONENT_LABEL: component}
        return {
            "metadata": {"name": name, "labels": labels},
            "spec": {"containers": [{"env": []}]},
            "status": {"phase": "Running"},
        }

    components = ("trainer", "evaluator", "collector", "conductor")
    planned = {c: Process(c, [sys.executable, "-m", c], {}, {}) for c in components}
    items = [pod(f"run-{c}-0", c) for c in components] + [pod("run-users-0", "users")]
    bound = {p.component: process_for(p, planned) for p in live_pods("hub", "run", items)}
    assert bound == planned

"""The trainer's MLflow logging (`rlfleet.trainer.tracking`) against a real MLflow tracking
server: every step's numbers at its step and the spec as parameters, read back over the
server's API; one MLflow run per RLRun across restarts; and a server that is down costing
dropped entries, counted, never a wait."""

from __future__ import annotations

import time
from collections.abc import Iterator

import pytest
from conftest import step_report
from mlflow_server import MlflowServer
from prometheus_client import REGISTRY

from rlfleet.launch.settings import TrackingConfig
from rlfleet.local.processes import free_port
from rlfleet.trainer.tracking import Tracker, step_metrics

pytestmark = pytest.mark.servers


@pytest.fixture(scope="module")
def mlflow(tmp_path_factory: pytest.TempPathFactory) -> Iterator[MlflowServer]:
    server = MlflowServer(tmp_path_factory.mktemp("mlflow"))
    try:
        yield server
    finally:
        server.stop()


def test_every_steps_numbers_and_the_spec_reach_the_run_in_mlflow_and_a_restart_goes_on(
    mlflow: MlflowServer,
) -> None:
    params = {"trainer.learningRate": "3e-05", "rollout.groupSize": "16"}
    config = TrackingConfig(mlflow.uri, "team-a", "team-a_tiny", params)
    tracker = Tracker(config)
    for step in range(1, 4):
        tracker.step(step_report("team-a_tiny", step, 1_700_000_000.0 + step, 0))
    assert tracker.flush(30)
    # The trainer restarted from its checkpoint: the same MLflow run goes on.
    resumed = Tracker(config)
    resumed.step(step_report("team-a_tiny", 4, 1_700_000_004.0, 0))
    assert resumed.flush(30)
    run = mlflow.run_of("team-a", "team-a_tiny")
    assert {p["key"]: p["value"] for p in run["data"]["params"]} == params
    keys = step_metrics(step_report("team-a_tiny", 1, 0.0, 0)).keys()
    assert {"reward", "loss", "staleness_mean", "kl", "tokens_per_second", "delta_bytes"} <= keys
    for key in keys:
        history = mlflow.history(run["info"]["run_id"], key)
        assert sorted(m["step"] for m in history) == [1, 2, 3, 4], key
    rewards = {m["step"]: m["value"] for m in mlflow.history(run["info"]["run_id"], "reward")}
    assert rewards[2] == step_report("team-a_tiny", 2, 0.0, 0).reward_mean


def _sample(name: str) -> float:
    return REGISTRY.get_sample_value(name) or 0.0


def test_a_tracker_that_is_down_drops_and_counts_and_never_holds_training_up() -> None:
    closed = f"http://127.0.0.1:{free_port()}"  # nothing listens there
    tracker = Tracker(TrackingConfig(closed, "team-a", "team-a_down", queue=8))
    before = _sample("rlfleet_tracking_dropped_total")
    for step in range(1, 101):
        tracker.step(step_report("team-a_down", step, float(step), 0))
    # Eight queued and at most one in the tracker's hands: the rest dropped, counted.
    assert 100 - 8 - 1 <= _sample("rlfleet_tracking_dropped_total") - before <= 100 - 8
    assert not tracker.flush(0.5)  # nothing got out
    deadline = time.monotonic() + 30
    while _sample("rlfleet_tracking_unreachable_seconds") == 0.0:
        assert time.monotonic() < deadline, "the tracker never said the server is unreachable"
        time.sleep(0.1)
    # The next step's report says so too, for the run's status (TrackingUnreachable).
    told = tracker.told(step_report("team-a_down", 101, 101.0, 0))
    assert told.tracking_unreachable_seconds > 0
    assert told.tracking_dropped_total == _sample("rlfleet_tracking_dropped_total") - before

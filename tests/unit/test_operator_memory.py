"""What an operator process remembers of a run or a pool lasts as long as it does: an
operator that lives for months sees thousands of runs come and go."""

from __future__ import annotations

import time

import yaml
from conftest import ROOT

from rlfleet.api.inferencepool import InferencePoolSpec
from rlfleet.api.wire import BusRole
from rlfleet.operator.config import OperatorConfig
from rlfleet.operator.hub import Hub
from rlfleet.operator.region.pool_reconciler import PoolReconciler as Region
from rlfleet.operator.regions import RegionClients

CONFIG = OperatorConfig(role="hub", cluster="hub", namespace="rlfleet-system")


def test_a_deleted_run_leaves_no_placed_nats_user_behind() -> None:
    spec = yaml.safe_load((ROOT / "examples" / "rlrun.yaml").read_text())["spec"]
    run = {"metadata": {"name": "r", "namespace": "team", "uid": "u-1"}, "spec": spec}
    # Neither the regions nor NATS are configured: deleting touches no cluster.
    hub = Hub(None, RegionClients(None, CONFIG), CONFIG)
    other = ("u-2", "hub", BusRole.TRAINER)
    hub._placed |= {
        ("u-1", "hub", BusRole.TRAINER),
        ("u-1", "hub", BusRole.EVALUATOR),
        ("u-1", "region-a", BusRole.ROLLOUT),
        other,
    }
    assert hub.delete(run) == []
    assert hub._placed == {other}


def test_a_deleted_pools_served_versions_are_forgotten_once_others_are_asked_again() -> None:
    config = OperatorConfig(role="region", cluster="region-a", namespace="rlfleet-system")
    region = Region(None, config)
    region._served_seen[("team", "deleted")] = (
        time.monotonic() - 3 * config.run_resync_seconds,
        (),
    )
    assert region._served_by(("team", "chat"), None, running=[]) == ()
    assert set(region._served_seen) == {("team", "chat")}


def test_a_deleted_pools_feedback_secret_is_forgotten_once_others_are_reconciled() -> None:
    config = OperatorConfig(role="region", cluster="region-a", namespace="rlfleet-system")
    region = Region(None, config)
    pool = yaml.safe_load((ROOT / "examples" / "inferencepool.yaml").read_text())
    pool["metadata"] |= {"namespace": "team", "uid": "u-1"}
    spec = InferencePoolSpec.model_validate(pool["spec"])
    written = ("u-1", spec.serving.user_header)  # its Secret is written: no kube needed
    region._feedback_written[("team", "chat-prod")] = (written, time.monotonic())
    region._feedback_written[("team", "deleted")] = (
        written,
        time.monotonic() - 3 * config.run_resync_seconds,
    )
    region._keep_feedback(pool, spec)
    assert set(region._feedback_written) == {("team", "chat-prod")}

"""Faults in a run under the operators, and the audit that says what they cost.

The schedule and the audit are pure and tested alone. The run itself, a real trainer,
workers and operators on the bed killed and restarted while they train, then audited from
durable state, is `bench/faults.py` (30 minutes) and, for two minutes, the last test of
`test_operator_local.py`, on the plane that module has started."""

from __future__ import annotations

import itertools
import socket
import time

import msgspec
from conftest import step_report

from rlfleet.api.wire import StepReport, TrajectoryDrop
from rlfleet.testbed.audit import Ledger, audit
from rlfleet.testbed.bed import Bed, BedInfo
from rlfleet.testbed.chaos import REGIONAL, FaultKind, schedule

REGIONS = ["region-a", "region-b"]


def test_every_kind_comes_once_before_any_comes_again() -> None:
    faults = schedule(7, 3600, REGIONS, mean_gap_s=30)
    kinds = len(FaultKind)
    assert len(faults) > 3 * kinds  # a Poisson process at one per 30 s, for an hour
    for start in range(0, len(faults) - kinds + 1, kinds):
        assert {f.kind for f in faults[start : start + kinds]} == set(FaultKind)
    assert all((f.region in REGIONS) == (f.kind in REGIONAL) for f in faults)
    assert faults == schedule(7, 3600, REGIONS, mean_gap_s=30)  # the seed decides
    assert all(0 < a.at_s < b.at_s < 3600 for a, b in itertools.pairwise(faults))


def step(version: int, trajectories: list[str]) -> StepReport:
    return msgspec.structs.replace(
        step_report("run", version, float(version), 0), trajectories=trajectories
    )


def ledger(**changes) -> Ledger:
    """Three tasks, each a group of two; the trainer trained two groups in two steps and
    dropped the third as stale; every version is everywhere."""
    found = {
        "trajectories": {1: "t@1/0", 2: "t@1/1", 3: "u@2/0", 4: "u@2/1", 5: "v@3/0", 6: "v@3/1"},
        "acked_through": 6,
        "outstanding": 0,
        "steps": [step(1, ["t@1/0", "t@1/1"]), step(2, ["u@2/0", "u@2/1"])],
        "drops": [TrajectoryDrop(s, f"v@3/{s - 5}", "stale") for s in (5, 6)],
        "tasks_issued": 3,
        "tasks_waiting": set(),
        "versions": {"hub": {0, 1, 2}, "region-a": {1, 2}},
    }
    return Ledger(**(found | changes))


def test_a_clean_run_audits_clean() -> None:
    clean = audit(ledger())
    assert (clean.trajectories_lost, clean.trajectories_trained_twice) == (0, 0)
    assert (clean.tasks_lost, clean.versions_missing) == (0, 0)
    assert clean.trajectories_dropped == {"stale": 2}


def test_the_audit_finds_what_was_lost_or_done_twice() -> None:
    base = ledger()
    # A trajectory acknowledged, never trained and never dropped: lost.
    assert audit(ledger(drops=base.drops[:1])).trajectories_lost == 1
    # Past the ack floor and still out with the trainer's consumer, it is pending, not
    # lost; past the floor with nothing out, it is lost.
    assert (
        audit(ledger(drops=base.drops[:1], acked_through=5, outstanding=1)).trajectories_lost == 0
    )
    assert audit(ledger(drops=base.drops[:1], acked_through=5)).trajectories_lost == 1
    # A redelivery trained in a second step (a step log re-written as it was is not).
    twice = [*base.steps, step(3, ["t@1/0"])]
    assert audit(ledger(steps=twice)).trajectories_trained_twice == 1
    assert audit(ledger(steps=[*base.steps, base.steps[0]])).trajectories_trained_twice == 0
    # A task acknowledged by a worker that published nothing for it: lost; one still on
    # the stream is waiting.
    assert audit(ledger(tasks_issued=4)).tasks_lost == 1
    assert audit(ledger(tasks_issued=4, tasks_waiting={4})).tasks_lost == 0
    # A region that never got version 2; one whose older versions were retired is fine.
    assert audit(ledger(versions={"hub": {0, 1, 2}, "region-a": {1}})).versions_missing == 1
    assert audit(ledger(versions={"hub": {2}, "region-a": {2}})).versions_missing == 0


def test_a_bed_server_restarted_leaves_the_bed_whole_for_the_next_run(testbed: Bed) -> None:
    # `rlfleet run --bed` takes a bed whose recorded processes are gone for half-dead and
    # stops it: after a fault restarts one of the bed's servers, bed.json names the new one.
    testbed.restart("nats-region-c")
    recorded = BedInfo.load(testbed.state_dir)
    assert all(recorded.alive().values())
    assert recorded.pids == testbed.supervisor.pids()
    # Later tests use the leaf node: it is back before this test ends.
    port = int(recorded.nats.leaves["region-c"].url.rpartition(":")[2])
    deadline = time.monotonic() + 30
    while True:
        try:
            socket.create_connection(("127.0.0.1", port), timeout=1).close()
            break
        except OSError:
            assert time.monotonic() < deadline, "region-c's leaf node did not come back"
            time.sleep(0.1)

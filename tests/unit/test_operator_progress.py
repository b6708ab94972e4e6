"""How a trainer's step report becomes a run's status (a pure function): the progress
fields, WeightSyncStalled and StalenessBoundExceeded; and how an evaluator's report
meets the evaluation gate."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta

import msgspec
import yaml
from conftest import ROOT, evaluation_report, step_report

from rlfleet.api.meta import Condition
from rlfleet.api.rlrun import EvaluationGate, RLRunSpec, RLRunStatus
from rlfleet.api.tracking import TrackingSpec
from rlfleet.api.wire import EvaluationReport, StepReport
from rlfleet.operator.gate import Verdict, judge
from rlfleet.operator.progress import fold

NOW = datetime(2026, 11, 21, 12, 0, 0, tzinfo=UTC)
SPEC = RLRunSpec.model_validate(
    yaml.safe_load((ROOT / "examples" / "rlrun.yaml").read_text())["spec"]
    | {"weightSync": {"stallSeconds": 300}, "maxStaleness": 2}
)


def report(version: int, age_s: float, dropped: int = 0) -> StepReport:
    return step_report("r", version, (NOW - timedelta(seconds=age_s)).timestamp(), dropped)


def stalled_condition(status: str) -> Condition:
    return Condition.model_validate(
        {
            "type": "WeightSyncStalled",
            "status": status,
            "reason": "x",
            "message": "x",
            "lastTransitionTime": "2026-11-21T11:00:00Z",
        }
    )


NONE = RLRunStatus()  # a run's status before the hub first wrote it


def test_a_fresh_report_fills_the_status_and_is_not_stalled() -> None:
    found = fold(report(7, age_s=10), SPEC, NONE, NOW - timedelta(hours=1), NOW, 1)
    fields = found.fields.merge_patch()
    assert fields["policyVersion"] == 7 and fields["staleness"] == 2
    assert fields["lastWeightSync"] == {
        "version": 7,
        "bytes": 12345,
        "seconds": 0.25,
        "time": "2026-11-21T11:59:50Z",
    }
    assert not found.stalled and found.condition.status == "False"
    assert found.events == []


def test_no_version_for_stall_seconds_while_training_is_stalled_and_told_once() -> None:
    found = fold(report(7, age_s=301), SPEC, NONE, NOW - timedelta(hours=1), NOW, 1)
    assert found.stalled and found.condition.reason == "NoNewVersion"
    assert [e.reason for e in found.events] == ["WeightSyncStalled"]
    assert "version 7 published at 2026-11-21T11:54:59Z" in found.events[0].message
    again = fold(
        report(7, age_s=400),
        SPEC,
        RLRunStatus(conditions=[stalled_condition("True")]),
        NOW - timedelta(hours=1),
        NOW,
        1,
    )
    assert again.stalled and again.events == []


def test_a_trainer_that_just_started_is_not_stalled_by_an_old_report() -> None:
    # Resumed after a suspend: the last version is old, but training began a minute ago.
    found = fold(report(7, age_s=3600), SPEC, NONE, NOW - timedelta(seconds=60), NOW, 1)
    assert not found.stalled
    # Not training at all (suspended, trainer not ready): never stalled.
    assert not fold(report(7, age_s=3600), SPEC, NONE, None, NOW, 1).stalled
    # Training with no report yet is timed from when training began.
    assert fold(None, SPEC, NONE, NOW - timedelta(seconds=301), NOW, 1).stalled


def test_new_drops_beyond_the_staleness_bound_are_an_event_with_the_numbers() -> None:
    old = RLRunStatus(trajectories_dropped_stale=4)
    found = fold(report(9, age_s=1, dropped=7), SPEC, old, NOW, NOW, 1)
    (event,) = found.events
    assert event.reason == "StalenessBoundExceeded" and event.type == "Warning"
    assert event.message.startswith("3 trajectories arrived more than maxStaleness 2 versions")
    assert "7 in all" in event.message
    assert fold(report(9, age_s=1, dropped=4), SPEC, old, NOW, NOW, 1).events == []


def test_a_resync_that_learns_nothing_yields_the_same_condition() -> None:
    same = report(7, age_s=10)
    first = fold(same, SPEC, NONE, NOW - timedelta(hours=1), NOW, 1)
    later = fold(
        same,
        SPEC,
        RLRunStatus(conditions=[first.condition]),
        NOW - timedelta(hours=1),
        NOW + timedelta(seconds=60),
        1,
    )
    assert later.condition == first.condition


# The evaluation gate (`spec.evaluation`): the evaluator's newest report against the floor
# and the target.
GATED = SPEC.model_copy(
    update={
        "evaluation": EvaluationGate(
            suite="rules", every_versions=10, min_reward=0.4, target_reward=0.8
        )
    }
)


def evaluation(version: int, reward: float) -> EvaluationReport:
    return evaluation_report(version, reward, NOW.timestamp())


def said(verdict: Verdict) -> dict[str, tuple[str, str]]:
    return {c.type: (c.status, c.reason) for c in verdict.conditions}


def status_after(verdict: Verdict) -> RLRunStatus:
    return RLRunStatus.model_validate(
        verdict.fields.merge_patch() | {"conditions": verdict.conditions}
    )


def test_a_score_under_the_floor_fails_the_run_once_and_names_the_numbers() -> None:
    verdict = judge(evaluation(40, 0.31), GATED, NONE, 3)
    assert verdict.failed and verdict.held and not verdict.succeeded
    assert verdict.fields.merge_patch()["lastEvaluation"] == {
        "version": 40,
        "reward": 0.31,
        "passAtK": 0.7,
        "suite": "rules",
        "time": "2026-11-21T12:00:00Z",
    }
    assert said(verdict) == {
        "Failed": ("True", "EvaluationBelowFloor"),
        "Succeeded": ("False", "EvaluationBelowTarget"),
    }
    assert [e.reason for e in verdict.events] == ["Evaluated", "EvaluationBelowFloor"]
    below = verdict.events[1]
    assert below.type == "Warning"
    assert "version 40" in below.message and "0.3100" in below.message and "0.4" in below.message
    # The next resync learns nothing new: still failed, nothing more to tell.
    again = judge(evaluation(40, 0.31), GATED, status_after(verdict), 3)
    assert again.failed and again.events == [] and again.conditions == verdict.conditions


def test_a_score_at_the_target_completes_the_run() -> None:
    verdict = judge(evaluation(90, 0.82), GATED, NONE, 3)
    assert verdict.succeeded and verdict.held and not verdict.failed
    assert said(verdict)["Succeeded"] == ("True", "EvaluationReachedTarget")
    assert [e.reason for e in verdict.events] == ["Evaluated", "EvaluationReachedTarget"]
    assert "targetReward 0.8" in verdict.why


def test_between_the_floor_and_the_target_the_run_goes_on() -> None:
    verdict = judge(evaluation(50, 0.6), GATED, NONE, 3)
    assert not verdict.held and verdict.why == ""
    assert [e.reason for e in verdict.events] == ["Evaluated"]


def test_the_verdict_stands_while_nats_does_not_answer() -> None:
    failed = judge(evaluation(40, 0.31), GATED, NONE, 3)
    assert judge(None, GATED, status_after(failed), 3).failed


def test_a_lower_floor_lets_a_failed_run_go_on() -> None:
    failed = judge(evaluation(40, 0.31), GATED, NONE, 3)
    lowered = SPEC.model_copy(update={"evaluation": EvaluationGate(suite="rules", min_reward=0.3)})
    verdict = judge(None, lowered, status_after(failed), 4)
    assert not verdict.held
    assert said(verdict) == {"Failed": ("False", "EvaluationAboveFloor")}
    assert [e.reason for e in verdict.events] == ["EvaluationAboveFloor"]


def test_without_a_gate_there_is_no_verdict() -> None:
    verdict = judge(evaluation(40, 0.0), SPEC, NONE, 3)
    assert not verdict.held and verdict.conditions == [] and verdict.fields.merge_patch() == {}


TRACKED = SPEC.model_copy(
    update={"tracking": TrackingSpec.model_validate({"mlflow": {"trackingUri": "http://ml:5000"}})}
)


def test_a_tracker_failing_past_its_patience_is_a_condition_told_once_and_cleared() -> None:
    failing = msgspec.structs.replace(
        report(7, age_s=10), tracking_unreachable_seconds=75.0, tracking_dropped_total=3
    )
    found = fold(failing, TRACKED, NONE, NOW - timedelta(hours=1), NOW, 1)
    assert found.tracking is not None and found.tracking.status == "True"
    assert found.tracking.reason == "TrackerUnreachable"
    assert "http://ml:5000 unreachable for 75s" in found.tracking.message
    assert "3 step reports dropped" in found.tracking.message
    assert [e.reason for e in found.events] == ["TrackingUnreachable"]
    said = RLRunStatus(conditions=[found.tracking])
    again = fold(failing, TRACKED, said, NOW - timedelta(hours=1), NOW, 1)
    assert again.events == []  # said once
    # A blip of a few retries is no condition; nor is a run without a tracker one.
    blip = msgspec.structs.replace(report(8, age_s=5), tracking_unreachable_seconds=6.0)
    cleared = fold(blip, TRACKED, said, NOW - timedelta(hours=1), NOW, 1).tracking
    assert cleared is not None and (cleared.status, cleared.reason) == ("False", "TrackerReachable")
    assert fold(failing, SPEC, NONE, NOW - timedelta(hours=1), NOW, 1).tracking is None

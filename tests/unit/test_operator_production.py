"""How the hub shows a production run's cycles (`rlfleet.operator.production.fold`): every
transition the conductor published since the status's is an event, once and in order;
the newest state is the status; what is not the run's is passed over."""

from __future__ import annotations

from datetime import UTC, datetime

from rlfleet.api.wire import (
    CycleEvent,
    CycleOutcome,
    CyclePhase,
    CycleReport,
    CycleState,
    FinishedCycle,
)
from rlfleet.operator.production import CycleUpdates, conditions, fold

RUN = "team-a_chat"


def state(number: int, phase: CyclePhase, run: str = RUN, **more) -> CycleState:
    return CycleState(run=run, number=number, phase=phase, since=1e9, serving=2, **more)


def report(run: str = RUN, cycle: int = 1) -> CycleReport:
    return CycleReport(
        run=run,
        cycle=cycle,
        capture_seq=9,
        captured=9,
        with_feedback=8,
        trained_on=8,
        dropped={"silent": 1},
        signals={},
        late_feedback=0,
        reward_mean=0.123456,
        served_from=0.0,
        served_to=1.0,
        finished_at=2.0,
    )


def test_each_transition_since_the_status_is_one_event_in_order() -> None:
    skipped = FinishedCycle(1, CycleOutcome.SKIPPED, None, "nothing to train on", 5.0)
    updates = CycleUpdates(
        RUN,
        [
            (4, state(1, CyclePhase.TRAINING, events=[CycleEvent("CycleCollected", "8")])),
            (
                5,
                state(
                    2,
                    CyclePhase.COLLECTING,
                    history=[skipped],
                    events=[CycleEvent("CycleSkipped", "0")],
                ),
            ),
        ],
        report(),
    )
    folded = fold(updates, None)
    assert [(e.type, e.reason) for e in folded.events] == [
        ("Normal", "CycleCollected"),
        ("Warning", "CycleSkipped"),
    ]
    status = folded.status
    assert status is not None
    assert (status.cycle, status.phase, status.state_sequence) == (2, "Collecting", 5)
    assert [(c.number, c.outcome) for c in status.history] == [(1, "Skipped")]
    assert status.last_collection is not None and status.last_collection.reward_mean == 0.1235
    # Read again with nothing new: the same status, no event.
    again = fold(CycleUpdates(RUN, [], report()), status)
    assert (again.status, again.events) == (status, [])


def test_what_is_not_the_runs_is_passed_over() -> None:
    forged = state(
        7, CyclePhase.CANARY, run="team-b_chat", events=[CycleEvent("CheckpointPromoted", "x")]
    )
    folded = fold(CycleUpdates(RUN, [(3, forged)], report(run="team-b_chat")), None)
    assert (folded.status, folded.events) == (None, [])


MOMENT = datetime(2026, 11, 28, 12, 0, tzinfo=UTC)


def test_the_candidate_under_way_its_stage_and_the_last_outcome_are_said_at_a_glance() -> None:
    rolled_back = FinishedCycle(3, CycleOutcome.ROLLED_BACK, 6, "version 6: worse by 0.2", 5.0)
    canary = state(4, CyclePhase.CANARY, candidate=7, history=[rolled_back])
    status = fold(CycleUpdates(RUN, [(9, canary)]), None).status
    assert status is not None
    assert (status.serving_version, status.candidate_version, status.phase) == (2, 7, "Canary")
    assert status.last_outcome == CycleOutcome.ROLLED_BACK
    progressing, promoted = conditions(status, [], 3, MOMENT)
    assert (progressing.type, progressing.status, progressing.reason) == (
        "Progressing",
        "True",
        "Canary",
    )
    assert progressing.message.startswith("cycle 4: candidate version 7 on the canary set since")
    assert progressing.message.endswith("production serves version 2")
    assert (promoted.type, promoted.status, promoted.reason) == ("Promoted", "False", "RolledBack")
    assert promoted.message.endswith("version 6: worse by 0.2")
    # Promoted, the next cycle collects: nothing under way, the last one promoted.
    done = FinishedCycle(4, CycleOutcome.PROMOTED, 7, "version 7: no worse", 6.0)
    collecting = state(5, CyclePhase.COLLECTING, history=[rolled_back, done])
    later = MOMENT.replace(minute=5)
    after = conditions(
        fold(CycleUpdates(RUN, [(10, collecting)]), status).status,
        [progressing, promoted],
        3,
        later,
    )
    assert [(c.status, c.reason) for c in after] == [("False", "Collecting"), ("True", "Promoted")]
    assert all(c.last_transition_time == "2026-11-28T12:05:00Z" for c in after)
    # Said again with nothing new: the same conditions, their transitions where they were.
    assert (
        conditions(fold(CycleUpdates(RUN, [(10, collecting)]), status).status, after, 3, MOMENT)
        == after
    )


def test_before_the_conductor_says_anything_both_are_unknown() -> None:
    said = conditions(None, [], 1, MOMENT)
    assert [(c.type, c.status, c.reason) for c in said] == [
        ("Progressing", "Unknown", "NoCycleYet"),
        ("Promoted", "Unknown", "NoCycleYet"),
    ]

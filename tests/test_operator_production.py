"""How the hub shows a production run's cycles (`rlfleet.operator.production.fold`): every
transition the conductor published since the status's is an event, once and in order;
the newest state is the status; what is not the run's is passed over."""

from __future__ import annotations

from rlfleet.api.wire import (
    CycleEvent,
    CycleOutcome,
    CyclePhase,
    CycleReport,
    CycleState,
    FinishedCycle,
)
from rlfleet.operator.production import CycleUpdates, fold

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

"""What a production run's conductor published means for the run's status. Pure: no I/O.

The conductor (`rlfleet.operator.conductor`) runs the cycles and publishes a `CycleState`
after each transition, with that transition's events. The hub reads every state after
the one its status shows (`stateSequence`), posts their events in order, and shows the
newest, with the collector's newest cycle report beside it. A state the hub missed is
never skipped: each is read by its sequence. A stream made anew (its sequences start
again) is read from its newest state.

Two conditions say it at a glance (`kubectl get rlrun` shows the same as columns):
`Progressing`, true while a cycle's candidate is trained, evaluated or canaried (its
reason the stage), and `Promoted`, whether the last finished cycle's candidate was
(its reason the outcome). Both are Unknown until the conductor has said.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from datetime import UTC, datetime

from rlfleet.api.meta import Condition
from rlfleet.api.production import (
    CollectionStatus,
    Dropped,
    FinishedCycleStatus,
    ProductionStatus,
)
from rlfleet.api.wire import CycleOutcome, CyclePhase, CycleReport, CycleState
from rlfleet.operator.status import Event, condition, timestamp

# Transitions an on-call engineer is warned of: a candidate users will not get.
WARNINGS = frozenset(
    {
        "CandidateRejected",
        "CanaryRolledBack",
        "CycleHeldBack",
        "CycleSkipped",
        "FeedbackDistrusted",
        "CycleTimedOut",
        "OrderRefused",
        "ServingOverridden",
    }
)


@dataclass(frozen=True)
class CycleUpdates:
    """The conductor's states after the status's, oldest first, with their sequences on
    the run's cycle stream; and the collector's newest cycle report. `run` is the name
    they must carry (the run's key on NATS)."""

    run: str
    states: Sequence[tuple[int, CycleState]] = ()
    report: CycleReport | None = None


@dataclass
class Folded:
    status: ProductionStatus | None
    events: list[Event] = field(default_factory=list)


def _moment(seconds: float) -> str:
    return timestamp(datetime.fromtimestamp(seconds, UTC))


def _collection(report: CycleReport | None) -> CollectionStatus | None:
    if report is None:
        return None
    return CollectionStatus(
        cycle=report.cycle,
        captured=report.captured,
        with_feedback=report.with_feedback,
        trained_on=report.trained_on,
        dropped=[Dropped(reason=r, count=n) for r, n in sorted(report.dropped.items())],
        late_feedback=report.late_feedback,
        reward_mean=round(report.reward_mean, 4),
    )


def _status(state: CycleState, seq: int, collection: CollectionStatus | None) -> ProductionStatus:
    history = [
        FinishedCycleStatus(
            number=done.number,
            outcome=done.outcome,
            candidate_version=done.candidate,
            reason=done.why,
            finished=_moment(done.finished_at),
        )
        for done in state.history
    ]
    return ProductionStatus(
        cycle=state.number,
        phase=state.phase,
        since=_moment(state.since),
        serving_version=state.serving,
        previous_version=state.previous,
        candidate_version=state.candidate,
        last_outcome=state.history[-1].outcome if state.history else None,
        orders_done=state.orders,
        last_collection=collection,
        history=history,
        state_sequence=seq,
    )


def fold(updates: CycleUpdates, old: ProductionStatus | None) -> Folded:
    """The run's production status after `updates`, and the events of the transitions
    it has not posted yet. States of another run (a forgery, a bug) are passed over."""
    run, report = updates.run, updates.report
    report = report if report is not None and report.run == run else None
    collection = _collection(report) or (old.last_collection if old is not None else None)
    mine = [(seq, state) for seq, state in updates.states if state.run == run]
    if not mine:
        if old is None:
            return Folded(None)
        return Folded(old.model_copy(update={"last_collection": collection}))
    events = [
        Event("Warning" if e.reason in WARNINGS else "Normal", e.reason, e.message)
        for _, state in mine
        for e in state.events
    ]
    seq, newest = mine[-1]
    return Folded(_status(newest, seq, collection), events)


def conditions(
    status: ProductionStatus | None,
    previous: Sequence[Condition],
    generation: int,
    moment: datetime,
) -> list[Condition]:
    """`Progressing` and `Promoted`, from the run's production status."""
    if status is None:
        waiting = "the run's conductor has published no cycle yet"
        return [
            condition(previous, kind, None, "NoCycleYet", waiting, generation, moment)
            for kind in ("Progressing", "Promoted")
        ]
    serving = f"production serves version {status.serving_version}"
    if status.phase == CyclePhase.COLLECTING:
        progressing = (False, f"cycle {status.cycle} collecting since {status.since}; {serving}")
    else:
        progressing = (
            True,
            f"cycle {status.cycle}: candidate version {status.candidate_version} "
            f"{STAGES[status.phase]} since {status.since}; {serving}",
        )
    last = status.history[-1] if status.history else None
    if last is None:
        promoted = (None, "NoCycleYet", f"no cycle has finished yet; {serving}")
    else:
        promoted = (
            last.outcome == CycleOutcome.PROMOTED,
            str(last.outcome),
            f"cycle {last.number}, finished {last.finished}: {last.reason}",
        )
    true, message = progressing
    return [
        condition(previous, "Progressing", true, str(status.phase), message, generation, moment),
        condition(previous, "Promoted", *promoted, generation, moment),
    ]


STAGES = {
    CyclePhase.TRAINING: "training",
    CyclePhase.EVALUATING: "evaluated against the serving version",
    CyclePhase.CANARY: "on the canary set",
}

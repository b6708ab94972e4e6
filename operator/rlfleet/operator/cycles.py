"""A production run's cycle: collect, train a candidate, evaluate, canary, then promote or
reject or roll back. A pure decision over what the reconcile observed; the caller acts
on the actions it returns, records the state in the run's status and emits the events.

    Collecting --the collector closes the cycle--> Training (no trajectories: Skipped)
    Training --the trainer took all of them--> Evaluating, both versions on one suite
    Evaluating --the gate passes--> Canary, the canary set told the candidate
               --the gate refuses--> Rejected
    Canary --the canary judged--> Promoted: every set told the candidate
           --judged worse--> RolledBack: the canary set told the serving version
    Training or Evaluating --past the phase deadline--> TimedOut

A trainer or an evaluator that never reports would hold the cycle, and production's
learning, forever: past its deadline the cycle ends and the next one collects. A canary
needs no deadline of its own: its window is the longest it runs (`judge_canary`).

A set is told the version it may serve next ahead of serving it (`standby`): the canary
set the candidate as its evaluation starts, the stable set as its canary does, and the
canary set, once it serves the candidate, the version to roll back to. Its servers
fetch or rebuild those weights while they serve, so a switch pauses them only for the
write (`bench/realtime.py`'s `serving_p99_ms_during_swap`).

Every cycle ends in exactly one outcome, then the next cycle collects. Only a promotion
changes what production serves, and only to a candidate that passed the gate and its
canary. A cycle whose candidate is not promoted sends the trainer back to the serving
version, so the next candidate is trained from what users actually saw.

An on-call order (`ServeOrder`: `rlfleet promote`, `rlfleet rollback`) overrides all of
it, in any phase: every set serves the version named and the cycle under way ends
(Promoted when it names the candidate, RolledBack when it names the serving version
during a canary, Overridden otherwise). Only a version whose weights and checkpoint are
kept can be named: the serving one, the one before it, or a candidate under evaluation.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import StrEnum

from msgspec.structs import replace

from rlfleet.api.inferencepool import CANARY, STABLE
from rlfleet.api.wire import (
    CYCLE_HISTORY,
    CycleEvent,
    CycleReport,
    CycleState,
    FinishedCycle,
    RewardTally,
    ServeOrder,
    servable,
)
from rlfleet.api.wire import CycleOutcome as Outcome
from rlfleet.api.wire import CyclePhase as Phase
from rlfleet.launch.production import CanaryPolicy
from rlfleet.operator.promotion import CanaryCall, GateVerdict, judge_canary


def first_state(run: str, serving: int, now: float) -> CycleState:
    return CycleState(run=run, number=1, phase=Phase.COLLECTING, since=now, serving=serving)


@dataclass(frozen=True)
class Observed:
    now: float
    report: CycleReport | None  # the collector's newest
    # Of this cycle's trajectories, how many the trainer has trained on or dropped, and
    # the policy version after the last step that took any of them.
    taken: int = 0
    version_after: int | None = None
    gate: GateVerdict | None = None  # once both versions are evaluated on the suite
    live: tuple[RewardTally, RewardTally] | None = None  # canary, stable
    order: ServeOrder | None = None  # the newest on-call order, in any phase


class Act(StrEnum):
    EVALUATE = "evaluate"  # the candidate and the serving version, on the same items
    SERVE = "serve"  # tell a replica set a version
    RESET_TRAINER = "reset_trainer"  # back to a version's weights


@dataclass(frozen=True)
class Action:
    act: Act
    version: int
    replica_set: str | None = None
    standby: int | None = None  # SERVE: the version the set may be told next


@dataclass(frozen=True)
class Step:
    state: CycleState
    actions: list[Action] = field(default_factory=list)
    events: list[CycleEvent] = field(default_factory=list)


def advance(state: CycleState, seen: Observed, canary: CanaryPolicy, deadline_s: float) -> Step:
    if seen.order is not None and seen.order.number > state.orders:
        return _ordered(state, seen.order, seen.now)
    step = _step(state, seen, canary)
    late = seen.now - state.since >= deadline_s
    if late and step.state == state and state.phase in (Phase.TRAINING, Phase.EVALUATING):
        return _timed_out(state, seen)
    return step


def _step(state: CycleState, seen: Observed, canary: CanaryPolicy) -> Step:
    match state.phase:
        case Phase.COLLECTING:
            return _collecting(state, seen)
        case Phase.TRAINING:
            return _training(state, seen)
        case Phase.EVALUATING:
            return _evaluating(state, seen)
        case Phase.CANARY:
            return _canary(state, seen, canary)


def _phase(state: CycleState, phase: Phase, now: float, **changes) -> CycleState:
    return replace(state, phase=phase, since=now, **changes)


def _finish(state: CycleState, outcome: Outcome, why: str, now: float, serving: int) -> CycleState:
    done = FinishedCycle(state.number, outcome, state.candidate, why, now)
    return CycleState(
        run=state.run,
        number=state.number + 1,
        phase=Phase.COLLECTING,
        since=now,
        serving=serving,
        history=[*state.history, done][-CYCLE_HISTORY:],
        previous=state.serving if serving != state.serving else state.previous,
        orders=state.orders,
    )


def _ordered(state: CycleState, order: ServeOrder, now: float) -> Step:
    version, heard = order.version, replace(state, orders=order.number)
    serve = [Action(Act.SERVE, version, CANARY), Action(Act.SERVE, version, STABLE)]
    kept = servable(state.phase, state.serving, state.previous, state.candidate)
    if version not in kept:
        why = (
            f"order {order.number}: version {version} cannot be served, only "
            f"{', '.join(map(str, kept))} (the serving version, the one before it, a "
            "candidate under evaluation): the weights of others are not kept"
        )
        return Step(heard, events=_event("OrderRefused", why))
    by = f"by on-call order {order.number}"
    if state.phase == Phase.COLLECTING and version == state.serving:
        why = f"order {order.number}: production already serves version {version}"
        return Step(heard, serve, _event("ServingOverridden", why))
    if version == state.candidate and state.phase in (Phase.EVALUATING, Phase.CANARY):
        why = f"version {version}: promoted {by}"
        promoted = _finish(heard, Outcome.PROMOTED, why, now, serving=version)
        return Step(promoted, serve, _event("CheckpointPromoted", why))
    back = [Action(Act.RESET_TRAINER, version)]
    if state.phase == Phase.CANARY and version == state.serving:
        why = f"version {state.candidate}: rolled back {by}"
        rolled_back = _finish(heard, Outcome.ROLLED_BACK, why, now, state.serving)
        return Step(rolled_back, serve + back, _event("CanaryRolledBack", why))
    was = f" (was {state.serving})" if version != state.serving else ""
    why = f"cycle {state.number} ended {by}: production serves version {version}{was}"
    overridden = _finish(heard, Outcome.OVERRIDDEN, why, now, serving=version)
    return Step(overridden, serve + back, _event("ServingOverridden", why))


def _event(reason: str, message: str) -> list[CycleEvent]:
    return [CycleEvent(reason, message)]


def _collecting(state: CycleState, seen: Observed) -> Step:
    report = seen.report
    if report is None or report.cycle != state.number:
        return Step(state)
    numbers = (
        f"cycle {report.cycle}: {report.captured} completions, {report.with_feedback} "
        f"answered, {report.trained_on} to train on, mean reward {report.reward_mean:+.3f}"
    )
    distrusted = []
    if report.distrusted:
        why = (
            f"cycle {report.cycle}: {report.distrusted} user(s)' feedback runs against the "
            "pool's history and is dropped from now on (the collector's log names them)"
        )
        distrusted = _event("FeedbackDistrusted", why)
    if report.held_back:
        why = f"{numbers}: held back, {report.held_back}"
        held = _finish(state, Outcome.SKIPPED, why, seen.now, state.serving)
        return Step(held, events=distrusted + _event("CycleHeldBack", why))
    if report.trained_on == 0:
        why = f"{numbers}: nothing to train on"
        skipped = _finish(state, Outcome.SKIPPED, why, seen.now, state.serving)
        return Step(skipped, events=distrusted + _event("CycleSkipped", why))
    training = _phase(state, Phase.TRAINING, seen.now, collected=report.trained_on)
    return Step(training, events=distrusted + _event("CycleCollected", numbers))


def _training(state: CycleState, seen: Observed) -> Step:
    if seen.taken < state.collected or seen.version_after is None:
        return Step(state)
    candidate = seen.version_after
    evaluating = _phase(state, Phase.EVALUATING, seen.now, candidate=candidate)
    message = f"cycle {state.number}: candidate version {candidate} against {state.serving}"
    # The canary set fetches the candidate while it is evaluated, to switch at once.
    ahead = Action(Act.SERVE, state.serving, CANARY, standby=candidate)
    return Step(
        evaluating,
        [Action(Act.EVALUATE, candidate), Action(Act.EVALUATE, state.serving), ahead],
        _event("CandidateTrained", message),
    )


def _evaluating(state: CycleState, seen: Observed) -> Step:
    gate, candidate = seen.gate, state.candidate
    if gate is None or candidate is None:
        return Step(state)
    if not gate.passed:
        why = f"version {candidate}: " + "; ".join(gate.reasons)
        rejected = _finish(state, Outcome.REJECTED, why, seen.now, state.serving)
        return Step(
            rejected,
            [Action(Act.RESET_TRAINER, state.serving)],
            _event("CandidateRejected", why),
        )
    message = (
        f"version {candidate} on the canary set: {gate.mean_difference:+.4f} over "
        f"{gate.items} items, lower bound {gate.lower_bound:+.4f}"
    )
    if gate.held_out_gain is not None:
        message += f"; held-out gain {gate.held_out_gain:+.2e} per token"
    canary = _phase(state, Phase.CANARY, seen.now)
    # During the window the stable set fetches the candidate and the canary set rebuilds
    # the serving version: a promotion, or a rollback, is then only the write.
    serve = [
        Action(Act.SERVE, candidate, CANARY, standby=state.serving),
        Action(Act.SERVE, state.serving, STABLE, standby=candidate),
    ]
    return Step(canary, serve, _event("CanaryStarted", message))


def _timed_out(state: CycleState, seen: Observed) -> Step:
    elapsed = f"{seen.now - state.since:.0f} s"
    if state.phase == Phase.TRAINING:
        what = f"trained on {seen.taken} of its {state.collected} trajectories in {elapsed}"
    else:
        what = f"version {state.candidate} not evaluated after {elapsed}"
    why = f"cycle {state.number}: {what}; the trainer goes back to version {state.serving}"
    timed_out = _finish(state, Outcome.TIMED_OUT, why, seen.now, state.serving)
    return Step(timed_out, [Action(Act.RESET_TRAINER, state.serving)], _event("CycleTimedOut", why))


def _canary(state: CycleState, seen: Observed, policy: CanaryPolicy) -> Step:
    candidate = state.candidate
    if candidate is None:
        return Step(state)
    # No tally yet is no canary traffic yet: judged so, it cannot wait past the window.
    live = seen.live or (RewardTally(), RewardTally())
    verdict = judge_canary(*live, seen.now - state.since, policy)
    if verdict.call == CanaryCall.WAIT:
        return Step(state)
    why = f"version {candidate}: {verdict.reason}"
    if verdict.call == CanaryCall.PROMOTE:
        promoted = _finish(state, Outcome.PROMOTED, why, seen.now, serving=candidate)
        return Step(
            promoted, [Action(Act.SERVE, candidate, STABLE)], _event("CheckpointPromoted", why)
        )
    rolled_back = _finish(state, Outcome.ROLLED_BACK, why, seen.now, state.serving)
    return Step(
        rolled_back,
        [Action(Act.SERVE, state.serving, CANARY), Action(Act.RESET_TRAINER, state.serving)],
        _event("CanaryRolledBack", why),
    )

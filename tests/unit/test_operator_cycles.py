"""A production run's cycle as a pure decision: scripted cycles with known outcomes, and
generated sequences of observations for the invariants every cycle keeps."""

from __future__ import annotations

import dataclasses

from hypothesis import given, settings
from hypothesis import strategies as st
from msgspec.structs import replace

from rlfleet.api.wire import CycleEvent, CycleReport, CycleState, RewardTally, ServeOrder
from rlfleet.launch.production import CanaryPolicy
from rlfleet.operator.cycles import (
    CANARY,
    STABLE,
    Act,
    Action,
    Observed,
    Outcome,
    Phase,
    Step,
    advance,
    first_state,
)
from rlfleet.operator.production import WARNINGS
from rlfleet.operator.promotion import GateVerdict

POLICY = CanaryPolicy(
    detectable_drop=0.2, false_rollback_rate=0.05, miss_rate=0.05, window_s=600, min_samples=20
)
DEADLINE = 3000.0  # for training, and for evaluating, a candidate
PASSED = GateVerdict(True, 0.01, -0.005, 200, ())
REFUSED = GateVerdict(False, -0.1, -0.12, 200, ("not shown within 0.02",))


def decide(state: CycleState, seen: Observed) -> Step:
    return advance(state, seen, POLICY, DEADLINE)


def report(cycle: int, trained_on: int) -> CycleReport:
    return CycleReport(
        run="live",
        cycle=cycle,
        capture_seq=10 * cycle,
        captured=trained_on + 2,
        with_feedback=trained_on,
        trained_on=trained_on,
        dropped={"no_signal": 2},
        signals={"accepted": trained_on},
        late_feedback=0,
        reward_mean=0.25,
        served_from=0.0,
        served_to=1.0,
        finished_at=1.0,
    )


def live(good: int, bad: int) -> RewardTally:
    rewards = RewardTally()
    for reward in [1.0] * good + [-1.0] * bad:
        rewards = rewards.add(reward)
    return rewards


def test_a_cycle_collected_trained_gated_and_canaried_is_promoted():
    state = first_state("live", serving=0, now=0)
    state = decide(state, Observed(1, report(1, 16))).state
    assert (state.phase, state.collected) == (Phase.TRAINING, 16)
    assert decide(state, Observed(2, None, taken=10, version_after=3)).state == state
    step = decide(state, Observed(3, None, taken=16, version_after=4))
    # Each set holds the version it may be told next: the canary set the candidate while
    # it is evaluated, then the serving version while it is canaried (a rollback), and the
    # stable set the candidate: each switch is then only the write.
    assert step.actions == [
        Action(Act.EVALUATE, 4),
        Action(Act.EVALUATE, 0),
        Action(Act.SERVE, 0, CANARY, standby=4),
    ]
    step = decide(step.state, Observed(4, None, gate=PASSED))
    assert step.actions == [
        Action(Act.SERVE, 4, CANARY, standby=0),
        Action(Act.SERVE, 0, STABLE, standby=4),
    ]
    assert step.events[0].reason == "CanaryStarted"
    canary = step.state
    even = (live(30, 10), live(300, 100))
    assert decide(canary, Observed(100, None, live=even)).state == canary  # window
    step = decide(canary, Observed(4 + 600, None, live=even))
    assert step.actions == [Action(Act.SERVE, 4, STABLE)]
    assert (step.state.serving, step.state.number, step.state.phase) == (4, 2, Phase.COLLECTING)
    assert step.state.history[-1].outcome == Outcome.PROMOTED
    assert step.events[0].reason == "CheckpointPromoted"


def test_a_poisoned_candidate_is_rolled_back_and_the_trainer_sent_back():
    state = CycleState(run="live", number=2, phase=Phase.CANARY, since=0, serving=4, candidate=7)
    poisoned = (live(2, 30), live(300, 100))
    step = decide(state, Observed(60, None, live=poisoned))
    assert step.actions == [Action(Act.SERVE, 4, CANARY), Action(Act.RESET_TRAINER, 4)]
    assert step.state.serving == 4 and step.state.history[-1].outcome == Outcome.ROLLED_BACK
    reason, message = step.events[0].reason, step.events[0].message
    assert reason == "CanaryRolledBack" and message.startswith("version 7: worse by 0.2")


def test_a_refused_candidate_never_reaches_users():
    state = CycleState(
        run="live", number=3, phase=Phase.EVALUATING, since=0, serving=4, candidate=9
    )
    step = decide(state, Observed(1, None, gate=REFUSED))
    assert step.actions == [Action(Act.RESET_TRAINER, 4)]
    assert step.events == [CycleEvent("CandidateRejected", "version 9: not shown within 0.02")]
    assert step.state.history[-1].outcome == Outcome.REJECTED


def test_a_cycle_with_nothing_to_train_on_is_skipped():
    step = decide(first_state("live", 0, 0), Observed(1, report(1, 0)))
    assert step.state.number == 2 and step.state.history[-1].outcome == Outcome.SKIPPED
    assert step.events[0].reason == "CycleSkipped"


def test_a_cycle_whose_feedback_runs_against_history_is_held_back_with_a_warning():
    why = "its rewards run against what history expects of the same prompts: ..."
    held = replace(report(1, 0), held_back=why, distrusted=1)
    step = decide(first_state("live", 0, 0), Observed(1, held))
    assert step.state.number == 2 and step.state.history[-1].outcome == Outcome.SKIPPED
    assert step.actions == []  # nothing trained, nothing served anew
    assert [e.reason for e in step.events] == ["FeedbackDistrusted", "CycleHeldBack"]
    assert why in step.events[1].message and "1 user(s)" in step.events[0].message
    assert {e.reason for e in step.events} <= WARNINGS


def test_a_cycle_whose_trainer_or_evaluator_never_finishes_times_out():
    training = CycleState(
        run="live", number=3, phase=Phase.TRAINING, since=100, serving=4, collected=16
    )
    stuck = Observed(100 + DEADLINE - 1, None, taken=10, version_after=6)
    assert decide(training, stuck).state == training
    late = Observed(100 + DEADLINE, None, taken=10, version_after=6)
    step = decide(training, late)
    assert step.actions == [Action(Act.RESET_TRAINER, 4)]  # it learnt from part of a cycle
    assert (step.state.number, step.state.phase, step.state.serving) == (4, Phase.COLLECTING, 4)
    assert step.state.history[-1].outcome == Outcome.TIMED_OUT
    assert step.events == [
        CycleEvent(
            "CycleTimedOut",
            "cycle 3: trained on 10 of its 16 trajectories in 3000 s; "
            "the trainer goes back to version 4",
        )
    ]
    # Progress seen at the deadline is taken, not thrown away.
    done = decide(training, Observed(100 + DEADLINE, None, taken=16, version_after=6))
    assert done.state.phase == Phase.EVALUATING
    evaluating = replace(training, phase=Phase.EVALUATING, candidate=6)
    step = decide(evaluating, Observed(100 + DEADLINE, None))
    assert step.events[0].message.startswith("cycle 3: version 6 not evaluated after 3000 s")


def test_a_canary_no_user_answers_is_rolled_back_at_its_windows_end():
    canary = CycleState(run="live", number=2, phase=Phase.CANARY, since=0, serving=4, candidate=7)
    assert decide(canary, Observed(599, None)).state == canary
    step = decide(canary, Observed(600, None))
    assert step.actions == [Action(Act.SERVE, 4, CANARY), Action(Act.RESET_TRAINER, 4)]
    assert "too little canary traffic" in step.events[0].message


@st.composite
def observation(draw, state: CycleState, now: float) -> Observed:
    cycle = state.number if draw(st.booleans()) else draw(st.integers(1, 9))
    return Observed(
        now=now,
        report=draw(st.none() | st.builds(report, st.just(cycle), st.integers(0, 5))),
        taken=draw(st.integers(0, 6)),
        version_after=draw(st.none() | st.integers(0, 50)),
        gate=draw(st.sampled_from([None, PASSED, REFUSED])),
        live=draw(
            st.none()
            | st.tuples(
                st.builds(live, st.integers(0, 40), st.integers(0, 40)),
                st.builds(live, st.integers(0, 400), st.integers(0, 400)),
            )
        ),
    )


@settings(max_examples=300, deadline=None)
@given(st.data(), st.integers(1, 40))
def test_every_cycle_ends_once_and_only_a_judged_candidate_is_served(data, steps):
    state, now = first_state("live", serving=0, now=0), 0.0
    passed: set[int] = set()  # candidates whose gate passed
    silent = data.draw(st.booleans())  # a trainer and an evaluator that never report
    for _ in range(steps):
        now += data.draw(st.floats(0, 400))
        seen = data.draw(observation(state, now))
        if silent:
            seen = dataclasses.replace(seen, taken=0, version_after=None, gate=None)
        step = decide(state, seen)
        if state.phase == Phase.EVALUATING and seen.gate is not None and seen.gate.passed:
            passed.add(state.candidate)
        for action in step.actions:
            if action.act == Act.SERVE:  # a candidate that passed, or the serving version
                assert action.version in passed or action.version == state.serving
            if action.standby is not None:  # the candidate under way, or the way back
                kept = {state.serving, step.state.candidate}
                assert {action.version, action.standby} == kept
            if action.act == Act.RESET_TRAINER:
                assert action.version == state.serving
        new = step.state
        late = now - state.since >= DEADLINE
        if state.phase in (Phase.TRAINING, Phase.EVALUATING) and late and new.phase == state.phase:
            # Nothing holds a cycle past its deadline: a phase that made no progress by
            # then ends it. A candidate trained just then goes on to its evaluation.
            assert new.number == state.number + 1
        if new.number != state.number:  # the cycle ended, in one outcome and one event
            assert new.number == state.number + 1 and new.phase == Phase.COLLECTING
            assert len(step.events) == 1 and new.history[-1].number == state.number
            if new.serving != state.serving:
                assert new.history[-1].outcome == Outcome.PROMOTED and new.serving in passed
        else:
            assert new.serving == state.serving and new.history == state.history
        state = new


def test_an_on_call_order_serves_only_a_kept_version_once_and_ends_the_cycle():
    canary = CycleState(
        run="live", number=5, phase=Phase.CANARY, since=0, serving=4, candidate=7, previous=2
    )
    everywhere = [Action(Act.SERVE, 7, CANARY), Action(Act.SERVE, 7, STABLE)]
    step = decide(canary, Observed(1, None, order=ServeOrder("live", 1, 7)))
    assert step.actions == everywhere  # the trainer already holds the candidate
    done = step.state
    assert (done.number, done.serving, done.previous, done.orders) == (6, 7, 4, 1)
    assert done.history[-1].outcome == Outcome.PROMOTED
    assert step.events[0].message == "version 7: promoted by on-call order 1"
    # The same order again is not carried out twice.
    assert decide(done, Observed(2, None, order=ServeOrder("live", 1, 7))).actions == []

    step = decide(canary, Observed(1, None, order=ServeOrder("live", 1, 4)))
    assert step.actions[-1] == Action(Act.RESET_TRAINER, 4)
    assert step.state.history[-1].outcome == Outcome.ROLLED_BACK
    assert (step.state.serving, step.state.previous) == (4, 2)

    # Back past a promotion, then forward again: each is the other's previous.
    collecting = replace(canary, phase=Phase.COLLECTING, candidate=None)
    back = decide(collecting, Observed(1, None, order=ServeOrder("live", 1, 2)))
    assert (back.state.serving, back.state.previous) == (2, 4)
    assert back.state.history[-1].outcome == Outcome.OVERRIDDEN
    assert back.events[0].reason == "ServingOverridden"
    forth = decide(back.state, Observed(2, None, order=ServeOrder("live", 2, 4)))
    assert (forth.state.serving, forth.state.previous) == (4, 2)

    # A version whose weights are gone: refused, heard, nothing served.
    refused = decide(collecting, Observed(1, None, order=ServeOrder("live", 1, 7)))
    assert refused.actions == [] and refused.state == replace(collecting, orders=1)
    assert refused.events[0].reason == "OrderRefused"

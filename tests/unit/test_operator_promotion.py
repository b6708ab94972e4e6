"""The production gate and the canary's judgement: a pure decision, tried on cases with known
answers and on generated scores for the properties any verdict must keep."""

from __future__ import annotations

import math

import msgspec
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from rlfleet.api.wire import AnswerStats, EvaluationReport, RewardTally
from rlfleet.launch.production import CanaryPolicy, GatePolicy
from rlfleet.operator.promotion import (
    AGAINST_HISTORY_Z,
    CanaryCall,
    compare_live,
    feedback_agreement,
    gate,
    gate_reports,
    judge_canary,
)

POLICY = GatePolicy(
    max_regression=0.02,
    confidence=0.95,
    max_empty_increase=0.05,
    length_ratio=(0.5, 2.0),
    max_malformed_tool_calls=0.1,
)
SAME = AnswerStats(answers=100, empty=1, tokens=3000, tool_calls=50, malformed_tool_calls=1)
CANARY = CanaryPolicy(
    detectable_drop=0.2, false_rollback_rate=0.05, miss_rate=0.05, window_s=600, min_samples=50
)


def scores(mean: float, items: int = 200, seed: int = 0) -> list[float]:
    rng = np.random.default_rng(seed)
    return np.clip(rng.normal(mean, 0.3, items), 0, 1).tolist()


def test_a_candidate_as_good_as_the_serving_one_passes():
    serving = scores(0.6)
    verdict = gate(serving, serving, SAME, SAME, POLICY)
    assert verdict.passed and verdict.reasons == () and verdict.lower_bound == 0


def test_a_regressed_candidate_is_rejected_with_the_numbers():
    serving = scores(0.6)
    worse = [s - 0.1 for s in serving]
    verdict = gate(worse, serving, SAME, SAME, POLICY)
    assert not verdict.passed
    (reason,) = verdict.reasons
    assert "-0.1000 over 200 items" in reason and "95% lower bound" in reason


def test_too_few_items_to_show_anything_reject():
    assert not gate([0.9], [0.5], SAME, SAME, POLICY).passed
    assert not gate([], [], SAME, SAME, POLICY).passed


def test_a_model_that_stops_answering_is_rejected_however_it_scores():
    silent = AnswerStats(answers=100, empty=40, tokens=600, tool_calls=50, malformed_tool_calls=1)
    verdict = gate(scores(0.9), scores(0.6), silent, SAME, POLICY)
    assert not verdict.passed
    assert any("empty 40.0% of the time against 1.0%" in r for r in verdict.reasons)
    assert any("0.20x as long" in r for r in verdict.reasons)


def test_a_candidate_that_learnt_against_the_cycle_befores_users_is_rejected():
    """However well it scores: one cycle of inverted feedback may not show on the suite."""
    serving = scores(0.6)
    policy = msgspec.structs.replace(POLICY, max_held_out_loss=1e-3)
    verdict = gate(serving, serving, SAME, SAME, policy, held_out_gain=-2.5e-3)
    assert not verdict.passed and verdict.held_out_gain == -2.5e-3
    (reason,) = verdict.reasons
    assert "held-out gain -2.50e-03 per token, below -0.001" in reason
    # Within the bound, above it, or with nothing held out: the suite decides.
    for gain in (-1e-3, 0.0, 4e-3, None):
        assert gate(serving, serving, SAME, SAME, policy, held_out_gain=gain).passed


def test_malformed_tool_calls_beyond_the_bound_reject():
    sloppy = AnswerStats(answers=100, empty=1, tokens=3000, tool_calls=50, malformed_tool_calls=10)
    verdict = gate(scores(0.6), scores(0.6), sloppy, SAME, POLICY)
    assert verdict.reasons == ("20.0% of its tool calls are malformed against 2.0%",)


@settings(max_examples=100, deadline=None)
@given(
    st.lists(st.floats(0, 1), min_size=2, max_size=60),
    st.floats(-0.5, 0.5),
    st.floats(0, 0.3),
)
def test_better_scores_never_turn_a_pass_into_a_rejection(serving, shift, lift):
    candidate = [s + shift for s in serving]
    first = gate(candidate, serving, SAME, SAME, POLICY)
    lifted = gate([c + lift for c in candidate], serving, SAME, SAME, POLICY)
    assert lifted.lower_bound >= first.lower_bound - 1e-9
    assert lifted.passed or not first.passed
    assert gate(candidate, serving, SAME, SAME, POLICY) == first  # the same verdict again


def live(rewards: list[float], expected: list[float] | None = None) -> RewardTally:
    total = RewardTally()
    for reward, guess in zip(rewards, expected or [0.0] * len(rewards), strict=True):
        total = total.add(reward, guess)
    return total


def test_a_clearly_worse_canary_is_rolled_back_before_its_window_ends():
    stable = live([1.0] * 70 + [-1.0] * 30)
    poisoned = live([1.0] * 10 + [-1.0] * 50)
    verdict = judge_canary(poisoned, stable, elapsed_s=60, policy=CANARY)
    assert verdict.call == CanaryCall.ROLL_BACK
    assert verdict.reason.startswith("worse by 0.2 at odds of 20 or more: canary -0.667 over 60")


def test_a_clearly_equal_canary_is_promoted_before_its_window_ends():
    stable = live([1.0] * 700 + [-1.0] * 300)
    canary = live([1.0] * 140 + [-1.0] * 60)
    verdict = judge_canary(canary, stable, 60, CANARY)
    assert verdict.call == CanaryCall.PROMOTE and verdict.reason.startswith("no worse")
    assert verdict.evidence <= -math.log(20)


def test_a_close_canary_waits_for_the_evidence_then_goes_the_likelier_way():
    stable = live([1.0] * 60 + [-1.0] * 40)  # +0.2
    nearer_none = live([1.0] * 56 + [-1.0] * 44)  # +0.12: 0.08 below
    nearer_the_drop = live([1.0] * 54 + [-1.0] * 46)  # +0.08: 0.12 below
    for canary in (nearer_none, nearer_the_drop):
        assert judge_canary(canary, stable, 60, CANARY).call == CanaryCall.WAIT
    promoted = judge_canary(nearer_none, stable, 600, CANARY)
    assert promoted.call == CanaryCall.PROMOTE and "nearer no drop" in promoted.reason
    rolled_back = judge_canary(nearer_the_drop, stable, 600, CANARY)
    assert rolled_back.call == CanaryCall.ROLL_BACK and "nearer a drop" in rolled_back.reason


def test_a_canary_without_traffic_is_never_promoted():
    stable = live([1.0] * 100)
    quiet = live([1.0] * 3)
    assert judge_canary(quiet, stable, 599, CANARY).call == CanaryCall.WAIT
    verdict = judge_canary(quiet, stable, 600, CANARY)
    assert verdict.call == CanaryCall.ROLL_BACK and "too little canary traffic" in verdict.reason


def test_what_history_expected_takes_the_prompts_share_of_the_spread_away():
    """Half the prompts every version gets right, half none (but for users' mistakes):
    history knows which, and the same difference is then far surer."""
    rng = np.random.default_rng(0)
    easy = rng.random(400) < 0.5
    liked = np.where(rng.random(400) < 0.05, ~easy, easy)
    rewards, guesses = np.where(liked, 1.0, -1.0).tolist(), np.where(easy, 0.9, -0.9).tolist()
    canary, stable = live(rewards[:200], guesses[:200]), live(rewards[200:], guesses[200:])
    plain = compare_live(live(rewards[:200]), live(rewards[200:]))
    adjusted = compare_live(canary, stable)
    assert plain.variance_kept == pytest.approx(1.0)
    assert adjusted.variance_kept < 0.3 and adjusted.variance < 0.3 * plain.variance
    assert adjusted.plain_difference == plain.difference
    # History that expects the same of every completion (a prompt and a user it never saw)
    # adjusts nothing, however its sums round.
    same = compare_live(live(rewards[:200], [0.1] * 200), live(rewards[200:], [0.1] * 200))
    assert (same.difference, same.variance) == (plain.difference, plain.variance)


def test_feedback_against_history_is_not_judged_on():
    """The same prompts as above, the users saying the opposite (a client's instrumentation
    inverted): the candidate looks far better, and is rolled back unjudged. Said honestly,
    the same answers are judged as they come."""
    rng = np.random.default_rng(1)
    easy = rng.random(400) < 0.5
    liked = np.where(rng.random(400) < 0.05, ~easy, easy)
    liked[:200] |= rng.random(200) < 0.3  # the candidate's answers are liked more
    rewards, guesses = np.where(liked, 1.0, -1.0), np.where(easy, 0.9, -0.9).tolist()
    honest = judge_canary(
        live(rewards[:200].tolist(), guesses[:200]),
        live(rewards[200:].tolist(), guesses[200:]),
        60,
        CANARY,
    )
    assert honest.call == CanaryCall.PROMOTE and honest.reason.startswith("no worse")
    said = (-rewards).tolist()
    inverted = judge_canary(
        live(said[:200], guesses[:200]), live(said[200:], guesses[200:]), 60, CANARY
    )
    assert inverted.call == CanaryCall.ROLL_BACK
    assert inverted.reason.startswith("not judged, users' feedback runs against the pool's history")
    r, z = feedback_agreement(live(said[:200], guesses[:200]), live(said[200:], guesses[200:]))
    assert r < -0.5 and z < -AGAINST_HISTORY_Z
    # History that knows nothing (one expectation for all) tells nothing either way.
    unknown = feedback_agreement(live(said[:200], [0.1] * 200), live(said[200:], [0.1] * 200))
    assert unknown == (0.0, 0.0)


rewards = st.lists(st.sampled_from([-1.0, -0.5, 0.0, 0.5, 1.0]), max_size=300)
calls = [CanaryCall.ROLL_BACK, CanaryCall.WAIT, CanaryCall.PROMOTE]  # worst to best


@settings(max_examples=300, deadline=None)
@given(rewards, rewards, st.data(), st.floats(0, 3000))
def test_a_worse_canary_is_never_promoted_where_a_better_one_would_be_rolled_back(
    canary_rewards, stable_rewards, data, elapsed
):
    lowered = [max(-1.0, r - data.draw(st.sampled_from([0.0, 0.5, 1.0]))) for r in canary_rewards]
    stable = live(stable_rewards)
    better = judge_canary(live(canary_rewards), stable, elapsed, CANARY)
    worse = judge_canary(live(lowered), stable, elapsed, CANARY)
    assert not (better.call == CanaryCall.ROLL_BACK and worse.call == CanaryCall.PROMOTE)
    if better.call == CanaryCall.ROLL_BACK:  # nor may a better stable set save it
        raised = live([min(1.0, r + 0.5) for r in stable_rewards])
        assert (
            judge_canary(live(canary_rewards), raised, elapsed, CANARY).call != CanaryCall.PROMOTE
        )


expectations = st.lists(st.floats(-1, 1), min_size=300, max_size=300)


@settings(max_examples=300, deadline=None)
@given(rewards.filter(bool), rewards, expectations, st.floats(0, 2), st.floats(0, 3000))
def test_with_history_a_lower_canary_is_judged_no_better(
    canary_rewards, stable_rewards, guesses, lower, elapsed
):
    """Every canary reward lower by the same amount, what history expected of each the
    same: the adjusted difference falls by that much, its spread stays, the call is no
    better."""
    canary = live(canary_rewards, guesses[: len(canary_rewards)])
    stable = live(stable_rewards, guesses[-len(stable_rewards) :] if stable_rewards else [])
    n = canary.count
    shifted = msgspec.structs.replace(
        canary,
        total=canary.total - lower * n,
        total_squares=canary.total_squares - 2 * lower * canary.total + lower**2 * n,
        products=canary.products - lower * canary.expected_total,
    )
    before = judge_canary(canary, stable, elapsed, CANARY)
    after = judge_canary(shifted, stable, elapsed, CANARY)
    assert after.difference == pytest.approx(before.difference - lower, rel=1e-6, abs=1e-9)
    assert after.variance == pytest.approx(before.variance, rel=1e-6, abs=1e-12)
    assert calls.index(after.call) <= calls.index(before.call)


@settings(max_examples=300, deadline=None)
@given(rewards, rewards, st.integers(2, 20), st.floats(0, 3000))
def test_more_of_the_same_evidence_never_turns_a_confident_call_around(
    canary_rewards, stable_rewards, times, elapsed
):
    first = judge_canary(live(canary_rewards), live(stable_rewards), elapsed, CANARY)
    more = judge_canary(live(canary_rewards * times), live(stable_rewards * times), elapsed, CANARY)
    if first.call != CanaryCall.WAIT and min(len(canary_rewards), len(stable_rewards)) >= 50:
        assert more.call == first.call


@settings(max_examples=300, deadline=None)
@given(rewards, rewards, st.floats(0, 3000))
def test_a_verdict_before_the_window_ends_is_one_the_evidence_bears_out(
    canary_rewards, stable_rewards, elapsed
):
    canary, stable = live(canary_rewards), live(stable_rewards)
    verdict = judge_canary(canary, stable, elapsed, CANARY)
    if verdict.call == CanaryCall.PROMOTE:
        assert min(canary.count, stable.count) >= CANARY.min_samples
        assert verdict.difference >= -CANARY.detectable_drop / 2
        assert elapsed >= CANARY.window_s or verdict.evidence <= math.log(CANARY.miss_rate)
    if verdict.call == CanaryCall.ROLL_BACK and elapsed < CANARY.window_s:
        assert verdict.evidence >= -math.log(CANARY.false_rollback_rate)
    if canary.mean >= stable.mean:  # never called worse when it is not
        assert verdict.call != CanaryCall.ROLL_BACK or "too little" in verdict.reason


def test_gate_refuses_unpaired_scores():
    with pytest.raises(ValueError, match="3 candidate scores for 2 items"):
        gate([0.1, 0.2, 0.3], [0.1, 0.2], SAME, SAME, POLICY)


def report(version: int, task_rewards: dict[str, float], answers=SAME) -> EvaluationReport:
    return EvaluationReport(
        run="live", suite="toy", policy_version=version, reward=0.5, pass_at_k=0.5,
        attempts=8, tasks=len(task_rewards), finished_at=1.0, task_rewards=task_rewards,
        answers=answers,
    )  # fmt: skip


def test_reports_are_gated_item_by_item_on_the_tasks_both_answered():
    serving = report(4, {f"t{i}": s for i, s in enumerate(scores(0.6))})
    candidate = report(5, {f"t{i}": s - 0.1 for i, s in enumerate(scores(0.6))} | {"new": 1.0})
    verdict = gate_reports(candidate, serving, POLICY)
    assert verdict.items == 200 and not verdict.passed
    assert gate_reports(serving, serving, POLICY).passed
    with pytest.raises(ValueError, match="without answer statistics"):
        gate_reports(report(5, {}, answers=None), serving, POLICY)

"""The production gate and the canary's judgement: a pure decision, tried on cases with known
answers and on generated scores for the properties any verdict must keep."""

from __future__ import annotations

import msgspec
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from rlfleet.api.wire import AnswerStats, EvaluationReport, RewardTally
from rlfleet.launch.settings import CanaryPolicy, GatePolicy
from rlfleet.operator.promotion import (
    CanaryCall,
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
CANARY = CanaryPolicy(max_drop=0.05, confidence=0.95, window_s=600, min_samples=50)


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


def live(rewards: list[float]) -> RewardTally:
    total = RewardTally()
    for reward in rewards:
        total = total.add(reward)
    return total


def test_a_clearly_worse_canary_is_rolled_back_before_its_window_ends():
    stable = live([1.0] * 70 + [-1.0] * 30)
    poisoned = live([1.0] * 10 + [-1.0] * 50)
    verdict = judge_canary(poisoned, stable, elapsed_s=60, policy=CANARY)
    assert verdict.call == CanaryCall.ROLL_BACK
    assert verdict.reason.startswith("worse by more than 0.05: canary -0.667 over 60")


def test_an_equal_canary_waits_for_its_window_then_is_promoted():
    stable = live([1.0] * 700 + [-1.0] * 300)
    canary = live([1.0] * 140 + [-1.0] * 60)
    assert judge_canary(canary, stable, 60, CANARY).call == CanaryCall.WAIT
    assert judge_canary(canary, stable, 600, CANARY).call == CanaryCall.PROMOTE


def test_a_canary_that_fell_beyond_the_bound_is_rolled_back_at_the_windows_end():
    stable = live([1.0] * 700 + [-1.0] * 300)  # +0.4
    canary = live([1.0] * 65 + [-1.0] * 35)  # +0.3: not yet confidently worse
    assert judge_canary(canary, stable, 60, CANARY).call == CanaryCall.WAIT
    verdict = judge_canary(canary, stable, 600, CANARY)
    assert verdict.call == CanaryCall.ROLL_BACK and verdict.reason.startswith("fell more")


def test_a_canary_without_traffic_is_never_promoted():
    stable = live([1.0] * 100)
    quiet = live([1.0] * 3)
    assert judge_canary(quiet, stable, 600, CANARY).call == CanaryCall.WAIT
    verdict = judge_canary(quiet, stable, 1200, CANARY)
    assert verdict.call == CanaryCall.ROLL_BACK and "too little canary traffic" in verdict.reason


rewards = st.lists(st.sampled_from([-1.0, -0.5, 0.0, 0.5, 1.0]), max_size=300)


@settings(max_examples=200, deadline=None)
@given(rewards, rewards, st.floats(0, 3000))
def test_a_promoted_canary_fell_within_the_bound_and_a_better_one_is_never_called_worse(
    canary_rewards, stable_rewards, elapsed
):
    canary, stable = live(canary_rewards), live(stable_rewards)
    verdict = judge_canary(canary, stable, elapsed, CANARY)
    if verdict.call == CanaryCall.PROMOTE:
        assert canary.count >= CANARY.min_samples and elapsed >= CANARY.window_s
        assert verdict.difference >= -CANARY.max_drop
    if canary.mean >= stable.mean:  # never called worse when it is not
        assert not verdict.reason.startswith("worse")


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

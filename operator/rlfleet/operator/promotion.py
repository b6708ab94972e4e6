"""Whether a production run's candidate may replace the serving checkpoint: a pure decision
in two steps, each a verdict with its numbers and, when it says no, the reason in the
words an on-call engineer reads in the event.

**The gate**, before any user sees the candidate. Both versions answered the same eval
items. The candidate passes when it is shown, at `confidence`, to be worse than the
serving checkpoint by no more than `max_regression`: the lower bound of a paired
bootstrap of the per-item differences must reach `-max_regression`. The burden of proof
is on the candidate (a non-inferiority test), so a suite too small to show it rejects
rather than promotes. Pairing removes the items' own difficulty from the comparison,
which is why it needs far fewer items than comparing two means would.

Then feedback that turned over between cycles (a client's instrumentation inverted): a
candidate whose training lowered its preference for what users rewarded in a cycle
before, on trajectories it did not train on (`rlfleet.trainer.held_out`), by more than
`max_held_out_loss` per token, learnt against those users, whatever the suite says. One
cycle of inverted feedback may move a model too little for the suite or the canary to
see, yet it mostly moves it this way (measurably in five of eight 15-minute runs of the
realtime example; in two others it moved it too little to see, and in one it moved it up,
and the canary rolled that one back).

Then behaviour drift that users' signals can reward but nobody wants: a model that
stops answering gets no rejections. The candidate is refused when it answers empty
more often than the serving one by more than `max_empty_increase`, when its answers'
mean length moves outside `length_ratio` of the serving one's, or when more than
`max_malformed_tool_calls` of its tool calls are malformed (and more than the serving
one's).

**The canary**, with live traffic. A share of the servers serves the candidate while
the rest serve the checkpoint, and users' rewards on each are compared as they come in:
a sequential probability ratio test of "the candidate is worse by `detectable_drop`"
against "it is no worse" (Wald's), on the difference of the two mean rewards, taken as
normal with the variance measured so far. It rolls back once the first is
`1 / false_rollback_rate` times as likely as the second, and promotes once the second is
`1 / miss_rate` times as likely as the first, whichever comes first: a clear candidate
either way is decided early, a close one takes the traffic it needs. The likelihood
ratio of a candidate no worse than the serving version is a martingale, so the chance
it ever reaches the rollback bound, however often it is looked at, is at most
`false_rollback_rate` (Ville's inequality; with the variance measured rather than known,
about so); likewise the chance that one `detectable_drop` worse is ever promoted is at
most `miss_rate`. At the end of
the window an undecided test goes the likelier way (rolled back when the difference is
nearer the drop than none), which adds little when the window holds several times the
traffic a decision takes on average (`tests/unit/test_canary_simulation.py` measures both
rates at the realtime example's traffic and at ten times it). Too little traffic on
either side by the end of the window rolls it back: promoting on no evidence is the one
mistake the canary exists to prevent.

The difference is adjusted by what the pool's history expected of each completion (its
prompt's and its user's rewards in the cycles before, `rlfleet.rollout.production.history`), as
CUPED does: the users' rewards vary far more between prompts than between versions, and
history knows which prompts are hard. The adjustment removes that share of the variance
without biasing the difference, as history was made before the canary and the servers
take requests whatever they ask; with no history it is the plain difference.

The canary judges only feedback it can trust. Honest users' rewards follow what history
expected of the same prompts; feedback that runs against it (a client's instrumentation
inverted while the canary runs) would make a worse candidate look better and a better
one worse. When the rewards, within each side, correlate with history's expectations
negatively by more than `AGAINST_HISTORY_Z` standard errors (Fisher's z, the collector's
bound for holding a cycle back) once both sides have `min_samples`, the candidate is
rolled back unjudged: the serving
version stays, whatever the difference says. Honest feedback correlates positively, so
it is almost never taken for this.

A decision takes what it takes: no rule meets both rates on 100 answers a side, say.
Telling a drop of 0.2 from none, each at most 5% wrong, takes a difference known to within
0.2 / 3.29 = 0.061 (one standard error), and 100 binary rewards a side give 0.14, or about
0.11 knowing every prompt's difficulty exactly.
"""

from __future__ import annotations

import math
import random
from dataclasses import dataclass
from enum import StrEnum
from statistics import fmean

from rlfleet.api.wire import AnswerStats, EvaluationReport, RewardTally
from rlfleet.launch.production import CanaryPolicy, GatePolicy

BOOTSTRAP_RESAMPLES = 2000
BOOTSTRAP_SEED = 0  # the same scores give the same verdict, on every operator replica
# Expectations that vary less than this (a variance, in reward squared) are rounding in
# the tally's sums, not history: one expectation for every completion.
NEGLIGIBLE_SPREAD = 1e-9
# Live feedback this many standard errors against history is not judged on: the collector's
# bound for holding a cycle back (`rlfleet.rollout.production.agreement.HOLD_Z`), one-sided 0.13%
# where there is no relation, and honest feedback's relation is positive.
AGAINST_HISTORY_Z = 3.0


@dataclass(frozen=True)
class GateVerdict:
    passed: bool
    mean_difference: float  # candidate - serving, per item
    lower_bound: float  # of the difference, at the policy's confidence
    items: int
    reasons: tuple[str, ...]  # empty when it passed
    held_out_gain: float | None = None  # of the candidate's training, when it had one


def paired_lower_bound(differences: list[float], confidence: float) -> float:
    """The lower `confidence` bound of the mean of `differences` (percentile bootstrap).
    Plain Python, as the operator's image has no numpy: about a second for 1000 items."""
    if len(differences) < 2:
        return -math.inf  # one item shows nothing about the next
    rng = random.Random(BOOTSTRAP_SEED)
    means = sorted(
        fmean(rng.choices(differences, k=len(differences))) for _ in range(BOOTSTRAP_RESAMPLES)
    )
    return means[int((1 - confidence) * BOOTSTRAP_RESAMPLES)]


def gate(
    candidate: list[float],
    serving: list[float],
    candidate_answers: AnswerStats,
    serving_answers: AnswerStats,
    policy: GatePolicy,
    held_out_gain: float | None = None,
) -> GateVerdict:
    """The candidate's scores and the serving checkpoint's on the same items, in order, and
    its training's held-out gain (None: nothing was held out)."""
    if len(candidate) != len(serving):
        raise ValueError(f"{len(candidate)} candidate scores for {len(serving)} items")
    differences = [c - s for c, s in zip(candidate, serving, strict=True)]
    mean = fmean(differences) if differences else 0.0
    lower = paired_lower_bound(differences, policy.confidence)
    reasons = []
    if lower < -policy.max_regression:
        reasons.append(
            f"not shown within {policy.max_regression:g} of the serving checkpoint: mean "
            f"difference {mean:+.4f} over {len(differences)} items, "
            f"{policy.confidence:.0%} lower bound {lower:+.4f}"
        )
    if held_out_gain is not None and held_out_gain < -policy.max_held_out_loss:
        reasons.append(
            f"learnt against what users said in a cycle before: held-out gain "
            f"{held_out_gain:+.2e} per token, below -{policy.max_held_out_loss:g}"
        )
    reasons += _drift(candidate_answers, serving_answers, policy)
    return GateVerdict(not reasons, mean, lower, len(differences), tuple(reasons), held_out_gain)


def gate_reports(
    candidate: EvaluationReport,
    serving: EvaluationReport,
    policy: GatePolicy,
    held_out_gain: float | None = None,
) -> GateVerdict:
    """The gate on two evaluator reports of one suite, paired by task id."""
    if candidate.answers is None or serving.answers is None:
        raise ValueError("a report without answer statistics cannot be gated")
    if candidate.suite != serving.suite:
        raise ValueError(f"reports of suites {candidate.suite} and {serving.suite}")
    shared = sorted(candidate.task_rewards.keys() & serving.task_rewards.keys())
    return gate(
        [candidate.task_rewards[task] for task in shared],
        [serving.task_rewards[task] for task in shared],
        candidate.answers,
        serving.answers,
        policy,
        held_out_gain,
    )


def _drift(candidate: AnswerStats, serving: AnswerStats, policy: GatePolicy) -> list[str]:
    reasons = []
    if candidate.empty_rate - serving.empty_rate > policy.max_empty_increase:
        reasons.append(
            f"answers empty {candidate.empty_rate:.1%} of the time against {serving.empty_rate:.1%}"
        )
    low, high = policy.length_ratio
    if serving.mean_tokens > 0:
        ratio = candidate.mean_tokens / serving.mean_tokens
        if not low <= ratio <= high:
            reasons.append(
                f"answers {ratio:.2f}x as long as the serving checkpoint's "
                f"({candidate.mean_tokens:.1f} tokens against {serving.mean_tokens:.1f}), "
                f"outside {low:g}-{high:g}x"
            )
    if (
        candidate.malformed_rate > policy.max_malformed_tool_calls
        and candidate.malformed_rate > serving.malformed_rate
    ):
        reasons.append(
            f"{candidate.malformed_rate:.1%} of its tool calls are malformed against "
            f"{serving.malformed_rate:.1%}"
        )
    return reasons


class CanaryCall(StrEnum):
    WAIT = "wait"
    PROMOTE = "promote"
    ROLL_BACK = "roll_back"


@dataclass(frozen=True)
class LiveComparison:
    """The canary's mean live reward against the stable set's, each adjusted by what the
    pool's history expected of its completions (analysis of covariance, as CUPED does)."""

    difference: float  # canary - stable, adjusted
    variance: float  # of `difference`
    plain_difference: float  # of the two means as they are
    variance_kept: float  # the adjusted difference's variance over the plain one's


def _centred(tally: RewardTally) -> tuple[float, float, float]:
    """Sums about the tally's own means: of squared rewards, of squared expectations, and of
    their products."""
    count = max(tally.count, 1)
    rewards = max(0.0, tally.total_squares - tally.total**2 / count)
    expected = max(0.0, tally.expected_squares - tally.expected_total**2 / count)
    return rewards, expected, tally.products - tally.total * tally.expected_total / count


def _mean_variance(count: int, squares: float) -> float:
    """The variance of a mean of `count` rewards whose squares about it sum to `squares`:
    never nothing, as rewards all alike may be a chance of a small sample, so at least
    1 / `count` a reward (rewards lie in [-1, 1]); the widest, 1, for one or none."""
    if count < 2:
        return 1.0
    return max(squares / (count - 1), 1 / count) / count


def compare_live(canary: RewardTally, stable: RewardTally) -> LiveComparison:
    """Users' rewards on the canary set's completions against the stable set's."""
    canary_sums, stable_sums = _centred(canary), _centred(stable)
    expected = canary_sums[1] + stable_sums[1]
    if expected <= NEGLIGIBLE_SPREAD * (canary.count + stable.count):
        expected = 0.0  # history expected the same of all: nothing to adjust by
    # One slope for both sets, fitted within each: how much a reward follows what history
    # expected of it.
    slope = (canary_sums[2] + stable_sums[2]) / expected if expected > 0 else 0.0

    def residual(rewards: float, expected: float, products: float) -> float:
        return max(0.0, rewards - 2 * slope * products + slope**2 * expected)

    canary_res, stable_res = residual(*canary_sums), residual(*stable_sums)
    expected_gap = canary.expected_mean - stable.expected_mean
    variance = _mean_variance(canary.count, canary_res) + _mean_variance(stable.count, stable_res)
    if expected > 0:  # the slope is estimated too
        pooled = (canary_res + stable_res) / max(canary.count + stable.count - 3, 1)
        variance += expected_gap**2 * pooled / expected
    plain = _mean_variance(canary.count, canary_sums[0]) + _mean_variance(
        stable.count, stable_sums[0]
    )
    return LiveComparison(
        difference=canary.mean - stable.mean - slope * expected_gap,
        variance=variance,
        plain_difference=canary.mean - stable.mean,
        variance_kept=variance / plain,
    )


@dataclass(frozen=True)
class CanaryVerdict:
    call: CanaryCall
    difference: float  # canary - stable, mean live reward adjusted by history
    variance: float  # of `difference`
    # The log-likelihood ratio of "worse by detectable_drop" against "no worse".
    evidence: float
    reason: str


def feedback_agreement(canary: RewardTally, stable: RewardTally) -> tuple[float, float]:
    """How users' rewards follow what history expected of them, within each side (so the
    candidate's effect does not count): their correlation and its Fisher z, about standard
    normal where there is no relation, as the collector tests a cycle
    (`rlfleet.rollout.production.agreement`). (0, 0) where history expected the same of all."""
    sides = [_centred(canary), _centred(stable)]
    rewards, expected = sum(s[0] for s in sides), sum(s[1] for s in sides)
    count = canary.count + stable.count
    if rewards <= 0 or expected <= NEGLIGIBLE_SPREAD * count or count <= 3:
        return 0.0, 0.0
    r = sum(s[2] for s in sides) / math.sqrt(rewards * expected)
    r = max(-0.999999, min(0.999999, r))
    return r, math.atanh(r) * math.sqrt(count - 3)


def judge_canary(
    canary: RewardTally, stable: RewardTally, elapsed_s: float, policy: CanaryPolicy
) -> CanaryVerdict:
    drop = policy.detectable_drop
    live = compare_live(canary, stable)
    agreement, z = feedback_agreement(canary, stable)
    # The difference is about normal with the variance measured: the log-likelihood
    # ratio of a mean `drop` below against one at zero, at the difference seen.
    evidence = -drop / live.variance * (live.difference + drop / 2)
    worse, no_worse = math.log(1 / policy.false_rollback_rate), math.log(1 / policy.miss_rate)
    numbers = (
        f"canary {canary.mean:+.3f} over {canary.count} answered, stable {stable.mean:+.3f} "
        f"over {stable.count}; difference {live.difference:+.3f} (s.e. "
        f"{math.sqrt(live.variance):.3f}) adjusted by history (plain "
        f"{live.plain_difference:+.3f}, variance x{live.variance_kept:.2f}); "
        + _odds(evidence, drop)
    )

    def verdict(call: CanaryCall, why: str) -> CanaryVerdict:
        return CanaryVerdict(call, live.difference, live.variance, evidence, f"{why}: {numbers}")

    if min(canary.count, stable.count) < policy.min_samples:
        if elapsed_s >= policy.window_s:
            return verdict(CanaryCall.ROLL_BACK, "too little canary traffic to judge")
        return verdict(CanaryCall.WAIT, "waiting for canary traffic")
    if z <= -AGAINST_HISTORY_Z:
        return verdict(
            CanaryCall.ROLL_BACK,
            f"not judged, users' feedback runs against the pool's history (correlation "
            f"{agreement:+.2f}, z {z:.1f}): the serving version stays",
        )
    if evidence >= worse:
        odds = 1 / policy.false_rollback_rate
        return verdict(CanaryCall.ROLL_BACK, f"worse by {drop:g} at odds of {odds:g} or more")
    if evidence <= -no_worse:
        return verdict(CanaryCall.PROMOTE, f"no worse at odds of {1 / policy.miss_rate:g} or more")
    if elapsed_s < policy.window_s:
        return verdict(CanaryCall.WAIT, "window open")
    if evidence > 0:
        return verdict(
            CanaryCall.ROLL_BACK, f"nearer a drop of {drop:g} than none at the window's end"
        )
    return verdict(CanaryCall.PROMOTE, f"nearer no drop than one of {drop:g} at the window's end")


def _odds(evidence: float, drop: float) -> str:
    """The likelihood ratio, as on-call reads it."""
    ratio = math.exp(min(abs(evidence), 700.0))
    if evidence >= 0:
        return f"a drop of {drop:g} {ratio:.3g} times as likely as none"
    return f"no drop {ratio:.3g} times as likely as one of {drop:g}"

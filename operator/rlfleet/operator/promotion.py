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
the rest serve the checkpoint; the users' rewards on each are compared as means (with
their variances). Confidently worse by more than `max_drop` rolls it back at once,
whenever that shows, so a poisoned candidate reaches no more users than needed. At the
end of the window it is promoted unless its mean fell more than `max_drop` below the
stable set's. The burden of proof is lighter here than at the gate on purpose: the
candidate has already been shown not to regress offline, and a canary's share of
traffic is small, so demanding proof of no harm would hold back nearly every candidate
(an equal one needs about a thousand answered canary completions to show it within
0.05). Too little canary traffic to judge by twice the window rolls it back: promoting
on no evidence is the one mistake the canary exists to prevent.
"""

from __future__ import annotations

import math
import random
from dataclasses import dataclass
from enum import StrEnum
from statistics import NormalDist, fmean

from rlfleet.api.wire import AnswerStats, EvaluationReport, RewardTally
from rlfleet.launch.settings import CanaryPolicy, GatePolicy

BOOTSTRAP_RESAMPLES = 2000
BOOTSTRAP_SEED = 0  # the same scores give the same verdict, on every operator replica


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
class CanaryVerdict:
    call: CanaryCall
    difference: float  # canary - stable, mean live reward
    lower_bound: float
    upper_bound: float
    reason: str


def judge_canary(
    canary: RewardTally, stable: RewardTally, elapsed_s: float, policy: CanaryPolicy
) -> CanaryVerdict:
    difference = canary.mean - stable.mean
    spread = math.sqrt(
        canary.variance / max(canary.count, 1) + stable.variance / max(stable.count, 1)
    )
    z = NormalDist().inv_cdf(policy.confidence)
    lower, upper = difference - z * spread, difference + z * spread
    numbers = (
        f"canary {canary.mean:+.3f} over {canary.count} answered, "
        f"stable {stable.mean:+.3f} over {stable.count}"
    )

    def verdict(call: CanaryCall, why: str) -> CanaryVerdict:
        return CanaryVerdict(call, difference, lower, upper, f"{why}: {numbers}")

    enough = canary.count >= policy.min_samples and stable.count >= 2
    if enough and upper < -policy.max_drop:
        return verdict(CanaryCall.ROLL_BACK, f"worse by more than {policy.max_drop:g}")
    if elapsed_s < policy.window_s:
        return verdict(CanaryCall.WAIT, "window open")
    if not enough:
        if elapsed_s >= 2 * policy.window_s:
            return verdict(CanaryCall.ROLL_BACK, "too little canary traffic to judge")
        return verdict(CanaryCall.WAIT, "waiting for canary traffic")
    if difference >= -policy.max_drop:
        return verdict(CanaryCall.PROMOTE, f"not worse by more than {policy.max_drop:g}")
    return verdict(CanaryCall.ROLL_BACK, f"fell more than {policy.max_drop:g}")

"""The canary's error rates, simulated: candidates of known effect canaried at the realtime
example's traffic and at ten times it, as often as it takes to measure how often each is
rolled back. No processes: the users, the model and the pool's history are drawn here,
the decision is the conductor's own (`judge_canary` on `RewardTally`s), the expectation
the collector's (`RewardHistory`).

The world is the realtime example's pool (`pool_world`), and:
- A candidate moves every question's log-odds by a random amount (sd 0.5: some get
  better, some worse) plus one shift, solved so that its mean reward over the users'
  questions is the serving version's plus `effect`, exactly.
- History is two cycles of the example's minimum (512 answers) from a version near the
  serving one (log-odds moved by sd 0.3), learnt as the collector learns each cycle.
- The example's servers answered about 100 completions a side in 25 s (the README's
  runs: 8,779 requests in 15 minutes, a quarter of them silent): four a second a side.
  The conductor judges every two seconds.
- The collector counts at most the example's `maxPerUser` rewards of one user a version
  (`feedback.maxPerUser`): once every user has given that many, a side's tally stops.
"""

from __future__ import annotations

import json
from collections import Counter
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pytest
from pool_world import World, defaults

from rlfleet.api.wire import RewardTally
from rlfleet.launch import from_spec, pods
from rlfleet.launch.production import CanaryPolicy, ConductorConfig, SignalRewards
from rlfleet.local.run import read_rlrun
from rlfleet.operator.promotion import CanaryCall, judge_canary
from rlfleet.rollout.production.history import RewardHistory

EXAMPLE = Path(__file__).parents[2] / "examples" / "realtime.yaml"


CANDIDATE_SD, HISTORY_SD = 0.5, 0.3  # of a version's log-odds about the serving one's
HISTORY = 512
BENCH_RATE = 4.0  # answered completions a second on each side
POLL_S = defaults(ConductorConfig)["poll_s"]
RUNS = 1000
WORSE = -0.2  # the inverted cycle's candidate


def _example(settings):
    """The example's component settings, as `settings` (a `launch` function) makes them."""
    name, spec = read_rlrun(EXAMPLE)
    return settings(name, spec, pods.Placement("nats://-"))


def example_policy() -> CanaryPolicy:
    """The example's canary, as its conductor is told it."""
    return _example(from_spec.conductor_settings).canary


def example_cap() -> int:
    """The most rewards of one user the example's collector counts for a version."""
    return _example(from_spec.collector_settings).rewards.max_per_user


@dataclass(frozen=True)
class Rates:
    rolled_back: float
    answers: float  # a side, on average, at the verdict
    seconds: float  # on average, to the verdict
    window_ends: float  # share decided at the window's end
    capped: float  # share decided after some user's rewards had stopped counting


def canary(
    world: World, effect: float, rate: float, policy: CanaryPolicy, cap: int, inverted: bool
) -> tuple[str, float, int, bool]:
    """One canary of a candidate `effect` from the serving version, counting at most `cap`
    rewards of a user a side, with users saying the opposite of what they think if
    `inverted`: its call, when, the answers a side it took, and whether some user's
    rewards stopped counting before it."""
    serving = world.serving()
    candidate = world.moved(serving, CANDIDATE_SD, effect)
    history = RewardHistory()
    history.learn(zip(*world.answers(world.moved(serving, HISTORY_SD, None), HISTORY), strict=True))
    sides = [(candidate, RewardTally()), (serving, RewardTally())]
    taken = [Counter(), Counter()]  # rewards counted per user, a side
    elapsed, owed, capped = 0.0, 0.0, False
    while True:
        elapsed += POLL_S
        owed += rate * POLL_S
        count, owed = int(owed), owed - int(owed)
        for index, (right, tally) in enumerate(sides):
            for question, user, reward in zip(*world.answers(right, count), strict=True):
                if taken[index][user] < cap:
                    taken[index][user] += 1
                    said = -reward if inverted else reward
                    tally = tally.add(said, history.expected(question, user))
                else:
                    capped = True
            sides[index] = (right, tally)
        verdict = judge_canary(sides[0][1], sides[1][1], elapsed, policy)
        if verdict.call != CanaryCall.WAIT:
            return verdict.call, elapsed, sides[0][1].count, capped


def measure(
    effect: float,
    rate: float,
    policy: CanaryPolicy,
    runs: int,
    seed: int,
    cap: int,
    inverted: bool = False,
) -> Rates:
    world = World(np.random.default_rng(seed))
    found = [canary(world, effect, rate, policy, cap, inverted) for _ in range(runs)]
    return Rates(
        rolled_back=sum(call == CanaryCall.ROLL_BACK for call, *_ in found) / runs,
        answers=sum(answers for _, _, answers, _ in found) / runs,
        seconds=sum(elapsed for _, elapsed, *_ in found) / runs,
        window_ends=sum(elapsed >= policy.window_s for _, elapsed, *_ in found) / runs,
        capped=sum(capped for *_, capped in found) / runs,
    )


@pytest.mark.parametrize(
    "policy,cap,rate",
    [
        (example_policy(), example_cap(), BENCH_RATE),
        (example_policy(), example_cap(), 10 * BENCH_RATE),
        (CanaryPolicy(), SignalRewards().max_per_user, BENCH_RATE),
    ],
    ids=["example-bench", "example-tenfold", "defaults-bench"],
)
def test_an_equal_candidate_is_rarely_rolled_back_and_a_worse_one_nearly_always(policy, cap, rate):
    equal = measure(0.0, rate, policy, RUNS, seed=1, cap=cap)
    worse = measure(WORSE, rate, policy, RUNS, seed=2, cap=cap)
    assert equal.rolled_back <= 0.05, equal
    assert worse.rolled_back >= 0.95, worse


def test_the_examples_tallies_count_to_the_verdict():
    """At the example's traffic no user's rewards stop counting before a canary's verdict,
    even for a candidate between equal and worse, whose canaries run longest. Were they to
    stop, such a canary would wait out its window on tallies that can no longer move."""
    between = measure(WORSE / 2, BENCH_RATE, example_policy(), 400, seed=3, cap=example_cap())
    assert between.capped == 0, between


def test_a_canary_on_inverted_feedback_is_rolled_back_unjudged():
    """Users who say the opposite while a canary runs (a client's instrumentation broke)
    make a worse candidate look better: judged on their word, it would be promoted. Their
    rewards run against what history expects of the same prompts, so the canary rolls it
    back without judging it, within seconds, and an equal one too."""
    for effect, seed in ((WORSE, 4), (0.0, 5)):
        inverted = measure(
            effect, BENCH_RATE, example_policy(), 400, seed, example_cap(), inverted=True
        )
        assert inverted.rolled_back >= 0.95, (effect, inverted)


if __name__ == "__main__":  # the rates, as JSON lines: python tests/unit/test_canary_simulation.py
    import sys

    runs = int(sys.argv[1]) if len(sys.argv) > 1 else RUNS
    named = (
        ("example", example_policy(), example_cap()),
        ("defaults", CanaryPolicy(), SignalRewards().max_per_user),
    )
    for name, policy, cap in named:
        for rate in (BENCH_RATE, 10 * BENCH_RATE):
            for effect in (0.0, WORSE):
                rates = measure(effect, rate, policy, runs, seed=1 if effect == 0 else 2, cap=cap)
                print(json.dumps({"policy": name, "rate": rate, "effect": effect} | rates.__dict__))
    for effect, seed in ((0.0, 5), (WORSE, 4)):  # users who say the opposite
        rates = measure(effect, BENCH_RATE, example_policy(), runs, seed, example_cap(), True)
        said = {"policy": "example", "rate": BENCH_RATE, "effect": effect, "inverted": True}
        print(json.dumps(said | rates.__dict__))

"""The canary's error rates, simulated: candidates of known effect canaried at the realtime
example's traffic and at ten times it, as often as it takes to measure how often each is
rolled back. No processes: the users, the model and the pool's history are drawn here,
the decision is the conductor's own (`judge_canary` on `RewardTally`s), the expectation
the collector's (`RewardHistory`).

The world is the realtime example's (`examples/realtime.yaml`, `rlfleet.rollout.users`):
- Users ask the rules suite's 400 questions, the n-th most popular in proportion to
  1 / n ** popularity; a quarter never answer; the others accept a right answer and
  reject a wrong one (reward +1 or -1), the opposite by mistake `noise` of the time.
- How often the model answers each question right is drawn from a beta distribution as
  spread as the warmed-up tiny MoE's (`rlfleet.rollout.warmup`'s 240 steps, then
  `rlfleet.rollout.evaluation` with 32 attempts a task at temperature 1 on the rules
  suite: right-rates of mean 0.34 and variance 0.099, so a + b = 1.27) around the
  example's accept rate of about a half: many questions it nearly always or never gets
  right, which is what history learns.
- A candidate moves every question's log-odds by a random amount (sd 0.5: some get
  better, some worse) plus one shift, solved so that its mean reward over the users'
  questions is the serving version's plus `effect`, exactly.
- History is two cycles of the example's minimum (512 answers) from a version near the
  serving one (log-odds moved by sd 0.3), learnt as the collector learns each cycle.
- The example's servers answered about 100 completions a side in 25 s (the README's
  runs: 8,779 requests in 15 minutes, a quarter of them silent): four a second a side.
  The conductor judges every two seconds.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import msgspec
import numpy as np
import pytest

from rlfleet import launch
from rlfleet.api.wire import RewardTally
from rlfleet.launch.settings import CanaryPolicy, ConductorConfig, UsersConfig
from rlfleet.local.run import read_rlrun
from rlfleet.operator.promotion import CanaryCall, judge_canary
from rlfleet.rollout.history import RewardHistory

EXAMPLE = Path(__file__).parent.parent / "examples" / "realtime.yaml"


def defaults(kind: type[msgspec.Struct]) -> dict:
    return {f.name: f.default for f in msgspec.structs.fields(kind)}


USERS = defaults(UsersConfig)
QUESTIONS = 400
ANSWERING = round(USERS["users"] * (1 - USERS["silent_share"]))
SPREAD = 1.27  # a + b of the per-question right-rates' beta distribution
RIGHT_RATE = 0.5
CANDIDATE_SD, HISTORY_SD = 0.5, 0.3  # of a version's log-odds about the serving one's
HISTORY = 512
BENCH_RATE = 4.0  # answered completions a second on each side
POLL_S = defaults(ConductorConfig)["poll_s"]
RUNS = 1000
WORSE = -0.2  # the inverted cycle's candidate


def example_policy() -> CanaryPolicy:
    """The example's canary, as its conductor is told it."""
    name, spec = read_rlrun(EXAMPLE)
    return launch.conductor_settings(name, spec, launch.Placement("nats://-")).canary


@dataclass(frozen=True)
class Rates:
    rolled_back: float
    answers: float  # a side, on average, at the verdict
    seconds: float  # on average, to the verdict
    window_ends: float  # share decided at the window's end


class World:
    def __init__(self, rng: np.random.Generator) -> None:
        self.rng = rng
        ranks = np.arange(1, QUESTIONS + 1, dtype=float)
        self.popularity = ranks ** -USERS["popularity"] / (ranks ** -USERS["popularity"]).sum()
        self.asked = np.cumsum(self.popularity)

    def expected_reward(self, right: np.ndarray) -> float:
        liked = right * (1 - USERS["noise"]) + (1 - right) * USERS["noise"]
        return float(self.popularity @ (2 * liked - 1))

    def moved(self, right: np.ndarray, sd: float, effect: float | None) -> np.ndarray:
        """`right` with each question's log-odds moved at random, then all shifted so
        the mean reward moves by `effect` (None: no shift)."""
        odds = np.log(right / (1 - right)) + self.rng.normal(0, sd, QUESTIONS)
        if effect is None:
            return 1 / (1 + np.exp(-odds))
        target, low, high = self.expected_reward(right) + effect, -20.0, 20.0
        for _ in range(60):
            shift = (low + high) / 2
            if self.expected_reward(1 / (1 + np.exp(-(odds + shift)))) < target:
                low = shift
            else:
                high = shift
        return 1 / (1 + np.exp(-(odds + (low + high) / 2)))

    def answers(self, right: np.ndarray, count: int) -> tuple[list, list, list]:
        """`count` answered completions: question, user, reward."""
        questions = np.minimum(np.searchsorted(self.asked, self.rng.random(count)), QUESTIONS - 1)
        users = self.rng.integers(0, ANSWERING, size=count)
        liked = (self.rng.random(count) < right[questions]) != (
            self.rng.random(count) < USERS["noise"]
        )
        return questions.tolist(), users.tolist(), np.where(liked, 1.0, -1.0).tolist()

    def canary(self, effect: float, rate: float, policy: CanaryPolicy) -> tuple[str, float, int]:
        """One canary of a candidate `effect` from the serving version: its call, when,
        and the answers a side it took."""
        serving = np.clip(
            self.rng.beta(RIGHT_RATE * SPREAD, (1 - RIGHT_RATE) * SPREAD, QUESTIONS), 0.005, 0.995
        )
        candidate = self.moved(serving, CANDIDATE_SD, effect)
        history = RewardHistory()
        history.learn(
            zip(*self.answers(self.moved(serving, HISTORY_SD, None), HISTORY), strict=True)
        )
        sides = [(candidate, RewardTally()), (serving, RewardTally())]
        elapsed, owed = 0.0, 0.0
        while True:
            elapsed += POLL_S
            owed += rate * POLL_S
            count, owed = int(owed), owed - int(owed)
            for index, (right, tally) in enumerate(sides):
                for question, user, reward in zip(*self.answers(right, count), strict=True):
                    tally = tally.add(reward, history.expected(question, user))
                sides[index] = (right, tally)
            verdict = judge_canary(sides[0][1], sides[1][1], elapsed, policy)
            if verdict.call != CanaryCall.WAIT:
                return verdict.call, elapsed, sides[0][1].count


def measure(effect: float, rate: float, policy: CanaryPolicy, runs: int, seed: int) -> Rates:
    world = World(np.random.default_rng(seed))
    found = [world.canary(effect, rate, policy) for _ in range(runs)]
    return Rates(
        rolled_back=sum(call == CanaryCall.ROLL_BACK for call, _, _ in found) / runs,
        answers=sum(answers for _, _, answers in found) / runs,
        seconds=sum(elapsed for _, elapsed, _ in found) / runs,
        window_ends=sum(elapsed >= policy.window_s for _, elapsed, _ in found) / runs,
    )


@pytest.mark.parametrize(
    "policy,rate",
    [
        (example_policy(), BENCH_RATE),
        (example_policy(), 10 * BENCH_RATE),
        (CanaryPolicy(), BENCH_RATE),
    ],
    ids=["example-bench", "example-tenfold", "defaults-bench"],
)
def test_an_equal_candidate_is_rarely_rolled_back_and_a_worse_one_nearly_always(policy, rate):
    equal = measure(0.0, rate, policy, RUNS, seed=1)
    worse = measure(WORSE, rate, policy, RUNS, seed=2)
    assert equal.rolled_back <= 0.05, equal
    assert worse.rolled_back >= 0.95, worse


if __name__ == "__main__":  # the rates, as JSON lines: python tests/test_canary_simulation.py
    import sys

    runs = int(sys.argv[1]) if len(sys.argv) > 1 else RUNS
    for name, policy in (("example", example_policy()), ("defaults", CanaryPolicy())):
        for rate in (BENCH_RATE, 10 * BENCH_RATE):
            for effect in (0.0, WORSE):
                rates = measure(effect, rate, policy, runs, seed=1 if effect == 0 else 2)
                print(json.dumps({"policy": name, "rate": rate, "effect": effect} | rates.__dict__))

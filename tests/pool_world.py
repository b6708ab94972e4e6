"""The realtime example's production pool, simulated for the tests that measure error rates
of decisions on users' feedback (`test_canary_simulation`, `test_poison_simulation`): no
processes, the users, the model and its questions drawn here.

The world is the realtime example's (`examples/realtime.yaml`, `rlfleet.rollout.production.users`):
- Users ask the rules suite's 400 questions, the n-th most popular in proportion to
  1 / n ** popularity; a quarter never answer; the others accept a right answer and
  reject a wrong one (reward +1 or -1), the opposite by mistake `noise` of the time.
- How often the model answers each question right is drawn from a beta distribution as
  spread as the warmed-up tiny MoE's (`rlfleet.rollout.environment.warmup`'s 240 steps, then
  `rlfleet.rollout.evaluation.suite` with 32 attempts a task at temperature 1 on the rules
  suite: right-rates of mean 0.34 and variance 0.099, so a + b = 1.27) around the
  example's accept rate of about a half: many questions it nearly always or never gets
  right, which is what history learns.
- A new version moves every question's log-odds by a random amount (`moved`).
"""

from __future__ import annotations

import msgspec
import numpy as np

from rlfleet.launch.production import UsersConfig


def defaults(kind: type[msgspec.Struct]) -> dict:
    return {f.name: f.default for f in msgspec.structs.fields(kind)}


USERS = defaults(UsersConfig)
QUESTIONS = 400
ANSWERING = round(USERS["users"] * (1 - USERS["silent_share"]))
SPREAD = 1.27  # a + b of the per-question right-rates' beta distribution
RIGHT_RATE = 0.5


class World:
    def __init__(self, rng: np.random.Generator) -> None:
        self.rng = rng
        ranks = np.arange(1, QUESTIONS + 1, dtype=float)
        self.popularity = ranks ** -USERS["popularity"] / (ranks ** -USERS["popularity"]).sum()
        self.asked = np.cumsum(self.popularity)

    def serving(self) -> np.ndarray:
        """A serving version: how often it answers each question right."""
        right = self.rng.beta(RIGHT_RATE * SPREAD, (1 - RIGHT_RATE) * SPREAD, QUESTIONS)
        return np.clip(right, 0.005, 0.995)

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

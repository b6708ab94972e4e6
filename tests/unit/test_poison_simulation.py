"""Poisoned feedback caught before it trains (`rlfleet.rollout.production.agreement`),
simulated in the realtime example's pool (`pool_world`): runs of `CYCLES` cycles of the
example's minimum of answered completions, the model a new version each cycle, history learnt as the
collector learns it, the screen the collector's own. Three kinds of feedback:

- honest: a cycle held back, or a user distrusted, in at most 1% of runs;
- the bench's inverted cycle (`--invert-cycle 3`: every user says the opposite for one
  cycle, as a client whose instrumentation broke): held back in at least 99% of runs;
- one answering user in nine saying the opposite all run long: distrusted in at least 95%
  of runs, with no honest user and no cycle held back for it.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field

import numpy as np
from pool_world import ANSWERING, World

from rlfleet.api.wire import CapturedCompletion, Segment
from rlfleet.rollout.production import agreement
from rlfleet.rollout.production.agreement import FeedbackScreen
from rlfleet.rollout.production.history import RewardHistory, prompt_key
from rlfleet.rollout.production.signals import CycleSamples, Scored

CYCLES = 15
PER_CYCLE = 256  # answered completions a cycle: the example's minSamples
VERSION_SD = 0.3  # how far each new version moves a question's log-odds
RUNS = 100
INVERTED = 3
POISONER = "user-0"


@dataclass
class Outcome:
    held: list[int] = field(default_factory=list)  # cycles held back
    distrusted: dict[str, int] = field(default_factory=dict)  # user: the cycle that found them


def capture(question: int, user: str) -> CapturedCompletion:
    segment = Segment(
        tokens=[question, 1], prompt_len=1, generated=[1], logprobs=[0.0], versions=[0]
    )
    return CapturedCompletion("live", f"{question}-{user}", user, segment, "", "stop", 1e9)


def run_pool(world: World, inverted: int | None = None, poisoner: str | None = None) -> Outcome:
    right, outcome = world.serving(), Outcome()
    history, screen = RewardHistory(), FeedbackScreen()
    captures = {
        (q, u): capture(q, f"user-{u}") for q in range(len(right)) for u in range(ANSWERING)
    }
    for number in range(1, CYCLES + 1):
        scored = []
        for question, user, reward in zip(*world.answers(right, PER_CYCLE), strict=True):
            said = captures[question, user]
            flipped = number == inverted or said.user == poisoner
            scored.append(Scored(said, -reward if flipped else reward, {}))
        screened = screen.screen(CycleSamples(scored), history)
        if screened.held_back:
            outcome.held.append(number)
            continue
        for user in screened.distrusted:
            outcome.distrusted[user] = number
        history.learn(
            (prompt_key(s.capture), s.capture.user, s.reward) for s in screened.samples.scored
        )
        right = world.moved(right, VERSION_SD, None)
    return outcome


def outcomes(seed: int, runs: int = RUNS, **poison) -> list[Outcome]:
    world = World(np.random.default_rng(seed))
    return [run_pool(world, **poison) for _ in range(runs)]


def test_honest_feedback_is_rarely_held_back_or_distrusted():
    found = outcomes(seed=1)
    assert sum(bool(o.held) for o in found) <= 0.01 * RUNS
    assert sum(bool(o.distrusted) for o in found) <= 0.01 * RUNS


def test_an_inverted_cycle_is_held_back_and_blames_no_user():
    found = outcomes(seed=2, inverted=INVERTED)
    assert sum(o.held == [INVERTED] for o in found) >= 0.99 * RUNS
    assert sum(bool(o.distrusted) for o in found) <= 0.01 * RUNS


def test_one_user_in_nine_saying_the_opposite_all_run_is_distrusted_alone():
    found = outcomes(seed=3, poisoner=POISONER)
    assert sum(o.distrusted.keys() == {POISONER} for o in found) >= 0.95 * RUNS
    assert sum(bool(o.held) for o in found) <= 0.01 * RUNS


def test_users_records_are_bounded_and_the_distrusted_stay_distrusted(monkeypatch):
    """A pool's millions of users cannot grow the screen without bound: the records of
    those who answered least recently go, a distrusted user's distrust does not."""
    monkeypatch.setattr(agreement, "MAX_USER_RECORDS", 4)
    history, screen = RewardHistory(), FeedbackScreen()
    liked = {question: float(question % 2) for question in range(40)}
    history.learn((prompt_key(capture(q, "past")), "past", r) for q, r in liked.items())
    users = ["liar", *(f"user-{n}" for n in range(6))]
    scored = [
        Scored(capture(q, user), -r if user == "liar" else r, {})
        for user in users
        for q, r in liked.items()
    ]
    screened = screen.screen(CycleSamples(scored), history)
    assert set(screened.distrusted) == {"liar"}
    assert list(screen.users) == users[-4:]  # the most recent four
    assert screen.distrusted == {"liar"}
    assert all(s.capture.user != "liar" for s in screened.samples.scored)


if __name__ == "__main__":  # the rates, as JSON: python tests/unit/test_poison_simulation.py [RUNS]
    import statistics
    import sys

    runs = int(sys.argv[1]) if len(sys.argv) > 1 else RUNS
    for name, poison in (
        ("honest", {}),
        ("inverted", {"inverted": INVERTED}),
        ("one-user", {"poisoner": POISONER}),
    ):
        found = outcomes(seed=7, runs=runs, **poison)
        found_at = [o.distrusted[POISONER] for o in found if POISONER in o.distrusted]
        print(json.dumps({
            "feedback": name,
            "runs": runs,
            "held_back": sum(bool(o.held) for o in found) / runs,
            "inverted_held": sum(INVERTED in o.held for o in found) / runs,
            "any_distrusted": sum(bool(o.distrusted) for o in found) / runs,
            "honest_distrusted": sum(bool(o.distrusted.keys() - {POISONER}) for o in found) / runs,
            "poisoner_found": len(found_at) / runs,
            "poisoner_found_cycle": statistics.mean(found_at) if found_at else None,
        }))  # fmt: skip

"""What a production pool's history expects of a completion's reward: its prompt's and its
user's rewards in the cycles the collector closed before. Pure.

A canary compares users' rewards on the candidate's answers with those on the serving
version's, and most of the spread of those rewards is not the versions' doing: some
prompts are answered well by any version, some by none, and some users reward more than
others. A completion's expected reward, made before the canary began, is a covariate the
canary's difference is adjusted by (CUPED, `rlfleet.operator.promotion.compare_live`):
the better it predicts the rewards, the fewer answers a verdict takes, and a poor one
costs nothing but the answers it does not save.

Each cycle's rewards are added once it closes, after everything before has been halved:
a version's rewards on a prompt say less of the next version's the more promotions lie
between. An entry left with less than `FORGOTTEN` of one reward is dropped, so the
history holds the prompts and users of the last few cycles. A prompt's (or a user's)
expectation is its mean reward shrunk towards everyone's by `PRIOR` rewards of
everyone's mean, so a prompt seen once predicts little. The history lives in the
collector's memory; a restarted collector replays the last cycles' captures and feedback
into it (`Collector.restore`), so it judges its next canary as it would have.
"""

from __future__ import annotations

import hashlib
from collections.abc import Hashable, Iterable
from dataclasses import dataclass, field

from rlfleet.api.wire import CapturedCompletion

DECAY = 0.5  # each older cycle counts half as much
FORGOTTEN = 1 / 64  # of one reward's weight: about six cycles old
PRIOR = 1.0  # rewards of everyone's mean every prompt and every user starts with


def prompt_key(capture: CapturedCompletion) -> bytes:
    """The completion's prompt, as history knows it: a digest of its tokens."""
    segment = capture.segment
    tokens = ",".join(map(str, segment.tokens[: segment.prompt_len]))
    return hashlib.blake2b(tokens.encode(), digest_size=16).digest()


@dataclass
class _Sum:
    weight: float = 0.0
    total: float = 0.0


@dataclass
class RewardHistory:
    """Rewards by prompt and by user over the cycles closed so far, older ones decayed."""

    prompts: dict[Hashable, _Sum] = field(default_factory=dict)
    users: dict[Hashable, _Sum] = field(default_factory=dict)
    everyone: _Sum = field(default_factory=_Sum)

    def learn(self, cycle: Iterable[tuple[Hashable, Hashable, float]]) -> None:
        """A closed cycle's rewards, as (prompt key, user, reward)."""
        for sums in (self.prompts, self.users):
            for key in list(sums):
                kept = sums[key]
                kept.weight *= DECAY
                kept.total *= DECAY
                if kept.weight < FORGOTTEN:
                    del sums[key]
        self.everyone.weight *= DECAY
        self.everyone.total *= DECAY
        for prompt, user, reward in cycle:
            for sums, key in ((self.prompts, prompt), (self.users, user)):
                kept = sums.setdefault(key, _Sum())
                kept.weight += 1
                kept.total += reward
            self.everyone.weight += 1
            self.everyone.total += reward

    def expected(self, prompt: Hashable, user: Hashable) -> float:
        """The reward history expects of a completion of `prompt` served to `user`: 0 when
        it knows nothing yet."""
        if self.everyone.weight == 0:
            return 0.0
        mean = self.everyone.total / self.everyone.weight
        return mean + self._lift(self.prompts, prompt, mean) + self._lift(self.users, user, mean)

    def prompt_expected(self, prompt: Hashable) -> float | None:
        """What history expects of `prompt` alone, whoever is served; None for a prompt it
        does not know (`rlfleet.rollout.production.agreement` asks it of users' feedback)."""
        if prompt not in self.prompts:
            return None
        mean = self.everyone.total / self.everyone.weight
        return mean + self._lift(self.prompts, prompt, mean)

    @staticmethod
    def _lift(sums: dict[Hashable, _Sum], key: Hashable, mean: float) -> float:
        kept = sums.get(key)
        if kept is None:
            return 0.0
        return (kept.total - kept.weight * mean) / (kept.weight + PRIOR)

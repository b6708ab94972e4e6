"""Whether users' feedback agrees with the pool's own history, judged before a cycle is
trained on. Pure: the collector asks it of each cycle it closes.

Poisoned feedback (a client whose instrumentation broke and reports the opposite, a user
who means harm) runs against what the pool already knows: how the same prompts were
rewarded in the cycles before (`RewardHistory.prompt_expected`). Honest rewards follow
it, cycle after cycle: a question the model nearly always gets right is mostly accepted,
one it nearly never does mostly rejected. So, before anything trains on them:

- A cycle whose rewards run against history's expectation of their prompts by more than
  `HOLD_Z` standard errors is held back whole: the collector publishes no trajectories
  and says why in its report, and the conductor skips the cycle with a Warning. Its
  rewards teach neither history nor the users' records.
- A user whose rewards, over the cycles trained on so far, run against it by more than
  `DISTRUST_Z` is distrusted: their feedback is dropped, counted, from that cycle on. The
  cycle's report names them, so a restarted collector drops them too.

The measure is Pearson's correlation between expectation and reward over the answered
completions whose prompt history knows, tested by Fisher's z (atanh(r) sqrt(n - 3), about
standard normal where there is no relation). No relation is the bound, not honesty's
level: honest feedback correlates positively, so an honest cycle is held back less often
than the one-sided 0.13% at 3 standard errors, and a poisoned one, whose correlation is
about as negative as an honest one's is positive, falls far below it. The user bound is
wider because every user is tested after every cycle. `tests/unit/test_poison_simulation.py`
measures both in the realtime example's world.
"""

from __future__ import annotations

import itertools
import math
from collections import Counter
from collections.abc import Iterable
from dataclasses import dataclass, field, replace

from rlfleet.rollout.production.history import RewardHistory, prompt_key
from rlfleet.rollout.production.signals import CycleSamples, Dropped

HOLD_Z = 3.0  # a cycle this many standard errors against history is held back
DISTRUST_Z = 4.5  # a user this many, over the run, is distrusted
MIN_PAIRS = 30  # fewer answers on known prompts say nothing (Fisher's z is not normal yet)
# Users whose records are kept (about 200 bytes each): a pool's millions of users cannot
# grow the collector without bound. A user who has not answered while this many others
# did starts again; a distrusted one stays distrusted (`distrusted`: few).
MAX_USER_RECORDS = 200_000


@dataclass
class Agreement:
    """Running sums of (expected, reward) pairs, for their correlation."""

    n: int = 0
    sx: float = 0.0
    sy: float = 0.0
    sxx: float = 0.0
    syy: float = 0.0
    sxy: float = 0.0

    def add(self, expected: float, reward: float) -> None:
        self.n += 1
        self.sx += expected
        self.sy += reward
        self.sxx += expected * expected
        self.syy += reward * reward
        self.sxy += expected * reward

    def correlation(self) -> float | None:
        """None with fewer than `MIN_PAIRS` pairs, or when either side never varies."""
        if self.n < MIN_PAIRS:
            return None
        vx = self.sxx - self.sx * self.sx / self.n
        vy = self.syy - self.sy * self.sy / self.n
        if vx <= 1e-12 or vy <= 1e-12:
            return None
        return max(-1.0, min(1.0, (self.sxy - self.sx * self.sy / self.n) / math.sqrt(vx * vy)))

    def z(self) -> float | None:
        """Standard errors above no relation (negative: against history)."""
        r = self.correlation()
        if r is None:
            return None
        return math.atanh(max(-0.999999, min(0.999999, r))) * math.sqrt(self.n - 3)

    def describe(self) -> str:
        return f"correlation {self.correlation():+.2f} over {self.n} answers (z {self.z():+.1f})"


@dataclass(frozen=True)
class Screened:
    samples: CycleSamples  # what the cycle may train on, distrusted users' feedback dropped
    held_back: str = ""  # why the whole cycle is not to be trained on; "" when it is
    # Users this cycle found to disagree, with their record over the run.
    distrusted: dict[str, Agreement] = field(default_factory=dict)


@dataclass
class FeedbackScreen:
    """What the collector knows of its users' agreement with history, cycle to cycle."""

    # Users' records, the least recently answering first: at most `MAX_USER_RECORDS`.
    users: dict[str, Agreement] = field(default_factory=dict)
    distrusted: set[str] = field(default_factory=set)

    def screen(self, samples: CycleSamples, history: RewardHistory) -> Screened:
        """The cycle's samples as they may be trained on, judged against `history` as it
        stood before the cycle."""
        cycle, by_user = self._pairs(samples, history)
        z = cycle.z()
        if z is not None and z < -HOLD_Z:
            why = "its rewards run against what history expects of the same prompts: "
            return Screened(self._kept(samples), held_back=why + cycle.describe())
        found = {}
        for user, record in self._recorded(by_user).items():
            user_z = record.z()
            if user_z is not None and user_z < -DISTRUST_Z:
                self.distrusted.add(user)
                found[user] = record
        return Screened(self._kept(samples), distrusted=found)

    def replay(
        self, samples: CycleSamples, history: RewardHistory, distrusted: Iterable[str]
    ) -> CycleSamples:
        """A cycle trained on before a restart, as it was judged then (its report names
        the users it distrusted): its samples as they were trained on, the users'
        records brought up to date. A restarted collector replays the last few cycles
        (`rlfleet.rollout.production.collector`), so what it knows of a user rests on those
        alone."""
        self.distrusted.update(distrusted)
        self._recorded(self._pairs(samples, history)[1])
        return self._kept(samples)

    def _pairs(
        self, samples: CycleSamples, history: RewardHistory
    ) -> tuple[Agreement, dict[str, list[tuple[float, float]]]]:
        """The trusted samples' (expected, reward) pairs on prompts history knows: the
        cycle's agreement, and each user's pairs."""
        cycle, by_user = Agreement(), dict[str, list[tuple[float, float]]]()
        for scored in samples.scored:
            if scored.capture.user in self.distrusted:
                continue
            expected = history.prompt_expected(prompt_key(scored.capture))
            if expected is not None:
                cycle.add(expected, scored.reward)
                by_user.setdefault(scored.capture.user, []).append((expected, scored.reward))
        return cycle, by_user

    def _recorded(self, by_user: dict[str, list[tuple[float, float]]]) -> dict[str, Agreement]:
        """The users' records over the run, with their new pairs added."""
        records = {}
        for user, pairs in by_user.items():
            record = records[user] = self.users.pop(user, None) or Agreement()
            self.users[user] = record  # last: the most recent
            for expected, reward in pairs:
                record.add(expected, reward)
        for user in list(itertools.islice(self.users, max(len(self.users) - MAX_USER_RECORDS, 0))):
            del self.users[user]  # gone quiet longest: their record starts again if they return
        return records

    def _kept(self, samples: CycleSamples) -> CycleSamples:
        kept = [s for s in samples.scored if s.capture.user not in self.distrusted]
        dropped = Counter(samples.dropped)
        if len(kept) < len(samples.scored):
            dropped[Dropped.DISTRUSTED] += len(samples.scored) - len(kept)
        return replace(samples, scored=kept, dropped=dropped)  # its other counts kept

"""Trajectories a production run's trainer keeps from one cycle to score the next cycle's
candidate on: what users said about answers it did not train on.

A candidate trained on feedback that turned over (a client's instrumentation inverted,
say) learns to prefer what users rejected. On the suite it may score no worse, and on
the canary users may even like it, if one cycle moved it little; but on an earlier
cycle's trajectories, with that cycle's advantages, its preference for what was
rewarded falls, because that is what its training did (when it did enough of it to
measure: five of seven inverted cycles of the realtime example). So each step reports how
it moved that preference (`StepReport.held_out_gain`); a candidate whose steps moved it
down learnt against the users of that cycle.

Only a promoted cycle's trajectories are held: a refused candidate's feedback is
suspect, and scoring the next candidate on it would refuse a good one for disagreeing
with bad feedback. A cycle is scored on the newer of the two cycles before it that was
promoted, so one rolled back (which canaries often do) leaves the next one checked; and
on none older, so one bad cycle that got through can cost at most two candidates.
"""

from __future__ import annotations

from rlfleet.api.wire import CycleOutcome, FinishedCycle
from rlfleet.trainer.rows import Rows

# Generated tokens kept of a cycle, each scored twice a step: in the real-time example
# about 100 trajectories, two steps' worth (its answers are short), which add about
# 0.15 s to a 0.6 s step.
HELD_OUT_TOKENS = 256
# Cycles back a cycle may be scored on.
LOOK_BACK = 2


class HeldOut:
    def __init__(self, budget_tokens: int = HELD_OUT_TOKENS) -> None:
        self.budget_tokens = budget_tokens
        self.by_cycle: dict[int, list[Rows]] = {}

    def keep(self, cycle: int | None, micro_batches: list[Rows]) -> None:
        """Keeps a step's micro-batches of `cycle` until the cycle's reach the budget (the
        last may pass it: micro-batches are kept whole), and forgets every cycle older
        than the two before it."""
        if cycle is None:
            return
        kept = self.by_cycle.setdefault(cycle, [])
        held = sum(rows.tokens for rows in kept)
        for rows in micro_batches:
            if held >= self.budget_tokens:
                break
            if rows.tokens:
                kept.append(rows)
                held += rows.tokens
        for old in [c for c in self.by_cycle if c < cycle - LOOK_BACK]:
            del self.by_cycle[old]

    def rows_for(self, cycle: int | None, history: list[FinishedCycle]) -> list[Rows]:
        """What to score `cycle`'s steps on: the newest cycle of the two before it whose
        candidate was promoted and whose trajectories are held, or nothing."""
        if cycle is None:
            return []
        promoted = {c.number for c in history if c.outcome == CycleOutcome.PROMOTED}
        for before in range(cycle - 1, cycle - 1 - LOOK_BACK, -1):
            if before in promoted and self.by_cycle.get(before):
                return self.by_cycle[before]
        return []

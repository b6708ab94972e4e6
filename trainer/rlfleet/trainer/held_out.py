"""Trajectories a production run's trainer keeps from one cycle to score the next cycle's
candidate on: what users said about answers it did not train on.

A candidate trained on feedback that turned over (a client's instrumentation inverted,
say) learns to prefer what users rejected. On the suite it may score no worse, and on
the canary users may even like it, if one cycle moved it little; but on an earlier
cycle's trajectories, with that cycle's advantages, its preference for what was
rewarded mostly falls, because that is what its training did (five of eight inverted
cycles of the realtime example; two moved it too little to see, one moved it up). So each
step reports how it moved that preference (`StepReport.held_out_gain`); a candidate
whose steps moved it down learnt against the users of that cycle.

Only a promoted cycle's trajectories are held: a refused candidate's feedback is
suspect, and scoring the next candidate on it would refuse a good one for disagreeing
with bad feedback. A cycle is scored on the newer of the two cycles before it that was
promoted, so one rolled back (which canaries often do) leaves the next one checked; and
on none older, so one bad cycle that got through can cost at most two candidates.

What is held goes into every checkpoint (`encode`), as the segments its rows were made
from: a trainer restarted between two cycles scores the next one as it would have
without the restart.
"""

from __future__ import annotations

import msgspec

from rlfleet.api.wire import CycleOutcome, FinishedCycle, Segment
from rlfleet.trainer.rows import Rows, make_rows

# Generated tokens kept of a cycle, each scored twice a step: in the real-time example
# about 100 trajectories, two steps' worth (its answers are short), which add about
# 0.15 s to a 0.6 s step.
HELD_OUT_TOKENS = 256
# Cycles back a cycle may be scored on.
LOOK_BACK = 2


# In a checkpoint, which a trainer of another release may read (an upgrade, a rollback):
# unknown fields are skipped (`rlfleet.api.wire`'s rules).
class Kept(msgspec.Struct, frozen=True):
    """A micro-batch of a cycle, as it was made (its rows are made from it again)."""

    segments: list[Segment]
    advantages: list[float]

    @property
    def tokens(self) -> int:
        return sum(sum(segment.generated) for segment in self.segments)


class _Stored(msgspec.Struct, frozen=True):
    by_cycle: dict[int, list[Kept]]


class HeldOut:
    def __init__(self, budget_tokens: int = HELD_OUT_TOKENS) -> None:
        self.budget_tokens = budget_tokens
        self.by_cycle: dict[int, list[Kept]] = {}

    def keep(self, cycle: int | None, micro_batches: list[Kept]) -> None:
        """Keeps a step's micro-batches of `cycle` until the cycle's reach the budget (the
        last may pass it: micro-batches are kept whole), and forgets every cycle older
        than the two before it."""
        if cycle is None:
            return
        kept = self.by_cycle.setdefault(cycle, [])
        held = sum(batch.tokens for batch in kept)
        for batch in micro_batches:
            if held >= self.budget_tokens:
                break
            if batch.tokens:
                kept.append(batch)
                held += batch.tokens
        for old in [c for c in self.by_cycle if c < cycle - LOOK_BACK]:
            del self.by_cycle[old]

    def kept_for(self, cycle: int | None, history: list[FinishedCycle]) -> list[Kept]:
        """What to score `cycle`'s steps on: the newest cycle of the two before it whose
        candidate was promoted and whose trajectories are held, or nothing."""
        if cycle is None:
            return []
        promoted = {c.number for c in history if c.outcome == CycleOutcome.PROMOTED}
        for before in range(cycle - 1, cycle - 1 - LOOK_BACK, -1):
            if before in promoted and self.by_cycle.get(before):
                return self.by_cycle[before]
        return []

    def rows_for(self, cycle: int | None, history: list[FinishedCycle], pad_id: int) -> list[Rows]:
        """`kept_for`'s micro-batches as rows."""
        return [make_rows(b.segments, b.advantages, pad_id) for b in self.kept_for(cycle, history)]

    def encode(self) -> bytes:
        """What a checkpoint stores, so that a restarted trainer scores the next cycle too:
        without it, a candidate trained after a crash would skip this check."""
        return msgspec.msgpack.encode(_Stored(self.by_cycle))

    @classmethod
    def decode(cls, stored: bytes | None) -> HeldOut:
        """`encode`'s bytes back (None, from a checkpoint older than it: nothing held)."""
        held = cls()
        if stored is not None:
            held.by_cycle = msgspec.msgpack.decode(stored, type=_Stored).by_cycle
        return held

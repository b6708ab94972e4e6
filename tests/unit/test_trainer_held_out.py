"""Which trajectories a production run's trainer holds out to score a cycle's candidate
on (`rlfleet.trainer.held_out`): the newer of the two cycles before whose candidate was
promoted, and about its budget."""

from __future__ import annotations

from rlfleet.api.wire import CycleOutcome, FinishedCycle, Segment, cycle_groups, cycle_of
from rlfleet.trainer.held_out import HeldOut, Kept


def kept(tokens: int) -> Kept:
    """A micro-batch of one trajectory with `tokens` generated tokens."""
    segment = Segment(
        tokens=list(range(tokens + 1)),
        prompt_len=1,
        generated=[1] * tokens,
        logprobs=[-1.0] * tokens,
        versions=[0] * tokens,
    )
    return Kept([segment], [0.5])


def finished(number: int, outcome: CycleOutcome) -> FinishedCycle:
    return FinishedCycle(number, outcome, candidate=number * 10, why="")


def test_a_cycle_is_scored_on_the_newer_promoted_cycle_of_the_two_before_it():
    held = HeldOut(budget_tokens=100)
    first, second, third = [kept(10)], [kept(20)], [kept(30)]
    held.keep(1, first)
    assert held.kept_for(2, []) == []  # cycle 1 not decided yet
    assert held.kept_for(2, [finished(1, CycleOutcome.PROMOTED)]) == first
    for refused in (CycleOutcome.REJECTED, CycleOutcome.ROLLED_BACK, CycleOutcome.TIMED_OUT):
        assert held.kept_for(2, [finished(1, refused)]) == []
    held.keep(2, second)
    history = [finished(1, CycleOutcome.PROMOTED), finished(2, CycleOutcome.PROMOTED)]
    assert held.kept_for(3, history) == second  # the newer
    # A refused cycle is passed over for the one before it...
    history = [finished(1, CycleOutcome.PROMOTED), finished(2, CycleOutcome.ROLLED_BACK)]
    assert held.kept_for(3, history) == first
    # ...but no further: after two refusals in a row, nothing is held.
    held.keep(3, third)
    history.append(finished(3, CycleOutcome.REJECTED))
    assert held.kept_for(4, history) == []
    assert held.kept_for(None, history) == []


def test_only_the_two_cycles_before_are_kept_and_each_about_its_budget():
    held = HeldOut(budget_tokens=50)
    held.keep(1, [kept(30), kept(30), kept(20)])  # kept whole until the budget is reached
    assert [b.tokens for b in held.by_cycle[1]] == [30, 30]
    held.keep(1, [kept(1)])  # full
    assert len(held.by_cycle[1]) == 2
    held.keep(2, [kept(5)])
    held.keep(3, [kept(5)])
    held.keep(4, [kept(5)])
    held.keep(None, [kept(5)])  # a step of no cycle: kept nowhere
    assert sorted(held.by_cycle) == [2, 3, 4]


def test_a_step_knows_its_cycle_by_its_groups_names():
    assert cycle_of(f"{cycle_groups(12)}/3") == 12
    for group in ("cycle-12", "cycle-x/3", "task-7/cycle-2", "cycle-/1", "12/3"):
        assert cycle_of(group) is None

"""Which trajectories a production run's trainer holds out to score a cycle's candidate
on (`rlfleet.trainer.held_out`): the newer of the two cycles before whose candidate was
promoted, and about its budget."""

from __future__ import annotations

import torch

from rlfleet.api.wire import CycleOutcome, FinishedCycle, cycle_groups, cycle_of
from rlfleet.trainer.held_out import HeldOut
from rlfleet.trainer.rows import Rows
from rlfleet.trainer.scoring import Batch


def rows(tokens: int) -> Rows:
    mask = torch.ones(1, tokens)
    batch = Batch.of([torch.arange(tokens + 1)], None, pad_id=0, prompts=[1])
    return Rows(batch, torch.zeros_like(mask), mask, mask)


def finished(number: int, outcome: CycleOutcome) -> FinishedCycle:
    return FinishedCycle(number, outcome, candidate=number * 10, why="")


def test_a_cycle_is_scored_on_the_newer_promoted_cycle_of_the_two_before_it():
    held = HeldOut(budget_tokens=100)
    first, second, third = [rows(10)], [rows(20)], [rows(30)]
    held.keep(1, first)
    assert held.rows_for(2, []) == []  # cycle 1 not decided yet
    assert held.rows_for(2, [finished(1, CycleOutcome.PROMOTED)]) == first
    for refused in (CycleOutcome.REJECTED, CycleOutcome.ROLLED_BACK, CycleOutcome.TIMED_OUT):
        assert held.rows_for(2, [finished(1, refused)]) == []
    held.keep(2, second)
    history = [finished(1, CycleOutcome.PROMOTED), finished(2, CycleOutcome.PROMOTED)]
    assert held.rows_for(3, history) == second  # the newer
    # A refused cycle is passed over for the one before it...
    history = [finished(1, CycleOutcome.PROMOTED), finished(2, CycleOutcome.ROLLED_BACK)]
    assert held.rows_for(3, history) == first
    # ...but no further: after two refusals in a row, nothing is held.
    held.keep(3, third)
    history.append(finished(3, CycleOutcome.REJECTED))
    assert held.rows_for(4, history) == []
    assert held.rows_for(None, history) == []


def test_only_the_two_cycles_before_are_kept_and_each_about_its_budget():
    held = HeldOut(budget_tokens=50)
    held.keep(1, [rows(30), rows(30), rows(20)])  # kept whole until the budget is reached
    assert [r.tokens for r in held.by_cycle[1]] == [30, 30]
    held.keep(1, [rows(1)])  # full
    assert len(held.by_cycle[1]) == 2
    held.keep(2, [rows(5)])
    held.keep(3, [rows(5)])
    held.keep(4, [rows(5)])
    held.keep(None, [rows(5)])  # a step of no cycle: kept nowhere
    assert sorted(held.by_cycle) == [2, 3, 4]


def test_a_step_knows_its_cycle_by_its_groups_names():
    assert cycle_of(f"{cycle_groups(12)}/3") == 12
    for group in ("cycle-12", "cycle-x/3", "task-7/cycle-2", "cycle-/1", "12/3"):
        assert cycle_of(group) is None

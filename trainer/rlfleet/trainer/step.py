"""What one training step is made of and makes: the batch it assembles from the groups it
took (advantages, micro-batches, rows) and the report of what it trained.

Apart from the `Trainer` (`rlfleet.trainer.loop`) because neither touches the bus, the
checkpoint or the other ranks: the loop's step then reads as its stages (take, assemble,
train, commit, report), and what passes between them is one of these values.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch

from rlfleet.api.wire import GroupOutcome, StepReport, cycle_of, trajectory_id
from rlfleet.trainer.groups import Received, staleness
from rlfleet.trainer.held_out import Kept
from rlfleet.trainer.objective import group_advantages
from rlfleet.trainer.policy import StepResult
from rlfleet.trainer.rows import Rows, make_rows, split_by_tokens


@dataclass(frozen=True)
class Batch:
    """A step's full groups, and what it trains on of them."""

    groups: list[list[Received]]
    items: list[Received]  # the groups' trajectories, group after group
    rewards: torch.Tensor  # each item's
    made: list[Kept]  # the micro-batches as made, which a production run holds out
    micro_batches: list[Rows]
    tokens: int
    cycle: int | None  # a production step's, whose trajectories are all of one cycle

    @property
    def seqs(self) -> list[int]:
        return [item.seq for item in self.items]


def assemble(
    groups: list[list[Received]], micro_batch_tokens: int, pad_id: int, production: bool
) -> Batch:
    """Each trajectory's advantage within its group, on every one of its segments, and
    the segments cut into micro-batches of at most `micro_batch_tokens`."""
    items = [item for group in groups for item in group]
    rewards = torch.tensor([i.trajectory.reward for i in items])
    group_index = torch.tensor([n for n, group in enumerate(groups) for _ in group])
    advantages = group_advantages(rewards, group_index).tolist()
    segments = [
        (segment, advantage)
        for item, advantage in zip(items, advantages, strict=True)
        for segment in item.trajectory.segments
    ]
    made = [
        Kept([s for s, _ in chunk], [a for _, a in chunk])
        for chunk in split_by_tokens(segments, micro_batch_tokens)
    ]
    micro_batches = [make_rows(b.segments, b.advantages, pad_id) for b in made]
    tokens = sum(rows.tokens for rows in micro_batches)
    # A production step's trajectories are all of one cycle: the conductor lets out
    # none of the next before this one's candidate is decided.
    cycle = cycle_of(items[0].trajectory.group_id) if production else None
    return Batch(groups, items, rewards, made, micro_batches, tokens, cycle)


def step_report(
    run: str,
    step: int,
    version: int,
    batch: Batch,
    result: StepResult,
    *,
    totals: tuple[int, int],
    started: float,
    waited: float,
) -> StepReport:
    """The report of the step after `step`, trained from `version` and `started` (on the
    `time.perf_counter` clock) `waited` seconds after the trainer was free; `totals` are
    the run's stale drops and rejections so far. Without the weights' size, which only
    publishing tells."""
    dropped_stale, rejected = totals
    lags = [staleness(i.trajectory, version) for i in batch.items]
    return StepReport(
        run=run,
        step=step + 1,
        policy_version=version + 1,
        trajectories=[trajectory_id(i.trajectory) for i in batch.items],
        groups=len(batch.groups),
        tokens=result.tokens,
        reward_mean=float(batch.rewards.mean()),
        loss=result.loss,
        staleness_mean=sum(lags) / len(lags),
        staleness_max=max(lags),
        mismatch_mean_abs=result.mismatch.mean_abs,
        mismatch_max_abs=result.mismatch.max_abs,
        mismatch_kl=result.mismatch.kl,
        clipped_fraction=result.clipped_fraction,
        dropped_stale_total=dropped_stale,
        rejected_total=rejected,
        step_seconds=time.perf_counter() - started,
        finished_at=time.time(),
        wait_seconds=round(waited, 3),
        learning_rate=result.learning_rate,
        held_out_gain=result.held_out_gain,
        outcomes=[
            GroupOutcome(
                task_id=group[0].trajectory.task_id,
                rewards=[i.trajectory.reward for i in group],
            )
            for group in batch.groups
        ],
    )

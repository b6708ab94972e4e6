"""Turning a stream of trajectories into optimiser steps: groups, staleness, token budget.

Pure bookkeeping, no I/O: the loop feeds it trajectories with their stream sequence
numbers and asks for the next step's worth.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from rlfleet.api.wire import Trajectory


@dataclass(frozen=True)
class Received:
    seq: int  # stream sequence: identity for dedupe and acknowledgement
    trajectory: Trajectory
    arrived: float

    @property
    def tokens(self) -> int:
        return sum(len(s.tokens) for s in self.trajectory.segments)


def staleness(trajectory: Trajectory, version: int) -> int:
    """How many policy versions the trainer is ahead of the oldest that generated it."""
    return version - trajectory.policy_version


# What the trainer holds at most, in steps' worth: the stream keeps the rest until there
# is room, so a flood of trajectories (many workers, a slow step) cannot grow its memory.
HELD_STEPS = 8


@dataclass
class GroupBuffer:
    """Trajectories waiting for the rest of their GRPO group.

    A group is ready when all `group_size` attempts are in, or, after `timeout_s`, with
    the attempts that came (at least two: one attempt has no baseline to compare with).
    """

    timeout_s: float
    groups: dict[str, list[Received]] = field(default_factory=dict)

    def add(self, item: Received) -> bool:
        """Hold `item`; False if its group already holds that attempt (a task run twice,
        after a rollout worker died before acknowledging it)."""
        items = self.groups.setdefault(item.trajectory.group_id, [])
        if any(i.trajectory.attempt == item.trajectory.attempt for i in items):
            return False
        items.append(item)
        return True

    def has_room(self, step_groups: int | None, step_token_cap: int) -> bool:
        """Whether to take more off the stream: fewer than `HELD_STEPS` steps' worth held
        (groups, with `step_groups`; else tokens). Groups that cannot fill while it is
        full still leave: ready with two attempts, or dropped, after the group timeout."""
        if step_groups is not None:
            return len(self.groups) < HELD_STEPS * step_groups
        held = sum(item.tokens for items in self.groups.values() for item in items)
        return held < HELD_STEPS * step_token_cap

    def holds(self) -> set[int]:
        return {item.seq for items in self.groups.values() for item in items}

    def drop_stale(self, version: int, max_staleness: int) -> list[Received]:
        dropped = []
        for group_id, items in list(self.groups.items()):
            keep = [i for i in items if staleness(i.trajectory, version) <= max_staleness]
            dropped += [i for i in items if staleness(i.trajectory, version) > max_staleness]
            if keep:
                self.groups[group_id] = keep
            else:
                del self.groups[group_id]
        return dropped

    def expire(self, now: float) -> list[Received]:
        """Timed-out groups too small to train on: the caller drops and counts them."""
        expired = []
        for group_id, items in list(self.groups.items()):
            if len(items) < 2 and now - items[0].arrived > self.timeout_s:
                expired += self.groups.pop(group_id)
        return expired

    def ready(self, now: float) -> list[list[Received]]:
        """Groups that can be trained on, oldest first."""
        return sorted(
            (
                items
                for items in self.groups.values()
                if len(items) >= items[0].trajectory.group_size
                or (len(items) >= 2 and now - items[0].arrived > self.timeout_s)
            ),
            key=lambda items: min(i.seq for i in items),
        )

    def take(
        self, token_budget: int, token_cap: int, now: float, partial: bool = False
    ) -> list[list[Received]]:
        """Ready groups, oldest first: nothing until `token_budget` tokens are ready (with
        `partial`, what is ready), then as many as fit in `token_cap` (at least up to the
        budget).

        Every step is full; and a synchronous run (staleness bound 0), where whatever a
        step leaves behind goes stale, can take a whole version's batch in one step.
        """
        ready = self.ready(now)
        if not partial and sum(i.tokens for items in ready for i in items) < token_budget:
            return []
        taken, tokens = [], 0
        for items in ready:
            size = sum(i.tokens for i in items)
            if tokens >= token_budget and tokens + size > token_cap:
                break
            taken.append(items)
            tokens += size
        return self._remove(taken)

    def take_groups(self, count: int, now: float, partial: bool = False) -> list[list[Received]]:
        """The `count` oldest ready groups, or nothing until that many are ready (with
        `partial`, fewer if that is all): a batch of a fixed number of tasks, which the
        task feed can issue exactly."""
        ready = self.ready(now)
        return self._remove(ready[:count]) if partial or len(ready) >= count else []

    def _remove(self, taken: list[list[Received]]) -> list[list[Received]]:
        for items in taken:
            del self.groups[items[0].trajectory.group_id]
        return taken

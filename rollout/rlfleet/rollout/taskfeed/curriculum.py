"""Which task the feed publishes next: mostly those that still teach the policy something.

GRPO learns only from groups whose attempts earned different rewards; a group all right
or all wrong gets advantage 0 everywhere and is rollout time spent for nothing. As a run
goes on, most tasks become one or the other, and a step's batch is left with a group or
two that carry signal: few samples behind each optimiser step, a noisy update. The feed
therefore remembers, per task, whether its last trained group was uniform, and asks such
a task again only with probability `revisit` (it may have become learnable, or been
forgotten). DAPO's dynamic sampling filters the same groups after generating them; here
they are mostly never generated.
"""

from __future__ import annotations

import random
from collections.abc import Iterable, Iterator

from rlfleet.api.wire import GroupOutcome, Task


class Curriculum:
    def __init__(self, revisit: float, seed: int) -> None:
        if not 0 < revisit <= 1:
            raise ValueError(f"revisit {revisit} must be in (0, 1]: 0 would never ask again")
        self.revisit = revisit
        self.rng = random.Random(seed)
        self.uniform: set[str] = set()  # tasks whose last trained group taught nothing
        self.skipped = 0

    def observe(self, outcomes: Iterable[GroupOutcome]) -> None:
        for outcome in outcomes:
            if outcome.uniform:
                self.uniform.add(outcome.task_id)
            else:
                self.uniform.discard(outcome.task_id)

    def wanted(self, task: Task) -> bool:
        if task.id not in self.uniform or self.rng.random() < self.revisit:
            return True
        self.skipped += 1
        return False

    def select(self, tasks: Iterator[Task]) -> Task:
        """The next task of `tasks` worth asking (ends: every task is asked at times)."""
        return next(task for task in tasks if self.wanted(task))

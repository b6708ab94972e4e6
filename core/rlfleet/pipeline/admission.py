"""Which tasks the feed may publish now, so that none reaches the trainer too stale to use.

Staleness-aware admission, as AReaL does it. The trainer turns `groups_per_step` groups
into each policy version and trains on trajectories at most `max_staleness` versions
older than its own. While the trainer is at version V, a task is meant for the step that
makes version t + 1 from version t, for t in V..V+max_staleness+1, and must be generated
by version t - max_staleness or newer: the task carries that minimum, and a worker still
running an older version holds it until the weights arrive. The feed publishes one
step's worth of tasks for each t. The last batch needs version V+1, which does not exist
yet: it waits in the workers, so generation starts the moment the weights land instead
of a round trip through the feed later. With `max_staleness` 0 this is the synchronous
loop, one batch per version and none of it wasted; with more, generation runs ahead of
training by at most that many versions.
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class Admission:
    max_staleness: int
    groups_per_step: int  # the trainer's batch; its step reports correct a wrong guess
    version: int = 0  # the trainer's newest policy version
    issued: dict[int, int] = field(default_factory=dict)  # tasks published per target
    last_seq: dict[int, int] = field(default_factory=dict)  # stream sequence of the last
    extra: int = 0  # tasks added to the current batch because the trainer starved

    def observe(self, version: int, groups: int) -> bool:
        """A step report: the trainer made `version` from `groups` groups. False if it is
        not news (a report seen before, or an older one)."""
        if version <= self.version:
            return False
        self.version = version
        self.groups_per_step = max(1, groups)
        self.issued = {t: n for t, n in self.issued.items() if t >= version}
        self.last_seq = {t: s for t, s in self.last_seq.items() if t >= version}
        self.extra = 0
        return True

    def min_version(self, target: int) -> int:
        return max(0, target - self.max_staleness)

    def admit(self, room: int) -> list[int]:
        """Targets of up to `room` tasks to publish now, in order."""
        admitted: list[int] = []
        for target in range(self.version, self.version + self.max_staleness + 2):
            quota = self.groups_per_step + (self.extra if target == self.version else 0)
            while len(admitted) < room and self.issued.get(target, 0) < quota:
                self.issued[target] = self.issued.get(target, 0) + 1
                admitted.append(target)
        return admitted

    def published(self, target: int, seq: int) -> None:
        self.last_seq[target] = max(seq, self.last_seq.get(target, 0))

    def batch_done(self, first_unfinished_seq: int) -> bool:
        """Whether every task for the current version is finished (a work queue forgets
        a task once it is acknowledged, so its first sequence is the oldest one left)."""
        last = self.last_seq.get(self.version)
        return last is not None and first_unfinished_seq > last

    def starved(self) -> None:
        """The current batch is done and the trainer still has not stepped: a group was
        lost (a task failed for good, or its attempts were rejected): one more task."""
        self.extra += 1

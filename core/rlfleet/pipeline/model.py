"""A discrete-event model of one RLRun's pipeline: feed, rollout engines, trainer, weights.

It plays the rules the processes play, at the grain of a GRPO group:

- the feed keeps at most `Feed.depth` tasks waiting or under way, and publishes them by
  `Admission` (the feed's own rule), each carrying the oldest version that may attempt it,
  every `Feed.poll_s` (it looks at its queue that often);
- an engine takes tasks while it has room for `groups_at_once` groups, holds a task until it
  runs the version the task needs, and shares its device's tokens per second among the
  groups it generates (continuous batching; a device short of groups is slower by
  `batch_exponent`); a group is done when its tokens are (about `group_size *
  tokens_per_attempt`, drawn with the profile's spread), and is as old as the version it
  started on;
- the trainer drops groups more than `max_staleness` versions behind, steps on the first
  `step_groups` fresh ones in arrival order, then publishes the version;
- a version reaches a region `arrival_s` after it is on the hub's stream; an engine there
  notices it `notice_busy_s` later while it generates, `notice_idle_s` while it waits
  (each polls for newer versions), then stops generating for `load_s` to load it.

The draws are seeded: the model is deterministic. What it leaves out, on purpose: a group's own tail
(its longest attempt), task failures and retries, network time of trajectories (small
next to generation). The model is checked against measured runs by `bench/plan.py`.
"""

from __future__ import annotations

import copy
import math
import random
from collections import deque
from dataclasses import dataclass, field

from rlfleet.pipeline.admission import Admission


@dataclass(frozen=True)
class Region:
    """A region's rollout engines, as many as it runs for this stretch of time."""

    name: str
    engines: int
    tokens_per_s: float  # one device's, shared by its engines' groups
    groups_at_once: int  # per engine
    arrival_s: float  # from the hub's stream to fetched and decoded here
    load_s: float  # generation paused to load a version
    notice_busy_s: float = 0.0  # from arrival until a generating engine starts loading
    notice_idle_s: float = 0.0  # the same for an engine with nothing to generate
    engines_per_device: int = 1
    batch_exponent: float = 0.0  # `RolloutCosts.batch_exponent`


@dataclass(frozen=True)
class Feed:
    depth: int  # tasks published and not yet done, at most (`FeedConfig.depth`)
    poll_s: float = 0.0  # how often it publishes (`FeedConfig.poll_s`); 0: at once


@dataclass(frozen=True)
class Pipeline:
    step_groups: int
    group_size: int
    max_staleness: int
    tokens_per_attempt: float
    group_tokens_cv: float  # the spread of a group's tokens, standard deviation over mean
    step_overhead_s: float
    seconds_per_token: float  # of the trainer as a whole: its ranks' speedup included
    publish_s: float
    feed: Feed
    regions: tuple[Region, ...]

    def step_s(self, tokens: float) -> float:
        return self.step_overhead_s + tokens * self.seconds_per_token

    @property
    def group_tokens(self) -> float:
        return self.group_size * self.tokens_per_attempt


@dataclass(frozen=True)
class Prediction:
    seconds: float
    steps: int
    idle_fraction: float  # the trainer's waiting over its span from first to last step
    staleness_mean: float  # over the groups trained on
    staleness_max: int
    dropped_stale: int  # groups
    groups_generated: int
    rollout_utilisation: float  # tokens generated over what the devices could at full speed
    step_ends: tuple[float, ...]  # when each version was on the hub's stream

    @property
    def steps_per_hour(self) -> float:
        return self.steps * 3600 / self.seconds

    def steps_within(self, span_s: float) -> int:
        """Steps ended within `span_s` of the first step's end (that step included): what
        a run whose budget counts from its first step makes."""
        if not self.step_ends:
            return 0
        return sum(1 for end in self.step_ends if end <= self.step_ends[0] + span_s)


@dataclass
class _Group:
    tokens: float
    version: int
    work: float = field(init=False)  # tokens left

    def __post_init__(self) -> None:
        self.work = self.tokens


@dataclass
class _Engine:
    region: Region
    device: int
    version: int = 0
    held: deque[int] = field(default_factory=deque)  # min versions of tasks waiting
    active: list[_Group] = field(default_factory=list)
    load_from: float = -1.0  # when the pending load pauses generation; -1: none pending
    loading_until: float = -1.0
    loading: int = 0  # the version being loaded

    @property
    def room(self) -> int:
        return self.region.groups_at_once - len(self.held) - len(self.active)

    def generating(self, now: float) -> bool:
        return bool(self.active) and not self.load_from <= now < self.loading_until


class _Model:
    def __init__(self, pipeline: Pipeline) -> None:
        self.p = pipeline
        self.now = 0.0
        self.admission = Admission(pipeline.max_staleness, pipeline.step_groups)
        self.queue: deque[int] = deque()  # min versions of published, untaken tasks
        self.outstanding = 0  # tasks published and not yet finished
        self.feed_at = -1.0  # the feed's next look, when it has work
        self.engines: list[_Engine] = []
        device = 0
        for region in pipeline.regions:
            for i in range(region.engines):
                self.engines.append(_Engine(region, device))
                if (i + 1) % region.engines_per_device == 0 or i + 1 == region.engines:
                    device += 1
        self.devices: dict[int, list[_Engine]] = {}
        for engine in self.engines:
            self.devices.setdefault(engine.device, []).append(engine)
        self.arrivals: list[tuple[float, str, int]] = []  # (time, region, version)
        self.arrived: dict[str, int] = {r.name: 0 for r in pipeline.regions}
        # The trainer.
        self.version = 0
        self.buffer: deque[_Group] = deque()
        self.busy_until = -1.0  # training and publishing
        self.publish_at = -1.0
        self.waiting_since = 0.0
        self.step_ends: list[float] = []
        self.waits: list[float] = []
        self.lags: list[int] = []
        self.dropped = 0
        self.generated = 0
        self.tokens = 0.0  # generated, groups under way included
        self.draws = random.Random(0)

    # -- the next event ----------------------------------------------------------------

    def _rates(self) -> dict[int, float]:
        """Tokens per second each generating group of each busy device gets now."""
        rates = {}
        for device, engines in self.devices.items():
            groups = sum(len(e.active) for e in engines if e.generating(self.now))
            if groups:
                region = engines[0].region
                room = region.groups_at_once * len(engines)
                speed = region.tokens_per_s * min(1.0, groups / room) ** region.batch_exponent
                rates[device] = speed / groups
        return rates

    def _next(self) -> float:
        times = [t for t, _, _ in self.arrivals]
        if self.feed_at > self.now:
            times.append(self.feed_at)
        times += [e.load_from for e in self.engines if e.load_from > self.now]
        times += [e.loading_until for e in self.engines if e.loading_until > self.now]
        if self.busy_until > self.now:
            times.append(self.busy_until)
        if self.publish_at > self.now:
            times.append(self.publish_at)
        rates = self._rates()
        for engine in self.engines:
            if engine.generating(self.now):
                times.append(self.now + min(g.work for g in engine.active) / rates[engine.device])
        return min(times, default=math.inf)

    def _advance(self, until: float) -> None:
        dt, rates = until - self.now, self._rates()
        for engine in self.engines:
            if engine.generating(self.now):
                rate = rates[engine.device]
                for group in engine.active:
                    group.work -= rate * dt
                self.tokens += rate * dt * len(engine.active)
        self.now = until

    # -- what happens at a moment ------------------------------------------------------

    def _settle(self) -> None:
        self._versions()
        self._finish_groups()
        self._trainer()
        self._feed()
        self._take()

    def _versions(self) -> None:
        if self.publish_at >= 0 and self.now >= self.publish_at:
            self.publish_at = -1.0
            self.admission.observe(self.version, self.p.step_groups)
            for region in self.p.regions:
                self.arrivals.append((self.now + region.arrival_s, region.name, self.version))
        due = [a for a in self.arrivals if a[0] <= self.now]
        self.arrivals = [a for a in self.arrivals if a[0] > self.now]
        for _, region, version in due:
            self.arrived[region] = max(self.arrived[region], version)
        for engine in self.engines:
            self._load(engine)
            while engine.held and engine.held[0] <= engine.version:
                engine.held.popleft()
                engine.active.append(self._group(engine.version))

    def _load(self, engine: _Engine) -> None:
        """Finish a load that is due, and start one of a newer version that has arrived
        (a load of no time finishes at once)."""
        while True:
            if engine.loading_until >= 0 and self.now >= engine.loading_until:
                engine.version, engine.loading_until = engine.loading, -1.0
                engine.load_from = -1.0
            newest = self.arrived[engine.region.name]
            if engine.loading_until >= 0 or newest <= engine.version:
                return
            region = engine.region
            engine.loading = newest
            engine.load_from = self.now + (
                region.notice_busy_s if engine.active else region.notice_idle_s
            )
            engine.loading_until = engine.load_from + region.load_s

    def _finish_groups(self) -> None:
        for engine in self.engines:
            done = [g for g in engine.active if g.work <= 1e-9]
            if done:
                engine.active = [g for g in engine.active if g.work > 1e-9]
                self.buffer.extend(done)
                self.outstanding -= len(done)
                self.generated += len(done)

    def _trainer(self) -> None:
        if self.busy_until > self.now or self.publish_at >= 0:
            return
        fresh = deque(g for g in self.buffer if self.version - g.version <= self.p.max_staleness)
        self.dropped += len(self.buffer) - len(fresh)
        self.buffer = fresh
        if len(self.buffer) < self.p.step_groups:
            return
        batch = [self.buffer.popleft() for _ in range(self.p.step_groups)]
        self.waits.append(self.now - self.waiting_since)
        self.lags += [self.version - g.version for g in batch]
        trained = self.now + self.p.step_s(sum(g.tokens for g in batch))
        self.version += 1
        self.busy_until = trained + self.p.publish_s
        self.publish_at = self.busy_until
        self.step_ends.append(self.busy_until)
        self.waiting_since = self.busy_until

    def _group(self, version: int) -> _Group:
        spread = self.p.group_tokens_cv * self.draws.gauss(0.0, 1.0)
        return _Group(self.p.group_tokens * max(0.1, 1.0 + spread), version)

    def _feed(self) -> None:
        room = self.p.feed.depth - self.outstanding
        poll = self.p.feed.poll_s
        if poll > 0 and not math.isclose(self.now / poll, round(self.now / poll), abs_tol=1e-9):
            # Not the feed's moment: if it will have work, its next look is an event.
            if room > 0 and copy.deepcopy(self.admission).admit(room):
                self.feed_at = math.ceil(self.now / poll) * poll
            return
        self.feed_at = -1.0
        for target in self.admission.admit(room):
            self.queue.append(self.admission.min_version(target))
            self.outstanding += 1

    def _take(self) -> None:
        """Engines with room take tasks from the queue's head, one each in turn."""
        while self.queue:
            open_ = [e for e in self.engines if e.room > 0]
            if not open_:
                return
            for engine in sorted(open_, key=lambda e: -e.room):
                if not self.queue:
                    return
                need = self.queue.popleft()
                if need <= engine.version:
                    engine.active.append(self._group(engine.version))
                else:
                    engine.held.append(need)

    def run(self, seconds: float) -> Prediction:
        self._settle()
        while True:
            at = self._next()
            if at > seconds:
                self._advance(seconds)
                break
            self._advance(at)
            self._settle()
        return self._prediction(seconds)

    def _prediction(self, seconds: float) -> Prediction:
        ends = self.step_ends
        span = ends[-1] - ends[0] if len(ends) > 1 else 0.0
        capacity = seconds * sum(e[0].region.tokens_per_s for e in self.devices.values())
        return Prediction(
            seconds=seconds,
            steps=len(ends),
            idle_fraction=sum(self.waits[1:]) / span if span > 0 else 0.0,
            staleness_mean=sum(self.lags) / len(self.lags) if self.lags else 0.0,
            staleness_max=max(self.lags, default=0),
            dropped_stale=self.dropped,
            groups_generated=self.generated,
            rollout_utilisation=self.tokens / capacity if capacity else 0.0,
            step_ends=tuple(ends),
        )


def simulate(pipeline: Pipeline, seconds: float) -> Prediction:
    """What the pipeline does in `seconds` from its start (no trainer step made yet)."""
    return _Model(pipeline).run(seconds)

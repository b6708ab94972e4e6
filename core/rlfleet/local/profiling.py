"""A cost profile (`rlfleet.api.profile`) measured from local runs' durable records.

Two runs of the same spec make one profile:

- one generous with staleness (`ahead`) and rollout-bound (its trainer waited for
  trajectories), so its rollout core generated all the time: the tokens the trainer
  received per second are the core's tokens per second. The trainer's costs come from its
  step reports, and the spread of a group's tokens from that of a step's (a step's
  `stepGroups` groups are independent draws);
- one synchronous (`maxStaleness: 0`): every version finds the engines idle, waiting.

Each version an engine loaded (its log line says when, with how many requests running,
and the pause) against when the trainer published it tells how soon an engine notices a
version, while it generates (the first run) and while it waits (the second).
"""

from __future__ import annotations

import itertools
import math
import platform
import re
import statistics
from dataclasses import dataclass
from pathlib import Path

from rlfleet.api.profile import (
    Profile,
    RolloutCosts,
    TrainerCosts,
    WeightCosts,
)
from rlfleet.api.rlrun import RLRunSpec
from rlfleet.api.wire import StepReport
from rlfleet.local.plan import Tuning

MIN_IDLE = 0.1  # below this the trainer kept up with nothing: rollout speed is unknown

# What a worker logs when its engine runs a new version (`rlfleet.rollout.engine.driver`).
LOADED = re.compile(
    r"policy version (?P<version>\d+) loaded at (?P<at>[0-9.]+) with (?P<running>\d+) "
    r"requests running; generation paused (?P<pause>[0-9.]+)s"
)


class NotRolloutBound(ValueError):
    pass


@dataclass(frozen=True)
class Profiled:
    """One local run's record: its step reports and its processes' logs."""

    steps: list[StepReport]
    logs: Path


@dataclass(frozen=True)
class _Load:
    notice_s: float  # from the version on the hub's stream until its load began
    busy: bool
    pause_s: float


def _loads(run: Profiled, publish_s: float) -> list[_Load]:
    on_stream = {s.policy_version: s.finished_at + publish_s for s in run.steps}
    found = []
    for log in sorted(run.logs.glob("rollout-*.log")):
        for match in LOADED.finditer(log.read_text(errors="replace")):
            version, pause = int(match["version"]), float(match["pause"])
            if version in on_stream:
                began = float(match["at"]) - pause
                notice = max(0.0, began - on_stream[version])
                found.append(_Load(notice, int(match["running"]) > 0, pause))
    return found


def _trainer(steps: list[StepReport]) -> TrainerCosts:
    """Step seconds against tokens by least squares (the step's fixed part is the
    intercept), and what follows a step until the trainer is ready again (checkpoint,
    publishing the version, acknowledging) from the gaps between steps' ends."""
    tokens = [s.tokens for s in steps]
    seconds = [s.step_seconds for s in steps]
    slope, intercept = statistics.linear_regression(tokens, seconds)
    if slope <= 0 or intercept < 0:  # sizes too alike to tell apart: all per token
        slope, intercept = sum(seconds) / sum(tokens), 0.0
    after = [
        b.finished_at - a.finished_at - b.wait_seconds - b.step_seconds
        for a, b in itertools.pairwise(steps)
    ]
    return TrainerCosts(
        seconds_per_token=slope,
        step_overhead_s=intercept,
        publish_s=max(0.0, statistics.median(after)),
    )


def measure(spec: RLRunSpec, ahead: Profiled, synchronous: Profiled, tuning: Tuning) -> Profile:
    """The profile of the machine local runs of `spec` ran on: `ahead` ran generous with
    staleness, `synchronous` with none. Each run's first step (a cold start) is left out."""
    if spec.rollout is None:
        raise ValueError("a profiling run needs spec.rollout")
    steps = ahead.steps[1:]
    if len(steps) < 10:
        raise ValueError(f"{len(steps)} steps are too few to measure a profile from")
    span = steps[-1].finished_at - steps[0].finished_at
    waited = sum(s.wait_seconds for s in steps[1:]) / span
    if waited < MIN_IDLE:
        raise NotRolloutBound(
            f"the trainer waited {waited:.0%} of the time: rollouts kept ahead, so their "
            "speed is not what the trainer received; profile with fewer rollout cores"
        )
    trainer = _trainer(steps)
    loads = _loads(ahead, trainer.publish_s) + _loads(synchronous, trainer.publish_s)
    busy = [load.notice_s for load in loads if load.busy]
    idle = [load.notice_s for load in loads if not load.busy]
    if not busy or not idle:
        raise ValueError(
            f"version loads in the workers' logs: {len(busy)} while generating, {len(idle)} "
            "while idle; a profile needs both"
        )
    tokens = [s.tokens for s in steps]
    attempts = sum(s.groups for s in steps) * spec.rollout.group_size
    groups_per_step = statistics.fmean(s.groups for s in steps)
    return Profile(
        measured_on=f"{platform.node()} ({platform.machine()}): local runs of tiny-moe",
        trainer=trainer,
        rollout=RolloutCosts(
            tokens_per_s=sum(tokens[1:]) / span,
            groups_at_once=max(1, tuning.max_sessions // spec.rollout.group_size),
            tokens_per_attempt=sum(tokens) / attempts,
            group_tokens_cv=statistics.stdev(tokens)
            / statistics.fmean(tokens)
            * math.sqrt(groups_per_step),
            load_s=statistics.median(load.pause_s for load in loads),
            notice_busy_s=statistics.median(busy),
            notice_idle_s=statistics.median(idle),
            # Every region's worker shares the one rollout core (`plan.split_cores`).
            engines_per_device=len(spec.rollout_regions),
        ),
        # The fetch over loopback is inside the engines' notice: a few hundred kB take
        # a millisecond there, too little to tell bandwidth by.
        weights=WeightCosts(
            bytes_per_version=int(statistics.median(s.weight_bytes for s in steps)),
            latency_s=0.0,
        ),
    )

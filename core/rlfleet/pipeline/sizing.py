"""From an RLRun's spec, a cost profile and a GPU split to the pipeline the model plays,
and the split that makes the most steps an hour.

The spec says the recipe (group size, step size, staleness bound, regions); the profile
says what each unit of work costs on the hardware; the split says how many GPUs train and
how many each region lends to rollouts.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass

from rlfleet.api.profile import Profile
from rlfleet.api.rlrun import STEP_TOKENS, RLRunSpec
from rlfleet.pipeline.model import Feed, Pipeline, Prediction, Region, simulate

# Steps a prediction plays: enough for the pipeline to reach its steady state (the first
# batch waits for rollouts from nothing) and to average over it.
STEPS_PLAYED = 60


@dataclass(frozen=True)
class Split:
    trainer_gpus: int
    rollout_gpus: dict[str, int]  # per region

    @property
    def total(self) -> int:
        return self.trainer_gpus + sum(self.rollout_gpus.values())

    @property
    def trainer_share(self) -> float:
        return self.trainer_gpus / self.total if self.total else 0.0


def step_groups(spec: RLRunSpec, profile: Profile) -> int:
    """Groups per step: the spec's, or as many as fill its token budget (the trainer takes
    complete groups until it has `stepTokens`)."""
    if spec.trainer.step_groups is not None:
        return spec.trainer.step_groups
    group_tokens = _group_size(spec) * profile.rollout.tokens_per_attempt
    return max(1, math.ceil((spec.trainer.step_tokens or STEP_TOKENS) / group_tokens))


def _group_size(spec: RLRunSpec) -> int:
    if spec.rollout is None:
        raise ValueError("spec.rollout: a production run has no task rollouts to plan")
    return spec.rollout.group_size


def spec_split(spec: RLRunSpec) -> Split:
    """The GPUs the spec asks for: its trainer's, and each region's most."""
    trainer = spec.trainer.replicas * max(1, spec.trainer.gpus_per_replica)
    return Split(trainer, {d.name: d.max_gpus for d in spec.rollout_regions})


def pipeline_for(spec: RLRunSpec, profile: Profile, split: Split, feed: Feed) -> Pipeline:
    """The pipeline `split` makes of the spec, at the profile's costs, fed as `feed` says
    (the feed's settings for the spec: `FeedConfig`)."""
    rollout, trainer = profile.rollout, profile.trainer
    links = {link.region: link.gbps for link in profile.links}
    weights = profile.weights
    regions = []
    for name, gpus in split.rollout_gpus.items():
        gbps = min(links.get(name, math.inf), weights.receive_gbps or math.inf)
        regions.append(
            Region(
                name=name,
                engines=gpus // rollout.gpus_per_engine,
                tokens_per_s=rollout.tokens_per_s,
                groups_at_once=rollout.groups_at_once,
                arrival_s=weights.latency_s + weights.bytes_per_version / (gbps * 1e9),
                load_s=rollout.load_s,
                notice_busy_s=rollout.notice_busy_s,
                notice_idle_s=rollout.notice_idle_s,
                engines_per_device=rollout.engines_per_device,
                batch_exponent=rollout.batch_exponent,
            )
        )
    speedup = 1 + (split.trainer_gpus - 1) * trainer.rank_efficiency
    return Pipeline(
        step_groups=step_groups(spec, profile),
        group_size=_group_size(spec),
        max_staleness=spec.max_staleness,
        tokens_per_attempt=rollout.tokens_per_attempt,
        group_tokens_cv=rollout.group_tokens_cv,
        step_overhead_s=trainer.step_overhead_s,
        seconds_per_token=trainer.seconds_per_token / speedup,
        publish_s=trainer.publish_s,
        feed=feed,
        regions=tuple(regions),
    )


def horizon_s(pipeline: Pipeline) -> float:
    """Model seconds for about `STEPS_PLAYED` steps at the slower of the two sides."""
    batch = pipeline.step_groups * pipeline.group_tokens
    rate = sum(r.engines * r.tokens_per_s / r.engines_per_device for r in pipeline.regions)
    generate = batch / rate if rate else math.inf
    train = pipeline.step_s(batch) + pipeline.publish_s
    arrival = max(
        (r.arrival_s + max(r.notice_busy_s, r.notice_idle_s) + r.load_s for r in pipeline.regions),
        default=0.0,
    )
    return STEPS_PLAYED * max(generate, train) + arrival


def predict(spec: RLRunSpec, profile: Profile, split: Split, feed: Feed) -> Prediction:
    pipeline = pipeline_for(spec, profile, split, feed)
    if not any(r.engines for r in pipeline.regions):
        raise ValueError("the split lends no region a whole rollout engine")
    return simulate(pipeline, horizon_s(pipeline))


def splits(
    spec: RLRunSpec, profile: Profile, gpus: int, where: Mapping[str, int] | None = None
) -> list[Split]:
    """Every way to share `gpus` between whole trainer replicas and whole rollout engines,
    the rollout GPUs spread over the regions in proportion to `where` (GPUs each region
    can lend; default: the spec's `maxGpus`) and never past it."""
    replica = max(1, spec.trainer.gpus_per_replica)
    engine = profile.rollout.gpus_per_engine
    if where is None:
        where = {d.name: d.max_gpus for d in spec.rollout_regions}
    weights = sum(where.values())
    found = []
    for trainer in range(replica, gpus, replica):
        left = gpus - trainer
        shares = {
            region: min(most, left * most // weights) // engine * engine
            for region, most in where.items()
        }
        if any(shares.values()):
            found.append(Split(trainer, shares))
    return found


def best_split(
    spec: RLRunSpec,
    profile: Profile,
    gpus: int,
    feed: Feed,
    where: Mapping[str, int] | None = None,
) -> tuple[Split, Prediction] | None:
    """The split of `gpus` that makes the most steps an hour (the staleness bound holds in
    every split: the model drops what the trainer would)."""
    best: tuple[Split, Prediction] | None = None
    for split in splits(spec, profile, gpus, where):
        prediction = predict(spec, profile, split, feed)
        if best is None or prediction.steps_per_hour > best[1].steps_per_hour:
            best = (split, prediction)
    return best


def third_rule_split(
    spec: RLRunSpec, profile: Profile, gpus: int, where: Mapping[str, int] | None = None
) -> Split | None:
    """Seed 001's rule of thumb: a third of the GPUs sample, two thirds train."""
    candidates = splits(spec, profile, gpus, where)
    return min(candidates, key=lambda s: abs(s.trainer_share - 2 / 3), default=None)

"""A run's GPUs hour by hour over a day of its regions' traffic, and what the pipeline
makes of them.

Each InferencePool lends by the region operator's own decision (`lending.decide`), played
hour by hour over the day's load with the hysteresis it carries from hour to hour (a
first day settles it). A region's rollout GPUs at an hour are what its pools lend the run
then; the trainer keeps the GPUs its spec gives it. Within an hour the model holds the
split steady: a reclaim costs the groups under way on the GPUs given back (at most one
batch's generation), which is small next to an hour.
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import UTC, date, datetime, time

from rlfleet.api.inferencepool import InferencePoolSpec
from rlfleet.api.profile import Profile
from rlfleet.api.rlrun import RLRunSpec
from rlfleet.api.traffic import HOURS
from rlfleet.pipeline.lending import PoolState, RunDemand, decide, lent_elsewhere
from rlfleet.pipeline.model import Feed, Prediction
from rlfleet.pipeline.sizing import Split, predict, spec_split

RUN = "planned"
DAY = date(2026, 1, 5)  # a Monday: off-peak windows are times of day, so any day will do


@dataclass(frozen=True)
class Pool:
    name: str
    region: str
    spec: InferencePoolSpec
    hourly_load: tuple[float, ...]


@dataclass(frozen=True)
class Hour:
    hour: int
    split: Split
    prediction: Prediction | None  # None: no region lends a whole engine


def lent_by_hour(spec: RLRunSpec, pools: list[Pool]) -> list[dict[str, int]]:
    """GPUs each region's pools lend the run at each hour of the day (UTC)."""
    # Pools are named within their region (each region's cluster has its own).
    lent: dict[tuple[str, str], dict[str, int]] = {(p.region, p.name): {} for p in pools}
    hours: list[dict[str, int]] = []
    for day in (0, 1):
        for hour in range(HOURS):
            now = datetime.combine(DAY, time(hour), tzinfo=UTC)
            gpus = {}
            for demand in spec.rollout_regions:
                wants = RunDemand.of(RUN, spec, demand)
                here = [p for p in pools if p.region == demand.name]
                for pool in here:
                    elsewhere = lent_elsewhere([_gpus(lent, p) for p in here if p is not pool])
                    key = (pool.region, pool.name)
                    load = pool.hourly_load[hour]
                    state = PoolState.of(pool.name, pool.spec, load, lent[key], now)
                    lent[key] = decide(state, [wants], elsewhere).lent
                gpus[demand.name] = sum(_gpus(lent, p).get(RUN, 0) for p in here)
            if day:
                hours.append(gpus)
    return hours


def _gpus(lent: dict[tuple[str, str], dict[str, int]], pool: Pool) -> dict[str, int]:
    replicas = lent[(pool.region, pool.name)]
    return {run: n * pool.spec.serving.gpus_per_replica for run, n in replicas.items()}


def plan_day(spec: RLRunSpec, profile: Profile, pools: list[Pool], feed: Feed) -> list[Hour]:
    trainer = spec_split(spec).trainer_gpus
    found = []
    for hour, gpus in enumerate(lent_by_hour(spec, pools)):
        split = Split(trainer, gpus)
        engines = sum(g // profile.rollout.gpus_per_engine for g in gpus.values())
        prediction = predict(spec, profile, split, feed) if engines else None
        found.append(Hour(hour, split, prediction))
    return found

"""How many serving replicas of each InferencePool to lend to each RLRun: a pure decision.

The decision takes what the pool has lent so far (its recorded intent) and returns what it
should lend now. Two thresholds make it hysteretic: a pool lends more only while the load
per serving replica is below `lend_below` and gives replicas back only once it rises above
`reclaim_above`; in between it holds. Lending stops at the serving floor and at
`max_lend_fraction`; outside its off-peak windows a pool lends nothing. Runs with higher
priority borrow first and give back last; a replica already lent stays with its run
unless the pool must shrink, so the decision never moves GPUs between runs for nothing.

A pool a production run learns from keeps that run's canary set serving
(`spec.production.canary.replicas`, `canary_set`) and one replica besides it: the canary
set comes out of serving, never out of what is lent.

A run that names GPU types borrows only from pools of one of them (a pool of no named
type lends it nothing). Among runs of one priority, those that named the pool's type
borrow first: a run that takes any type can be served by any pool, one that named a
type only by pools of it.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from datetime import datetime, time
from zoneinfo import ZoneInfo, ZoneInfoNotFoundError

from rlfleet.api.inferencepool import InferencePoolSpec, OffPeakWindow
from rlfleet.api.rlrun import RegionDemand, RLRunSpec


@dataclass(frozen=True)
class PoolState:
    """One pool as the decision sees it."""

    name: str
    replicas: int  # the pool's whole size
    gpus_per_replica: int
    min_serving: int
    max_lend_fraction: float
    lend_below: float
    reclaim_above: float
    load: float | None  # the traffic signal summed over serving replicas; None: unknown
    in_window: bool = True
    lent: Mapping[str, int] = field(default_factory=dict)  # run -> replicas, the intent so far
    gpu_type: str | None = None  # None: the pool names none

    @classmethod
    def of(
        cls,
        name: str,
        spec: InferencePoolSpec,
        load: float | None,
        lent: Mapping[str, int],
        now: datetime,
        canary: int = 0,
    ) -> PoolState:
        """`canary`: replicas in the pool's canary set (`canary_set`), which serving keeps
        with one more, the stable set's, whatever its floor."""
        return cls(
            name=name,
            replicas=spec.serving.replicas,
            gpus_per_replica=spec.serving.gpus_per_replica,
            min_serving=max(spec.min_serving_replicas, canary + 1 if canary else 0),
            max_lend_fraction=spec.max_lend_fraction,
            lend_below=spec.traffic.lend_below,
            reclaim_above=spec.traffic.reclaim_above,
            load=load,
            in_window=in_off_peak(spec.off_peak_windows, now),
            lent=dict(lent),
            gpu_type=spec.serving.gpu_type,
        )

    @property
    def lendable(self) -> int:
        """The most replicas this pool may ever lend at once."""
        by_fraction = math.floor(self.max_lend_fraction * self.replicas + 1e-9)
        return max(0, min(self.replicas - self.min_serving, by_fraction))


@dataclass(frozen=True)
class RunDemand:
    """What one run wants in this region, in GPUs, and from which pools."""

    run: str
    priority: int
    min_gpus: int
    max_gpus: int
    pools: tuple[str, ...]
    active: bool = True  # False while suspended or being deleted
    gpu_types: tuple[str, ...] = ()  # the GPU types it can use; empty: any

    @classmethod
    def of(cls, run: str, spec: RLRunSpec, here: RegionDemand, active: bool = True) -> RunDemand:
        """What the run's spec asks of one region (`here`, one of its rollout regions)."""
        return cls(
            run=run,
            priority=spec.priority,
            min_gpus=here.min_gpus,
            max_gpus=here.max_gpus,
            pools=tuple(here.inference_pools),
            gpu_types=tuple(here.gpu_types),
            active=active,
        )

    def accepts(self, pool: PoolState) -> bool:
        """Whether the run can use the pool's GPUs at all."""
        return not self.gpu_types or pool.gpu_type in self.gpu_types

    def named(self, pool: PoolState) -> bool:
        """Whether the run asked for the pool's GPU type by name."""
        return pool.gpu_type is not None and pool.gpu_type in self.gpu_types


@dataclass(frozen=True)
class Decision:
    lent: dict[str, int]  # run -> replicas; runs lent nothing are left out
    reason: str  # Lend | Hold | Reclaim | OffPeakOver | TrafficUnknown | NoDemand

    @property
    def total(self) -> int:
        return sum(self.lent.values())


def _zone(name: str) -> ZoneInfo | None:
    """The IANA time zone of this name; None for a name that is none (a directory such as
    `America` and a path such as `../x` included)."""
    try:
        return ZoneInfo(name)
    except (ZoneInfoNotFoundError, ValueError, OSError):
        return None


def unknown_time_zones(windows: list[OffPeakWindow]) -> list[str]:
    """The windows whose time zone is no IANA name, each as `field: why` (the schema
    cannot tell: it knows no zone names)."""
    return [
        f"spec.offPeakWindows[{index}].timeZone: no time zone is named {window.time_zone!r}"
        for index, window in enumerate(windows)
        if _zone(window.time_zone) is None
    ]


def in_off_peak(windows: list[OffPeakWindow], now: datetime) -> bool:
    """Whether now is inside one of the windows; no windows means always. A window in an
    unknown time zone is never open: the pool lends nothing it cannot place in time."""
    if not windows:
        return True
    for window in windows:
        zone = _zone(window.time_zone)
        if zone is None:
            continue
        local = now.astimezone(zone).time()
        start, end = time.fromisoformat(window.start), time.fromisoformat(window.end)
        inside = start <= local < end if start <= end else (local >= start or local < end)
        if inside:
            return True
    return False


def _target_total(pool: PoolState) -> tuple[int, str]:
    """How many replicas the pool should lend in all, and why."""
    current = sum(pool.lent.values())
    if not pool.in_window:
        return 0, "OffPeakOver"
    if pool.load is None:
        # No signal: lend nothing more, and take nothing back on a guess.
        return min(current, pool.lendable), "TrafficUnknown"
    serving = max(pool.replicas - current, 1)
    per_replica = pool.load / serving
    # Enough serving replicas to bring the load per replica down to lend_below.
    comfortable = (
        math.ceil(pool.load / pool.lend_below - 1e-9) if pool.lend_below > 0 else pool.replicas
    )
    room = max(0, min(pool.lendable, pool.replicas - max(comfortable, pool.min_serving)))
    if per_replica > pool.reclaim_above:
        return min(current, room), "Reclaim"
    if per_replica < pool.lend_below:
        return max(min(current, pool.lendable), room), "Lend"
    return min(current, pool.lendable), "Hold"


def _wants(demand: RunDemand, pool: PoolState, elsewhere: Mapping[str, int]) -> tuple[int, int]:
    """The replicas of this pool a run needs for its floor, and at most, given the GPUs
    other pools of the region already lend it."""
    if not demand.active or pool.name not in demand.pools or not demand.accepts(pool):
        return 0, 0
    other = elsewhere.get(demand.run, 0)
    floor = max(0, math.ceil((demand.min_gpus - other) / pool.gpus_per_replica))
    most = max(0, (demand.max_gpus - other) // pool.gpus_per_replica)
    return min(floor, most), most


def decide(
    pool: PoolState, demands: list[RunDemand], elsewhere: Mapping[str, int] | None = None
) -> Decision:
    """What the pool lends to each run now. `elsewhere`: GPUs other pools of the region
    lend each run, so a run's demand is counted once across pools."""
    elsewhere = elsewhere or {}
    target, reason = _target_total(pool)
    wants = {d.run: _wants(d, pool, elsewhere) for d in demands}
    by_priority = sorted(demands, key=lambda d: (-d.priority, not d.named(pool), d.run))
    # Keep what is lent, within each run's demand; a run that is gone keeps nothing.
    lent = {run: min(n, wants[run][1]) for run, n in pool.lent.items() if run in wants}
    # Shrink: the lowest priority gives back first.
    for demand in reversed(by_priority):
        excess = sum(lent.values()) - target
        if excess <= 0:
            break
        give_back = min(excess, lent.get(demand.run, 0))
        lent[demand.run] = lent.get(demand.run, 0) - give_back
    # Grow: the highest priority borrows first, floors before maxima.
    for level in (0, 1):
        for demand in by_priority:
            room = target - sum(lent.values())
            if room <= 0:
                break
            extra = min(room, max(0, wants[demand.run][level] - lent.get(demand.run, 0)))
            lent[demand.run] = lent.get(demand.run, 0) + extra
    lent = {run: n for run, n in sorted(lent.items()) if n > 0}
    if not lent and reason == "Lend" and target > 0:
        reason = "NoDemand"
    return Decision(lent, reason)


def canary_set(runs: Iterable[RLRunSpec], region: str, pool: str, replicas: int) -> int:
    """Replicas of a pool of `replicas` that serve as its canary set: what a production run
    learning from it asks, the most if several do, short of the whole pool (the stable set
    keeps one)."""
    asked = [
        spec.production.canary.replicas
        for spec in runs
        if spec.production is not None
        and (spec.production.pool.region, spec.production.pool.name) == (region, pool)
    ]
    return min(max(asked, default=0), replicas - 1)


def unserved_gpu_types(
    region: str, demand: RunDemand, pool_types: Mapping[str, str | None]
) -> str | None:
    """Why a run that names GPU types borrows nothing in the region, which a schema cannot
    see: the pools it names there exist (`pool_types`: the region's pools, name -> GPU
    type), but none serves on one of its types. None when that is not so."""
    offered = {p: pool_types[p] for p in demand.pools if p in pool_types}
    if not demand.gpu_types or not offered:
        return None
    if any(t in demand.gpu_types for t in offered.values()):
        return None
    seen = ", ".join(f"{p} on {t or 'no named type'}" for p, t in sorted(offered.items()))
    return (
        f"spec.rollout.regions[{region}].gpuTypes {', '.join(demand.gpu_types)}: no pool of its "
        f"inferencePools serves on them ({seen})"
    )


def lent_elsewhere(by_pool: list[Mapping[str, int]]) -> dict[str, int]:
    """GPUs lent to each run by the region's other pools (each pool's run -> GPUs), summed:
    the `elsewhere` of a pool's decision."""
    elsewhere: dict[str, int] = {}
    for lent in by_pool:
        for run, gpus in lent.items():
            elsewhere[run] = elsewhere.get(run, 0) + gpus
    return elsewhere

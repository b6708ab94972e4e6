"""What a trainer's newest step report means for its run's status. Pure: no I/O.

The hub reads the report from the run's step stream (`DataPlane.last_step`) and folds it
here into the status fields an on-call engineer reads (version, step, staleness, the
last weight sync) and the data plane's two warnings:

- `WeightSyncStalled`: training, yet no new policy version for `stallSeconds`;
- `StalenessBoundExceeded`: the trainer dropped trajectories that arrived more than
  `maxStaleness` versions old since the hub last looked: some region's rollouts lag.

Messages name fixed moments, not ages, so a resync that learns nothing writes nothing.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from datetime import UTC, datetime

from rlfleet.api.rlrun import RLRunSpec
from rlfleet.api.wire import StepReport
from rlfleet.operator.status import Event, condition, timestamp


@dataclass
class Progress:
    fields: dict  # status fields from the report; empty before the first step
    stalled: bool
    condition: dict  # WeightSyncStalled
    events: list[Event] = field(default_factory=list)


def fold(
    report: StepReport | None,
    spec: RLRunSpec,
    old: dict,
    training_since: datetime | None,
    moment: datetime,
    generation: int,
) -> Progress:
    """`old` is the run's current status; `training_since` is when Training last became
    true (None while it is not)."""
    fields: dict = {}
    events: list[Event] = []
    published = None
    if report is not None:
        published = datetime.fromtimestamp(report.finished_at, UTC)
        fields = {
            "policyVersion": report.policy_version,
            "trainerStep": report.step,
            "staleness": report.staleness_max,
            "trajectoriesDroppedStale": report.dropped_stale_total,
            "lastWeightSync": {
                "version": report.policy_version,
                "bytes": report.weight_bytes,
                "seconds": report.weight_seconds,
                "time": timestamp(published),
            },
        }
        dropped = report.dropped_stale_total - old.get("trajectoriesDroppedStale", 0)
        if dropped > 0:
            events.append(
                Event(
                    "Warning",
                    "StalenessBoundExceeded",
                    f"{dropped} trajectories arrived more than maxStaleness "
                    f"{spec.max_staleness} versions behind and were dropped "
                    f"({report.dropped_stale_total} in all, policy version "
                    f"{report.policy_version}); rollouts in some region lag",
                )
            )

    since = max(filter(None, [published, training_since]), default=None)
    stalled = (
        training_since is not None
        and since is not None
        and (moment - since).total_seconds() > spec.weight_sync.stall_seconds
    )
    newest = (
        f"version {report.policy_version} published at {timestamp(published)}"
        if report is not None
        else f"no version since training began at {timestamp(training_since)}"
        if training_since is not None
        else "not training"
    )
    limit = f"stallSeconds {spec.weight_sync.stall_seconds}"
    stalled_condition = condition(
        old.get("conditions", []),
        "WeightSyncStalled",
        stalled,
        "NoNewVersion" if stalled else "VersionsLanding",
        f"{newest}; {limit}",
        generation,
    )
    was = next((c for c in old.get("conditions", []) if c.get("type") == "WeightSyncStalled"), {})
    if stalled and was.get("status") != "True":
        age = (moment - since).total_seconds() if since else 0.0
        events.append(Event("Warning", "WeightSyncStalled", f"{newest}, {age:.0f}s ago; {limit}"))
    return Progress(fields, stalled, stalled_condition, events)

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

from rlfleet.api.meta import Condition
from rlfleet.api.rlrun import RLRunSpec, RLRunStatus, WeightSyncStatus
from rlfleet.api.wire import StepReport
from rlfleet.operator.status import Event, condition, find, timestamp

# A tracker that fails for longer than this (its server down, or refusing the trainer's
# credentials) is said in the run's status: a blip of a few retries is not.
TRACKING_PATIENCE_S = 60.0


@dataclass
class Progress:
    fields: RLRunStatus  # the status fields the report sets; none before the first step
    stalled: bool
    condition: Condition  # WeightSyncStalled
    events: list[Event] = field(default_factory=list)
    tracking: Condition | None = None  # TrackingUnreachable, for a run with a tracker


def fold(
    report: StepReport | None,
    spec: RLRunSpec,
    old: RLRunStatus,
    training_since: datetime | None,
    moment: datetime,
    generation: int,
) -> Progress:
    """`old` is the run's current status; `training_since` is when Training last became
    true (None while it is not)."""
    published = None if report is None else datetime.fromtimestamp(report.finished_at, UTC)
    events = [] if report is None else _dropped(report, spec, old)
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
        old.conditions,
        "WeightSyncStalled",
        stalled,
        "NoNewVersion" if stalled else "VersionsLanding",
        f"{newest}; {limit}",
        generation,
        moment,
    )
    was = find(old.conditions, "WeightSyncStalled")
    if stalled and (was is None or was.status != "True"):
        age = (moment - since).total_seconds() if since else 0.0
        events.append(Event("Warning", "WeightSyncStalled", f"{newest}, {age:.0f}s ago; {limit}"))
    fields = RLRunStatus() if report is None else _fields(report, published, spec)
    tracked = tracking(report, spec, old, moment, generation)
    if tracked is not None:
        was_tracking = find(old.conditions, "TrackingUnreachable")
        if tracked.status == "True" and (was_tracking is None or was_tracking.status != "True"):
            events.append(Event("Warning", "TrackingUnreachable", tracked.message))
    return Progress(fields, stalled, stalled_condition, events, tracked)


def tracking(
    report: StepReport | None, spec: RLRunSpec, old: RLRunStatus, moment: datetime, generation: int
) -> Condition | None:
    """TrackingUnreachable, for a run with a tracker, once a step has said how it fares:
    true while the trainer has failed to reach it for TRACKING_PATIENCE_S."""
    if spec.tracking is None or report is None:
        return None
    failing = report.tracking_unreachable_seconds
    down = failing > TRACKING_PATIENCE_S
    where = spec.tracking.mlflow.tracking_uri
    message = (
        f"{where} unreachable for {failing:.0f}s at step {report.step}"
        if down
        else f"{where} answers (step {report.step})"
    ) + f"; {report.tracking_dropped_total} step reports dropped in all"
    reason = "TrackerUnreachable" if down else "TrackerReachable"
    return condition(
        old.conditions, "TrackingUnreachable", down, reason, message, generation, moment
    )


def _fields(report: StepReport, published: datetime, spec: RLRunSpec) -> RLRunStatus:
    return RLRunStatus(
        policy_version=report.policy_version,
        trainer_step=report.step,
        # A production run trains on what production served, the serving version's
        # answers, while its trainer steps a candidate: versions behind mean nothing there.
        staleness=report.staleness_max if spec.production is None else None,
        trajectories_dropped_stale=report.dropped_stale_total,
        last_weight_sync=WeightSyncStatus(
            version=report.policy_version,
            bytes=report.weight_bytes,
            seconds=report.weight_seconds,
            time=timestamp(published),
        ),
    )


def _dropped(report: StepReport, spec: RLRunSpec, old: RLRunStatus) -> list[Event]:
    """StalenessBoundExceeded when the trainer dropped more since the hub last looked."""
    dropped = report.dropped_stale_total - (old.trajectories_dropped_stale or 0)
    if dropped <= 0:
        return []
    return [
        Event(
            "Warning",
            "StalenessBoundExceeded",
            f"{dropped} trajectories arrived more than maxStaleness "
            f"{spec.max_staleness} versions behind and were dropped "
            f"({report.dropped_stale_total} in all, policy version "
            f"{report.policy_version}); rollouts in some region lag",
        )
    ]

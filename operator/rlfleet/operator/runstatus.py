"""What the hub's reading of the world means for one RLRun: its new status and the events
worth telling the on-call engineer. Pure: no I/O, no clock (the moment is observed).

A region that does not answer keeps its last report, marked unreachable once it has been
silent for `region_timeout_seconds` (`RegionUnreachable`) or at once when the hub's
credentials for it are refused (`RegionCredentialsInvalid`); training goes on with the
others. While a region answers, its lastSeen is rewritten at most every
`LAST_SEEN_REFRESH_S`, so a resync that learns nothing new writes nothing.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from datetime import datetime

from rlfleet.api.meta import Condition
from rlfleet.api.production import ProductionStatus
from rlfleet.api.rlrun import RegionStatus, RLRunSpec, RLRunStatus
from rlfleet.api.wire import StepReport
from rlfleet.operator import production, progress
from rlfleet.operator.gate import Verdict
from rlfleet.operator.production import CycleUpdates
from rlfleet.operator.status import (
    Event,
    condition,
    find,
    invalid_spec,
    merged,
    parse_time,
    timestamp,
)

LAST_SEEN_REFRESH_S = 60


@dataclass(frozen=True)
class RegionReport:
    """One region named by the spec, as the hub found it this time."""

    name: str
    reachable: bool
    reported: RegionStatus | None = None  # the region's entry on its mirror, when it answered
    answered: datetime | None = None  # when it answered
    problem: str = ""  # why it is not reachable: credentials or the network
    credentials: bool = False  # the problem is the kubeconfig Secret, not the network


@dataclass(frozen=True)
class Observed:
    """Everything the decision reads, gathered by the hub before deciding."""

    spec: RLRunSpec
    old: RLRunStatus
    generation: int
    created: datetime | None  # the run's creationTimestamp
    verdict: Verdict  # the evaluation gate's, judged on the newest report
    ready: int  # trainer replicas ready
    regions: Sequence[RegionReport]  # one per region the spec names, in its order
    leftover: Sequence[str]  # regions dropped from the spec whose mirror is not gone yet
    last_answer: Mapping[str, datetime]  # region -> its last answer in this process
    stepped: bool  # the step stream answered (False without NATS or when it did not)
    step: StepReport | None  # the trainer's newest step report
    moment: datetime
    region_timeout_s: float
    # A production run's conductor states since the status's; None when not read.
    cycles: CycleUpdates | None = None
    # What the data plane refused in the spec, each naming its field (`invalid_spec`).
    spec_problems: Sequence[str] = ()


@dataclass
class Decision:
    status: RLRunStatus  # the whole new status: every field the hub owns is given
    events: list[Event] = field(default_factory=list)


@dataclass(frozen=True)
class RegionView:
    """A region's new status entry and what it means for the run."""

    entry: RegionStatus
    silent_s: float = 0.0  # since its last answer, when it did not answer
    lost: bool = False  # silent past the timeout
    refused: bool = False  # its credentials were refused
    problem: str = ""  # why it did not answer
    event: Event | None = None  # it turned reachable or unreachable


def region_view(
    report: RegionReport,
    previous: RegionStatus | None,
    last_answer: datetime | None,
    created: datetime | None,
    moment: datetime,
    timeout_s: float,
) -> RegionView:
    """Reachability: `previous` is the region's entry in the run's status (None before the
    first), `last_answer` when it last answered this process."""
    was_reachable = previous.reachable if previous is not None else True
    if report.reachable:
        return _answered(report, previous, was_reachable)
    entry = previous or RegionStatus(name=report.name)
    last_seen = last_answer or parse_time(entry.last_seen) or created
    if last_seen:
        entry = entry.model_copy(update={"last_seen": timestamp(last_seen)})
    silent = (moment - last_seen).total_seconds() if last_seen else 0.0
    lost = not report.credentials and silent >= timeout_s
    reachable = was_reachable and not report.credentials and not lost  # else: not yet
    entry = entry.model_copy(update={"reachable": reachable})
    event = None
    if was_reachable and not reachable:
        reason = "RegionCredentialsInvalid" if report.credentials else "RegionUnreachable"
        event = Event(
            "Warning",
            reason,
            f"region {report.name}: {report.problem}; silent {silent:.0f}s, "
            f"its {entry.running} rollout GPUs are not counted; training goes on",
        )
    return RegionView(entry, silent, lost, report.credentials, report.problem, event)


def _answered(report: RegionReport, previous: RegionStatus | None, was: bool) -> RegionView:
    assert report.answered is not None and report.reported is not None
    last_seen = timestamp(report.answered)
    seen = parse_time(previous.last_seen) if previous is not None else None
    if seen and was and (report.answered - seen).total_seconds() < LAST_SEEN_REFRESH_S:
        last_seen = previous.last_seen
    entry = report.reported.model_copy(
        update={"name": report.name, "last_seen": last_seen, "reachable": True}
    )
    back = (
        None if was else Event("Normal", "RegionReachable", f"region {report.name} answers again")
    )
    return RegionView(entry, event=back)


def lending_event(
    entries: Sequence[RegionStatus], wanted: Sequence[str], before: int | None
) -> Event | None:
    """GPUsLent when what the reachable regions the spec names lend has changed."""
    reachable = [e for e in entries if e.reachable and e.name in wanted]
    lent = sum(e.lent for e in reachable)
    if lent == before or not reachable:
        return None
    detail = ", ".join(f"{e.name} {e.lent}" for e in reachable)
    return Event("Normal", "GPUsLent", f"{lent} rollout GPUs lent ({detail})")


# What a region can find wrong with the run there: the field it sets, and the reason.
REGION_PROBLEMS = (
    ("gpu_types_unserved", "NoPoolOfGpuType"),
    ("env_pool_missing", "EnvPoolNotFound"),
)


def region_problem_events(
    previous: Mapping[str, RegionStatus], entries: Sequence[RegionStatus]
) -> list[Event]:
    """A Warning the first time a region finds a problem with the run (or finds it for
    other reasons): none of the pools it names serves on the GPU types the run can use
    (NoPoolOfGpuType), or the EnvPool it names is not there (EnvPoolNotFound)."""
    return [
        Event("Warning", reason, f"region {e.name}: {getattr(e, field)}")
        for field, reason in REGION_PROBLEMS
        for e in entries
        if getattr(e, field) and getattr(e, field) != getattr(previous.get(e.name), field, None)
    ]


def phase(verdict: Verdict, spec: RLRunSpec, training: bool) -> str:
    if verdict.failed:
        return "Failed"
    if verdict.succeeded:
        return "Succeeded"
    if spec.suspend:
        return "Suspended"
    return "Running" if training else "Pending"


def decide(observed: Observed) -> Decision:
    """The run's new status and the events to post, from what the hub observed."""
    spec, old, verdict = observed.spec, observed.old, observed.verdict
    events: list[Event] = list(verdict.events)
    previous = {e.name: e for e in old.regions}
    wanted = spec.region_names
    views = [
        region_view(
            report,
            previous.get(report.name),
            observed.last_answer.get(report.name),
            observed.created,
            observed.moment,
            observed.region_timeout_s,
        )
        for report in observed.regions
    ]
    events += [v.event for v in views if v.event is not None]
    entries = [v.entry for v in views]
    events += region_problem_events(previous, entries)
    entries += [previous[n].model_copy(update={"reachable": False}) for n in observed.leftover]
    # A production run borrows no GPUs: its pool's region has nothing to lend it.
    borrowing = [d.name for d in spec.rollout_regions]
    lent_event = lending_event(entries, borrowing, old.gpus_lent)
    events += [lent_event] if lent_event is not None else []
    stopped = spec.suspend or verdict.held
    training = not stopped and observed.ready >= spec.trainer.replicas
    found = _progress(observed, training)
    events += found.events if found is not None else []
    reachable = [e for e in entries if e.reachable and e.name in wanted]
    # NATS not read this time leaves the production status as it was.
    cycles = (
        production.fold(observed.cycles, old.production)
        if observed.cycles is not None
        else production.Folded(old.production)
    )
    events += cycles.events
    conditions = _conditions(observed, views, reachable, training, found, cycles.status)
    if observed.spec_problems:
        ready, told = invalid_spec(old.conditions, observed.spec_problems, observed.generation)
        conditions = [ready if c.type == "Ready" else c for c in conditions]
        events += told
    status = RLRunStatus(
        phase=phase(verdict, spec, training),
        observed_generation=observed.generation,
        conditions=conditions,
        trainer_replicas=observed.ready,
        gpus_lent=sum(e.lent for e in reachable),
        gpus_running=sum(e.running for e in reachable),
        regions=entries,
    )
    parts = [status] + ([found.fields] if found is not None else []) + [verdict.fields]
    if observed.cycles is not None:
        parts.append(RLRunStatus(production=cycles.status))
    return Decision(merged(RLRunStatus, *parts), events)


def _progress(observed: Observed, training: bool) -> progress.Progress | None:
    """The trainer's newest step folded into the status; None when NATS did not answer."""
    if not observed.stepped:
        return None
    was = find(observed.old.conditions, "Training")
    since = parse_time(was.last_transition_time) if was and was.status == "True" else None
    return progress.fold(
        observed.step,
        observed.spec,
        observed.old,
        (since or observed.moment) if training else None,
        observed.moment,
        observed.generation,
    )


def degraded(
    spec: RLRunSpec, views: Sequence[RegionView], reachable: Sequence[RegionStatus], stopped: bool
) -> tuple[list[str], str]:
    """Why the rollouts are degraded (none: they are not), and the condition's reason."""
    lost = [f"{v.entry.name} unreachable for {v.silent_s:.0f}s" for v in views if v.lost]
    refused = [f"{v.entry.name}: {v.problem}" for v in views if v.refused]
    unserved = [f"{e.name}: {e.gpu_types_unserved}" for e in reachable if e.gpu_types_unserved]
    no_envpool = [f"{e.name}: {e.env_pool_missing}" for e in reachable if e.env_pool_missing]
    below_floor = [
        f"{e.name} runs {e.running} of at least {d.min_gpus} GPUs"
        for d in spec.rollout_regions
        for e in reachable
        if e.name == d.name and e.running < d.min_gpus and not stopped  # stopped: no GPUs
    ]
    reason = (
        "RegionUnreachable"
        if lost
        else "RegionCredentialsInvalid"
        if refused
        else "NoPoolOfGpuType"
        if unserved
        else "EnvPoolNotFound"
        if no_envpool
        else "BelowMinGpus"
        if below_floor
        else "AllRegionsServing"
    )
    return lost + refused + unserved + no_envpool + below_floor, reason


def _conditions(
    observed: Observed,
    views: Sequence[RegionView],
    reachable: Sequence[RegionStatus],
    training: bool,
    found: progress.Progress | None,
    cycles: ProductionStatus | None,
) -> list[Condition]:
    """Ready first, then Training, RolloutsDegraded, Suspended, WeightSyncStalled once it
    has been said, TrackingUnreachable for a tracked run once a step said how its tracker
    fares, the evaluation gate's, and a production run's Progressing and Promoted."""
    spec, verdict = observed.spec, observed.verdict
    stopped = spec.suspend or verdict.held
    # NATS not answering this time leaves the last word on weight sync standing.
    said = find(observed.old.conditions, "WeightSyncStalled")
    synced = found.condition if found is not None else said
    stalled = synced is not None and synced.status == "True"
    old_tracking = find(observed.old.conditions, "TrackingUnreachable")
    tracked = found.tracking if found is not None else old_tracking
    why, reason = degraded(spec, views, reachable, stopped)
    running = sum(e.running for e in reachable)
    wanted = 0 if stopped else spec.trainer.replicas
    rest = [
        _condition(
            observed,
            "Training",
            training,
            "TrainerReady" if training else "TrainerNotReady",
            f"{observed.ready}/{wanted} trainer replicas ready",
        ),
        _condition(
            observed,
            "RolloutsDegraded",
            bool(why),
            reason,
            "; ".join(why) or f"{running} rollout GPUs running in {len(reachable)} regions",
        ),
        _condition(
            observed,
            "Suspended",
            spec.suspend,
            "SpecSuspend" if spec.suspend else "NotSuspended",
            "spec.suspend is true" if spec.suspend else "",
        ),
        *([synced] if synced is not None else []),
        *([tracked] if tracked is not None and spec.tracking is not None else []),
        *verdict.conditions,
    ]
    if spec.production is not None:
        old = observed.old.conditions
        rest += production.conditions(cycles, old, observed.generation, observed.moment)
    # A production run learns from its pool's users, with no rollout GPUs to wait for.
    rolling = running > 0 or spec.production is not None
    healthy = training and not why and rolling and not stalled
    return [_ready(observed, healthy, why, stalled), *rest]


def _ready(observed: Observed, healthy: bool, degraded: list[str], stalled: bool) -> Condition:
    verdict = observed.verdict
    waiting = (
        ([verdict.why] if verdict.held else [])
        or degraded
        or (["no new policy version for stallSeconds"] if stalled else [])
        or ["waiting for the trainer or rollout GPUs"]
    )
    return _condition(
        observed,
        "Ready",
        healthy,
        "Healthy" if healthy else "NotReady",
        _healthy(observed.spec) if healthy else "; ".join(waiting),
    )


def _healthy(spec: RLRunSpec) -> str:
    if spec.production is not None:
        return "training from the users of production pool " + spec.production.pool.name
    return "training with rollouts in every region"


def _condition(observed: Observed, kind: str, true: bool, reason: str, message: str) -> Condition:
    return condition(
        observed.old.conditions, kind, true, reason, message, observed.generation, observed.moment
    )

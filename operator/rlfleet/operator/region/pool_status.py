"""What a pool's reconcile writes and tells once it has acted: the pool's whole status and
the events worth an on-call engineer's attention (pure).

Kept apart from the reconciler so that each can be tested on its own: a resync over a
world that has not changed must tell nothing new and write nothing, or every resync would
post events and patch status. The reclaim clock lives in the status
(`reclaimStartedAt`), so an operator restarted mid-reclaim times it from its start.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from datetime import datetime

from rlfleet.api.inferencepool import InferencePoolSpec, InferencePoolStatus, LentToRun
from rlfleet.api.meta import LENDABLE_LABEL, Condition
from rlfleet.operator.served import Answers, count_served
from rlfleet.operator.status import Event, condition, find, invalid_spec, timestamp
from rlfleet.pipeline.lending import Decision, PoolState, unknown_time_zones


@dataclass(frozen=True)
class PoolSeen:
    """What a pool's reconcile read of its serving side."""

    load: float | None  # None: the traffic signal could not be read
    traffic_problem: str  # why not
    serving_pods: int  # alive
    serving_running: int
    served: Answers = ()  # each running serving pod's answer


@dataclass(frozen=True)
class ReclaimClock:
    started: datetime | None  # when the reclaim in progress began; None: none is
    events: list[Event]
    overdue: bool  # past the deadline: the draining pods are to be killed


def lent_entries(decision: Decision) -> list[LentToRun]:
    return [LentToRun(run=r, replicas=n) for r, n in decision.lent.items()]


def unusable(
    serving: dict | None, namespace: str, spec: InferencePoolSpec
) -> tuple[str, str] | None:
    """Why the pool may not act on its serving Deployment, as (reason, message); None if it
    may. It must exist and carry its owner's opt-in: whoever may create an InferencePool
    must not thereby scale serving they do not own."""
    name = f"{namespace}/{spec.serving.deployment_name}"
    if serving is None:
        return "ServingNotFound", f"Deployment {name} does not exist"
    if (serving["metadata"].get("labels") or {}).get(LENDABLE_LABEL) != "true":
        return (
            "ServingNotLendable",
            f"Deployment {name} (spec.serving.deploymentName) lacks the label {LENDABLE_LABEL}: "
            '"true" its owner sets to let InferencePools lend it; nothing is scaled',
        )
    return None


def serving_unusable(
    old: InferencePoolStatus, reason: str, message: str, generation: int
) -> tuple[InferencePoolStatus, list[Event]]:
    """The pool's status, and its event the first time, when its serving Deployment is gone
    (`ServingNotFound`) or not opted in to lending (`ServingNotLendable`). Nothing is
    scaled then, so what was lent stays lent, and is still shown."""
    ready = condition(old.conditions, "Ready", False, reason, message, generation)
    was = find(old.conditions, "Ready")
    told = was is not None and was.reason == reason  # tell once, not every resync
    events = [] if told else [Event("Warning", reason, message)]
    return InferencePoolStatus(conditions=[ready], lent=old.lent), events


def decision_events(
    spec: InferencePoolSpec, state: PoolState, decision: Decision, current: Mapping[str, int]
) -> list[Event]:
    """GPUsLent or GPUsReclaiming for each run whose share of the pool changed."""
    gpus = spec.serving.gpus_per_replica
    load = "unknown" if state.load is None else f"{state.load:g}"
    events = []
    for run in sorted(set(current) | set(decision.lent)):
        before, after = current.get(run, 0), decision.lent.get(run, 0)
        if after > before:
            events.append(
                Event(
                    "Normal",
                    "GPUsLent",
                    f"lending {(after - before) * gpus} GPUs ({after - before} replicas) "
                    f"to {run}, {after * gpus} in all; serving keeps "
                    f"{spec.serving.replicas - decision.total} of {spec.serving.replicas} "
                    f"replicas at load {load}",
                )
            )
        elif after < before:
            events.append(
                Event(
                    "Normal",
                    "GPUsReclaiming",
                    f"taking {(before - after) * gpus} GPUs back from {run} "
                    f"({decision.reason}, load {load}); deadline "
                    f"{spec.reclaim_deadline_seconds}s",
                )
            )
    return events


def reclaim_clock(
    started: datetime | None,
    reclaiming: int,
    moment: datetime,
    spec: InferencePoolSpec,
    lent_replicas: int,
) -> ReclaimClock:
    """Times a reclaim from the first reconcile that finds rollout pods draining to the
    first that finds none; past the pool's deadline the draining pods are overdue."""
    if reclaiming and started is None:
        started = moment
    if started and not reclaiming:
        seconds = (moment - started).total_seconds()
        done = Event(
            "Normal",
            "GPUsReclaimed",
            f"serving has its GPUs back {seconds:.1f}s after the reclaim began "
            f"(deadline {spec.reclaim_deadline_seconds}s); "
            f"{lent_replicas * spec.serving.gpus_per_replica} GPUs stay lent",
        )
        return ReclaimClock(None, [done], False)
    overdue = bool(started) and (moment - started).total_seconds() > spec.reclaim_deadline_seconds
    return ReclaimClock(started, [], overdue)


def forced_events(killed: int, spec: InferencePoolSpec) -> list[Event]:
    if not killed:
        return []
    return [
        Event(
            "Warning",
            "ReclaimDeadlineExceeded",
            f"{killed} rollout pods did not finish within "
            f"{spec.reclaim_deadline_seconds}s and were killed",
        )
    ]


def pool_status(
    spec: InferencePoolSpec,
    old: InferencePoolStatus,
    generation: int,
    seen: PoolSeen,
    decision: Decision,
    reclaiming: int,
    started: datetime | None,
) -> InferencePoolStatus:
    """The pool's whole status after acting on `decision`; a reclaim that is over clears
    reclaimStartedAt."""

    def said(kind: str, true: bool, reason: str, message: str) -> Condition:
        return condition(old.conditions, kind, true, reason, message, generation)

    load = seen.load
    served, unversioned = count_served(seen.served)
    return InferencePoolStatus(
        observed_generation=generation,
        serving_replicas=seen.serving_running,
        lent_replicas=decision.total,
        reclaiming_replicas=reclaiming,
        lent=lent_entries(decision),
        observed_traffic=load,
        served_versions=served,
        unversioned_replicas=unversioned,
        reclaim_started_at=timestamp(started) if started else None,
        conditions=[
            said(
                "Ready",
                load is not None,
                "TrafficRead" if load is not None else "TrafficUnknown",
                seen.traffic_problem or f"load {load:g} over {seen.serving_pods} serving pods",
            ),
            said(
                "Lending",
                decision.total > 0,
                decision.reason,
                f"{decision.total} of {spec.serving.replicas} replicas lent",
            ),
            said(
                "Reclaiming",
                reclaiming > 0,
                "Draining" if reclaiming else "Idle",
                f"{reclaiming} rollout pods draining" if reclaiming else "",
            ),
        ],
    )


def zones_checked(
    status: InferencePoolStatus, old: InferencePoolStatus, spec: InferencePoolSpec, generation: int
) -> tuple[InferencePoolStatus, list[Event]]:
    """The status, its Ready condition false while an off-peak window names an unknown
    time zone (such a window never opens: `lending.in_off_peak`), and the event the first
    time."""
    problems = unknown_time_zones(spec.off_peak_windows)
    if not problems:
        return status, []
    ready, told = invalid_spec(old.conditions, problems, generation)
    conditions = [ready if c.type == "Ready" else c for c in status.conditions]
    return status.model_copy(update={"conditions": conditions}), told

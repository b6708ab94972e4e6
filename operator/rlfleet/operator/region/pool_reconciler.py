"""The region role: lends InferencePool replicas to mirrored RLRuns and takes them back.

For each pool, `reconcile_pool` decides (`lending.decide`) and records the decision in the
pool's status before acting on it, so an operator restarted at any point reads what it
meant to do and carries on. Acting keeps two rules, checked against the pods that exist,
not against what was asked for:

- a GPU is lent at most once: rollout pods grow only into GPUs that serving pods have
  actually left (serving pods alive + rollout pods alive never exceed the pool's size);
- serving comes back only once rollout pods are gone. Rollout pods get SIGTERM and the
  pool's `reclaimDeadlineSeconds` to finish their groups; past it they are killed.

Serving never drops below its floor because the decision never lends past it.
"""

from __future__ import annotations

import math
import time
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from datetime import datetime
from functools import partial

import httpx
from kubernetes.client.exceptions import ApiException
from pydantic import ValidationError

from rlfleet.api.envpool import EnvPoolSpec, EnvPoolStatus
from rlfleet.api.inferencepool import (
    CANARY,
    InferencePoolSpec,
    InferencePoolStatus,
    LentToRun,
    ServedVersion,
)
from rlfleet.api.meta import API_VERSION, Condition
from rlfleet.api.rlrun import RegionStatus, RLRunSpec, RLRunStatus
from rlfleet.operator import telemetry
from rlfleet.operator.config import OperatorConfig
from rlfleet.operator.envpools import DELETION_COST, ServerSeen, plan_pool, refusals
from rlfleet.operator.envtokens import TokenMint
from rlfleet.operator.kube import Kube, Ref
from rlfleet.operator.locks import KeyedLocks
from rlfleet.operator.parallel import at_once
from rlfleet.operator.served import Answers, count_served, read_served
from rlfleet.operator.status import (
    Event,
    condition,
    find,
    invalid_spec,
    now,
    parse_time,
    timestamp,
)
from rlfleet.operator.traffic import TrafficUnknown, read_load
from rlfleet.operator.workloads import (
    COMPONENT_LABEL,
    ENVPOOL_LABEL,
    ENVPOOL_PORT,
    ORIGIN_LABEL,
    POOL_LABEL,
    RUN_LABEL,
    canary_deployment,
    envpool_objects,
    envpool_service,
    envpool_token,
    pool_feedback,
    rollout_deployment,
    spec_config_map,
)
from rlfleet.pipeline.lending import (
    Decision,
    PoolState,
    RunDemand,
    canary_set,
    decide,
    lent_elsewhere,
    unknown_time_zones,
    unserved_gpu_types,
)


def _alive(pods: Iterable[dict]) -> list[dict]:
    return [p for p in pods if p.get("status", {}).get("phase") not in ("Succeeded", "Failed")]


def _running(pods: Iterable[dict]) -> list[dict]:
    return [
        p
        for p in pods
        if p.get("status", {}).get("phase") == "Running"
        and not p["metadata"].get("deletionTimestamp")
    ]


def _selector(labels: dict[str, str]) -> str:
    return ",".join(f"{k}={v}" for k, v in sorted(labels.items()))


def _lent(decision: Decision) -> list[LentToRun]:
    return [LentToRun(run=r, replicas=n) for r, n in decision.lent.items()]


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


def serving_missing(
    old: InferencePoolStatus, message: str, generation: int
) -> tuple[InferencePoolStatus, list[Event]]:
    """The pool's status, and its event the first time, when its serving Deployment is gone."""
    ready = condition(old.conditions, "Ready", False, "ServingNotFound", message, generation)
    was = find(old.conditions, "Ready")
    told = was is not None and was.reason == "ServingNotFound"  # tell once, not every resync
    events = [] if told else [Event("Warning", "ServingNotFound", message)]
    return InferencePoolStatus(conditions=[ready]), events


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
        lent=_lent(decision),
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


class Region:
    def __init__(self, local: Kube, config: OperatorConfig) -> None:
        self.local = local
        self.config = config
        self.name = config.cluster
        # A namespace's pools share its runs' demand: one decision at a time there.
        self.decisions = KeyedLocks()
        # (namespace, pool) -> (when, run -> GPUs): decisions this process recorded, newer
        # than a recent list of the pools may be.
        self._decided: dict[tuple[str, str], tuple[float, dict[str, int]]] = {}
        self.mint = TokenMint(local, config.namespace, config.envpool_key_secret)
        # (namespace, pool) -> (when, answers): what its serving pods said last.
        self._served_seen: dict[tuple[str, str], tuple[float, Answers]] = {}
        # (namespace, pool) -> ((its uid, its user header), when): what the pool's feedback
        # Secret this process wrote holds, and when the pool was last reconciled.
        self._feedback_written: dict[tuple[str, str], tuple[tuple[str, str], float]] = {}

    # --- runs -------------------------------------------------------------------------

    def _runs(self, namespace: str) -> list[dict]:
        """The namespace's mirrors, shared by the pools' decisions for half a resync: only
        their specs (demand) matter here, and what is lent is read fresh from the pools."""
        return self.local.list_recent(
            Ref(API_VERSION, "RLRun", namespace=namespace),
            ORIGIN_LABEL,
            self.config.resync_seconds / 2,
        )

    def _demand(self, run: dict) -> RunDemand | None:
        spec = RLRunSpec.model_validate(run["spec"])
        here = next((d for d in spec.rollout_regions if d.name == self.name), None)
        if here is None:
            return None
        active = not spec.suspend and not run["metadata"].get("deletionTimestamp")
        return RunDemand.of(run["metadata"]["name"], spec, here, active)

    def report_run(self, run: dict, resync: bool = False) -> None:
        """Writes the region's part of a mirrored run's status, read by the hub; on a
        change (not a `resync`) also the run's spec for its pods."""
        meta = run["metadata"]
        namespace, name = meta["namespace"], meta["name"]
        rollout = RLRunSpec.model_validate(run["spec"]).rollout
        envpool = rollout.env_pool if rollout is not None else None
        if not resync:
            self.local.apply(spec_config_map(run))
            if envpool:
                token = self.mint.token(namespace, envpool, name, meta["uid"])
                self.local.apply(envpool_token(run, token))
        demand = self._demand(run)
        # Every mirror's report reads the same two lists: share one fetch per half resync.
        fresh_s = self.config.resync_seconds / 2
        _, pools = self._pools_recent(namespace)
        pods = [
            p
            for p in _running(
                self.local.list_recent(
                    Ref("v1", "Pod", namespace=namespace), f"{COMPONENT_LABEL}=rollout", fresh_s
                )
            )
            if p["metadata"]["labels"].get(RUN_LABEL) == name
        ]
        lent = running = 0
        for pool in pools:
            gpus = pool["spec"]["serving"]["gpusPerReplica"]
            for entry in (pool.get("status") or {}).get("lent", []):
                if entry["run"] == name:
                    lent += entry["replicas"] * gpus
            here = [
                p
                for p in pods
                if p["metadata"]["labels"].get(POOL_LABEL) == pool["metadata"]["name"]
            ]
            running += len(here) * gpus
        types = {p["metadata"]["name"]: p["spec"]["serving"].get("gpuType") for p in pools}
        unserved = unserved_gpu_types(self.name, demand, types) if demand else None
        missing = self._envpool_missing(namespace, envpool, fresh_s) if demand else None
        entry = RegionStatus(
            name=self.name,
            requested=demand.max_gpus if demand else 0,
            lent=lent,
            running=running,
            # Set only when so: the hub folds this entry in whole, and a null is no value.
            **({"gpu_types_unserved": unserved} if unserved else {}),
            **({"env_pool_missing": missing} if missing else {}),
        )
        status = RLRunStatus(
            observed_generation=meta.get("generation", 0),
            regions=[entry],
            gpus_lent=lent,
            gpus_running=running,
        )
        self.local.write_status(run, status)

    def _envpool_missing(self, namespace: str, envpool: str | None, fresh_s: float) -> str | None:
        """Why the EnvPool a run names cannot serve it here (None: it is here, or the run
        names none)."""
        if envpool is None:
            return None
        here = self.local.list_recent(
            Ref(API_VERSION, "EnvPool", namespace=namespace), None, fresh_s
        )
        if any(p["metadata"]["name"] == envpool for p in here):
            return None
        return (
            f"spec.rollout.envPool: no EnvPool {envpool} in namespace {namespace}; "
            "attempts that use tools fail until there is one"
        )

    # --- pools ------------------------------------------------------------------------

    def reconcile_pool(self, pool: dict) -> tuple[list[Event], int]:
        """Decides, records, acts; returns the events to post and the GPUs now lent."""
        meta = pool["metadata"]
        namespace, name = meta["namespace"], meta["name"]
        spec = InferencePoolSpec.model_validate(pool["spec"])
        old = InferencePoolStatus.model_validate(pool.get("status") or {})
        generation = meta.get("generation", 0)
        serving = self.local.get(
            Ref("apps/v1", "Deployment", spec.serving.deployment_name, namespace)
        )
        if serving is None:
            message = f"Deployment {namespace}/{spec.serving.deployment_name} does not exist"
            status, events = serving_missing(old, message, generation)
            self.local.write_status(pool, status)
            return events, 0

        # The world, read once and at once before deciding: the status counts what this
        # reconcile acted on, and the next one counts what its scaling made of it.
        (load, traffic_problem), rollout_pods, serving_pods, (deployments, canary) = at_once(
            [
                partial(self._load, spec),
                partial(self._pods, namespace, {POOL_LABEL: name, COMPONENT_LABEL: "rollout"}),
                # The canary set's pods too: they match the serving selector.
                partial(self._pods, namespace, serving["spec"]["selector"]["matchLabels"]),
                partial(self._pool_deployments, namespace, name),
            ]
        )
        current = {e.run: e.replicas for e in old.lent}
        canary_replicas = self._canary_set(namespace, name, spec)
        state = PoolState.of(name, spec, load, current, now(), canary_replicas)
        decision, runs = self._decide(pool, state)
        events = decision_events(spec, state, decision, current)
        reclaiming = self._act(
            name, spec, serving, decision, runs, deployments, rollout_pods, serving_pods,
            canary_replicas,
        )  # fmt: skip
        self._keep_canary(pool, serving, canary, canary_replicas)
        self._keep_feedback(pool, spec)
        clock = reclaim_clock(
            parse_time(old.reclaim_started_at), reclaiming, now(), spec, decision.total
        )
        events += clock.events
        killed = self._force(namespace, name) if clock.overdue else 0
        # Counted from 0 on, so that the first kill is an increase an alert sees.
        telemetry.RECLAIM_DEADLINE_EXCEEDED.labels(namespace, name).inc(killed)
        events += forced_events(killed, spec)
        running = _running(serving_pods)
        served = self._served_by((namespace, name), spec, running)
        seen = PoolSeen(load, traffic_problem, len(serving_pods), len(running), served)
        status = pool_status(spec, old, generation, seen, decision, reclaiming, clock.started)
        # A window in an unknown zone never opens (`lending.in_off_peak`); the pool says so.
        problems = unknown_time_zones(spec.off_peak_windows)
        if problems:
            ready, told = invalid_spec(old.conditions, problems, generation)
            conditions = [ready if c.type == "Ready" else c for c in status.conditions]
            status = status.model_copy(update={"conditions": conditions})
            events += told
        self.local.write_status(pool, status)
        return events, decision.total * spec.serving.gpus_per_replica

    def _decide(self, pool: dict, state: PoolState) -> tuple[Decision, dict[str, dict]]:
        """The pool's lending decision, durable in its status before anything acts on it,
        and the namespace's runs by name. One pool of a namespace at a time, since its pools
        share its runs' demand; acting on a decision needs no such lock."""
        namespace, name = pool["metadata"]["namespace"], pool["metadata"]["name"]
        # Refresh the shared lists before taking the lock, so that a slow apiserver holds
        # up only this pool, not every pool of the namespace queued behind it.
        at_once([partial(self._runs, namespace), partial(self._pools_recent, namespace)])
        with telemetry.tracer.start_as_current_span("decide"), self.decisions.of(namespace):
            runs = self._runs(namespace)
            demands = [d for d in (self._demand(r) for r in runs) if d is not None]
            elsewhere = lent_elsewhere(self._lent_by_pool(namespace, besides=name))
            decision = decide(state, demands, elsewhere)
            if decision.lent != state.lent:
                lent = InferencePoolStatus(lent=_lent(decision))
                patch = {"status": lent.merge_patch()}
                self.local.merge_patch(Ref.of(pool), patch, "status")
                gpus = state.gpus_per_replica
                self._decided[(namespace, name)] = (
                    time.monotonic(),
                    {r: n * gpus for r, n in decision.lent.items()},
                )
        return decision, {r["metadata"]["name"]: r for r in runs}

    def _lent_by_pool(self, namespace: str, besides: str) -> list[dict[str, int]]:
        """What the namespace's other pools lend, run -> GPUs: a recent list of the pools
        (shared with the runs' reports), where this process decided since, its decision.
        Called under the namespace's decision lock, so no decision of ours is missed."""
        asked, pools = self._pools_recent(namespace)
        lent: dict[str, dict[str, int]] = {}
        for pool in pools:
            gpus = pool["spec"]["serving"]["gpusPerReplica"]
            entries = (pool.get("status") or {}).get("lent", [])
            lent[pool["metadata"]["name"]] = {e["run"]: e["replicas"] * gpus for e in entries}
        for (where, pool_name), (when, decided) in list(self._decided.items()):
            if where != namespace:
                continue
            if when < asked:  # the list has it
                del self._decided[(where, pool_name)]
            else:
                lent[pool_name] = decided
        return [gpus for pool_name, gpus in lent.items() if pool_name != besides]

    def _pools_recent(self, namespace: str) -> tuple[float, list[dict]]:
        """The namespace's pools at most half a resync old, and when they were asked for."""
        return self.local.recent(
            Ref(API_VERSION, "InferencePool", namespace=namespace),
            None,
            self.config.resync_seconds / 2,
        )

    def _pods(self, namespace: str, labels: dict[str, str]) -> list[dict]:
        return _alive(self.local.list(Ref("v1", "Pod", namespace=namespace), _selector(labels)))

    def _load(self, spec: InferencePoolSpec) -> tuple[float | None, str]:
        """The serving load, or None and why it could not be read."""
        try:
            return read_load(spec.traffic, self.config.traffic_timeout_seconds), ""
        except TrafficUnknown as error:
            return None, str(error)

    def _served_by(
        self, pool: tuple[str, str], spec: InferencePoolSpec, running: list[dict]
    ) -> Answers:
        """What the pool's running serving pods say they serve, asked at most once a run
        resync: a pool's every pod, every few seconds, would be load for nothing."""
        resync = self.config.run_resync_seconds
        when, answers = self._served_seen.get(pool, (-math.inf, ()))
        if time.monotonic() - when >= resync:
            answers = tuple(at_once([partial(self._served, spec, p) for p in running]))
            asked = time.monotonic()
            # A pool still there is asked again within a resync: older answers are of
            # pools deleted since, which nothing else would ever remove. A copy of the
            # items, as other pools' reconciles may be asking at the same time.
            for key, (seen, _) in list(self._served_seen.items()):
                if asked - seen >= 2 * resync:
                    self._served_seen.pop(key, None)
            self._served_seen[pool] = (asked, answers)
        return answers

    def _served(self, spec: InferencePoolSpec, pod: dict) -> ServedVersion | None:
        """What a running serving pod's server says it serves."""
        ip = pod.get("status", {}).get("podIP")
        if not ip:
            return None
        return read_served(ip, spec.serving.port, self.config.call_timeout_seconds)

    def _pool_deployments(self, namespace: str, pool: str) -> tuple[dict[str, dict], dict | None]:
        """The rollout Deployments on the pool's GPUs, by run, and its canary set's."""
        found = self.local.list(
            Ref("apps/v1", "Deployment", namespace=namespace), _selector({POOL_LABEL: pool})
        )
        rollouts, canary = {}, None
        for deployment in found:
            labels = deployment["metadata"]["labels"]
            if labels.get(COMPONENT_LABEL) == "rollout":
                rollouts[labels[RUN_LABEL]] = deployment
            elif labels.get(COMPONENT_LABEL) == CANARY:
                canary = deployment
        return rollouts, canary

    def _act(
        self,
        pool: str,
        spec: InferencePoolSpec,
        serving: dict,
        decision: Decision,
        runs: dict[str, dict],
        deployments: dict[str, dict],
        rollout_pods: list[dict],
        serving_pods: list[dict],
        canary_replicas: int,
    ) -> int:
        """Moves pods toward the decision; returns how many rollout pods are draining."""
        # Shrink first: scaling a rollout Deployment down sends its pods SIGTERM.
        for run, deployment in deployments.items():
            want = decision.lent.get(run, 0)
            if deployment["spec"]["replicas"] > want:
                # Gone already when its run's mirror was deleted: nothing left to shrink.
                self.local.scale(Ref.of(deployment), want)
        # Serving takes back only GPUs no rollout pod holds any more; the canary set has its
        # share of it (the floor is above that share, so the serving Deployment keeps one).
        in_use = max(len(rollout_pods), decision.total)
        serving_target = max(0, spec.serving.replicas - in_use - canary_replicas)
        if serving["spec"].get("replicas") != serving_target:
            self.local.scale(Ref.of(serving), serving_target)
        # Grow into GPUs that serving pods have actually left.
        free = spec.serving.replicas - len(serving_pods) - len(rollout_pods)
        for run in sorted(decision.lent):
            have = deployments.get(run, {}).get("spec", {}).get("replicas", 0)
            grow = min(decision.lent[run] - have, free)
            if grow <= 0 or run not in runs:
                continue
            free -= grow
            self.local.apply(
                rollout_deployment(
                    runs[run],
                    pool,
                    spec,
                    have + grow,
                    self.config.images.rollout,
                    self.config.workloads,
                    self.name,
                )
            )
        return max(0, len(rollout_pods) - decision.total)

    def _canary_set(self, namespace: str, pool: str, spec: InferencePoolSpec) -> int:
        """Replicas of the pool in its canary set, as the production run learning from it
        asks (`spec.production.canary.replicas`)."""
        runs = [
            RLRunSpec.model_validate(run["spec"])
            for run in self._runs(namespace)
            if not run["metadata"].get("deletionTimestamp")
        ]
        return canary_set(runs, self.name, pool, spec.serving.replicas)

    def _keep_canary(self, pool: dict, serving: dict, canary: dict | None, replicas: int) -> None:
        """The pool's canary set: its Deployment applied from the serving Deployment's pods
        (so it follows their changes), or scaled to none when no run asks for one; the
        garbage collector takes it with the pool."""
        if replicas:
            self.local.apply(canary_deployment(pool, serving, replicas))
        elif canary is not None and canary["spec"].get("replicas"):
            self.local.scale(Ref.of(canary), 0)

    def _keep_feedback(self, pool: dict, spec: InferencePoolSpec) -> None:
        """The pool's feedback Secret, written once per process (and again when its user
        header changes). Its key is minted from the region's key and the pool's uid, so a
        restart writes the same one and a pool made again under its name gets another;
        deleting the region's key Secret and restarting rotates every pool's."""
        meta = pool["metadata"]
        here, holds = (meta["namespace"], meta["name"]), (meta["uid"], spec.serving.user_header)
        seen = time.monotonic()
        # A pool still there is reconciled again within a resync: older entries are of
        # pools deleted since, which nothing else would ever remove.
        for other, (_, when) in list(self._feedback_written.items()):
            if seen - when >= 2 * self.config.run_resync_seconds:
                self._feedback_written.pop(other, None)
        if self._feedback_written.get(here, (None, 0.0))[0] != holds:
            key = self.mint.token(meta["namespace"], "feedback", meta["name"], meta["uid"])
            self.local.apply(pool_feedback(pool, key))
        self._feedback_written[here] = (holds, seen)

    def _force(self, namespace: str, pool: str) -> int:
        """Kills rollout pods still terminating past the reclaim deadline."""
        killed = 0
        for pod in self._pods(namespace, {POOL_LABEL: pool, COMPONENT_LABEL: "rollout"}):
            if pod["metadata"].get("deletionTimestamp"):
                self.local.delete(Ref.of(pod), grace_seconds=0)
                killed += 1
        return killed

    # --- sandboxes --------------------------------------------------------------------

    def reconcile_envpool(self, envpool: dict) -> list[Event]:
        """Sizes the pool's servers from what they say (`envpools.plan_pool`), records the
        plan in its status, then acts: each pod's deletion cost (idle ones go first), then
        its objects. A pool this region will not run (`envpools.refusals`) gets no server.
        Returns the events to post."""
        meta = envpool["metadata"]
        namespace, name = meta["namespace"], meta["name"]
        old = EnvPoolStatus.model_validate(envpool.get("status") or {})
        generation = meta.get("generation", 0)
        spec = self._envpool_spec(envpool, old, generation)
        if not isinstance(spec, EnvPoolSpec):
            return spec  # refused: the events that say so
        pods = [
            p
            for p in self._pods(namespace, {ENVPOOL_LABEL: name})
            if not p["metadata"].get("deletionTimestamp")
        ]
        deployment = self.local.get(Ref("apps/v1", "Deployment", envpool_service(name), namespace))
        replicas = deployment["spec"]["replicas"] if deployment else 0
        servers = at_once([partial(self._probe, p) for p in pods]) if pods else []
        plan = plan_pool(spec, servers, replicas, parse_time(old.idle_since), now())
        serving = any(s.answered for s in servers)
        reason, message = (
            ("Serving", "") if serving else ("Warming", "no session server answers yet")
        )
        ready = condition(old.conditions, "Ready", serving, reason, message, generation)
        status = EnvPoolStatus(
            observed_generation=generation,
            conditions=[ready],
            pods=len(pods),
            ready=plan.ready,
            claimed=plan.claimed,
            warming=plan.warming,
            bursting=plan.bursting,
            idle_since=timestamp(plan.idle_since) if plan.idle_since else None,
        )
        self.local.write_status(envpool, status)
        for pod in pods:
            cost = plan.deletion_costs.get(pod["metadata"]["name"])
            if cost is not None and pod["metadata"].get("annotations", {}).get(
                DELETION_COST
            ) != str(cost):
                self._annotate(pod, {DELETION_COST: str(cost)})
        runs = {
            r["metadata"]["name"]: r["metadata"]["uid"]
            for r in self._runs(namespace)
            if (r["spec"].get("rollout") or {}).get("envPool") == name
            and not r["metadata"].get("deletionTimestamp")
        }
        tokens = {run: self.mint.token(namespace, name, run, uid) for run, uid in runs.items()}
        for manifest in envpool_objects(envpool, plan.replicas, tokens, self.config.namespace):
            self.local.apply(manifest)
        return []

    def _envpool_spec(
        self, envpool: dict, old: EnvPoolStatus, generation: int
    ) -> EnvPoolSpec | list[Event]:
        """The pool's spec, or for one this region will not run (stored before the schema
        asked for a field, or refused by `envpools.refusals`) the events of refusing it:
        its status says why, and a session server an earlier spec made stops."""
        try:
            spec = EnvPoolSpec.model_validate(envpool["spec"])
        except ValidationError as error:
            problems = [f"spec.{'.'.join(map(str, e['loc']))}: {e['msg']}" for e in error.errors()]
        else:
            allowed = self.config.envpool_runtime_classes, self.config.envpool_image_registries
            if not (problems := refusals(spec, *allowed)):
                return spec
            meta = envpool["metadata"]
            ref = Ref("apps/v1", "Deployment", envpool_service(meta["name"]), meta["namespace"])
            if (self.local.get(ref) or {}).get("spec", {}).get("replicas"):
                self.local.scale(ref, 0)
        ready, told = invalid_spec(old.conditions, problems, generation)
        self.local.write_status(envpool, EnvPoolStatus(conditions=[ready]))
        return told

    def _annotate(self, pod: dict, annotations: dict[str, str]) -> None:
        try:
            self.local.merge_patch(Ref.of(pod), {"metadata": {"annotations": annotations}})
        except ApiException as error:
            if error.status != 404:  # gone since it was listed: nothing to mark
                raise

    def _probe(self, pod: dict) -> ServerSeen:
        """A sandbox pod's server, as its `/healthz` says (nothing, if it does not)."""
        name, ip = pod["metadata"]["name"], pod.get("status", {}).get("podIP")
        if not ip or pod.get("status", {}).get("phase") != "Running":
            return ServerSeen(name)
        try:
            response = httpx.get(
                f"http://{ip}:{ENVPOOL_PORT}/healthz", timeout=self.config.call_timeout_seconds
            )
            health = response.raise_for_status().json()
            return ServerSeen(
                name,
                ready=int(health["ready"]),
                warming=int(health["warming"]),
                claimed=int(health["sessions"]),
                waiting=int(health["waiting"]),
            )
        except (httpx.HTTPError, ValueError, KeyError, TypeError):
            return ServerSeen(name)

"""The region's InferencePool reconciler: lends a pool's replicas to mirrored RLRuns and
takes them back.

For each pool, `reconcile_pool` decides (`lending.decide`) and records the decision in the
pool's status before acting on it, so an operator restarted at any point reads what it
meant to do and carries on. Acting keeps two rules, checked against the pods that exist,
not against what was asked for:

- a GPU is lent at most once: rollout pods grow only into GPUs that serving pods have
  actually left (serving pods alive + rollout pods alive never exceed the pool's size);
- serving comes back only once rollout pods are gone. Rollout pods get SIGTERM and the
  pool's `reclaimDeadlineSeconds` to finish their groups; past it they are killed.

Serving never drops below its floor because the decision never lends past it. What the
pool's status and events say afterwards is `pool_status`'s business, pure.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass
from functools import partial

from rlfleet.api.inferencepool import CANARY, InferencePoolSpec, InferencePoolStatus, ServedVersion
from rlfleet.api.meta import COMPONENT_LABEL, RUN_LABEL
from rlfleet.operator import telemetry
from rlfleet.operator.config import OperatorConfig
from rlfleet.operator.envtokens import TokenMint
from rlfleet.operator.kube import Kube, Ref
from rlfleet.operator.locks import KeyedLocks
from rlfleet.operator.parallel import at_once
from rlfleet.operator.region.common import (
    Listings,
    Mirror,
    demand_here,
    label_selector,
    list_alive_pods,
    running_pods,
    token_mint,
)
from rlfleet.operator.region.pool_status import (
    PoolSeen,
    decision_events,
    forced_events,
    lent_entries,
    pool_status,
    reclaim_clock,
    serving_unusable,
    unusable,
    zones_checked,
)
from rlfleet.operator.served import Answers, read_served
from rlfleet.operator.status import Event, now, parse_time
from rlfleet.operator.traffic import TrafficUnknown, read_load
from rlfleet.operator.workloads.common import POOL_LABEL
from rlfleet.operator.workloads.inferencepool import canary_deployment, pool_feedback
from rlfleet.operator.workloads.rollout import rollout_deployment
from rlfleet.pipeline.lending import Decision, PoolState, canary_set, decide, lent_elsewhere


@dataclass(frozen=True)
class Observed:
    """What a pool's reconcile reads of the world before it decides."""

    load: float | None  # None: the traffic signal could not be read
    traffic_problem: str  # why not
    rollout_pods: list[dict]  # alive, on the pool's GPUs
    serving_pods: list[dict]  # alive, the canary set's included
    rollouts: dict[str, dict]  # the rollout Deployments on the pool's GPUs, by run
    canary: dict | None  # the canary set's Deployment, if there is one


@dataclass(frozen=True)
class Decided:
    """A pool's decision, recorded in its status, and what it was made from."""

    state: PoolState
    decision: Decision
    canary_replicas: int  # of the pool's replicas, in its canary set
    runs: dict[str, Mirror]  # the namespace's mirrors, by name


class PoolReconciler:
    def __init__(self, local: Kube, config: OperatorConfig, mint: TokenMint | None = None) -> None:
        self.local = local
        self.config = config
        self.name = config.cluster
        self.listings = Listings(local, config)
        self.mint = mint or token_mint(local, config)
        # A namespace's pools share its runs' demand: one decision at a time there.
        self.decisions = KeyedLocks()
        # (namespace, pool) -> (when, run -> GPUs): decisions this process recorded, newer
        # than a recent list of the pools may be.
        self._decided: dict[tuple[str, str], tuple[float, dict[str, int]]] = {}
        # (namespace, pool) -> (when, answers): what its serving pods said last.
        self._served_seen: dict[tuple[str, str], tuple[float, Answers]] = {}
        # (namespace, pool) -> ((its uid, its user header), when): what the pool's feedback
        # Secret this process wrote holds, and when the pool was last reconciled.
        self._feedback_written: dict[tuple[str, str], tuple[tuple[str, str], float]] = {}

    def reconcile_pool(self, pool: dict) -> tuple[list[Event], int]:
        """Observes, decides and records, acts, then writes the status; returns the events
        to post and the GPUs now lent."""
        meta = pool["metadata"]
        namespace, name = meta["namespace"], meta["name"]
        spec = InferencePoolSpec.model_validate(pool["spec"])
        old = InferencePoolStatus.model_validate(pool.get("status") or {})
        generation = meta.get("generation", 0)
        serving = self.local.get(
            Ref("apps/v1", "Deployment", spec.serving.deployment_name, namespace)
        )
        if (refused := unusable(serving, namespace, spec)) is not None:
            status, events = serving_unusable(old, *refused, generation)
            self.local.write_status(pool, status)
            return events, sum(e.replicas for e in old.lent) * spec.serving.gpus_per_replica

        observed = self._observe(namespace, name, spec, serving)
        current = {e.run: e.replicas for e in old.lent}
        decided = self._decide(pool, spec, observed.load, current)
        decision, canary_replicas = decided.decision, decided.canary_replicas
        events = decision_events(spec, decided.state, decision, current)
        reclaiming = self._act(
            name, spec, serving, decision, decided.runs, observed.rollouts, observed.rollout_pods,
            observed.serving_pods, canary_replicas,
        )  # fmt: skip
        self._keep_canary(pool, serving, observed.canary, canary_replicas)
        self._keep_feedback(pool, spec)
        clock = reclaim_clock(
            parse_time(old.reclaim_started_at), reclaiming, now(), spec, decision.total
        )
        events += clock.events
        killed = self._force(namespace, name) if clock.overdue else 0
        # Counted from 0 on, so that the first kill is an increase an alert sees.
        telemetry.RECLAIM_DEADLINE_EXCEEDED.labels(namespace, name).inc(killed)
        events += forced_events(killed, spec)
        running = running_pods(observed.serving_pods)
        served = self._served_by((namespace, name), spec, running)
        seen = PoolSeen(
            observed.load,
            observed.traffic_problem,
            len(observed.serving_pods),
            len(running),
            served,
        )
        status = pool_status(spec, old, generation, seen, decision, reclaiming, clock.started)
        status, told = zones_checked(status, old, spec, generation)
        self.local.write_status(pool, status)
        return events + told, decision.total * spec.serving.gpus_per_replica

    def _observe(
        self, namespace: str, name: str, spec: InferencePoolSpec, serving: dict
    ) -> Observed:
        """The world, read once and at once before deciding: the status counts what this
        reconcile acted on, and the next one counts what its scaling made of it."""
        rollout_labels = {POOL_LABEL: name, COMPONENT_LABEL: "rollout"}
        (load, traffic_problem), rollout_pods, serving_pods, (rollouts, canary) = at_once(
            [
                partial(self._load, spec),
                partial(list_alive_pods, self.local, namespace, rollout_labels),
                # The canary set's pods too: they match the serving selector.
                partial(
                    list_alive_pods,
                    self.local,
                    namespace,
                    serving["spec"]["selector"]["matchLabels"],
                ),
                partial(self._pool_deployments, namespace, name),
            ]
        )
        return Observed(load, traffic_problem, rollout_pods, serving_pods, rollouts, canary)

    def _decide(
        self, pool: dict, spec: InferencePoolSpec, load: float | None, current: dict[str, int]
    ) -> Decided:
        """The pool's lending decision, durable in its status before anything acts on it.
        One pool of a namespace at a time, since its pools share its runs' demand; acting on
        a decision needs no such lock. Each mirror's spec is parsed once, here."""
        namespace, name = pool["metadata"]["namespace"], pool["metadata"]["name"]
        # Refresh the shared lists before taking the lock, so that a slow apiserver holds
        # up only this pool, not every pool of the namespace queued behind it.
        self.listings.refresh(namespace)
        with telemetry.tracer.start_as_current_span("decide"), self.decisions.of(namespace):
            runs = self.listings.mirrors(namespace)
            # The canary set is what a production run learning from the pool asks for
            # (`spec.production.canary.replicas`).
            canary = canary_set(
                [r.spec for r in runs if not r.deleting], self.name, name, spec.serving.replicas
            )
            state = PoolState.of(name, spec, load, current, now(), canary)
            demands = [d for d in (demand_here(r, self.name) for r in runs) if d is not None]
            elsewhere = lent_elsewhere(self._lent_by_pool(namespace, besides=name))
            decision = decide(state, demands, elsewhere)
            if decision.lent != state.lent:
                lent = InferencePoolStatus(lent=lent_entries(decision))
                patch = {"status": lent.merge_patch()}
                self.local.merge_patch(Ref.of(pool), patch, "status")
                gpus = state.gpus_per_replica
                self._decided[(namespace, name)] = (
                    time.monotonic(),
                    {r: n * gpus for r, n in decision.lent.items()},
                )
        return Decided(state, decision, canary, {r.name: r for r in runs})

    def _lent_by_pool(self, namespace: str, besides: str) -> list[dict[str, int]]:
        """What the namespace's other pools lend, run -> GPUs: a recent list of the pools
        (shared with the runs' reports), where this process decided since, its decision.
        Called under the namespace's decision lock, so no decision of ours is missed."""
        asked, pools = self.listings.pools(namespace)
        lent = {pool.name: pool.lent_gpus() for pool in pools}
        for (where, pool_name), (when, decided) in list(self._decided.items()):
            if where != namespace:
                continue
            if when < asked:  # the list has it
                del self._decided[(where, pool_name)]
            else:
                lent[pool_name] = decided
        return [gpus for pool_name, gpus in lent.items() if pool_name != besides]

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
            Ref("apps/v1", "Deployment", namespace=namespace), label_selector({POOL_LABEL: pool})
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
        runs: dict[str, Mirror],
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
                    runs[run].body,
                    pool,
                    spec,
                    have + grow,
                    self.config.images.rollout,
                    self.config.workloads,
                    self.name,
                )
            )
        return max(0, len(rollout_pods) - decision.total)

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
        labels = {POOL_LABEL: pool, COMPONENT_LABEL: "rollout"}
        for pod in list_alive_pods(self.local, namespace, labels):
            if pod["metadata"].get("deletionTimestamp"):
                self.local.delete(Ref.of(pod), grace_seconds=0)
                killed += 1
        return killed

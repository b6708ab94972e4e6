"""The region's EnvPool reconciler: runs a pool's session servers, as many as its claims
need.

How many is decided purely (`rlfleet.operator.envpools.plan_pool`) from what each server's
`/healthz` says; the plan is recorded in the pool's status before anything acts on it.
Then each pod gets its deletion cost (idle servers go first when the pool shrinks), and
the pool's objects are applied (`workloads.envpool`), its token Secret holding a token
for each mirrored run that names the pool. A pool this region will not run
(`envpools.refusals`) gets no server, and its status says why.
"""

from __future__ import annotations

from functools import partial

import httpx
from kubernetes.client.exceptions import ApiException
from pydantic import ValidationError

from rlfleet.api.envpool import EnvPoolSpec, EnvPoolStatus
from rlfleet.api.meta import ENVPOOL_LABEL
from rlfleet.operator.config import OperatorConfig
from rlfleet.operator.envpools import DELETION_COST, PoolPlan, ServerSeen, plan_pool, refusals
from rlfleet.operator.envtokens import TokenMint
from rlfleet.operator.kube import Kube, Ref
from rlfleet.operator.parallel import at_once
from rlfleet.operator.region.common import Listings, list_alive_pods, token_mint
from rlfleet.operator.status import Event, condition, invalid_spec, now, parse_time, timestamp
from rlfleet.operator.workloads.envpool import ENVPOOL_PORT, envpool_objects, envpool_service


def envpool_status(
    old: EnvPoolStatus, generation: int, pods: int, servers: list[ServerSeen], plan: PoolPlan
) -> EnvPoolStatus:
    """The pool's whole status once `plan` is made: Ready while some server answers."""
    serving = any(s.answered for s in servers)
    reason, message = ("Serving", "") if serving else ("Warming", "no session server answers yet")
    ready = condition(old.conditions, "Ready", serving, reason, message, generation)
    return EnvPoolStatus(
        observed_generation=generation,
        conditions=[ready],
        pods=pods,
        ready=plan.ready,
        claimed=plan.claimed,
        warming=plan.warming,
        bursting=plan.bursting,
        idle_since=timestamp(plan.idle_since) if plan.idle_since else None,
    )


class EnvPoolReconciler:
    def __init__(self, local: Kube, config: OperatorConfig, mint: TokenMint | None = None) -> None:
        self.local = local
        self.config = config
        self.listings = Listings(local, config)
        self.mint = mint or token_mint(local, config)

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
            for p in list_alive_pods(self.local, namespace, {ENVPOOL_LABEL: name})
            if not p["metadata"].get("deletionTimestamp")
        ]
        deployment = self.local.get(Ref("apps/v1", "Deployment", envpool_service(name), namespace))
        replicas = deployment["spec"]["replicas"] if deployment else 0
        servers = at_once([partial(self._probe, p) for p in pods]) if pods else []
        plan = plan_pool(spec, servers, replicas, parse_time(old.idle_since), now())
        self.local.write_status(envpool, envpool_status(old, generation, len(pods), servers, plan))
        for pod in pods:
            cost = plan.deletion_costs.get(pod["metadata"]["name"])
            if cost is not None and pod["metadata"].get("annotations", {}).get(
                DELETION_COST
            ) != str(cost):
                self._annotate(pod, {DELETION_COST: str(cost)})
        runs = {
            run.name: run.uid
            for run in self.listings.mirrors(namespace)
            if run.spec.rollout is not None
            and run.spec.rollout.env_pool == name
            and not run.deleting
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

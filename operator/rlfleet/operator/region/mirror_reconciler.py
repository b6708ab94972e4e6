"""The region's RLRun mirror reconciler: what a run the hub mirrored here needs, and what
the hub reads back of it.

A mirror is the hub's copy of its run (label `rlfleet.io/origin`); the region never edits
its spec. On a change the reconciler writes the run's spec as its pods read it and, when
the run names an EnvPool, the run's token for it. On every resync it reports the region's
part of the run's status (GPUs asked for, lent and running here, and what keeps the run
from borrowing), which the hub folds into its own object. Lending itself is the pools'
decision (`pool_reconciler`): a mirror only reads what they lend.
"""

from __future__ import annotations

from rlfleet.api.meta import API_VERSION, COMPONENT_LABEL, RUN_LABEL
from rlfleet.api.rlrun import RegionStatus, RLRunStatus
from rlfleet.operator.config import OperatorConfig
from rlfleet.operator.envtokens import TokenMint
from rlfleet.operator.kube import Kube, Ref
from rlfleet.operator.region.common import (
    ListedPool,
    Listings,
    Mirror,
    demand_here,
    running_pods,
    token_mint,
)
from rlfleet.operator.workloads.common import POOL_LABEL, spec_config_map
from rlfleet.operator.workloads.rollout import envpool_token
from rlfleet.pipeline.lending import RunDemand, unserved_gpu_types


def run_report(
    region: str,
    run: str,
    generation: int,
    demand: RunDemand | None,
    pools: list[ListedPool],
    rollout_pods: list[dict],
    envpool_missing: str | None,
) -> RLRunStatus:
    """The region's part of a mirrored run's status: the GPUs its pools lend the run and
    those its running rollout pods (`rollout_pods`, the run's) hold, and, for a run that
    asks something of the region (`demand`), why it borrows nothing."""
    lent = running = 0
    for pool in pools:
        gpus = pool.spec.serving.gpus_per_replica
        lent += sum(entry.replicas for entry in pool.status.lent if entry.run == run) * gpus
        here = [p for p in rollout_pods if p["metadata"]["labels"].get(POOL_LABEL) == pool.name]
        running += len(here) * gpus
    types = {pool.name: pool.spec.serving.gpu_type for pool in pools}
    unserved = unserved_gpu_types(region, demand, types) if demand else None
    entry = RegionStatus(
        name=region,
        requested=demand.max_gpus if demand else 0,
        lent=lent,
        running=running,
        # Set only when so: the hub folds this entry in whole, and a null is no value.
        **({"gpu_types_unserved": unserved} if unserved else {}),
        **({"env_pool_missing": envpool_missing} if envpool_missing else {}),
    )
    return RLRunStatus(
        observed_generation=generation, regions=[entry], gpus_lent=lent, gpus_running=running
    )


class MirrorReconciler:
    def __init__(self, local: Kube, config: OperatorConfig, mint: TokenMint | None = None) -> None:
        self.local = local
        self.config = config
        self.name = config.cluster
        self.listings = Listings(local, config)
        self.mint = mint or token_mint(local, config)

    def report_run(self, run: dict, resync: bool = False) -> None:
        """Writes the region's part of a mirrored run's status, read by the hub; on a
        change (not a `resync`) also the run's spec for its pods."""
        meta = run["metadata"]
        namespace, name = meta["namespace"], meta["name"]
        mirror = Mirror.of(run)
        rollout = mirror.spec.rollout
        envpool = rollout.env_pool if rollout is not None else None
        if not resync:
            self.local.apply(spec_config_map(run))
            if envpool:
                token = self.mint.token(namespace, envpool, name, meta["uid"])
                self.local.apply(envpool_token(run, token))
        demand = demand_here(mirror, self.name)
        # Every mirror's report reads the same two lists: share one fetch per half resync.
        fresh_s = self.listings.fresh_s
        _, pools = self.listings.pools(namespace)
        pods = self.local.list_recent(
            Ref("v1", "Pod", namespace=namespace), f"{COMPONENT_LABEL}=rollout", fresh_s
        )
        mine = [p for p in running_pods(pods) if p["metadata"]["labels"].get(RUN_LABEL) == name]
        missing = self._envpool_missing(namespace, envpool, fresh_s) if demand else None
        status = run_report(
            self.name, name, meta.get("generation", 0), demand, pools, mine, missing
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

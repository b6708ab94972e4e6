"""What the region's reconcilers read alike: the namespace's RLRun mirrors and
InferencePools, the pods they count, and the key that mints EnvPool tokens.

The mirrors and pools are lists shared by every reconcile in a namespace for half a resync
(`Kube.recent`): the resyncs of 50 runs and pools read one list instead of 50 objects
each. A reconcile parses each listed object into its api model where it reads the list,
once, and passes the typed objects on; pods and Deployments, which have no model of
ours, stay as the API server returns them.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from functools import partial

from rlfleet.api.inferencepool import InferencePoolSpec, InferencePoolStatus
from rlfleet.api.meta import API_VERSION
from rlfleet.api.rlrun import RLRunSpec
from rlfleet.operator.config import OperatorConfig
from rlfleet.operator.envtokens import TokenMint
from rlfleet.operator.kube import Kube, Ref
from rlfleet.operator.parallel import at_once
from rlfleet.operator.workloads.common import ORIGIN_LABEL
from rlfleet.pipeline.lending import RunDemand


def alive_pods(pods: Iterable[dict]) -> list[dict]:
    return [p for p in pods if p.get("status", {}).get("phase") not in ("Succeeded", "Failed")]


def running_pods(pods: Iterable[dict]) -> list[dict]:
    return [
        p
        for p in pods
        if p.get("status", {}).get("phase") == "Running"
        and not p["metadata"].get("deletionTimestamp")
    ]


def label_selector(labels: dict[str, str]) -> str:
    return ",".join(f"{k}={v}" for k, v in sorted(labels.items()))


def list_alive_pods(kube: Kube, namespace: str, labels: dict[str, str]) -> list[dict]:
    """The namespace's pods with these labels that have not finished, listed now."""
    return alive_pods(kube.list(Ref("v1", "Pod", namespace=namespace), label_selector(labels)))


def token_mint(kube: Kube, config: OperatorConfig) -> TokenMint:
    """The region's EnvPool token mint: one per process is enough (it reads its key once)."""
    return TokenMint(kube, config.namespace, config.envpool_key_secret)


@dataclass(frozen=True)
class Mirror:
    """A region's mirror of a hub RLRun, its spec parsed once: `body` is the object as
    listed, for its metadata and for the workload builders, which take the manifest."""

    body: dict
    spec: RLRunSpec

    @classmethod
    def of(cls, body: dict) -> Mirror:
        return cls(body, RLRunSpec.model_validate(body["spec"]))

    @property
    def name(self) -> str:
        return self.body["metadata"]["name"]

    @property
    def uid(self) -> str:
        return self.body["metadata"]["uid"]

    @property
    def deleting(self) -> bool:
        return bool(self.body["metadata"].get("deletionTimestamp"))


def demand_here(mirror: Mirror, region: str) -> RunDemand | None:
    """What the run asks of this region's pools; None when it names the region for no
    rollouts. A suspended or deleted run still counts, asking for nothing."""
    here = next((d for d in mirror.spec.rollout_regions if d.name == region), None)
    if here is None:
        return None
    active = not mirror.spec.suspend and not mirror.deleting
    return RunDemand.of(mirror.name, mirror.spec, here, active)


@dataclass(frozen=True)
class ListedPool:
    """One of the namespace's InferencePools, as another reconcile reads it from the list."""

    name: str
    spec: InferencePoolSpec
    status: InferencePoolStatus

    @classmethod
    def of(cls, body: dict) -> ListedPool:
        return cls(
            body["metadata"]["name"],
            InferencePoolSpec.model_validate(body["spec"]),
            InferencePoolStatus.model_validate(body.get("status") or {}),
        )

    def lent_gpus(self) -> dict[str, int]:
        """What its status says it lends, run -> GPUs."""
        gpus = self.spec.serving.gpus_per_replica
        return {entry.run: entry.replicas * gpus for entry in self.status.lent}


class Listings:
    """The namespace's mirrors and pools, at most half a resync old: only the mirrors'
    specs (demand) matter to a decision, and what the listed pools lend is brought up to
    date with this process's own decisions since (`PoolReconciler._lent_by_pool`)."""

    def __init__(self, kube: Kube, config: OperatorConfig) -> None:
        self.kube = kube
        self.fresh_s = config.resync_seconds / 2

    def _mirror_bodies(self, namespace: str) -> list[dict]:
        ref = Ref(API_VERSION, "RLRun", namespace=namespace)
        return self.kube.list_recent(ref, ORIGIN_LABEL, self.fresh_s)

    def _pool_bodies(self, namespace: str) -> tuple[float, list[dict]]:
        ref = Ref(API_VERSION, "InferencePool", namespace=namespace)
        return self.kube.recent(ref, None, self.fresh_s)

    def refresh(self, namespace: str) -> None:
        """Fetches both lists, at once, where they are older than that; parses nothing."""
        at_once([partial(self._mirror_bodies, namespace), partial(self._pool_bodies, namespace)])

    def mirrors(self, namespace: str) -> list[Mirror]:
        return [Mirror.of(body) for body in self._mirror_bodies(namespace)]

    def pools(self, namespace: str) -> tuple[float, list[ListedPool]]:
        """The pools, and the `time.monotonic()` at which their list was asked for."""
        asked, bodies = self._pool_bodies(namespace)
        return asked, [ListedPool.of(body) for body in bodies]

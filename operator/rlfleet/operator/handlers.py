"""kopf wiring: which events of which kinds run which reconcile, per role.

kopf watches one cluster per process. Each reconcile is level-driven and runs on a change
and on a timer (`resync_seconds`), so traffic, pods and regions are re-read even when no
spec changes; a lock per object keeps a timer and a change from running it twice at once.
"""

from __future__ import annotations

import threading
from collections import defaultdict

import kopf

from rlfleet.api.meta import GROUP, VERSION
from rlfleet.operator import telemetry
from rlfleet.operator.config import OperatorConfig
from rlfleet.operator.hub import Hub
from rlfleet.operator.kube import Kube, Ref
from rlfleet.operator.region import Region
from rlfleet.operator.regions import RegionClients
from rlfleet.operator.status import Event
from rlfleet.operator.workloads import ORIGIN_LABEL

FINALIZER = f"{GROUP}/cleanup"
RETRY_S = 5.0  # a failed reconcile is tried again this soon (kopf's default is 60 s)


def settings(config: OperatorConfig) -> kopf.OperatorSettings:
    chosen = kopf.OperatorSettings()
    chosen.persistence.finalizer = FINALIZER
    # Progress in annotations: status holds only the schema's fields (the CRD prunes others).
    chosen.persistence.progress_storage = kopf.AnnotationsProgressStorage(prefix=GROUP)
    chosen.persistence.diffbase_storage = kopf.AnnotationsDiffBaseStorage(
        prefix=GROUP, key="last-handled-configuration"
    )
    chosen.posting.level = 20  # events for INFO and above
    chosen.execution.max_workers = 16
    chosen.watching.server_timeout = 300
    return chosen


def _post(body: kopf.Body, events: list[Event]) -> None:
    for event in events:
        kopf.event(body, type=event.type, reason=event.reason, message=event.message)


class _Locks:
    def __init__(self) -> None:
        self._locks: defaultdict[str, threading.Lock] = defaultdict(threading.Lock)
        self._guard = threading.Lock()

    def of(self, uid: str) -> threading.Lock:
        with self._guard:
            return self._locks[uid]


def registry(config: OperatorConfig, local: Kube) -> kopf.OperatorRegistry:
    chosen = kopf.OperatorRegistry()

    @kopf.on.login(registry=chosen)
    def login(**kwargs) -> kopf.ConnectionInfo | None:
        # The same credentials as `Kube.local`: in-cluster, else $KUBECONFIG.
        return kopf.login_via_client(**kwargs)

    if config.role == "hub":
        _hub(chosen, config, local)
    else:
        _region(chosen, config, local)
    return chosen


def _hub(registry: kopf.OperatorRegistry, config: OperatorConfig, local: Kube) -> None:
    hub = Hub(local, RegionClients(local, config), config)
    locks = _Locks()
    # The hub's own runs; mirrors (labelled with an origin) belong to a region's operator.
    own = dict(group=GROUP, version=VERSION, plural="rlruns", registry=registry, backoff=RETRY_S)
    own_labels = {ORIGIN_LABEL: kopf.ABSENT}

    @kopf.on.resume(**own, labels=own_labels)
    @kopf.on.create(**own, labels=own_labels)
    @kopf.on.update(**own, labels=own_labels, field="spec")
    @kopf.timer(**own, labels=own_labels, interval=config.resync_seconds)
    def reconcile_run(body: kopf.Body, namespace: str, name: str, uid: str, **_) -> None:
        if body.metadata.get("deletionTimestamp"):
            return
        with locks.of(uid), telemetry.reconciling("RLRun", namespace, name):
            outcome = hub.reconcile(dict(body))
            local.merge_patch(Ref.of(dict(body)), {"status": outcome.status}, subresource="status")
        for entry in outcome.status["regions"]:
            telemetry.REGION_REACHABLE.labels(namespace, name, entry["name"]).set(
                1 if entry.get("reachable") else 0
            )
        _post(body, outcome.events)

    @kopf.on.delete(**own, labels=own_labels)
    def delete_run(body: kopf.Body, namespace: str, name: str, uid: str, **_) -> None:
        with locks.of(uid), telemetry.reconciling("RLRun", namespace, name):
            unreachable = hub.delete(dict(body))
        if unreachable:
            raise kopf.TemporaryError(
                f"the mirrors in {', '.join(unreachable)} are deleted once they answer", delay=5
            )
        # Trainer objects carry ownerReferences: the garbage collector takes them.


def _region(registry: kopf.OperatorRegistry, config: OperatorConfig, local: Kube) -> None:
    region = Region(local, config)
    locks = _Locks()
    pools = dict(
        group=GROUP, version=VERSION, plural="inferencepools", registry=registry, backoff=RETRY_S
    )
    mirrors = dict(
        group=GROUP, version=VERSION, plural="rlruns", registry=registry, backoff=RETRY_S
    )
    mirror_labels = {ORIGIN_LABEL: kopf.PRESENT}
    envpools = dict(
        group=GROUP, version=VERSION, plural="envpools", registry=registry, backoff=RETRY_S
    )

    @kopf.on.resume(**pools)
    @kopf.on.create(**pools)
    @kopf.on.update(**pools, field="spec")
    @kopf.timer(**pools, interval=config.resync_seconds)
    def reconcile_pool(body: kopf.Body, namespace: str, name: str, uid: str, **_) -> None:
        with locks.of(uid), telemetry.reconciling("InferencePool", namespace, name):
            events = region.reconcile_pool(dict(body))
        lent = body.get("status", {}).get("lentReplicas") or 0
        telemetry.GPUS_LENT.labels(namespace, name).set(
            lent * body["spec"]["serving"]["gpusPerReplica"]
        )
        _post(body, events)

    @kopf.on.resume(**mirrors, labels=mirror_labels)
    @kopf.on.create(**mirrors, labels=mirror_labels)
    @kopf.on.update(**mirrors, labels=mirror_labels, field="spec")
    @kopf.timer(**mirrors, labels=mirror_labels, interval=config.resync_seconds)
    def report_run(body: kopf.Body, namespace: str, name: str, uid: str, **_) -> None:
        if body.metadata.get("deletionTimestamp"):
            return
        with locks.of(uid), telemetry.reconciling("RLRun", namespace, name):
            region.report_run(dict(body))

    @kopf.on.resume(**envpools)
    @kopf.on.create(**envpools)
    @kopf.on.update(**envpools, field="spec")
    @kopf.timer(**envpools, interval=config.resync_seconds)
    def reconcile_envpool(body: kopf.Body, namespace: str, name: str, uid: str, **_) -> None:
        with locks.of(uid), telemetry.reconciling("EnvPool", namespace, name):
            region.reconcile_envpool(dict(body))

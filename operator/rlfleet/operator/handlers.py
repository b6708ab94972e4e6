"""kopf wiring: which events of which kinds run which reconcile, per role.

kopf watches one cluster per process. Each reconcile is level-driven and runs on a change
and on a timer (`resync_seconds` for pools and sandboxes, `run_resync_seconds` for runs),
so traffic, pods and regions are re-read even when no spec changes; a lock per object
keeps a timer and a change from running it twice at once.
"""

from __future__ import annotations

import base64
from collections.abc import Callable

import kopf

from rlfleet.api.meta import GROUP, VERSION
from rlfleet.operator import telemetry
from rlfleet.operator.config import OperatorConfig
from rlfleet.operator.dataplane import DataPlane, DataPlaneUnavailable, NatsLogin
from rlfleet.operator.hub import Hub
from rlfleet.operator.kube import Kube, Ref
from rlfleet.operator.locks import KeyedLocks
from rlfleet.operator.region.common import token_mint
from rlfleet.operator.region.envpool_reconciler import EnvPoolReconciler
from rlfleet.operator.region.mirror_reconciler import MirrorReconciler
from rlfleet.operator.region.pool_reconciler import PoolReconciler
from rlfleet.operator.regions import RegionClients
from rlfleet.operator.status import Event
from rlfleet.operator.workloads.common import ORIGIN_LABEL

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
    # An object's resync timer caught mid-reconcile when the object is deleted (the more
    # likely the busier the operator) is checked again this soon, its finalizer held
    # until then: kopf's default, 60 s, kept a deleted run in place a minute.
    chosen.background.cancellation_polling = 1.0
    return chosen


def _post(body: kopf.Body, events: list[Event]) -> None:
    for event in events:
        kopf.event(body, type=event.type, reason=event.reason, message=event.message)


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


def _kind(registry: kopf.OperatorRegistry, plural: str) -> dict:
    return dict(group=GROUP, version=VERSION, plural=plural, registry=registry, backoff=RETRY_S)


def _level_driven(resource: dict, interval: float, **filters) -> Callable:
    """Runs the handler when the operator starts, on create, on a spec change, and every
    `interval` seconds: it reads the world, so it must not wait for a spec change."""

    def register(handler: Callable) -> Callable:
        # kopf keeps a handler's progress in an annotation named by its id (when one is
        # retried, or two run at once: resume and update, for a spec changed while the
        # operator was down). The default id, `_hub.<locals>.name`, is no valid annotation
        # key, and every such write would fail.
        named = {"id": handler.__name__}
        for decorator in (
            kopf.on.resume(**resource, **filters, **named),
            kopf.on.create(**resource, **filters, **named),
            kopf.on.update(**resource, **filters, **named, field="spec"),
        ):
            handler = decorator(handler)

        def resync(**kwargs) -> None:
            handler(resync=True, **kwargs)

        timer = kopf.timer(
            **resource, **filters, interval=interval, id=f"{handler.__name__}-resync"
        )
        timer(resync)
        return handler

    return register


def _dataplane(config: OperatorConfig, local: Kube) -> DataPlane | None:
    access = config.nats
    if access is None:
        return None

    def login() -> NatsLogin:
        if access.credentials_secret is None:
            return NatsLogin(None)
        ref = Ref("v1", "Secret", access.credentials_secret, config.namespace)
        data = (local.get(ref) or {}).get("data") or {}
        if "creds" not in data:
            raise DataPlaneUnavailable(
                f"Secret {config.namespace}/{access.credentials_secret} needs key creds"
            )
        creds, seed, operator, system = (
            data.get(k) and base64.b64decode(data[k]).decode()
            for k in ("creds", "signing-seed", "operator-seed", "system-creds")
        )
        return NatsLogin(creds, seed, operator, system)

    return DataPlane(access.url, login, access.domain, config.call_timeout_seconds)


def _hub(registry: kopf.OperatorRegistry, config: OperatorConfig, local: Kube) -> None:
    hub = Hub(local, RegionClients(local, config), config, _dataplane(config, local))
    locks = KeyedLocks()
    # The hub's own runs; mirrors (labelled with an origin) belong to a region's operator.
    runs, own = _kind(registry, "rlruns"), {"labels": {ORIGIN_LABEL: kopf.ABSENT}}

    @_level_driven(runs, config.run_resync_seconds, **own)
    def reconcile_run(
        body: kopf.Body, namespace: str, name: str, uid: str, resync: bool = False, **_
    ) -> None:
        if body.metadata.get("deletionTimestamp"):
            return
        with locks.of(uid), telemetry.reconciling("RLRun", namespace, name):
            decision = hub.reconcile(dict(body), resync)
        for entry in decision.status.regions:
            telemetry.REGION_REACHABLE.labels(namespace, name, entry.name).set(
                1 if entry.reachable else 0
            )
        _post(body, decision.events)

    @kopf.on.delete(**runs, **own, id="delete_run")  # a valid annotation key: see above
    def delete_run(body: kopf.Body, namespace: str, name: str, uid: str, **_) -> None:
        with locks.of(uid), telemetry.reconciling("RLRun", namespace, name):
            left = hub.delete(dict(body))
        if left:
            raise kopf.TemporaryError(f"left for a later try: {'; '.join(left)}", delay=5)
        telemetry.forget("RLRun", namespace, name)
        # Trainer objects carry ownerReferences: the garbage collector takes them.


def _region(registry: kopf.OperatorRegistry, config: OperatorConfig, local: Kube) -> None:
    mint = token_mint(local, config)  # one per process: it reads the region's key once
    pools = PoolReconciler(local, config, mint)
    mirrors = MirrorReconciler(local, config, mint)
    envpools = EnvPoolReconciler(local, config, mint)
    locks = KeyedLocks()
    every = config.resync_seconds

    @_level_driven(_kind(registry, "inferencepools"), every)
    def reconcile_pool(body: kopf.Body, namespace: str, name: str, uid: str, **_) -> None:
        # Traffic and pods change without a spec change: a resync decides afresh too.
        with locks.of(uid), telemetry.reconciling("InferencePool", namespace, name):
            events, lent_gpus = pools.reconcile_pool(dict(body))
        telemetry.GPUS_LENT.labels(namespace, name).set(lent_gpus)
        _post(body, events)

    @_level_driven(
        _kind(registry, "rlruns"), config.run_resync_seconds, labels={ORIGIN_LABEL: kopf.PRESENT}
    )
    def report_run(
        body: kopf.Body, namespace: str, name: str, uid: str, resync: bool = False, **_
    ) -> None:
        if body.metadata.get("deletionTimestamp"):
            return
        with locks.of(uid), telemetry.reconciling("RLRun", namespace, name):
            mirrors.report_run(dict(body), resync)

    @_level_driven(_kind(registry, "envpools"), every)
    def reconcile_envpool(body: kopf.Body, namespace: str, name: str, uid: str, **_) -> None:
        with locks.of(uid), telemetry.reconciling("EnvPool", namespace, name):
            events = envpools.reconcile_envpool(dict(body))
        _post(body, events)

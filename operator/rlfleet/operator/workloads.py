"""The Kubernetes objects the operator creates, built from the custom resources (pure).

Every object carries the labels that say which run, pool and component it belongs to, and
an ownerReference to its custom resource in the same cluster, so the garbage collector
removes it with its owner. Nothing here crosses a cluster: a region's objects are owned
by that region's mirror of the run.
"""

from __future__ import annotations

import json
from typing import Any

from rlfleet.api.envpool import EnvPoolSpec
from rlfleet.api.inferencepool import InferencePoolSpec
from rlfleet.api.meta import API_VERSION, COMPONENT_LABEL, GPU_RESOURCE, GROUP, RUN_LABEL
from rlfleet.api.rlrun import RLRunSpec

POOL_LABEL = f"{GROUP}/pool"
ENVPOOL_LABEL = f"{GROUP}/envpool"
ORIGIN_LABEL = f"{GROUP}/origin"  # on a region's mirror: the hub cluster it came from
ORIGIN_UID = f"{GROUP}/origin-uid"
MANAGED_BY = {"app.kubernetes.io/managed-by": "rlfleet-operator"}
SPEC_FILE = "/etc/rlfleet/rlrun.json"
TRAINER_PORT = 29500  # torch.distributed rendezvous


def owner(body: dict) -> dict:
    meta = body["metadata"]
    return {
        "apiVersion": body["apiVersion"],
        "kind": body["kind"],
        "name": meta["name"],
        "uid": meta["uid"],
        "controller": True,
        "blockOwnerDeletion": True,
    }


def _meta(body: dict, name: str, labels: dict[str, str]) -> dict:
    return {
        "name": name,
        "namespace": body["metadata"]["namespace"],
        "labels": MANAGED_BY | labels,
        "ownerReferences": [owner(body)],
    }


def spec_config_map(run: dict) -> dict:
    """The run's spec as the pods read it: one source of truth for their settings."""
    name = run["metadata"]["name"]
    return {
        "apiVersion": "v1",
        "kind": "ConfigMap",
        "metadata": _meta(run, f"{name}-spec", {RUN_LABEL: name}),
        "data": {"rlrun.json": json.dumps({"name": name, "spec": run["spec"]}, sort_keys=True)},
    }


def _deployment(owner_body: dict, name: str, labels: dict, replicas: int, pod: dict) -> dict:
    return {
        "apiVersion": "apps/v1",
        "kind": "Deployment",
        "metadata": _meta(owner_body, name, labels),
        "spec": {
            "replicas": replicas,
            "selector": {"matchLabels": labels},
            "template": {"metadata": {"labels": labels}, "spec": pod},
        },
    }


def _container(name: str, image: str, run: str, gpus: int, env: dict[str, str]) -> dict:
    return {
        "name": name,
        "image": image,
        "args": [SPEC_FILE],
        "env": [{"name": k, "value": v} for k, v in ({"RLFLEET_RUN": run} | env).items()],
        "resources": {"limits": {GPU_RESOURCE: str(gpus)}} if gpus else {},
        "volumeMounts": [{"name": "spec", "mountPath": "/etc/rlfleet", "readOnly": True}],
    }


def _spec_volume(run: str) -> dict:
    return {"name": "spec", "configMap": {"name": f"{run}-spec"}}


def trainer_objects(run: dict, default_image: str) -> list[dict]:
    """StatefulSet (stable ranks), headless Service for rendezvous, PodDisruptionBudget."""
    name = run["metadata"]["name"]
    spec = RLRunSpec.model_validate(run["spec"])
    labels = {RUN_LABEL: name, COMPONENT_LABEL: "trainer"}
    replicas = 0 if spec.suspend else spec.trainer.replicas
    container = _container(
        "trainer",
        spec.trainer.image or default_image,
        name,
        spec.trainer.gpus_per_replica,
        {"RLFLEET_TRAINER_SERVICE": f"{name}-trainer"},
    )
    container["ports"] = [{"name": "rendezvous", "containerPort": TRAINER_PORT}]
    statefulset = {
        "apiVersion": "apps/v1",
        "kind": "StatefulSet",
        "metadata": _meta(run, f"{name}-trainer", labels),
        "spec": {
            "serviceName": f"{name}-trainer",
            "replicas": replicas,
            "podManagementPolicy": "Parallel",  # ranks rendezvous; none waits for another
            "selector": {"matchLabels": labels},
            "template": {
                "metadata": {"labels": labels},
                "spec": {
                    "containers": [container],
                    "volumes": [_spec_volume(name)],
                    # A step in flight is finished, checkpointed and published on SIGTERM.
                    "terminationGracePeriodSeconds": 300,
                },
            },
        },
    }
    service = {
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": _meta(run, f"{name}-trainer", labels),
        "spec": {
            "clusterIP": "None",
            "selector": labels,
            "ports": [{"name": "rendezvous", "port": TRAINER_PORT}],
        },
    }
    budget = {
        "apiVersion": "policy/v1",
        "kind": "PodDisruptionBudget",
        "metadata": _meta(run, f"{name}-trainer", labels),
        # Losing one rank stops the step for all: voluntary evictions wait for the run.
        "spec": {"maxUnavailable": 0, "selector": {"matchLabels": labels}},
    }
    return [spec_config_map(run), statefulset, service, budget]


def mirror(run: dict, origin: str) -> dict:
    """The copy of a hub RLRun a region's operator acts on (no ownerReference: the owner
    lives in another cluster; the hub deletes its mirrors itself)."""
    meta = run["metadata"]
    return {
        "apiVersion": API_VERSION,
        "kind": "RLRun",
        "metadata": {
            "name": meta["name"],
            "namespace": meta["namespace"],
            "labels": MANAGED_BY | {ORIGIN_LABEL: origin},
            "annotations": {ORIGIN_UID: meta["uid"]},
        },
        "spec": run["spec"],
    }


def rollout_name(run: str, pool: str) -> str:
    return f"{run}-rollout-{pool}"


def rollout_deployment(
    run: dict,
    pool: str,
    pool_spec: InferencePoolSpec,
    replicas: int,
    default_image: str,
    region: str,
) -> dict:
    """The run's rollout workers on GPUs borrowed from one pool: one replica per lent
    serving replica, with as many GPUs. A worker stops taking tasks on SIGTERM and finishes
    its groups; past the pool's reclaim deadline it is killed."""
    name = run["metadata"]["name"]
    spec = RLRunSpec.model_validate(run["spec"])
    labels = {RUN_LABEL: name, POOL_LABEL: pool, COMPONENT_LABEL: "rollout"}
    endpoints = {e.region: e.url for e in spec.weight_sync.endpoints}
    env = {"RLFLEET_REGION": region, "RLFLEET_POOL": pool}
    if region in endpoints:
        env["RLFLEET_NATS_URL"] = endpoints[region]
    container = _container(
        "rollout",
        spec.rollout.image or default_image,
        name,
        pool_spec.serving.gpus_per_replica,
        env,
    )
    pod = {
        "containers": [container],
        "volumes": [_spec_volume(name)],
        "terminationGracePeriodSeconds": pool_spec.reclaim_deadline_seconds,
    }
    return _deployment(run, rollout_name(name, pool), labels, replicas, pod)


def envpool_objects(envpool: dict, replicas: int) -> list[dict]:
    """The sandbox pods (a Deployment) and, unless egress is allowed, a NetworkPolicy
    that lets them talk to nothing but the rollout workers that call them."""
    name = envpool["metadata"]["name"]
    spec = EnvPoolSpec.model_validate(envpool["spec"])
    labels = {ENVPOOL_LABEL: name, COMPONENT_LABEL: "sandbox"}
    limits = {
        "cpu": spec.limits.cpu,
        "memory": spec.limits.memory,
        "ephemeral-storage": spec.limits.ephemeral_storage,
    }
    pod: dict[str, Any] = {
        "automountServiceAccountToken": False,
        "enableServiceLinks": False,
        "containers": [
            {
                "name": "sandbox",
                "image": spec.template.image,
                **({"command": spec.template.command} if spec.template.command else {}),
                "resources": {"limits": limits, "requests": limits},
                "env": [
                    {"name": "RLFLEET_SANDBOX_TIMEOUT_S", "value": str(spec.limits.timeout_seconds)}
                ],
                "securityContext": {
                    "allowPrivilegeEscalation": False,
                    "runAsNonRoot": True,
                    "runAsUser": 65534,
                    "capabilities": {"drop": ["ALL"]},
                },
            }
        ],
    }
    if spec.template.runtime_class_name:
        pod["runtimeClassName"] = spec.template.runtime_class_name
    objects = [_deployment(envpool, f"{name}-sandbox", labels, replicas, pod)]
    if spec.network.egress == "Deny":
        objects.append(
            {
                "apiVersion": "networking.k8s.io/v1",
                "kind": "NetworkPolicy",
                "metadata": _meta(envpool, f"{name}-sandbox", labels),
                "spec": {
                    "podSelector": {"matchLabels": labels},
                    "policyTypes": ["Ingress", "Egress"],
                    "ingress": [
                        {"from": [{"podSelector": {"matchLabels": {COMPONENT_LABEL: "rollout"}}}]}
                    ],
                    "egress": [],
                },
            }
        )
    return objects

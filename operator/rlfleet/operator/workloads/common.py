"""What every object the operator builds shares: its labels, its owner, its pod's least
privilege, and the component container that reads the run's mounted spec (pure).

Every object carries the labels that say which run, pool and component it belongs to, and
an ownerReference to its custom resource in the same cluster, so the garbage collector
removes it with its owner. Nothing here crosses a cluster: a region's objects are owned
by that region's mirror of the run. The builders of each kind's objects (`hub`,
`rollout`, `inferencepool`, `envpool`) are made of these, so a pod of any of them is
secured and labelled the same way.
"""

from __future__ import annotations

import base64
from pathlib import Path
from typing import Any

from rlfleet.api.meta import GPU_RESOURCE, GROUP, RUN_LABEL
from rlfleet.api.rlrun import RLRunSpec
from rlfleet.api.wire import BusRole
from rlfleet.bus.connection import CREDENTIALS_ENV
from rlfleet.launch import components, objectstore, pods
from rlfleet.operator.config import NatsAccess, Resources, Workloads

POOL_LABEL = f"{GROUP}/pool"
ORIGIN_LABEL = f"{GROUP}/origin"  # on a region's mirror: the hub cluster it came from
ORIGIN_UID = f"{GROUP}/origin-uid"
# On a region's mirror: the hub's JetStream domain, where the run's streams live.
JETSTREAM_DOMAIN = f"{GROUP}/jetstream-domain"
# On a region's mirror: the Secret with the run's rollout NATS user, which the hub mints when
# its NATS has users (`NatsAccess.credentials_secret`); without it pods connect anonymously.
NATS_USER = f"{GROUP}/nats-user"
MANAGED_BY = {"app.kubernetes.io/managed-by": "rlfleet-operator"}
METRICS_PORT_NAME = "metrics"  # the container port a component serves Prometheus metrics on
# The user (and group) each image runs as: `USER` in images/trainer.Dockerfile and
# images/rollout.Dockerfile. An EnvPool's server runs as root in its VM (`envpool`).
WORKLOAD_USER = 1000
# A credential a workload mounts (its NATS user, its EnvPool token): read-only, for the
# pod's own group alone, which is its fsGroup, WORKLOAD_USER's (`least_privilege`). The
# kubelet owns a Secret volume's files root:fsGroup and adds group read to them (0400
# lands as 0440 all the same); without the group bit a non-root uid could not read it.
# Nothing for other uids: no process of another uid in the pod reads it.
CREDENTIALS_MODE = 0o440
# Where a component with a read-only root writes: an emptyDir at /tmp, also its $HOME, so
# the caches torch, Triton, vLLM, DeepSpeed and Hugging Face keep under ~/.cache, ~/.triton
# and /tmp land in it.
SCRATCH_DIR = "/tmp"


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


def object_meta(body: dict, name: str, labels: dict[str, str]) -> dict:
    return {
        "name": name,
        "namespace": body["metadata"]["namespace"],
        "labels": MANAGED_BY | labels,
        "ownerReferences": [owner(body)],
    }


def nats_key(run: dict) -> str:
    """The run's name on NATS, for its pods (in the mounted spec) and the hub alike."""
    return pods.run_key(run["metadata"]["namespace"], run["metadata"]["name"])


def spec_config_map(run: dict) -> dict:
    """The run's spec as the pods read it: one source of truth for their settings."""
    name = run["metadata"]["name"]
    return {
        "apiVersion": "v1",
        "kind": "ConfigMap",
        "metadata": object_meta(run, f"{name}-spec", {RUN_LABEL: name}),
        "data": {Path(pods.SPEC_FILE).name: pods.spec_document(nats_key(run), run["spec"])},
    }


def pod_template(labels: dict, pod: dict) -> dict:
    """A pod template. A pod whose container has a `metrics` port carries the annotations
    Prometheus's pod discovery scrapes by (`prometheus.io/scrape|port|path`)."""
    metadata: dict[str, Any] = {"labels": labels}
    ports = [
        p for c in pod["containers"] for p in c.get("ports", []) if p["name"] == METRICS_PORT_NAME
    ]
    if ports:
        metadata["annotations"] = {
            "prometheus.io/scrape": "true",
            "prometheus.io/port": str(ports[0]["containerPort"]),
            "prometheus.io/path": pods.METRICS_PATH,
        }
    return {"metadata": metadata, "spec": pod}


def owned_deployment(owner_body: dict, name: str, labels: dict, replicas: int, pod: dict) -> dict:
    return {
        "apiVersion": "apps/v1",
        "kind": "Deployment",
        "metadata": object_meta(owner_body, name, labels),
        "spec": {
            "replicas": replicas,
            "selector": {"matchLabels": labels},
            "template": pod_template(labels, pod),
        },
    }


def least_privilege(pod: dict, user: int, read_only_root: bool = True) -> dict:
    """Every pod the operator makes, as the Pod Security Standards' `restricted` profile
    wants it: its containers run as `user`, never root, with no capability, no privilege
    escalation and the runtime's default seccomp profile, and without a ServiceAccount
    token (none of them calls the API server). With a `read_only_root`, they write only
    to their volumes and the SCRATCH_DIR emptyDir. Volumes are writable by `user`'s group
    (fsGroup), changed only when their root's owner differs (a large claim mounts fast)."""
    pod["automountServiceAccountToken"] = False
    pod["securityContext"] = {
        "runAsNonRoot": True,
        "runAsUser": user,
        "runAsGroup": user,
        "fsGroup": user,
        "fsGroupChangePolicy": "OnRootMismatch",
        "seccompProfile": {"type": "RuntimeDefault"},
    }
    if read_only_root:
        pod.setdefault("volumes", []).append({"name": "scratch", "emptyDir": {}})
    for container in pod["containers"] + pod.get("initContainers", []):
        container["securityContext"] = {
            "allowPrivilegeEscalation": False,
            "capabilities": {"drop": ["ALL"]},
            "readOnlyRootFilesystem": read_only_root,
        }
        if read_only_root:
            container.setdefault("volumeMounts", []).append(
                {"name": "scratch", "mountPath": SCRATCH_DIR}
            )
            container.setdefault("env", []).append({"name": "HOME", "value": SCRATCH_DIR})
    return pod


def _resources(sized: Resources, gpus: int) -> dict:
    """CPU and memory as the operator's config sizes them; GPUs (an extended resource)
    asked for and capped alike."""
    gpu = {GPU_RESOURCE: str(gpus)} if gpus else {}
    return {
        "requests": sized.requests.model_dump() | gpu,
        "limits": sized.limits.model_dump() | gpu,
    }


def component_container(
    name: str, image: str, gpus: int, env: dict[str, str], workloads: Workloads
) -> dict:
    """A component reading its run's mounted spec (`python -m ... --rlrun`), placed by
    the environment (`rlfleet.launch.pods.Placement`), sized by the operator's config for its
    kind (`name`), serving its metrics on the `metrics` port."""
    port = workloads.metrics_port
    return {
        "name": name,
        "image": image,
        "args": ["--rlrun", pods.SPEC_FILE],
        "env": [
            *({"name": k, "value": v} for k, v in env.items()),
            {"name": pods.METRICS_PORT_ENV, "value": str(port)},
            {
                "name": pods.POD_NAME_ENV,
                "valueFrom": {"fieldRef": {"fieldPath": "metadata.name"}},
            },
        ],
        "ports": [{"name": METRICS_PORT_NAME, "containerPort": port}],
        "resources": _resources(workloads.resources[name], gpus),
        "volumeMounts": [{"name": "spec", "mountPath": pods.SPEC_DIR, "readOnly": True}],
    }


def on_gpu_type(pod: dict, workloads: Workloads, gpu_type: str | None) -> dict:
    """Places the pod on nodes whose GPU-type label says `gpu_type` (none: anywhere)."""
    if gpu_type is not None:
        term = {
            "matchExpressions": [
                {"key": workloads.gpu_type_label, "operator": "In", "values": [gpu_type]}
            ]
        }
        pod["affinity"] = {
            "nodeAffinity": {
                "requiredDuringSchedulingIgnoredDuringExecution": {"nodeSelectorTerms": [term]}
            }
        }
    return pod


def mints_users(nats: NatsAccess | None) -> bool:
    """Whether the hub mints each run a NATS user: its NATS has users at all."""
    return nats is not None and nats.credentials_secret is not None


def with_nats(pod: dict, run: str, role: BusRole, minted: bool) -> dict:
    """Mounts the NATS user of the run's component `role`, if the hub `minted` users, and
    tells the component where it is: a pod can do with its own run's subjects and streams
    what its component does, nothing more (`rlfleet.bus.permissions.role_access`)."""
    if not minted:
        return pod
    secret = {"secretName": pods.nats_credentials_secret(run, role)}
    pod["volumes"].append({"name": "nats", "secret": secret | {"defaultMode": CREDENTIALS_MODE}})
    container = pod["containers"][0]
    container["volumeMounts"].append(
        {"name": "nats", "mountPath": pods.NATS_CREDENTIALS_DIR, "readOnly": True}
    )
    path = f"{pods.NATS_CREDENTIALS_DIR}/{pods.NATS_CREDENTIALS_KEY}"
    container["env"].insert(0, {"name": CREDENTIALS_ENV, "value": path})
    return pod


# What the init container that fetches an s3:// model asks for: it streams 1 MiB chunks.
FETCH_RESOURCES = {
    "requests": {"cpu": "500m", "memory": "512Mi"},
    "limits": {"cpu": "2", "memory": "512Mi"},
}
# The keys of `spec.model.credentialsSecret` the fetch reads, as AWS's tools name them.
STORE_CREDENTIALS = {
    "AWS_ACCESS_KEY_ID": False,  # key: whether the Secret may lack it
    "AWS_SECRET_ACCESS_KEY": False,
    "AWS_SESSION_TOKEN": True,
    "AWS_REGION": True,
}


def with_model(pod: dict, spec: RLRunSpec, workloads: Workloads) -> dict:
    """Mounts the model's claim, if the spec names one, where its file:// uri points; for
    an s3:// uri, the model cache, into which an init container fetches the model first."""
    if spec.model.uri.startswith(objectstore.S3_SCHEME):
        return _with_fetched_model(pod, spec, workloads)
    claim = spec.model.volume_claim_name
    if claim is not None:
        pod["volumes"].append({"name": "model", "persistentVolumeClaim": {"claimName": claim}})
        pod["containers"][0]["volumeMounts"].append(
            {"name": "model", "mountPath": pods.model_dir(spec), "readOnly": True}
        )
    return pod


def secret_env(secret: str, keys: dict[str, bool]) -> list[dict]:
    """Environment variables named as the Secret's keys, from it (each key: whether the
    Secret may lack it): its values reach the container alone, never its arguments."""
    return [
        {
            "name": key,
            "valueFrom": {"secretKeyRef": {"name": secret, "key": key, "optional": optional}},
        }
        for key, optional in keys.items()
    ]


def _with_fetched_model(pod: dict, spec: RLRunSpec, workloads: Workloads) -> dict:
    """The model cache volume, read-only in the pod's containers, and the init container
    that fills it: it alone holds the store's credentials."""
    model = spec.model
    command = [*components.FETCH_MODEL.command(), model.uri, "--cache", pods.MODEL_CACHE_DIR]
    if model.endpoint is not None:
        command += ["--endpoint", model.endpoint]
    fetch: dict[str, Any] = {
        "name": "fetch-model",
        "image": pod["containers"][0]["image"],
        "command": command,
        "resources": FETCH_RESOURCES,
        "volumeMounts": [{"name": "model-cache", "mountPath": pods.MODEL_CACHE_DIR}],
    }
    if model.credentials_secret is not None:
        fetch["env"] = secret_env(model.credentials_secret, STORE_CREDENTIALS)
    pod.setdefault("initContainers", []).append(fetch)
    pod["volumes"].append({"name": "model-cache", **workloads.model_cache})
    for container in pod["containers"]:
        container.setdefault("volumeMounts", []).append(
            {"name": "model-cache", "mountPath": pods.MODEL_CACHE_DIR, "readOnly": True}
        )
    return pod


def spec_volume(run: str) -> dict:
    return {"name": "spec", "configMap": {"name": f"{run}-spec"}}


def secret_data(values: dict[str, str]) -> dict[str, str]:
    """A Secret's `data` (base64): what a server-side apply owns field by field, where
    `stringData` is only written through."""
    return {key: base64.b64encode(value.encode()).decode() for key, value in values.items()}

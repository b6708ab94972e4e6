"""The Kubernetes objects the operator creates, built from the custom resources (pure).

Every object carries the labels that say which run, pool and component it belongs to, and
an ownerReference to its custom resource in the same cluster, so the garbage collector
removes it with its owner. Nothing here crosses a cluster: a region's objects are owned
by that region's mirror of the run.
"""

from __future__ import annotations

import base64
import copy
import json
import math
from pathlib import Path
from typing import Any

import msgspec
from kubernetes.utils.quantity import parse_quantity

from rlfleet import launch
from rlfleet.api.envpool import EnvPoolSpec
from rlfleet.api.inferencepool import (
    CANARY,
    FEEDBACK_KEY_FILE,
    REPLICA_SET_LABEL,
    USER_HEADER_FILE,
    InferencePoolSpec,
    feedback_secret,
)
from rlfleet.api.meta import (
    API_VERSION,
    COMPONENT_LABEL,
    ENVPOOL_LABEL,
    GPU_RESOURCE,
    GROUP,
    RUN_LABEL,
)
from rlfleet.api.rlrun import CheckpointStorage, RLRunSpec
from rlfleet.api.wire import BusRole
from rlfleet.bus.auth import CREDENTIALS_ENV
from rlfleet.launch.settings import Limits, Ranks, ServerConfig
from rlfleet.operator.config import Images, NatsAccess, Resources, Workloads

POOL_LABEL = f"{GROUP}/pool"
ORIGIN_LABEL = f"{GROUP}/origin"  # on a region's mirror: the hub cluster it came from
ORIGIN_UID = f"{GROUP}/origin-uid"
# On a region's mirror: the hub's JetStream domain, where the run's streams live.
JETSTREAM_DOMAIN = f"{GROUP}/jetstream-domain"
# On a region's mirror: the Secret with the run's rollout NATS user, which the hub mints when
# its NATS has users (`NatsAccess.credentials_secret`); without it pods connect anonymously.
NATS_USER = f"{GROUP}/nats-user"
MANAGED_BY = {"app.kubernetes.io/managed-by": "rlfleet-operator"}
TRAINER_PORT = Ranks().master_port  # torch.distributed rendezvous, on rank 0's pod
# The StatefulSet controller labels each pod with its ordinal: the pod's node rank.
POD_INDEX_LABEL = "apps.kubernetes.io/pod-index"
METRICS_PORT_NAME = "metrics"  # the container port a component serves Prometheus metrics on
# The user (and group) each image runs as: `USER` in images/trainer.Dockerfile and
# images/rollout.Dockerfile. An EnvPool's server runs as root in its VM (below).
WORKLOAD_USER = 1000
# A credential a workload mounts (its NATS user, its EnvPool token): read-only, for the
# pod's own group alone, which is its fsGroup, WORKLOAD_USER's (`_least_privilege`). The
# kubelet owns a Secret volume's files root:fsGroup and adds group read to them (0400
# lands as 0440 all the same); without the group bit a non-root uid could not read it.
# Nothing for other uids: no process of another uid in the pod reads it.
CREDENTIALS_MODE = 0o440
# An EnvPool's pods: the session server (images/env-sandbox.Dockerfile) and where it keeps
# its state, the runs' tokens, the port it serves and probes on, and the capabilities it
# makes sandboxes with: namespaces and mounts, each sandbox's uid, its tree's owner, and
# killing what a sandbox left.
ENVPOOL_SERVER = "/opt/rlfleet/envsessions.py"
ENVPOOL_PYTHON = "/usr/local/bin/python3"  # the image's (python:3.11-slim), sandboxes' too
ENVPOOL_STATE_DIR = "/var/lib/rlfleet"
ENVPOOL_TOKENS_DIR = "/etc/rlfleet/envpool"
ENVPOOL_TOKENS_KEY = "tokens.json"
ENVPOOL_PORT, ENVPOOL_PORT_NAME = 8080, "sessions"
POD_IP_ENV = "POD_IP"
# A region operator's pods, as the chart labels them (`rlfleet.selector` and
# `rlfleet.labels` in templates/_helpers.tpl): the one peer besides rollout pods that an
# EnvPool's NetworkPolicy lets in.
REGION_OPERATOR_LABELS = {"app.kubernetes.io/name": "rlfleet-operator", "rlfleet.io/role": "region"}
SANDBOX_CAPABILITIES = ["SYS_ADMIN", "SETUID", "SETGID", "CHOWN", "FOWNER", "DAC_OVERRIDE", "KILL"]
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


def _meta(body: dict, name: str, labels: dict[str, str]) -> dict:
    return {
        "name": name,
        "namespace": body["metadata"]["namespace"],
        "labels": MANAGED_BY | labels,
        "ownerReferences": [owner(body)],
    }


def nats_key(run: dict) -> str:
    """The run's name on NATS, for its pods (in the mounted spec) and the hub alike."""
    return launch.run_key(run["metadata"]["namespace"], run["metadata"]["name"])


def spec_config_map(run: dict) -> dict:
    """The run's spec as the pods read it: one source of truth for their settings."""
    name = run["metadata"]["name"]
    return {
        "apiVersion": "v1",
        "kind": "ConfigMap",
        "metadata": _meta(run, f"{name}-spec", {RUN_LABEL: name}),
        "data": {Path(launch.SPEC_FILE).name: launch.spec_document(nats_key(run), run["spec"])},
    }


def _template(labels: dict, pod: dict) -> dict:
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
            "prometheus.io/path": launch.METRICS_PATH,
        }
    return {"metadata": metadata, "spec": pod}


def _deployment(owner_body: dict, name: str, labels: dict, replicas: int, pod: dict) -> dict:
    return {
        "apiVersion": "apps/v1",
        "kind": "Deployment",
        "metadata": _meta(owner_body, name, labels),
        "spec": {
            "replicas": replicas,
            "selector": {"matchLabels": labels},
            "template": _template(labels, pod),
        },
    }


def _least_privilege(pod: dict, user: int, read_only_root: bool = True) -> dict:
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
    for container in pod["containers"]:
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


def _container(name: str, image: str, gpus: int, env: dict[str, str], workloads: Workloads) -> dict:
    """A component reading its run's mounted spec (`python -m ... --rlrun`), placed by
    the environment (`rlfleet.launch.Placement`), sized by the operator's config for its
    kind (`name`), serving its metrics on the `metrics` port."""
    port = workloads.metrics_port
    return {
        "name": name,
        "image": image,
        "args": ["--rlrun", launch.SPEC_FILE],
        "env": [
            *({"name": k, "value": v} for k, v in env.items()),
            {"name": launch.METRICS_PORT_ENV, "value": str(port)},
            {
                "name": launch.POD_NAME_ENV,
                "valueFrom": {"fieldRef": {"fieldPath": "metadata.name"}},
            },
        ],
        "ports": [{"name": METRICS_PORT_NAME, "containerPort": port}],
        "resources": _resources(workloads.resources[name], gpus),
        "volumeMounts": [{"name": "spec", "mountPath": launch.SPEC_DIR, "readOnly": True}],
    }


def _on_gpu_type(pod: dict, workloads: Workloads, gpu_type: str | None) -> dict:
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


def _with_nats(pod: dict, run: str, role: BusRole, minted: bool) -> dict:
    """Mounts the NATS user of the run's component `role`, if the hub `minted` users, and
    tells the component where it is: a pod can do with its own run's subjects and streams
    what its component does, nothing more (`rlfleet.bus.auth.role_access`)."""
    if not minted:
        return pod
    secret = {"secretName": launch.nats_credentials_secret(run, role)}
    pod["volumes"].append({"name": "nats", "secret": secret | {"defaultMode": CREDENTIALS_MODE}})
    container = pod["containers"][0]
    container["volumeMounts"].append(
        {"name": "nats", "mountPath": launch.NATS_CREDENTIALS_DIR, "readOnly": True}
    )
    path = f"{launch.NATS_CREDENTIALS_DIR}/{launch.NATS_CREDENTIALS_KEY}"
    container["env"].insert(0, {"name": CREDENTIALS_ENV, "value": path})
    return pod


def nats_user_secret(run: dict, role: BusRole, credentials: str, owned: bool) -> dict:
    """The NATS user (.creds text) of one of the run's components: owned by the run in
    the hub, so it goes with it; in a region, the hub deletes it with the mirror."""
    name = run["metadata"]["name"]
    meta = _meta(run, launch.nats_credentials_secret(name, role), {RUN_LABEL: name})
    if not owned:
        del meta["ownerReferences"]
    return {
        "apiVersion": "v1",
        "kind": "Secret",
        "metadata": meta,
        "type": "Opaque",
        "stringData": {launch.NATS_CREDENTIALS_KEY: credentials},
    }


def _with_model(pod: dict, spec: RLRunSpec) -> dict:
    """Mounts the model's claim, if the spec names one, where its file:// uri points."""
    claim = spec.model.volume_claim_name
    if claim is not None:
        pod["volumes"].append({"name": "model", "persistentVolumeClaim": {"claimName": claim}})
        pod["containers"][0]["volumeMounts"].append(
            {"name": "model", "mountPath": launch.model_dir(spec), "readOnly": True}
        )
    return pod


def _with_deepspeed(pod: dict, spec: RLRunSpec) -> dict:
    """Mounts the user's DeepSpeed settings, if the spec names a ConfigMap, where the
    trainer reads them (`launch.DEEPSPEED_CONFIG_FILE`). Only that key is projected: a
    ConfigMap without it leaves the pod unstarted with an event that says so."""
    config_map = spec.trainer.deep_speed_config_map
    if config_map is not None:
        key = launch.DEEPSPEED_KEY
        pod["volumes"].append(
            {
                "name": "deepspeed",
                "configMap": {"name": config_map, "items": [{"key": key, "path": key}]},
            }
        )
        pod["containers"][0]["volumeMounts"].append(
            {"name": "deepspeed", "mountPath": launch.DEEPSPEED_DIR, "readOnly": True}
        )
    return pod


def _nats_env(nats: NatsAccess | None) -> dict[str, str]:
    """The hub's NATS, for the trainer, the feed and the evaluator. Without the chart's
    `nats` they are told none, and stop saying so (`Placement.from_env`)."""
    if nats is None:
        return {}
    return {launch.NATS_URL_ENV: nats.url, launch.JETSTREAM_DOMAIN_ENV: nats.domain}


def _spec_volume(run: str) -> dict:
    return {"name": "spec", "configMap": {"name": f"{run}-spec"}}


def hub_objects(
    run: dict, images: Images, workloads: Workloads, nats: NatsAccess | None, held: bool = False
) -> list[dict]:
    """The run's spec, its trainer (StatefulSet with stable ranks, headless Service for
    rendezvous, PodDisruptionBudget, NetworkPolicy), its task feed and, with an evaluation
    gate, its evaluator. A suspended run, or one `held` (it failed its gate), keeps them
    at zero."""
    name = run["metadata"]["name"]
    spec = RLRunSpec.model_validate(run["spec"])
    stopped = spec.suspend or held
    labels = {RUN_LABEL: name, COMPONENT_LABEL: "trainer"}
    service = {
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": _meta(run, f"{name}-trainer", labels),
        "spec": {
            "clusterIP": "None",
            # Ranks meet before any is ready: rank 0's name resolves once its pod exists.
            "publishNotReadyAddresses": True,
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
    statefulset = _trainer(run, spec, images, workloads, nats, stopped, labels)
    network = trainer_network_policy(run, labels, workloads)
    objects = [spec_config_map(run), statefulset, service, budget, network]
    for component in launch.components_of(spec):
        if component not in (launch.TRAINER, launch.ROLLOUT):
            objects.append(
                _hub_component(run, spec, images, workloads, nats, component.name, stopped)
            )
    return objects


def trainer_network_policy(run: dict, labels: dict[str, str], workloads: Workloads) -> dict:
    """Who reaches the run's trainer pods (`labels`): the run's own ranks, on every port
    (the rendezvous, and those the collectives' backends pick at random), and the chart's
    metrics scrapers on the metrics port alone. No other pod, of another run or another
    namespace, reaches the rendezvous (a rank that joins it joins the job)."""
    ranks = {"podSelector": {"matchLabels": labels}}  # without a namespaceSelector: this one
    ingress: list[dict[str, Any]] = [{"from": [ranks]}]
    scrapers = [scraper.peer() for scraper in workloads.metrics_scrapers]
    if scrapers:
        metrics = {"protocol": "TCP", "port": workloads.metrics_port}
        ingress.append({"from": scrapers, "ports": [metrics]})
    return {
        "apiVersion": "networking.k8s.io/v1",
        "kind": "NetworkPolicy",
        "metadata": _meta(run, f"{run['metadata']['name']}-trainer", labels),
        "spec": {
            "podSelector": {"matchLabels": labels},
            "policyTypes": ["Ingress"],
            "ingress": ingress,
        },
    }


def _trainer(
    run: dict,
    spec: RLRunSpec,
    images: Images,
    workloads: Workloads,
    nats: NatsAccess | None,
    stopped: bool,
    labels: dict[str, str],
) -> dict:
    """The trainer's StatefulSet: its pods are the nodes of one DeepSpeed job, at zero
    while the run is stopped."""
    name = run["metadata"]["name"]
    container = _trainer_container(run, spec, images, workloads, nats)
    storage = spec.trainer.checkpoint_storage
    statefulset = {
        "apiVersion": "apps/v1",
        "kind": "StatefulSet",
        "metadata": _meta(run, f"{name}-trainer", labels),
        "spec": {
            "serviceName": f"{name}-trainer",
            "replicas": 0 if stopped else spec.trainer.replicas,
            "podManagementPolicy": "Parallel",  # ranks rendezvous; none waits for another
            "selector": {"matchLabels": labels},
            "template": _template(
                labels,
                _with_nats(
                    _with_model(
                        {
                            "containers": [container],
                            "volumes": [_spec_volume(name)]
                            + ([] if storage else [{"name": "state", "emptyDir": {}}]),
                            # A step in flight is finished, checkpointed and published on
                            # SIGTERM.
                            "terminationGracePeriodSeconds": 300,
                        },
                        spec,
                    ),
                    name,
                    BusRole.TRAINER,
                    mints_users(nats),
                ),
            ),
        },
    }
    pod = statefulset["spec"]["template"]["spec"]
    _with_deepspeed(pod, spec)
    _on_gpu_type(pod, workloads, spec.trainer.gpu_type)
    _least_privilege(pod, WORKLOAD_USER)
    if storage is not None:
        statefulset["spec"] |= _checkpoint_claims(storage, labels)
    return statefulset


def _trainer_container(
    run: dict, spec: RLRunSpec, images: Images, workloads: Workloads, nats: NatsAccess | None
) -> dict:
    """A trainer pod's container, told its place in the job (`launch.Placement.from_env`
    reads it into `Ranks`): its ordinal as node rank, the replicas as nodes, one process per
    GPU (one on a GPU-less trainer), and pod 0 through the headless Service as rank 0."""
    name, namespace = run["metadata"]["name"], run["metadata"]["namespace"]
    gpus = spec.trainer.gpus_per_replica
    ranks = {
        launch.TRAINER_NODES_ENV: str(spec.trainer.replicas),
        launch.TRAINER_PROCS_PER_NODE_ENV: str(max(gpus, 1)),
        launch.TRAINER_MASTER_ADDR_ENV: f"{name}-trainer-0.{name}-trainer.{namespace}.svc",
        launch.TRAINER_MASTER_PORT_ENV: str(TRAINER_PORT),
    }
    image = spec.trainer.image or images.trainer
    container = _container("trainer", image, gpus, _nats_env(nats) | ranks, workloads)
    index = {"fieldRef": {"fieldPath": f"metadata.labels['{POD_INDEX_LABEL}']"}}
    container["env"].append({"name": launch.TRAINER_NODE_RANK_ENV, "valueFrom": index})
    container["ports"].append({"name": "rendezvous", "containerPort": TRAINER_PORT})
    container["volumeMounts"].append({"name": "state", "mountPath": launch.STATE_DIR})
    return container


def _checkpoint_claims(storage: CheckpointStorage, labels: dict[str, str]) -> dict:
    """A claim per rank for its checkpoints, so a rank moved to another node resumes
    (without one, an emptyDir outlives only a restarted container). Scaling to zero (a
    suspended run) keeps the claims; deleting the run deletes them."""
    claim: dict = {
        "accessModes": ["ReadWriteOnce"],
        "resources": {"requests": {"storage": storage.size}},
    }
    if storage.storage_class_name:
        claim["storageClassName"] = storage.storage_class_name
    return {
        "volumeClaimTemplates": [{"metadata": {"name": "state", "labels": labels}, "spec": claim}],
        "persistentVolumeClaimRetentionPolicy": {"whenDeleted": "Delete", "whenScaled": "Retain"},
    }


def evaluator_name(run: str) -> str:
    return f"{run}-evaluator"


def _hub_component(
    run: dict,
    spec: RLRunSpec,
    images: Images,
    workloads: Workloads,
    nats: NatsAccess | None,
    component: str,
    stopped: bool,
) -> dict:
    """One pod of a component in the hub, never two at once (`Recreate`): the task feed
    (`rlfleet.rollout.feed`), which counts what it has queued against the trainer's
    staleness bound; the evaluator (`rlfleet.rollout.evaluator`), which reads the run's
    model; a production run's collector, whose cycles' trajectories would be made twice;
    its conductor (in the operator's image), whose orders would be given twice."""
    name = run["metadata"]["name"]
    labels = {RUN_LABEL: name, COMPONENT_LABEL: component}
    image = (spec.rollout.image if spec.rollout is not None else None) or images.rollout
    if component == launch.CONDUCTOR.name:
        image = images.operator
    container = _container(component, image, 0, _nats_env(nats), workloads)
    container["command"] = launch.COMPONENTS[component].command()
    pod = {"containers": [container], "volumes": [_spec_volume(name)]}
    if component == "evaluator":
        pod = _with_model(pod, spec)
    pod = _with_nats(pod, name, BusRole(component), mints_users(nats))
    pod = _least_privilege(pod, WORKLOAD_USER)
    deployment = _deployment(run, f"{name}-{component}", labels, 0 if stopped else 1, pod)
    deployment["spec"]["strategy"] = {"type": "Recreate"}
    return deployment


def mirror(run: dict, origin: str, nats: NatsAccess | None, held: bool = False) -> dict:
    """The copy of a hub RLRun a region's operator acts on (no ownerReference: the owner
    lives in another cluster; the hub deletes its mirrors itself). A `held` run's mirror
    is suspended, so the region gives its GPUs back."""
    meta = run["metadata"]
    spec = run["spec"] | {"suspend": True} if held else run["spec"]
    annotations = {ORIGIN_UID: meta["uid"]} | ({JETSTREAM_DOMAIN: nats.domain} if nats else {})
    if mints_users(nats):
        role = launch.region_role(RLRunSpec.model_validate(run["spec"]))
        annotations[NATS_USER] = launch.nats_credentials_secret(meta["name"], role)
    return {
        "apiVersion": API_VERSION,
        "kind": "RLRun",
        "metadata": {
            "name": meta["name"],
            "namespace": meta["namespace"],
            "labels": MANAGED_BY | {ORIGIN_LABEL: origin},
            "annotations": annotations,
        },
        "spec": spec,
    }


def rollout_name(run: str, pool: str) -> str:
    return f"{run}-rollout-{pool}"


def rollout_deployment(
    run: dict,
    pool: str,
    pool_spec: InferencePoolSpec,
    replicas: int,
    default_image: str,
    workloads: Workloads,
    region: str,
) -> dict:
    """The run's rollout workers on GPUs borrowed from one pool: one replica per lent
    serving replica, with as many GPUs. A worker stops taking tasks on SIGTERM and finishes
    its groups; past the pool's reclaim deadline it is killed."""
    name = run["metadata"]["name"]
    spec = RLRunSpec.model_validate(run["spec"])
    rollout = spec.rollout
    assert rollout is not None  # a production run asks no region for rollout GPUs
    labels = {RUN_LABEL: name, POOL_LABEL: pool, COMPONENT_LABEL: "rollout"}
    endpoints = {e.region: e.url for e in spec.weight_sync.endpoints}
    env = {launch.REGION_ENV: region, "RLFLEET_POOL": pool}
    if region in endpoints:
        env[launch.NATS_URL_ENV] = endpoints[region]
    domain = run["metadata"].get("annotations", {}).get(JETSTREAM_DOMAIN)
    if domain:
        env[launch.JETSTREAM_DOMAIN_ENV] = domain
    image = rollout.image or default_image
    container = _container("rollout", image, pool_spec.serving.gpus_per_replica, env, workloads)
    pod = _with_model(
        {
            "containers": [container],
            "volumes": [_spec_volume(name)],
            "terminationGracePeriodSeconds": pool_spec.reclaim_deadline_seconds,
        },
        spec,
    )
    # On the pool's own kind of GPU: the lent replicas' nodes, none of another type.
    pod = _on_gpu_type(pod, workloads, pool_spec.serving.gpu_type)
    minted = NATS_USER in run["metadata"].get("annotations", {})
    pod = _with_nats(pod, name, BusRole.ROLLOUT, minted)
    if rollout.env_pool:
        pod = _with_envpool(pod, run, rollout.env_pool)
    # Sandboxes are made by an EnvPool's servers, never here: the worker needs no privilege.
    pod = _least_privilege(pod, WORKLOAD_USER)
    return _deployment(run, rollout_name(name, pool), labels, replicas, pod)


def canary_name(deployment: str) -> str:
    return f"{deployment}-canary"


def canary_deployment(pool: dict, serving: dict, replicas: int) -> dict:
    """A pool's canary set (`lending.canary_set`): the serving Deployment's own pods, told
    to serve the canary set's version and labelled so, owned by the pool. Its pods still
    match the serving selector: a Service sends them their share of the requests, and the
    operator counts them as serving (they are never lent)."""
    spec = InferencePoolSpec.model_validate(pool["spec"])
    template = copy.deepcopy(serving["spec"]["template"])
    template["metadata"]["labels"] = template["metadata"].get("labels", {}) | {
        REPLICA_SET_LABEL: CANARY
    }
    for container in template["spec"]["containers"]:
        env = [e for e in container.get("env", []) if e["name"] != launch.REPLICA_SET_ENV]
        container["env"] = [*env, {"name": launch.REPLICA_SET_ENV, "value": CANARY}]
    selector = copy.deepcopy(serving["spec"]["selector"])
    selector["matchLabels"] = selector.get("matchLabels", {}) | {REPLICA_SET_LABEL: CANARY}
    labels = {POOL_LABEL: pool["metadata"]["name"], COMPONENT_LABEL: CANARY}
    return {
        "apiVersion": "apps/v1",
        "kind": "Deployment",
        "metadata": _meta(pool, canary_name(spec.serving.deployment_name), labels),
        "spec": {
            "replicas": replicas,
            "selector": selector,
            "template": template,
        },
    }


def pool_feedback(pool: dict, key: str) -> dict:
    """A pool's feedback Secret, owned by the pool: the `key` its servers sign feedback
    tokens with and the header its gateway names users in. Its serving pods mount it (the
    canary set's, copied from them, too) where `RLFLEET_FEEDBACK_DIR` says."""
    spec = InferencePoolSpec.model_validate(pool["spec"])
    name = pool["metadata"]["name"]
    values = {FEEDBACK_KEY_FILE: key, USER_HEADER_FILE: spec.serving.user_header}
    return {
        "apiVersion": "v1",
        "kind": "Secret",
        "metadata": _meta(pool, feedback_secret(name), {POOL_LABEL: name}),
        "type": "Opaque",
        "data": _secret_data(values),
    }


def envpool_url(namespace: str, envpool: str) -> str:
    """Where a run's rollout pods claim sandboxes: the EnvPool's Service."""
    return f"http://{envpool_service(envpool)}.{namespace}.svc:{ENVPOOL_PORT}"


def envpool_service(envpool: str) -> str:
    return f"{envpool}-sandbox"


def _with_envpool(pod: dict, run: dict, envpool: str) -> dict:
    """Tells the worker where its run's EnvPool is, and mounts the run's token for it."""
    secret = launch.envpool_token_secret(run["metadata"]["name"])
    pod["volumes"].append(
        {"name": "envpool", "secret": {"secretName": secret, "defaultMode": CREDENTIALS_MODE}}
    )
    container = pod["containers"][0]
    container["volumeMounts"].append(
        {"name": "envpool", "mountPath": launch.ENVPOOL_TOKEN_DIR, "readOnly": True}
    )
    url = envpool_url(run["metadata"]["namespace"], envpool)
    container["env"].insert(0, {"name": launch.ENVPOOL_URL_ENV, "value": url})
    return pod


def _secret_data(values: dict[str, str]) -> dict[str, str]:
    """A Secret's `data` (base64): what a server-side apply owns field by field, where
    `stringData` is only written through."""
    return {key: base64.b64encode(value.encode()).decode() for key, value in values.items()}


def envpool_token(run: dict, token: str) -> dict:
    """A run's bearer token for its EnvPool, beside its mirror (which owns it)."""
    name = run["metadata"]["name"]
    return {
        "apiVersion": "v1",
        "kind": "Secret",
        "metadata": _meta(run, launch.envpool_token_secret(name), {RUN_LABEL: name}),
        "type": "Opaque",
        "data": _secret_data({launch.ENVPOOL_TOKEN_KEY: token}),
    }


def envpool_server(spec: EnvPoolSpec) -> ServerConfig:
    """A sandbox pod's session server: `sessionsPerPod` sandboxes, each within the pool's
    limits, every free one kept warm, at the pod's own address (`$(POD_IP)`, which the
    kubelet fills in), its paths on the pod's emptyDirs."""
    limits = spec.limits
    return ServerConfig(
        tokens_file=f"{ENVPOOL_TOKENS_DIR}/{ENVPOOL_TOKENS_KEY}",
        host=None,  # every address, IPv4 and IPv6
        port=ENVPOOL_PORT,
        snapshots_dir=f"{ENVPOOL_STATE_DIR}/snapshots",
        mounts_dir=f"{ENVPOOL_STATE_DIR}/sandboxes",
        limits=Limits(
            cpu_seconds=math.ceil(float(parse_quantity(limits.cpu)) * limits.timeout_seconds),
            memory_bytes=int(parse_quantity(limits.memory)),
            disk_bytes=int(parse_quantity(limits.ephemeral_storage)),
            wall_seconds=float(limits.timeout_seconds),
        ),
        max_sessions=spec.sessions_per_pod,
        warm=spec.sessions_per_pod,
        advertise=f"http://$({POD_IP_ENV}):{ENVPOOL_PORT}",
        sandbox_python=ENVPOOL_PYTHON,
    )


def _times(quantity: str, n: int) -> str:
    return str(parse_quantity(quantity) * n)


def envpool_objects(
    envpool: dict, replicas: int, tokens: dict[str, str], operator_namespace: str
) -> list[dict]:
    """The session servers (a Deployment of `replicas` pods), the Service rollout workers
    claim through, the runs' tokens (a Secret: run -> token), and a NetworkPolicy: in, only
    the rollout pods of those runs and the region operator's pods; out, nothing unless the
    pool allows egress."""
    name = envpool["metadata"]["name"]
    spec = EnvPoolSpec.model_validate(envpool["spec"])
    labels = {ENVPOOL_LABEL: name, COMPONENT_LABEL: "sandbox"}
    port = {"name": ENVPOOL_PORT_NAME, "port": ENVPOOL_PORT, "targetPort": ENVPOOL_PORT_NAME}
    service = {
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": _meta(envpool, envpool_service(name), labels),
        "spec": {"selector": labels, "ports": [port]},
    }
    secret = {
        "apiVersion": "v1",
        "kind": "Secret",
        "metadata": _meta(envpool, envpool_tokens_secret(name), labels),
        "type": "Opaque",
        "data": _secret_data({ENVPOOL_TOKENS_KEY: json.dumps(tokens, sort_keys=True)}),
    }
    network = {
        "apiVersion": "networking.k8s.io/v1",
        "kind": "NetworkPolicy",
        "metadata": _meta(envpool, envpool_service(name), labels),
        "spec": _envpool_policy(spec, labels, sorted(tokens), operator_namespace),
    }
    pod = _envpool_pod(spec, name)
    return [
        secret,
        _deployment(envpool, envpool_service(name), labels, replicas, pod),
        service,
        network,
    ]


def _envpool_pod(spec: EnvPoolSpec, name: str) -> dict:
    """One session server: root, to make each sandbox's namespaces, mounts and uid, which
    is sound only in the VM of the pool's runtimeClass (required), whose kernel is the
    pod's alone; no ServiceAccount token; a read-only root, its state on emptyDirs."""
    per = spec.sessions_per_pod
    size = {
        "cpu": _times(spec.limits.cpu, per),
        "memory": _times(spec.limits.memory, per),
        "ephemeral-storage": _times(spec.limits.ephemeral_storage, per),
    }
    server = json.dumps(msgspec.to_builtins(envpool_server(spec)), sort_keys=True)
    probe = {"httpGet": {"path": "/healthz", "port": ENVPOOL_PORT_NAME}, "periodSeconds": 5}
    container = {
        "name": "sandbox",
        "image": spec.template.image,
        "command": ["python", "-I", ENVPOOL_SERVER, server],
        "env": [{"name": POD_IP_ENV, "valueFrom": {"fieldRef": {"fieldPath": "status.podIP"}}}],
        "ports": [{"name": ENVPOOL_PORT_NAME, "containerPort": ENVPOOL_PORT}],
        "readinessProbe": probe,
        "livenessProbe": probe | {"periodSeconds": 20, "failureThreshold": 6},
        "resources": {"limits": size, "requests": size},
        "volumeMounts": [
            {"name": "tokens", "mountPath": ENVPOOL_TOKENS_DIR, "readOnly": True},
            {"name": "state", "mountPath": ENVPOOL_STATE_DIR},
            {"name": "tmp", "mountPath": "/tmp"},
        ],
        "securityContext": {
            "runAsUser": 0,
            "runAsNonRoot": False,
            "allowPrivilegeEscalation": False,
            "readOnlyRootFilesystem": True,
            "capabilities": {"drop": ["ALL"], "add": SANDBOX_CAPABILITIES},
        },
    }
    # Root's alone: a sandbox's uid must not read any run's token.
    tokens = {"secretName": envpool_tokens_secret(name), "defaultMode": 0o400}
    return {
        "enableServiceLinks": False,
        "automountServiceAccountToken": False,
        "runtimeClassName": spec.template.runtime_class_name,
        "containers": [container],
        "securityContext": {"seccompProfile": {"type": "RuntimeDefault"}},
        "volumes": [
            {"name": "tokens", "secret": tokens},
            {"name": "state", "emptyDir": {}},
            {"name": "tmp", "emptyDir": {}},
        ],
    }


def _envpool_policy(
    spec: EnvPoolSpec, labels: dict[str, str], runs: list[str], operator_namespace: str
) -> dict:
    """In: the rollout pods of `runs` (those that name the pool) in its namespace, and the
    region operator's own pods (which read each server's /healthz to size the pool), on
    the server's port alone; the kubelet's probes come from the pod's node, which a
    NetworkPolicy always lets in. Out: nothing, unless the pool allows egress."""
    callers = [
        {
            "podSelector": {
                "matchLabels": {COMPONENT_LABEL: "rollout"},
                "matchExpressions": [{"key": RUN_LABEL, "operator": "In", "values": runs}],
            }
        }
    ]
    prober = {
        "namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": operator_namespace}},
        "podSelector": {"matchLabels": REGION_OPERATOR_LABELS},
    }
    policy: dict[str, Any] = {
        "podSelector": {"matchLabels": labels},
        "policyTypes": ["Ingress"],
        "ingress": [
            {"from": [*(callers if runs else []), prober], "ports": [{"port": ENVPOOL_PORT}]}
        ],
    }
    if spec.network.egress == "Deny":
        policy |= {"policyTypes": ["Ingress", "Egress"], "egress": []}
    return policy


def envpool_tokens_secret(envpool: str) -> str:
    return f"{envpool}-sandbox-tokens"

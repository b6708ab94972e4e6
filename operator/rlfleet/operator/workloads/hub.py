"""The objects an RLRun becomes in the hub, and its mirror for each region (pure).

In the hub a run is its trainer (a StatefulSet of DeepSpeed ranks, their headless Service,
PodDisruptionBudget and NetworkPolicy), its task feed and, with an evaluation gate, its
evaluator; a production run adds its collector and conductor. Each of its components
logs in to NATS as its own user, whose Secret is built here too. A region gets none of
these: it gets the run's mirror, which its own operator turns into rollout workers
(`rollout`).
"""

from __future__ import annotations

from typing import Any

from rlfleet.api.meta import API_VERSION, COMPONENT_LABEL, RUN_LABEL
from rlfleet.api.rlrun import CheckpointStorage, RLRunSpec
from rlfleet.api.taskdata import MOUNT_DIR
from rlfleet.api.wire import BusRole
from rlfleet.launch import components, pods
from rlfleet.launch.settings import Ranks
from rlfleet.operator.config import Images, NatsAccess, Workloads
from rlfleet.operator.workloads.common import (
    JETSTREAM_DOMAIN,
    MANAGED_BY,
    NATS_USER,
    ORIGIN_LABEL,
    ORIGIN_UID,
    WORKLOAD_USER,
    component_container,
    least_privilege,
    mints_users,
    object_meta,
    on_gpu_type,
    owned_deployment,
    pod_template,
    secret_env,
    spec_config_map,
    spec_volume,
    with_model,
    with_nats,
)

TRAINER_PORT = Ranks().master_port  # torch.distributed rendezvous, on rank 0's pod
# The StatefulSet controller labels each pod with its ordinal: the pod's node rank.
POD_INDEX_LABEL = "apps.kubernetes.io/pod-index"


def nats_user_secret(run: dict, role: BusRole, credentials: str, owned: bool) -> dict:
    """The NATS user (.creds text) of one of the run's components: owned by the run in
    the hub, so it goes with it; in a region, the hub deletes it with the mirror."""
    name = run["metadata"]["name"]
    meta = object_meta(run, pods.nats_credentials_secret(name, role), {RUN_LABEL: name})
    if not owned:
        del meta["ownerReferences"]
    return {
        "apiVersion": "v1",
        "kind": "Secret",
        "metadata": meta,
        "type": "Opaque",
        "stringData": {pods.NATS_CREDENTIALS_KEY: credentials},
    }


def _with_deepspeed(pod: dict, spec: RLRunSpec) -> dict:
    """Mounts the user's DeepSpeed settings, if the spec names a ConfigMap, where the
    trainer reads them (`pods.DEEPSPEED_CONFIG_FILE`). Only that key is projected: a
    ConfigMap without it leaves the pod unstarted with an event that says so."""
    config_map = spec.trainer.deep_speed_config_map
    if config_map is not None:
        key = pods.DEEPSPEED_KEY
        pod["volumes"].append(
            {
                "name": "deepspeed",
                "configMap": {"name": config_map, "items": [{"key": key, "path": key}]},
            }
        )
        pod["containers"][0]["volumeMounts"].append(
            {"name": "deepspeed", "mountPath": pods.DEEPSPEED_DIR, "readOnly": True}
        )
    return pod


def _nats_env(nats: NatsAccess | None) -> dict[str, str]:
    """The hub's NATS, for the trainer, the feed and the evaluator. Without the chart's
    `nats` they are told none, and stop saying so (`Placement.from_env`)."""
    if nats is None:
        return {}
    return {pods.NATS_URL_ENV: nats.url, pods.JETSTREAM_DOMAIN_ENV: nats.domain}


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
        "metadata": object_meta(run, f"{name}-trainer", labels),
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
        "metadata": object_meta(run, f"{name}-trainer", labels),
        # Losing one rank stops the step for all: voluntary evictions wait for the run.
        "spec": {"maxUnavailable": 0, "selector": {"matchLabels": labels}},
    }
    statefulset = _trainer(run, spec, images, workloads, nats, stopped, labels)
    network = trainer_network_policy(run, labels, workloads)
    objects = [spec_config_map(run), statefulset, service, budget, network]
    for component in components.components_of(spec):
        if component not in (components.TRAINER, components.ROLLOUT):
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
        "metadata": object_meta(run, f"{run['metadata']['name']}-trainer", labels),
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
        "metadata": object_meta(run, f"{name}-trainer", labels),
        "spec": {
            "serviceName": f"{name}-trainer",
            "replicas": 0 if stopped else spec.trainer.replicas,
            "podManagementPolicy": "Parallel",  # ranks rendezvous; none waits for another
            "selector": {"matchLabels": labels},
            "template": pod_template(
                labels,
                with_nats(
                    with_model(
                        {
                            "containers": [container],
                            "volumes": [spec_volume(name)]
                            + ([] if storage else [{"name": "state", "emptyDir": {}}]),
                            # A step in flight is finished, checkpointed and published on
                            # SIGTERM.
                            "terminationGracePeriodSeconds": 300,
                        },
                        spec,
                        workloads,
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
    on_gpu_type(pod, workloads, spec.trainer.gpu_type)
    least_privilege(pod, WORKLOAD_USER)
    if storage is not None:
        statefulset["spec"] |= _checkpoint_claims(storage, labels)
    return statefulset


# The keys of `spec.tracking.mlflow.credentialsSecret`, as MLflow's clients name them: a
# token, or a user and password.
TRACKING_CREDENTIALS = dict.fromkeys(
    ["MLFLOW_TRACKING_TOKEN", "MLFLOW_TRACKING_USERNAME", "MLFLOW_TRACKING_PASSWORD"], True
)


def _trainer_container(
    run: dict, spec: RLRunSpec, images: Images, workloads: Workloads, nats: NatsAccess | None
) -> dict:
    """A trainer pod's container, told its place in the job (`pods.Placement.from_env`
    reads it into `Ranks`): its ordinal as node rank, the replicas as nodes, one process per
    GPU (one on a GPU-less trainer), and pod 0 through the headless Service as rank 0."""
    name, namespace = run["metadata"]["name"], run["metadata"]["namespace"]
    gpus = spec.trainer.gpus_per_replica
    ranks = {
        pods.TRAINER_NODES_ENV: str(spec.trainer.replicas),
        pods.TRAINER_PROCS_PER_NODE_ENV: str(max(gpus, 1)),
        pods.TRAINER_MASTER_ADDR_ENV: f"{name}-trainer-0.{name}-trainer.{namespace}.svc",
        pods.TRAINER_MASTER_PORT_ENV: str(TRAINER_PORT),
    }
    image = spec.trainer.image or images.trainer
    container = component_container("trainer", image, gpus, _nats_env(nats) | ranks, workloads)
    index = {"fieldRef": {"fieldPath": f"metadata.labels['{POD_INDEX_LABEL}']"}}
    container["env"].append({"name": pods.TRAINER_NODE_RANK_ENV, "valueFrom": index})
    container["ports"].append({"name": "rendezvous", "containerPort": TRAINER_PORT})
    container["volumeMounts"].append({"name": "state", "mountPath": pods.STATE_DIR})
    tracking = spec.tracking.mlflow if spec.tracking is not None else None
    if tracking is not None and tracking.credentials_secret is not None:
        container["env"] += secret_env(tracking.credentials_secret, TRACKING_CREDENTIALS)
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
    (`rlfleet.rollout.taskfeed.feed`), which counts what it has queued against the trainer's
    staleness bound; the evaluator (`rlfleet.rollout.evaluation.evaluator`), which reads the run's
    model; a production run's collector, whose cycles' trajectories would be made twice;
    its conductor (in the operator's image), whose orders would be given twice."""
    name = run["metadata"]["name"]
    labels = {RUN_LABEL: name, COMPONENT_LABEL: component}
    image = (spec.rollout.image if spec.rollout is not None else None) or images.rollout
    if component == components.CONDUCTOR.name:
        image = images.operator
    container = component_container(component, image, 0, _nats_env(nats), workloads)
    container["command"] = components.COMPONENTS[component].command()
    pod = {"containers": [container], "volumes": [spec_volume(name)]}
    if component == "evaluator":
        pod = with_model(pod, spec, workloads)
    if component == components.FEED.name:
        pod = with_task_data(pod, spec)
    pod = with_nats(pod, name, BusRole(component), mints_users(nats))
    pod = least_privilege(pod, WORKLOAD_USER)
    deployment = owned_deployment(run, f"{name}-{component}", labels, 0 if stopped else 1, pod)
    deployment["spec"]["strategy"] = {"type": "Recreate"}
    return deployment


def with_task_data(pod: dict, spec: RLRunSpec) -> dict:
    """Mounts the volume of the run's own task data, read-only, where the feed reads it."""
    source = spec.rollout.tasks if spec.rollout is not None else None
    if source is None or source.volume is None:
        return pod
    if source.volume.persistent_volume_claim is not None:
        volume = {"persistentVolumeClaim": {"claimName": source.volume.persistent_volume_claim}}
    else:
        volume = {"configMap": {"name": source.volume.config_map}}
    pod["volumes"].append({"name": "tasks"} | volume)
    pod["containers"][0]["volumeMounts"].append(
        {"name": "tasks", "mountPath": MOUNT_DIR, "readOnly": True}
    )
    return pod


def mirror(run: dict, origin: str, nats: NatsAccess | None, held: bool = False) -> dict:
    """The copy of a hub RLRun a region's operator acts on (no ownerReference: the owner
    lives in another cluster; the hub deletes its mirrors itself). A `held` run's mirror
    is suspended, so the region gives its GPUs back."""
    meta = run["metadata"]
    spec = run["spec"] | {"suspend": True} if held else run["spec"]
    annotations = {ORIGIN_UID: meta["uid"]} | ({JETSTREAM_DOMAIN: nats.domain} if nats else {})
    if mints_users(nats):
        role = components.region_role(RLRunSpec.model_validate(run["spec"]))
        annotations[NATS_USER] = pods.nats_credentials_secret(meta["name"], role)
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

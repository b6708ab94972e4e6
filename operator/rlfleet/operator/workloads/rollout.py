"""A run's rollout workers in a region, on GPUs an InferencePool lends it (pure).

One Deployment per run and pool, one replica per lent serving replica with as many GPUs,
placed on the pool's kind of GPU. The workers read the run's mirror (its spec, and the
hub's JetStream domain and NATS user in its annotations) and, when the run names an
EnvPool, claim sandboxes there with the run's token, a Secret beside the mirror.
"""

from __future__ import annotations

from rlfleet.api.inferencepool import InferencePoolSpec
from rlfleet.api.meta import COMPONENT_LABEL, RUN_LABEL
from rlfleet.api.rlrun import RLRunSpec
from rlfleet.api.wire import BusRole
from rlfleet.launch import pods
from rlfleet.operator.config import Workloads
from rlfleet.operator.workloads.common import (
    CREDENTIALS_MODE,
    JETSTREAM_DOMAIN,
    NATS_USER,
    POOL_LABEL,
    WORKLOAD_USER,
    component_container,
    least_privilege,
    object_meta,
    on_gpu_type,
    owned_deployment,
    secret_data,
    spec_volume,
    with_model,
    with_nats,
)
from rlfleet.operator.workloads.envpool import envpool_url


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
    env = {pods.REGION_ENV: region, "RLFLEET_POOL": pool}
    if region in endpoints:
        env[pods.NATS_URL_ENV] = endpoints[region]
    domain = run["metadata"].get("annotations", {}).get(JETSTREAM_DOMAIN)
    if domain:
        env[pods.JETSTREAM_DOMAIN_ENV] = domain
    image = rollout.image or default_image
    container = component_container(
        "rollout", image, pool_spec.serving.gpus_per_replica, env, workloads
    )
    pod = with_model(
        {
            "containers": [container],
            "volumes": [spec_volume(name)],
            "terminationGracePeriodSeconds": pool_spec.reclaim_deadline_seconds,
        },
        spec,
        workloads,
    )
    # On the pool's own kind of GPU: the lent replicas' nodes, none of another type.
    pod = on_gpu_type(pod, workloads, pool_spec.serving.gpu_type)
    minted = NATS_USER in run["metadata"].get("annotations", {})
    pod = with_nats(pod, name, BusRole.ROLLOUT, minted)
    if rollout.env_pool:
        pod = _with_envpool(pod, run, rollout.env_pool)
    # Sandboxes are made by an EnvPool's servers, never here: the worker needs no privilege.
    pod = least_privilege(pod, WORKLOAD_USER)
    return owned_deployment(run, rollout_name(name, pool), labels, replicas, pod)


def _with_envpool(pod: dict, run: dict, envpool: str) -> dict:
    """Tells the worker where its run's EnvPool is, and mounts the run's token for it."""
    secret = pods.envpool_token_secret(run["metadata"]["name"])
    pod["volumes"].append(
        {"name": "envpool", "secret": {"secretName": secret, "defaultMode": CREDENTIALS_MODE}}
    )
    container = pod["containers"][0]
    container["volumeMounts"].append(
        {"name": "envpool", "mountPath": pods.ENVPOOL_TOKEN_DIR, "readOnly": True}
    )
    url = envpool_url(run["metadata"]["namespace"], envpool)
    container["env"].insert(0, {"name": pods.ENVPOOL_URL_ENV, "value": url})
    return pod


def envpool_token(run: dict, token: str) -> dict:
    """A run's bearer token for its EnvPool, beside its mirror (which owns it)."""
    name = run["metadata"]["name"]
    return {
        "apiVersion": "v1",
        "kind": "Secret",
        "metadata": object_meta(run, pods.envpool_token_secret(name), {RUN_LABEL: name}),
        "type": "Opaque",
        "data": secret_data({pods.ENVPOOL_TOKEN_KEY: token}),
    }

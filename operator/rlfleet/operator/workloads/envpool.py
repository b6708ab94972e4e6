"""An EnvPool's objects: its session servers, the Service rollout workers claim sandboxes
through, the runs' tokens and the NetworkPolicy around them (pure).

How many servers a pool runs is decided elsewhere (`rlfleet.operator.envpools`); this
module only builds them. A session server runs as root with the capabilities it makes
sandboxes with, which is sound only inside the VM of the pool's runtimeClass.
"""

from __future__ import annotations

import json
import math
from typing import Any

import msgspec
from kubernetes.utils.quantity import parse_quantity

from rlfleet.api.envpool import EnvPoolSpec
from rlfleet.api.meta import COMPONENT_LABEL, ENVPOOL_LABEL, RUN_LABEL
from rlfleet.launch.settings import ENVPOOL_SERVER, Limits, ServerConfig
from rlfleet.operator.workloads.common import object_meta, owned_deployment, secret_data

# An EnvPool's pods: the session server (images/env-sandbox.Dockerfile) and where it keeps
# its state, the runs' tokens, the port it serves and probes on, and the capabilities it
# makes sandboxes with: namespaces and mounts, each sandbox's uid, its tree's owner, and
# killing what a sandbox left.
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


def envpool_url(namespace: str, envpool: str) -> str:
    """Where a run's rollout pods claim sandboxes: the EnvPool's Service."""
    return f"http://{envpool_service(envpool)}.{namespace}.svc:{ENVPOOL_PORT}"


def envpool_service(envpool: str) -> str:
    return f"{envpool}-sandbox"


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
        "metadata": object_meta(envpool, envpool_service(name), labels),
        "spec": {"selector": labels, "ports": [port]},
    }
    secret = {
        "apiVersion": "v1",
        "kind": "Secret",
        "metadata": object_meta(envpool, envpool_tokens_secret(name), labels),
        "type": "Opaque",
        "data": secret_data({ENVPOOL_TOKENS_KEY: json.dumps(tokens, sort_keys=True)}),
    }
    network = {
        "apiVersion": "networking.k8s.io/v1",
        "kind": "NetworkPolicy",
        "metadata": object_meta(envpool, envpool_service(name), labels),
        "spec": _envpool_policy(spec, labels, sorted(tokens), operator_namespace),
    }
    pod = _envpool_pod(spec, name)
    return [
        secret,
        owned_deployment(envpool, envpool_service(name), labels, replicas, pod),
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
        "command": ["python", "-I", "-m", ENVPOOL_SERVER, server],
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

"""Real Kubernetes clusters on one machine: one shared etcd (a key prefix per cluster) and,
per cluster, kube-apiserver, kube-controller-manager, kube-scheduler and kwok, whose fake
nodes advertise nvidia.com/gpu and name their GPU type."""

from __future__ import annotations

import base64
import functools
import json
import ssl
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import yaml

from rlfleet.api.meta import GPU_RESOURCE, GPU_TYPE_LABEL
from rlfleet.local.binaries import binary
from rlfleet.local.files import write_secret
from rlfleet.local.processes import Supervisor, free_port
from rlfleet.testbed.pki import Pki

GPU = GPU_RESOURCE
REGION_LABEL = "rlfleet.io/region"
KWOK_SELECTOR = ("type", "kwok")
SERVICE_CIDR = "10.96.0.0/16"


def pod_cidr(index: int) -> str:
    """The pod IPs kwok gives cluster `index`'s pods: loopback addresses, each cluster its
    own, so a process standing in for a pod (an EnvPool's server, `sandboxes.py`) listens
    at the pod's own IP, where the operator and the other pods reach it."""
    return f"127.{100 + index}.0.0/16"


# Two GPU generations, as NVIDIA's feature discovery names them on GPU_TYPE_LABEL: the
# hub trains on the first; a region serves on both, alternating node by node.
H100 = "NVIDIA-H100-80GB-HBM3"
L4 = "NVIDIA-L4"


@dataclass(frozen=True)
class ClusterSpec:
    name: str
    nodes: int
    gpus_per_node: int
    region: str
    gpu_types: tuple[str, ...] = (H100,)  # node i has gpu_types[i % len(gpu_types)]


DEFAULT_CLUSTERS = (
    ClusterSpec("hub", nodes=2, gpus_per_node=8, region="hub"),
    ClusterSpec("region-a", nodes=4, gpus_per_node=8, region="region-a", gpu_types=(H100, L4)),
    ClusterSpec("region-b", nodes=4, gpus_per_node=8, region="region-b", gpu_types=(H100, L4)),
    ClusterSpec("region-c", nodes=4, gpus_per_node=8, region="region-c", gpu_types=(H100, L4)),
)


@dataclass
class Cluster:
    spec: ClusterSpec
    server: str
    kubeconfig: Path

    @property
    def name(self) -> str:
        return self.spec.name


@dataclass
class KubeBed:
    """The clusters of a started bed, and the kubeconfig with a context for each."""

    clusters: dict[str, Cluster]
    merged_kubeconfig: Path


def kubeconfig(clusters: list[Cluster], pki: Pki, current: str) -> dict:
    ca_data = base64.b64encode(pki.ca_cert.read_bytes()).decode()
    return {
        "apiVersion": "v1",
        "kind": "Config",
        "clusters": [
            {"name": c.name, "cluster": {"server": c.server, "certificate-authority-data": ca_data}}
            for c in clusters
        ],
        "users": [{"name": "admin", "user": {"token": pki.admin_token}}],
        "contexts": [
            {"name": c.name, "context": {"cluster": c.name, "user": "admin"}} for c in clusters
        ],
        "current-context": current,
    }


@functools.cache
def _tls(ca_cert: Path) -> ssl.SSLContext:
    return ssl.create_default_context(cafile=str(ca_cert))


def _call(
    cluster: Cluster, pki: Pki, path: str, method: str = "GET", body: dict | None = None
) -> bytes:
    """One authenticated request to a cluster's API server; HTTP errors raise."""
    request = urllib.request.Request(
        cluster.server + path,
        method=method,
        data=json.dumps(body).encode() if body is not None else None,
        headers={"Authorization": f"Bearer {pki.admin_token}", "Content-Type": "application/json"},
    )
    with urllib.request.urlopen(request, context=_tls(pki.ca_cert), timeout=10) as response:
        return response.read()


def _http_ok(url: str) -> bool:
    with urllib.request.urlopen(url, timeout=2) as response:
        return response.status == 200


def start_etcd(supervisor: Supervisor, data_dir: Path) -> str:
    client, peer = free_port(), free_port()
    supervisor.start(
        "etcd",
        [
            binary("etcd"),
            f"--data-dir={data_dir}",
            f"--listen-client-urls=http://127.0.0.1:{client}",
            f"--advertise-client-urls=http://127.0.0.1:{client}",
            f"--listen-peer-urls=http://127.0.0.1:{peer}",
            f"--initial-advertise-peer-urls=http://127.0.0.1:{peer}",
            f"--initial-cluster=default=http://127.0.0.1:{peer}",
            "--unsafe-no-fsync",  # a throwaway test store: durability buys nothing here
            "--quota-backend-bytes=2147483648",
            "--log-level=warn",
        ],
    )
    url = f"http://127.0.0.1:{client}"
    supervisor.wait_until("etcd", lambda: _http_ok(f"{url}/health"), 60)
    return url


# ServiceAccounts' requests, at Metadata level (who, which verb, which object; never a
# body, so no Secret's data), and nothing else: the tests' own admin calls and the
# controllers' are not the operators'.
AUDIT_POLICY = {
    "apiVersion": "audit.k8s.io/v1",
    "kind": "Policy",
    "omitStages": ["RequestReceived"],
    "rules": [
        {"level": "Metadata", "userGroups": ["system:serviceaccounts"]},
        {"level": "None"},
    ],
}


def audit_log(log_dir: Path, cluster: str) -> Path:
    """Where a bed cluster's API server writes its audit log (`AUDIT_POLICY`); the parts
    it rotates out sit beside it as `<cluster>-audit-<time>.log`."""
    return log_dir / f"{cluster}-audit.log"


def _start_apiserver(
    spec: ClusterSpec, supervisor: Supervisor, etcd: str, pki: Pki, tokens: Path, state: Path
) -> Cluster:
    port = free_port()
    audit_policy = state / "audit-policy.yaml"
    audit_policy.write_text(yaml.safe_dump(AUDIT_POLICY))
    supervisor.start(
        f"{spec.name}-kube-apiserver",
        [
            binary("kube-apiserver"),
            f"--etcd-servers={etcd}",
            f"--etcd-prefix=/registry/{spec.name}",
            "--bind-address=127.0.0.1",
            "--advertise-address=127.0.0.1",
            f"--secure-port={port}",
            f"--tls-cert-file={pki.serving_cert}",
            f"--tls-private-key-file={pki.serving_key}",
            f"--token-auth-file={tokens}",
            "--authorization-mode=RBAC",
            "--service-account-issuer=https://kubernetes.default.svc",
            f"--service-account-key-file={pki.service_account_pub}",
            f"--service-account-signing-key-file={pki.service_account_key}",
            f"--service-cluster-ip-range={SERVICE_CIDR}",
            "--allow-privileged=true",
            "--profiling=false",
            "--enable-priority-and-fairness=false",
            # What the operators' accounts do, to show each RBAC rule is used (`testbed.rbac`).
            f"--audit-policy-file={audit_policy}",
            f"--audit-log-path={audit_log(supervisor.log_dir, spec.name)}",
            "--audit-log-format=json",
            "--audit-log-mode=batch",
            "--audit-log-batch-max-wait=1s",
            "--audit-log-maxsize=256",
            "--audit-log-maxbackup=20",
            "--v=0",
        ],
    )
    return Cluster(spec, f"https://127.0.0.1:{port}", state / f"{spec.name}.kubeconfig")


def _start_cluster_controllers(
    cluster: Cluster, supervisor: Supervisor, pki: Pki, pods: str
) -> None:
    kc = str(cluster.kubeconfig)
    supervisor.start(
        f"{cluster.name}-kube-controller-manager",
        [
            binary("kube-controller-manager"),
            f"--kubeconfig={kc}",
            "--leader-elect=false",
            "--secure-port=0",
            f"--service-account-private-key-file={pki.service_account_key}",
            f"--root-ca-file={pki.ca_cert}",
            "--use-service-account-credentials=false",
            "--concurrent-gc-syncs=5",
            "--v=0",
        ],
    )
    supervisor.start(
        f"{cluster.name}-kube-scheduler",
        [
            binary("kube-scheduler"),
            f"--kubeconfig={kc}",
            "--leader-elect=false",
            "--secure-port=0",
            "--v=0",
        ],
    )
    key, value = KWOK_SELECTOR
    supervisor.start(
        f"{cluster.name}-kwok",
        [
            binary("kwok"),
            f"--kubeconfig={kc}",
            f"--config={binary('kwok-stages.yaml', executable=False)}",
            "--manage-all-nodes=false",
            f"--manage-nodes-with-label-selector={key}={value}",
            f"--server-address=127.0.0.1:{free_port()}",
            f"--cidr={pods}",
            "--node-lease-duration-seconds=40",
        ],
    )


def node_manifest(spec: ClusterSpec, index: int) -> dict:
    name = f"{spec.name}-gpu-{index}"
    key, value = KWOK_SELECTOR
    capacity = {
        "cpu": "96",
        "memory": "1024Gi",
        "ephemeral-storage": "2Ti",
        "pods": "110",
        GPU: str(spec.gpus_per_node),
    }
    return {
        "apiVersion": "v1",
        "kind": "Node",
        "metadata": {
            "name": name,
            "annotations": {"node.alpha.kubernetes.io/ttl": "0", "kwok.x-k8s.io/node": "fake"},
            "labels": {
                key: value,
                REGION_LABEL: spec.region,
                "kubernetes.io/hostname": name,
                "kubernetes.io/os": "linux",
                "kubernetes.io/arch": "amd64",
                "nvidia.com/gpu.present": "true",
                GPU_TYPE_LABEL: spec.gpu_types[index % len(spec.gpu_types)],
            },
        },
        "status": {"capacity": capacity, "allocatable": capacity},
    }


def _nodes_ready(cluster: Cluster, pki: Pki) -> bool:
    nodes = json.loads(_call(cluster, pki, "/api/v1/nodes"))["items"]
    ready = [
        n
        for n in nodes
        if any(
            c["type"] == "Ready" and c["status"] == "True"
            for c in n["status"].get("conditions", [])
        )
    ]
    return len(ready) == cluster.spec.nodes


def _default_service_account(cluster: Cluster, pki: Pki) -> bool:
    # Pods are admitted only once the controller-manager made the namespace's ServiceAccount;
    # until then the GET answers 404, which raises.
    return bool(_call(cluster, pki, "/api/v1/namespaces/default/serviceaccounts/default"))


def start_clusters(
    specs: tuple[ClusterSpec, ...], supervisor: Supervisor, etcd: str, pki: Pki, state: Path
) -> KubeBed:
    tokens = state / "tokens.csv"
    write_secret(tokens, f'{pki.admin_token},admin,admin,"system:masters"\n')
    clusters = [_start_apiserver(spec, supervisor, etcd, pki, tokens, state) for spec in specs]
    for cluster in clusters:
        write_secret(cluster.kubeconfig, yaml.safe_dump(kubeconfig([cluster], pki, cluster.name)))
    bed = KubeBed({c.name: c for c in clusters}, state / "kubeconfig")
    write_secret(bed.merged_kubeconfig, yaml.safe_dump(kubeconfig(clusters, pki, clusters[0].name)))
    for cluster in clusters:
        supervisor.wait_until(
            f"{cluster.name} kube-apiserver", lambda c=cluster: bool(_call(c, pki, "/readyz")), 180
        )
    for index, cluster in enumerate(clusters):
        _start_cluster_controllers(cluster, supervisor, pki, pod_cidr(index))

    def add_nodes(cluster: Cluster) -> None:
        for index in range(cluster.spec.nodes):
            manifest = node_manifest(cluster.spec, index)
            _call(cluster, pki, "/api/v1/nodes", "POST", manifest)

    with ThreadPoolExecutor(len(clusters)) as pool:
        list(pool.map(add_nodes, clusters))
    for cluster in clusters:
        supervisor.wait_until(f"{cluster.name} nodes", lambda c=cluster: _nodes_ready(c, pki), 120)
        supervisor.wait_until(
            f"{cluster.name} default ServiceAccount",
            lambda c=cluster: _default_service_account(c, pki),
            120,
        )
    return bed

"""The operator on the bed: the Helm chart installed in each cluster with the real helm
binary, and the operator run as a local process per cluster, with the chart's config
and the chart's ServiceAccount token, so its RBAC is the one users get.

The hub reaches each region through a kubeconfig Secret for the region's `hub` account;
its server is a `Link`, a TCP relay the tests can cut to take a region off the network.
"""

from __future__ import annotations

import json
import socket
import subprocess
import sys
import threading
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import kubernetes
import yaml

from rlfleet.api.meta import COMPONENT_LABEL, LENDABLE_LABEL
from rlfleet.local.binaries import binary
from rlfleet.local.files import write_secret
from rlfleet.local.processes import Supervisor, free_port
from rlfleet.testbed.bed import BedInfo
from rlfleet.testbed.sandboxes import SandboxKubelet, pump

CHART = Path(__file__).resolve().parents[3] / "helm" / "rlfleet"
RELEASE = "rlfleet"
RELEASE_NAMESPACE = "rlfleet-system"
NATS_SECRET = "rlfleet-nats"  # the hub operator's NATS user
HUB = "hub"


GVISOR = {
    "apiVersion": "node.k8s.io/v1",
    "kind": "RuntimeClass",
    "metadata": {"name": "gvisor"},
    "handler": "runsc",
}


def serving_deployment(name: str, replicas: int, gpus: int) -> dict:
    """A production vLLM fleet as an InferencePool sees it (kwok runs its pods), its owner
    letting InferencePools lend it."""
    labels = {"app": name}
    container = {
        "name": "vllm",
        "image": "vllm/vllm-openai",
        "resources": {"limits": {"nvidia.com/gpu": str(gpus)}},
    }
    return {
        "apiVersion": "apps/v1",
        "kind": "Deployment",
        "metadata": {"name": name, "labels": labels | {LENDABLE_LABEL: "true"}},
        "spec": {
            "replicas": replicas,
            "selector": {"matchLabels": labels},
            "template": {"metadata": {"labels": labels}, "spec": {"containers": [container]}},
        },
    }


class Link:
    """A TCP relay to a region's API server that can be cut and restored."""

    def __init__(self, target: str) -> None:
        host, port = target.removeprefix("https://").rsplit(":", 1)
        self.target = (host, int(port))
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.port = self.listener.getsockname()[1]
        self.cut_off = False
        self._open: set[socket.socket] = set()
        self._lock = threading.Lock()
        threading.Thread(target=self._accept, daemon=True).start()

    @property
    def url(self) -> str:
        return f"https://127.0.0.1:{self.port}"

    def cut(self) -> None:
        with self._lock:
            self.cut_off = True
            for sock in self._open:
                sock.close()
            self._open.clear()

    def restore(self) -> None:
        self.cut_off = False

    def _accept(self) -> None:
        while True:
            client, _ = self.listener.accept()
            if self.cut_off:
                client.close()
                continue
            try:
                upstream = socket.create_connection(self.target, timeout=5)
            except OSError:
                client.close()
                continue
            upstream.settimeout(None)
            with self._lock:
                self._open |= {client, upstream}
            for source, sink in ((client, upstream), (upstream, client)):
                args = (source, sink, self._closed)
                threading.Thread(target=pump, args=args, daemon=True).start()

    def _closed(self, *sockets: socket.socket) -> None:
        with self._lock:
            self._open -= set(sockets)


class TrafficServer:
    """The serving pods' metrics endpoint, one path per pool: /<name>/metrics exports
    `vllm:num_requests_running` with whatever load the test sets."""

    def __init__(self) -> None:
        self.load: dict[str, float] = {}
        loads = self.load

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self) -> None:
                name = self.path.strip("/").removesuffix("/metrics")
                if name not in loads:
                    self.send_error(404)
                    return
                body = (
                    "# TYPE vllm:num_requests_running gauge\n"
                    f'vllm:num_requests_running{{pod="{name}-0"}} {loads[name]}\n'
                ).encode()
                self.send_response(200)
                self.send_header("Content-Type", "text/plain; version=0.0.4")
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, *args) -> None:
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def url(self, name: str) -> str:
        return f"http://127.0.0.1:{self.server.server_port}/{name}/metrics"

    def close(self) -> None:
        self.server.shutdown()


def rendered_chart(*values: str, release: str = RELEASE) -> list[dict]:
    """The chart's documents as the real helm renders them with `values` (helm template
    arguments: --namespace, --set, ...), no cluster involved."""
    rendered = subprocess.run(
        [binary("helm"), "template", release, str(CHART), *values],
        capture_output=True,
        text=True,
        check=True,
        timeout=60,
    ).stdout
    return [d for d in yaml.safe_load_all(rendered) if d]


@dataclass
class Fleet:
    bed: BedInfo
    work: Path
    watch: list[str]  # namespaces the operators watch
    regions: list[str]
    values: dict = field(default_factory=dict)  # extra chart values for every cluster
    links: dict[str, Link] = field(default_factory=dict)
    configs: dict[str, Path] = field(default_factory=dict)
    metrics_ports: dict[str, int] = field(default_factory=dict)
    operator_env: dict[str, str] = field(default_factory=dict)  # e.g. where traces go
    # The interpreter the operators run under: the operator image's environment in tests.
    python: str = sys.executable
    chart: Path = CHART  # what `install` installs: another release's chart to upgrade from
    install_flags: tuple[str, ...] = ()  # more `helm upgrade --install` flags

    def __post_init__(self) -> None:
        self.supervisor = Supervisor(self.work / "logs", attached=True)
        self.merged = yaml.safe_load(self.bed.kubeconfig.read_text())
        self._apis: dict[str, kubernetes.client.CoreV1Api] = {}
        # EnvPools' pods in the regions, each one's session server a local process.
        self.sandboxes = SandboxKubelet(
            self._sandbox_pods,
            self._secret_data,
            self.regions,
            self.watch,
            self.supervisor,
        )

    def _api(self, cluster: str) -> kubernetes.client.CoreV1Api:
        if cluster not in self._apis:
            client = kubernetes.config.new_client_from_config(
                str(self.bed.kubeconfig), context=cluster
            )
            self._apis[cluster] = kubernetes.client.CoreV1Api(client)
        return self._apis[cluster]

    def _sandbox_pods(self, cluster: str, namespace: str) -> list[dict]:
        response = self._api(cluster).list_namespaced_pod(
            namespace,
            label_selector=f"{COMPONENT_LABEL}=sandbox",
            _preload_content=False,
            _request_timeout=10,
        )
        return json.loads(response.data)["items"]

    def _secret_data(self, cluster: str, namespace: str, name: str) -> dict[str, str] | None:
        try:
            secret = self._api(cluster).read_namespaced_secret(
                name, namespace, _preload_content=False, _request_timeout=10
            )
        except kubernetes.client.ApiException as error:
            if error.status == 404:
                return None
            raise
        return json.loads(secret.data).get("data") or {}

    # --- clusters -----------------------------------------------------------------------

    def _server(self, cluster: str) -> tuple[str, str]:
        entry = next(c for c in self.merged["clusters"] if c["name"] == cluster)["cluster"]
        return entry["server"], entry["certificate-authority-data"]

    def kubectl(self, cluster: str, *args: str, stdin: str | None = None) -> str:
        result = subprocess.run(
            [
                binary("kubectl"),
                f"--kubeconfig={self.bed.kubeconfig}",
                f"--context={cluster}",
                *args,
            ],
            input=stdin,
            capture_output=True,
            text=True,
            timeout=120,
        )
        if result.returncode != 0:
            raise RuntimeError(f"kubectl {' '.join(args)} in {cluster}: {result.stderr}")
        return result.stdout

    def helm(self, cluster: str, *args: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            [
                binary("helm"),
                f"--kubeconfig={self.bed.kubeconfig}",
                f"--kube-context={cluster}",
                *args,
            ],
            capture_output=True,
            text=True,
            timeout=300,
        )

    def chart_values(self, cluster: str) -> dict:
        role = "hub" if cluster == HUB else "region"
        values = {
            "role": role,
            "cluster": cluster,
            "watchNamespaces": self.watch,
            "metrics": {"port": self.metrics_ports.setdefault(cluster, free_port())},
            "health": {"port": free_port()},
        }
        if role == "hub":
            values["regions"] = [
                {"name": r, "kubeconfigSecret": f"rlfleet-region-{r}"} for r in self.regions
            ]
            values["nats"] = {"url": self.bed.nats.hub.url, "credentialsSecret": NATS_SECRET}
        return values | self.values

    def install(self, cluster: str, **extra_values) -> subprocess.CompletedProcess[str]:
        """`helm upgrade --install` of the chart; CRDs applied earlier by kubectl are adopted."""
        values = self.work / f"values-{cluster}.yaml"
        values.write_text(yaml.safe_dump(self.chart_values(cluster) | extra_values))
        return self.helm(
            cluster,
            "upgrade",
            "--install",
            RELEASE,
            str(self.chart),
            f"--namespace={RELEASE_NAMESPACE}",
            "--create-namespace",
            "--take-ownership",
            f"--values={values}",
            *self.install_flags,
        )

    def token_kubeconfig(self, cluster: str, account: str, server: str | None = None) -> dict:
        token = self.kubectl(
            cluster, "-n", RELEASE_NAMESPACE, "create", "token", account, "--duration=24h"
        ).strip()
        real_server, ca = self._server(cluster)
        return {
            "apiVersion": "v1",
            "kind": "Config",
            "clusters": [
                {
                    "name": cluster,
                    "cluster": {"server": server or real_server, "certificate-authority-data": ca},
                }
            ],
            "users": [{"name": account, "user": {"token": token}}],
            "contexts": [{"name": cluster, "context": {"cluster": cluster, "user": account}}],
            "current-context": cluster,
        }

    def region_secret(self, region: str, document: dict | str) -> None:
        """The hub's kubeconfig Secret for a region (a document, or any text to break it)."""
        text = document if isinstance(document, str) else yaml.safe_dump(document)
        self.hub_secret(f"rlfleet-region-{region}", {"kubeconfig": text})

    def hub_secret(self, name: str, data: dict[str, str]) -> None:
        """A Secret in the hub's release namespace, where the hub operator reads them."""
        secret = {
            "apiVersion": "v1",
            "kind": "Secret",
            "metadata": {"name": name, "namespace": RELEASE_NAMESPACE},
            "stringData": data,
        }
        self.kubectl(HUB, "apply", "-f", "-", stdin=json.dumps(secret))

    # --- operators ----------------------------------------------------------------------

    def setup(self) -> None:
        """Installs the chart everywhere and links the hub to every region."""
        for cluster in [HUB, *self.regions]:
            result = self.install(cluster)
            if result.returncode != 0:
                raise RuntimeError(f"helm install in {cluster}: {result.stderr}")
        hub_nats = self.bed.nats.hub
        self.hub_secret(
            NATS_SECRET,
            {
                "creds": Path(hub_nats.credentials).read_text(),
                "signing-seed": Path(self.bed.nats.signing_seed).read_text(),
                "operator-seed": Path(self.bed.nats.operator_seed).read_text(),
                "system-creds": Path(self.bed.nats.system_credentials).read_text(),
            },
        )
        for region in self.regions:
            self.links[region] = Link(self._server(region)[0])
            self.region_secret(
                region, self.token_kubeconfig(region, f"{RELEASE}-hub", self.links[region].url)
            )

    def start(self, cluster: str) -> None:
        """Runs the cluster's operator with the chart's config and ServiceAccount."""
        config = self.kubectl(
            cluster,
            "-n",
            RELEASE_NAMESPACE,
            "get",
            "configmap",
            f"{RELEASE}-operator",
            "-o",
            "jsonpath={.data.config\\.yaml}",
        )
        config_path = self.work / f"operator-{cluster}.yaml"
        config_path.write_text(config)
        kubeconfig = self.work / f"operator-{cluster}.kubeconfig"
        write_secret(
            kubeconfig, yaml.safe_dump(self.token_kubeconfig(cluster, f"{RELEASE}-operator"))
        )
        self.configs[cluster] = config_path
        self.supervisor.start(
            f"operator-{cluster}",
            [self.python, "-m", "rlfleet.operator", str(config_path)],
            env={"KUBECONFIG": str(kubeconfig)} | self.operator_env,
        )

    def start_all(self) -> None:
        for cluster in [HUB, *self.regions]:
            self.start(cluster)
        self.sandboxes.start()

    def crash_and_restart(self, cluster: str) -> None:
        """SIGKILL, as a crash (nothing finished or cleaned up), then start it again."""
        self.supervisor.restart(f"operator-{cluster}")

    def log(self, cluster: str) -> str:
        return (self.work / "logs" / f"operator-{cluster}.log").read_text(errors="replace")

    def release(self) -> None:
        """Deletes the watched namespaces everywhere, without waiting: their pods go at once,
        so the next test's pods get the kwok nodes' GPUs."""
        for cluster in [HUB, *self.regions]:
            for namespace in self.watch:
                self.kubectl(cluster, "delete", "namespace", namespace, "--wait=false")

    def stop(self) -> None:
        self.sandboxes.stop()
        self.supervisor.stop_all()

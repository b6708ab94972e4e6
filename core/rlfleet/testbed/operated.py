"""`rlfleet run FILE --operator`: the RLRun through the control plane, on the four-cluster
bed, with the pods the operators create run as processes on this machine.

The chart is installed in the bed's hub and in every region the run names, and each
operator runs as a local process with the chart's config and RBAC (`testbed.fleet`). Each
region has a simulated production fleet to borrow from: a vLLM Deployment of two 8-GPU
replicas on kwok's nodes and an InferencePool over it, whose traffic is a metrics endpoint
served from here. The RLRun is applied to the hub as a user would; the hub mints its NATS
user and places it in every cluster, and `PodRunner` binds each trainer, feed and rollout
pod to a local process of the same plan as `rlfleet run`. A spike of traffic in a region
(`--spike region-a:2-4`) makes its operator reclaim the GPUs, which stops that region's
worker while training goes on; when traffic falls, the GPUs come back and a new worker
starts.
"""

from __future__ import annotations

import base64
import contextlib
import copy
import functools
import json
import logging
import secrets
import signal
import subprocess
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import yaml
from rich.logging import RichHandler

from rlfleet.api.meta import API_VERSION
from rlfleet.api.rlrun import RLRunSpec
from rlfleet.api.wire import BusRole
from rlfleet.launch import components, pods
from rlfleet.launch.settings import PoolConfig
from rlfleet.local import plan
from rlfleet.local import run as local_run
from rlfleet.local.files import write_secret
from rlfleet.local.processes import Supervisor, stop_pids
from rlfleet.local.run import console
from rlfleet.testbed.bed import STATE_FILE, Bed, BedInfo, stop_recorded
from rlfleet.testbed.fleet import GVISOR, HUB, Fleet, TrafficServer, serving_deployment
from rlfleet.testbed.pods import BOUND, Pod, PodRunner, kube_pods

log = logging.getLogger(__name__)

POOL = "chat-prod"  # each region's simulated serving fleet
ENVPOOL = "sandboxes"  # each region's EnvPool, unless the run names its own
SERVING = "chat-vllm"
SERVING_REPLICAS, GPUS_PER_REPLICA = 2, 8
# Requests running: above the pool's reclaimAbove, and under its lendBelow.
BUSY, QUIET = 200.0, 0.0
# Fast loops, for a demo on one machine (the chart's defaults suit a real fleet).
OPERATOR_VALUES = {
    "resyncSeconds": 1,
    "runResyncSeconds": 1,
    "regionTimeoutSeconds": 5,
    "callTimeoutSeconds": 2,
}
WAIT_S = 120.0  # for the operators' first decisions: the chart, the run's NATS user
DELETE_WAIT_S = 60  # for the hub to delete the run's mirrors and streams


@dataclass(frozen=True)
class Spike:
    """High traffic in a region's serving fleet for a window of the training budget."""

    region: str
    start_s: float
    end_s: float

    @classmethod
    def parse(cls, text: str) -> Spike:
        """`REGION:FROM-TO`, in minutes of training, as `region-a:2-4`."""
        region, _, window = text.partition(":")
        start, _, end = window.partition("-")
        try:
            spike = cls(region, float(start) * 60, float(end) * 60)
        except ValueError:
            spike = None
        if not region or spike is None or not 0 <= spike.start_s < spike.end_s:
            raise ValueError(f"spike {text!r}: expected REGION:FROM-TO in minutes, as region-a:2-4")
        return spike

    def busy(self, trained_s: float) -> bool:
        return self.start_s <= trained_s < self.end_s


def borrowing(document: dict) -> dict:
    """The RLRun, with each region that names no InferencePool borrowing one replica of
    the bed's serving fleet there (GPUs are lent a whole replica at a time), and its
    agents acting in each region's EnvPool."""
    borrowed = copy.deepcopy(document)
    if "rollout" not in borrowed["spec"]:
        return borrowed  # a production run borrows nothing: it serves
    borrowed["spec"]["rollout"].setdefault("envPool", ENVPOOL)
    for region in borrowed["spec"]["rollout"]["regions"]:
        if not region.get("inferencePools"):
            region["inferencePools"] = [POOL]
            region["maxGpus"] = max(region.get("maxGpus", 0), GPUS_PER_REPLICA)
    return borrowed


def envpool() -> dict:
    """Each region's sandboxes: one pod of four warm, bursting a pod of four at a time."""
    return {
        "apiVersion": API_VERSION,
        "kind": "EnvPool",
        "metadata": {"name": ENVPOOL},
        "spec": {
            "template": {
                "image": "ghcr.io/rlfleet/env-sandbox:0.1.0",
                "runtimeClassName": GVISOR["metadata"]["name"],
            },
            "warm": 4,
            "maxBurst": 64,
            "sessionsPerPod": 4,
            "idleSeconds": 60,
        },
    }


def inference_pool(metrics_url: str) -> dict:
    """Lends up to half the serving replicas while fewer requests run than `lendBelow`."""
    return {
        "apiVersion": API_VERSION,
        "kind": "InferencePool",
        "metadata": {"name": POOL},
        "spec": {
            "serving": {
                "deploymentName": SERVING,
                "replicas": SERVING_REPLICAS,
                "gpusPerReplica": GPUS_PER_REPLICA,
            },
            "minServingReplicas": 1,
            "maxLendFraction": 0.5,
            "reclaimDeadlineSeconds": 20,
            "traffic": {"metricsUrl": metrics_url, "lendBelow": 4, "reclaimAbove": 12},
        },
    }


@contextlib.contextmanager
def bed_at(state: Path) -> Iterator[BedInfo]:
    """The bed `rlfleet dev up` left running in `state`, or one started there for this
    run alone and stopped after it."""
    if (info := BedInfo.running(state)) is not None:
        yield info
        return
    if (state / STATE_FILE).exists():
        stop_recorded(state)  # a half-dead bed from an earlier run
    console.print(f"starting the four-cluster bed in {state} (`rlfleet dev up` keeps one up)")
    bed = Bed(state.resolve(), attached=True)
    info = bed.start()
    try:
        yield info
    finally:
        bed.stop()


class Binding:
    """Keeps `PodRunner` in step with the clusters in the background, twice a second.
    A failure (a process that died, a cluster that stopped answering) is kept and raised
    by `check_alive`."""

    def __init__(self, runner: PodRunner) -> None:
        self.runner = runner
        self.error: Exception | None = None
        self.sync_errors = 0  # with restarts on: syncs that failed and were tried again
        self._stop = threading.Event()
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    def _run(self) -> None:
        try:
            while not self._stop.wait(0.5):
                try:
                    self.runner.sync()
                    if not self.runner.restart_exited:
                        self.runner.supervisor.check_alive()
                except Exception as error:  # raised in the caller's thread by check_alive
                    if not self.runner.restart_exited:
                        self.error = error
                        return
                    # A kubelet keeps its containers running while its API server is away.
                    self.sync_errors += 1
                    log.warning("pod sync failed, trying again: %s", error)
        finally:
            # The processes die the moment this thread ends (PR_SET_PDEATHSIG follows the
            # thread that started them): stopped from it, each finishes what it was doing,
            # the trainer its step, instead of being killed with half a step published.
            self.runner.supervisor.stop_all(grace_seconds=self.runner.stop_grace_s)

    def check_alive(self) -> None:
        if self.error is not None:
            raise RuntimeError(f"the pod runner stopped: {self.error}") from self.error

    def workers(self) -> dict[str, int]:
        """Local rollout workers running, by region."""
        counts: dict[str, int] = {}
        for key, name in list(self.runner.running.items()):
            if name.startswith("rollout-"):
                region = key.partition("/")[0]
                counts[region] = counts.get(region, 0) + 1
        return counts

    def stop(self) -> None:
        """Stops the processes, each given its grace, and then the thread."""
        self._stop.set()
        self.thread.join()


class OperatedPlane:
    """The run applied to the bed's hub, its pods bound to local processes (a `Plane`)."""

    def __init__(
        self,
        name: str,
        spec: RLRunSpec,
        layout: plan.Layout,
        tuning: plan.Tuning,
        *,
        bed: BedInfo,
        document: dict,
        namespace: str,
        spikes: tuple[Spike, ...] = (),
    ) -> None:
        self.name, self.layout = name, layout
        self.bed, self.namespace, self.spikes = bed, namespace, spikes
        self.document = borrowing(document)
        self.document["metadata"].pop("namespace", None)  # applied into `namespace`
        self.regions = spec.region_names
        missing = sorted(set(self.regions) - set(bed.kubeconfigs))
        if missing:
            raise ValueError(f"the bed has no cluster for region(s) {', '.join(missing)}")
        self.url = bed.nats.hub.url
        self.key = pods.run_key(namespace, name)  # as the hub names the run on NATS
        self.root, self.production = layout.root, spec.production is not None
        self.credentials = layout.credentials(BusRole.OBSERVER)
        self.fleet = Fleet(bed, layout.root / "fleet", [namespace], self.regions)
        self.fleet.values = OPERATOR_VALUES
        self.traffic = TrafficServer()
        self.supervisor = Supervisor(layout.logs, attached=True)
        if self.production:
            found = local_run.production_processes(self.key, spec, layout, bed.nats, tuning)
        else:
            found = plan.processes(self.key, spec, layout, bed.nats, tuning)
        # A production pool's servers and its users are production's own, not the run's
        # pods: they start beside the bed, as a pool's Deployment runs in its region.
        own = [p for p in found if p.name not in BOUND] if self.production else []
        self.production_own = own
        self.runner = PodRunner(
            name,
            {p.name: p for p in found if p not in own},
            kube_pods(bed.kubeconfig, namespace, name),
            [HUB, *self.regions],
            self.supervisor,
            envpool_for=self._envpool,
        )
        self.binding: Binding | None = None
        self.busy: set[str] = set()
        self.envpool_urls: dict[str, str] = {}  # region -> its EnvPool's Service (a relay)

    def __enter__(self) -> OperatedPlane:
        try:
            self._start()
        except BaseException:
            self.__exit__()
            raise
        console.print(
            f"started {self.name} in namespace {self.namespace} of the bed's hub: "
            f"operator and process logs in {self.layout.root}; Ctrl-C stops and reports"
        )
        return self

    def _start(self) -> None:
        fleet = self.fleet
        console.print(f"installing the chart in hub, {', '.join(self.regions)}")
        for cluster in [HUB, *self.regions]:
            fleet.kubectl(cluster, "create", "namespace", self.namespace)
        fleet.setup()
        for cluster in [HUB, *self.regions]:  # the chart's CRDs, before their objects
            fleet.kubectl(cluster, "wait", "--for=condition=Established", "crd", "--all")
        for region in self.regions:
            self.traffic.load[region] = QUIET
            self.apply(region, serving_deployment(SERVING, SERVING_REPLICAS, GPUS_PER_REPLICA))
            self.apply(region, inference_pool(self.traffic.url(region)))
            fleet.kubectl(region, "apply", "-f", "-", stdin=json.dumps(GVISOR))
            self.apply(region, envpool())
        fleet.start_all()
        self.apply(HUB, self.document)
        console.print(f"applied RLRun {self.name}; waiting for the hub to mint its NATS users")
        spec = RLRunSpec.model_validate(self.document["spec"])
        for role in [*components.hub_roles(spec), components.region_role(spec)]:
            write_secret(self.layout.credentials(role), self._minted_user(role))
        for process in self.production_own:
            local_run.launch(process, self.supervisor)
        self.binding = Binding(self.runner)

    def apply(self, cluster: str, document: dict) -> None:
        self.fleet.kubectl(
            cluster, "-n", self.namespace, "apply", "-f", "-", stdin=yaml.safe_dump(document)
        )

    def _minted_user(self, role: BusRole) -> str:
        """The `.creds` the hub wrote for the pods of a component (rollout workers': in
        their regions): its processes log in as them."""
        secret = pods.nats_credentials_secret(self.name, role)
        cluster = self.regions[0] if role in (BusRole.ROLLOUT, BusRole.SERVING) else HUB
        return self._minted(cluster, secret, pods.NATS_CREDENTIALS_KEY, "the hub", "NATS user")

    def _minted(self, cluster: str, secret: str, key: str, who: str, what: str) -> str:
        """A key of a Secret an operator writes in `cluster`, once it is there."""
        jsonpath = "-o=jsonpath={.data." + key + "}"
        deadline = time.monotonic() + WAIT_S
        while time.monotonic() < deadline:
            self.fleet.supervisor.check_alive()
            found = self.fleet.kubectl(
                cluster,
                "-n",
                self.namespace,
                "get",
                "secret",
                secret,
                "--ignore-not-found",
                jsonpath,
            )
            if found:
                return base64.b64decode(found).decode()
            time.sleep(0.5)
        raise TimeoutError(f"{who} minted no {what} in {WAIT_S:.0f}s; see its log")

    def _envpool(self, pod: Pod) -> PoolConfig:
        """A rollout pod's EnvPool, as its environment and token mount give it: the pool's
        Service (the bed's relay for it) and the run's token, from the Secret the region
        operator minted (waited for, as the kubelet waits for a Secret volume)."""
        name = self.document["spec"]["rollout"]["envPool"]
        token = self.layout.root / f"envpool-{pod.cluster}.token"
        if not token.exists():
            secret = pods.envpool_token_secret(self.name)
            minted = self._minted(
                pod.cluster, secret, pods.ENVPOOL_TOKEN_KEY, pod.cluster, "EnvPool token"
            )
            write_secret(token, minted)
        if pod.cluster not in self.envpool_urls:
            self.envpool_urls[pod.cluster] = self.fleet.sandboxes.service_url(
                pod.cluster, self.namespace, name
            )
        return PoolConfig(url=self.envpool_urls[pod.cluster], token_file=str(token))

    def check_alive(self) -> None:
        self.fleet.supervisor.check_alive()  # the operators
        if self.binding is not None:
            self.binding.check_alive()

    def status(self, trained_s: float) -> str | None:
        """Sets each region's traffic for the spikes, and says where workers run."""
        if self.production:
            return None  # the followed cycles say it: it borrows no GPUs
        self.busy = {s.region for s in self.spikes if s.busy(trained_s)}
        for region in self.regions:
            self.traffic.load[region] = BUSY if region in self.busy else QUIET
        workers = self.binding.workers() if self.binding else {}
        shown = []
        for region in self.regions:
            spike = " (traffic spike)" if region in self.busy else ""
            shown.append(f"{region} {workers.get(region, 0)}{spike}")
        return "rollout workers: " + ", ".join(shown)

    def stop_run(self) -> None:
        if self.binding is not None:
            self.binding.stop()
        own = [p.name for p in self.production_own]
        stop_pids([pid for name, pid in self.supervisor.pids().items() if name in own], 30)

    def __exit__(self, *exc: object) -> None:
        self.stop_run()
        # The run is deleted while its operators still run: the hub deletes its mirrors
        # and NATS streams before it lets the RLRun go.
        try:
            self.fleet.kubectl(
                HUB,
                "-n",
                self.namespace,
                "delete",
                "rlrun",
                self.name,
                "--ignore-not-found",
                f"--timeout={DELETE_WAIT_S}s",
            )
        except (RuntimeError, subprocess.TimeoutExpired) as error:  # an operator had died
            console.print(f"[yellow]the hub did not finish deleting {self.name}: {error}")
        # The namespace goes in every cluster, and with it the pools and Secrets.
        for cluster in [HUB, *self.regions]:
            self.fleet.kubectl(cluster, "delete", "namespace", self.namespace, "--wait=false")
        self.fleet.stop()
        self.traffic.close()
        for link in self.fleet.links.values():
            link.listener.close()


def namespace_for(name: str) -> str:
    """A namespace of its own for a run of `name`: runs of one name do not meet."""
    return f"{name[:50]}-{secrets.token_hex(3)}"


def run(
    path: Path,
    root: Path | None,
    minutes: float,
    warmup_steps: int | None,
    bed_state: Path,
    spikes: tuple[Spike, ...],
    invert_cycle: int | None = None,
    namespace: str | None = None,
) -> int:
    """`rlfleet run FILE --operator`: as `rlfleet run`, through the bed's operators. Each
    time round is a new RLRun, with new streams, in a namespace of its own, deleted at the
    end; the trainer resumes from its checkpoint in the run folder."""
    # SIGTERM (`rlfleet dev down`, for a detached run) is Ctrl-C from here on: whatever
    # the run has started by then is stopped and deleted on the way out.
    signal.signal(signal.SIGTERM, signal.default_int_handler)
    name, spec = local_run.load(path)
    strays = sorted({s.region for s in spikes} - set(spec.region_names))
    if strays:
        console.print(f"[red]--spike in {', '.join(strays)}: not a region of {name}[/red]")
        return 2
    document = yaml.safe_load(path.read_text())
    # The pod runner's starts and stops, above the live table.
    pods_log = logging.getLogger(PodRunner.__module__)
    pods_log.setLevel(logging.INFO)
    pods_log.addHandler(RichHandler(console=console, show_path=False))
    namespace = namespace or namespace_for(name)
    with bed_at(bed_state) as bed:
        plane_for = functools.partial(
            OperatedPlane, bed=bed, document=document, namespace=namespace, spikes=spikes
        )
        folder = root or Path(".rlfleet") / "runs" / f"{name}-operator"
        return local_run.run(path, folder, minutes, warmup_steps, plane_for, invert_cycle)

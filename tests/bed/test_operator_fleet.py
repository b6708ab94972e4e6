"""The operator on the real four-cluster bed: the chart installed with helm in each cluster,
one operator process per cluster running under the chart's ServiceAccount.

The operators and the regions' serving come up once for the module; one RLRun (the
example) lends in three regions, and each test that needs it asks for `lending`, which
applies it again if a test before deleted it and waits until it lends everywhere. So every
test runs alone or in any order: a traffic spike reclaimed, an operator crashed mid-lend, a
region cut off and back, a broken kubeconfig Secret, the run deleted from all four
clusters; other runs come and go on their own pools.
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import itertools
import json
import os
import re
import subprocess
import sys
import threading
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import nats
import nats.js.errors
import pytest
import yaml
from conftest import ROOT, run_streams, scrape, step_report, wait_for
from prometheus_client import start_http_server

import images
from rlfleet.api.meta import GPU_TYPE_LABEL, LENDABLE_LABEL
from rlfleet.api.wire import (
    CycleEvent,
    CycleOutcome,
    CyclePhase,
    CycleReport,
    CycleState,
    EvaluationReport,
    FinishedCycle,
    ServeOrder,
    StepReport,
    cycle_state_subject,
    cycle_subject,
    decode_serve_order,
    encode,
    evaluation_subject,
    serve_order_subject,
    step_subject,
    task_stream,
    trajectory_stream,
    weights_stream,
)
from rlfleet.bus import connection
from rlfleet.bus.credentials import claims_of, parse_creds
from rlfleet.bus.reading import newest
from rlfleet.bus.streams import cycle_stream, step_stream
from rlfleet.launch.pods import (
    ENVPOOL_TOKEN_KEY,
    ENVPOOL_URL_ENV,
    REPLICA_SET_ENV,
    Placement,
    envpool_token_secret,
    run_key,
)
from rlfleet.launch.production import ServingConfig
from rlfleet.operator.workloads.envpool import ENVPOOL_PORT
from rlfleet.operator.workloads.rollout import rollout_name
from rlfleet.rollout.environment.envclient import EnvClient, EnvServerError
from rlfleet.rollout.production.versions import VersionFollower
from rlfleet.testbed.bed import BedInfo
from rlfleet.testbed.fleet import (
    GVISOR,
    HUB,
    RELEASE,
    RELEASE_NAMESPACE,
    Fleet,
    TrafficServer,
    serving_deployment,
)
from rlfleet.testbed.kube import H100, L4, audit_log
from rlfleet.testbed.rbac import Grant, used_grants
from rlfleet.testbed.traces import TraceReceiver

REGIONS = ["region-a", "region-b", "region-c"]
RUN = "tiny-moe-arith"
POOL = "chat-prod"
# The operators' own counts (`rlfleet.operator.telemetry`), as a scraper names them.
RECONCILES = "rlfleet_operator_reconcile_seconds_count"
RECONCILE_ERRORS = "rlfleet_operator_reconcile_errors_total"
# examples/rlrun.yaml wants 8-16, 0-16 and 0-8 GPUs; each pool may lend 2 of 4 replicas.
LENT = {"region-a": 16, "region-b": 16, "region-c": 8}


class World:
    def __init__(
        self, fleet: Fleet, namespace: str, traffic: TrafficServer, traces: TraceReceiver
    ) -> None:
        self.fleet = fleet
        self.ns = namespace
        self.traffic = traffic
        self.traces = traces
        self.key = run_key(namespace, RUN)  # the run's name on NATS

    def get(self, cluster: str, *what: str) -> dict:
        return json.loads(self.fleet.kubectl(cluster, "-n", self.ns, "get", *what, "-o", "json"))

    def items(self, cluster: str, *what: str) -> list[dict]:
        return self.get(cluster, *what)["items"]

    def apply(self, cluster: str, document: dict) -> None:
        self.fleet.kubectl(cluster, "-n", self.ns, "apply", "-f", "-", stdin=json.dumps(document))

    def running(self, cluster: str, selector: str) -> int:
        pods = self.items(cluster, "pods", "-l", selector)
        return sum(
            1
            for p in pods
            if p["status"].get("phase") == "Running" and not p["metadata"].get("deletionTimestamp")
        )

    def trainer_pods(self) -> int:
        return self.running(HUB, f"rlfleet.io/run={RUN},rlfleet.io/component=trainer")

    def rollout_pods(self, region: str) -> int:
        return self.running(region, f"rlfleet.io/run={RUN},rlfleet.io/component=rollout")

    def serving_pods(self, region: str) -> int:
        return self.running(region, "app=chat-vllm")

    def run_status(self) -> dict:
        return self.get(HUB, "rlrun", RUN).get("status", {})

    def events(self, cluster: str, name: str) -> list[dict]:
        return self.items(cluster, "events", "--field-selector", f"involvedObject.name={name}")

    def reasons(self, cluster: str, name: str) -> set[str]:
        return {e["reason"] for e in self.events(cluster, name)}

    def condition(self, kind: str) -> dict:
        return next((c for c in self.run_status().get("conditions", []) if c["type"] == kind), {})

    def lent_everywhere(self) -> bool:
        status = self.run_status()
        return (
            all(self.rollout_pods(r) * 8 == LENT[r] for r in REGIONS)
            and status.get("gpusRunning") == sum(LENT.values())
            and status.get("gpusLent") == sum(LENT.values())
        )


CHECKPOINTS = {"size": "1Gi", "storageClassName": "rlfleet-checkpoints"}


def checkpoint_volume(namespace: str) -> dict:
    """A volume for the trainer rank's checkpoint claim, as a hub's storage would offer."""
    return {
        "apiVersion": "v1",
        "kind": "PersistentVolume",
        "metadata": {"name": f"{namespace}-checkpoints"},
        "spec": {
            "capacity": {"storage": CHECKPOINTS["size"]},
            "accessModes": ["ReadWriteOnce"],
            "storageClassName": CHECKPOINTS["storageClassName"],
            "hostPath": {"path": f"/var/lib/rlfleet/{namespace}"},
        },
    }


def example(name: str) -> dict:
    return yaml.safe_load((ROOT / "examples" / name).read_text())


@pytest.fixture(scope="module")
def world(
    bed: BedInfo,
    crds_installed: None,
    image_environments: images.Environments,
    tmp_path_factory: pytest.TempPathFactory,
) -> Iterator[World]:
    namespace = f"op-{uuid.uuid4().hex[:6]}"
    fleet = Fleet(bed, tmp_path_factory.mktemp("fleet"), [namespace], REGIONS)
    # The operators run from the operator image's environment, as a cluster runs them.
    fleet.python = str(image_environments.python("operator"))
    fleet.values = {
        "resyncSeconds": 1,
        "runResyncSeconds": 1,
        "regionTimeoutSeconds": 5,
        "callTimeoutSeconds": 2,
    }
    traffic = TrafficServer()
    traces = TraceReceiver()
    fleet.operator_env = traces.env
    for cluster in [HUB, *REGIONS]:
        fleet.kubectl(cluster, "create", "namespace", namespace)
    fleet.setup()
    world = World(fleet, namespace, traffic, traces)
    for region in REGIONS:
        traffic.load[region] = 0.0
        # The example's sandboxes run under gVisor, which a region's admins install.
        fleet.kubectl(region, "apply", "-f", "-", stdin=json.dumps(GVISOR))
        world.apply(region, serving_deployment("chat-vllm", replicas=4, gpus=8))
        pool = example("inferencepool.yaml")
        pool["spec"]["traffic"]["metricsUrl"] = traffic.url(region)
        pool["spec"]["reclaimDeadlineSeconds"] = 20
        world.apply(region, pool)
        world.apply(region, example("envpool.yaml"))
    fleet.start_all()
    try:
        yield world
    finally:
        fleet.release()
        fleet.stop()
        traffic.close()
        traces.close()
        for link in fleet.links.values():
            link.listener.close()
        fleet.kubectl(
            HUB, "delete", "persistentvolume", f"{namespace}-checkpoints", "--ignore-not-found"
        )


def the_run() -> dict:
    """The example, its trainer's checkpoints on a claim of their own."""
    run = example("rlrun.yaml")
    run["spec"]["trainer"] = {"checkpointStorage": CHECKPOINTS}
    return run


@pytest.fixture
def lending(world: World) -> None:
    """The example's run lending in all three regions: applied if it is not there (first, or
    after a test deleted it), so each test starts from it whatever ran before."""

    def present() -> list[dict]:
        return world.items(HUB, "rlruns", "--field-selector", f"metadata.name={RUN}")

    wait_for(
        "a deleted run gone",
        lambda: not any("deletionTimestamp" in r["metadata"] for r in present()),
    )
    if not present():
        # A deleted run's claim leaves its volume Released, which no new claim binds.
        volume = checkpoint_volume(world.ns)
        world.fleet.kubectl(
            HUB, "delete", "persistentvolume", volume["metadata"]["name"], "--ignore-not-found"
        )
        world.fleet.kubectl(HUB, "apply", "-f", "-", stdin=json.dumps(volume))
        world.apply(HUB, the_run())
    wait_for("lending", world.lent_everywhere, timeout=240)  # a new run's pods first


def _columns(world: World, name: str, *options: str) -> dict[str, str]:
    """`kubectl get rlrun` on the hub, as column: value. Columns left empty print blank:
    each is read where its header starts."""
    header, row = world.fleet.kubectl(
        HUB, "-n", world.ns, "get", "rlrun", name, *options
    ).splitlines()
    starts = [m.start() for m in re.finditer(r"\S+", header)] + [None]
    return {header[a:b].strip(): row[a:b].strip() for a, b in itertools.pairwise(starts)}


@pytest.mark.usefixtures("lending")
def test_applying_the_example_trains_in_the_hub_and_borrows_gpus_in_three_regions(
    world: World,
) -> None:
    wait_for("trainer pods running", lambda: world.trainer_pods() == 1)
    # Its rank keeps checkpoints on a claim of its own, bound to the hub's volume.
    claim = world.get(HUB, "persistentvolumeclaim", f"state-{RUN}-trainer-0")
    assert claim["status"]["phase"] == "Bound"
    assert claim["spec"]["storageClassName"] == CHECKPOINTS["storageClassName"]
    wait_for("the task feed running", lambda: world.running(HUB, "rlfleet.io/component=feed") == 1)
    for region in REGIONS:
        # Serving gave exactly the lent replicas; never below its floor of 1.
        assert world.serving_pods(region) == 4 - LENT[region] // 8
        pool = world.get(region, "inferencepool", POOL)["status"]
        assert pool["lent"] == [{"run": RUN, "replicas": LENT[region] // 8}]
        lent_events = [e for e in world.events(region, POOL) if e["reason"] == "GPUsLent"]
        assert lent_events and f"to {RUN}" in lent_events[0]["message"]
        # The mirror is labelled with its origin and has no cross-cluster ownerReference.
        mirror = world.get(region, "rlrun", RUN)
        assert mirror["metadata"]["labels"]["rlfleet.io/origin"] == HUB
        assert "ownerReferences" not in mirror["metadata"]
        wait_for(
            "four warm sandboxes",
            lambda r=region: (
                world.get(r, "envpool", "arith-sandbox").get("status", {}).get("ready") == 4
            ),
        )
        policy = world.get(region, "networkpolicy", "arith-sandbox-sandbox")
        assert not policy["spec"].get("egress") and "Egress" in policy["spec"]["policyTypes"]
    wait_for("Ready", lambda: world.condition("Ready").get("status") == "True")
    status = world.run_status()
    assert status["phase"] == "Running" and status["trainerReplicas"] == 1
    assert {e["name"]: e["running"] for e in status["regions"]} == LENT
    assert "GPUsLent" in world.reasons(HUB, RUN)
    table = world.fleet.kubectl(HUB, "-n", world.ns, "get", "rlrun", RUN).splitlines()
    assert table[0].split()[:5] == ["NAME", "PHASE", "VERSION", "STALENESS", "GPUS-LENT"]
    assert table[1].split()[1] == "Running"
    # Rollout pods running: on the wide table (the default one is a production run's too).
    assert _columns(world, RUN, "-o", "wide")["RUNNING"] == "40"
    budget = world.get(HUB, "poddisruptionbudget", f"{RUN}-trainer")
    assert budget["spec"]["maxUnavailable"] == 0


@pytest.mark.usefixtures("lending")
def test_reconciles_and_their_cross_cluster_calls_are_traced(world: World) -> None:
    """Spans reach an OTLP endpoint: each reconcile names its object, and the hub's calls
    into a region are children of the reconcile that made them, naming the cluster."""

    def spans(service: str, name: str) -> list:
        return [s for s in list(world.traces.spans) if s.service == service and s.name == name]

    reconciles = wait_for(
        "the hub's RLRun reconciles",
        lambda: [
            s
            for s in spans("rlfleet-operator-hub", "reconcile RLRun")
            if s.attributes.get("rlfleet.name") == RUN
        ],
    )
    assert reconciles[0].attributes["k8s.namespace.name"] == world.ns

    def calls_into_region_a() -> list:
        seen = list(world.traces.spans)
        by_id = {s.span_id: s for s in seen}
        return [
            (s, by_id[s.parent_id])
            for s in seen
            if s.service == "rlfleet-operator-hub"
            and s.name.startswith("kube ")
            and s.attributes.get("k8s.cluster") == "region-a"
            and s.parent_id in by_id
        ]

    call, parent = wait_for("a call into region-a under a reconcile", calls_into_region_a)[0]
    assert parent.name == "reconcile RLRun" and parent.trace_id == call.trace_id
    pools = spans("rlfleet-operator-region", "reconcile InferencePool")
    assert POOL in {s.attributes["rlfleet.name"] for s in pools}
    assert world.traces.rejected == 0


def container_env(pod: dict) -> dict[str, str | None]:
    return {e["name"]: e.get("value") for e in pod["spec"]["containers"][0]["env"]}


@pytest.mark.usefixtures("lending")
def test_every_pod_reads_the_runs_mounted_spec_and_is_told_where_nats_is(world: World) -> None:
    """The environment `rlfleet.launch.pods.Placement` reads, as the operators set it: the
    trainer and the feed reach the hub's NATS, a rollout worker its region's leaf node and
    the hub's JetStream domain (from the mirror), and each names itself by its pod."""
    hub_pods = world.items(HUB, "pods", "-l", f"rlfleet.io/run={RUN}")
    rollout = world.items("region-a", "pods", "-l", "rlfleet.io/component=rollout")[0]
    spec = json.loads(world.get(HUB, "configmap", f"{RUN}-spec")["data"]["rlrun.json"])
    assert spec["run"] == world.key and spec["spec"]["rollout"]["groupSize"] == 8
    for pod in [*hub_pods, rollout]:
        container = pod["spec"]["containers"][0]
        assert container["args"] == ["--rlrun", "/etc/rlfleet/rlrun.json"]
        mounts = {m["name"]: m["mountPath"] for m in container["volumeMounts"]}
        assert mounts["spec"] == "/etc/rlfleet"
        pod_name = next(e for e in container["env"] if e["name"] == "RLFLEET_POD_NAME")
        assert pod_name["valueFrom"]["fieldRef"]["fieldPath"] == "metadata.name"
        # Its component's own NATS user, from the Secret the hub minted into this cluster.
        assert mounts["nats"] == "/var/run/secrets/rlfleet/nats"
        assert container_env(pod)["RLFLEET_NATS_CREDS"] == "/var/run/secrets/rlfleet/nats/creds"
        secrets = [v["secret"]["secretName"] for v in pod["spec"]["volumes"] if "secret" in v]
        component = pod["metadata"]["labels"]["rlfleet.io/component"]
        # A rollout worker also holds its run's token for the region's EnvPool.
        envpool = [f"{RUN}-envpool"] if pod is rollout else []
        assert secrets == [f"{RUN}-nats-{component}", *envpool]
    hub_nats = world.fleet.bed.nats.hub.url
    components = {p["metadata"]["labels"]["rlfleet.io/component"]: p for p in hub_pods}
    assert set(components) == {"trainer", "feed"}
    for pod in components.values():
        env = container_env(pod)
        assert env["RLFLEET_NATS_URL"] == hub_nats and env["RLFLEET_JETSTREAM_DOMAIN"] == "hub"
    feed = world.get(HUB, "deployment", f"{RUN}-feed")
    assert feed["spec"]["replicas"] == 1 and feed["spec"]["strategy"]["type"] == "Recreate"
    env = container_env(rollout)
    assert env["RLFLEET_REGION"] == "region-a" and env["RLFLEET_JETSTREAM_DOMAIN"] == "hub"
    assert env["RLFLEET_NATS_URL"] == "nats://nats.rlfleet-system.svc:4222"  # its endpoint


def assert_sized_and_scraped(pod: dict) -> None:
    """The pod asks for the CPU and memory it uses, and caps them, as the scheduler and
    the kubelet see it, and serves its metrics on its named port, annotated for scraping."""
    (container,) = pod["spec"]["containers"]
    name = pod["metadata"]["name"]
    for kind in ("requests", "limits"):
        assert {"cpu", "memory"} <= set(container["resources"].get(kind, {})), (name, kind)
    port = next(p["containerPort"] for p in container["ports"] if p["name"] == "metrics")
    annotations = pod["metadata"].get("annotations", {})
    assert annotations.get("prometheus.io/scrape") == "true", name
    assert annotations.get("prometheus.io/port") == str(port), name
    assert annotations.get("prometheus.io/path") == "/metrics", name
    assert container_env(pod)["RLFLEET_METRICS_PORT"] == str(port), name


@pytest.mark.usefixtures("lending")
def test_every_pod_of_the_run_asks_for_what_it_uses_and_serves_its_metrics(world: World) -> None:
    pods = world.items(HUB, "pods", "-l", f"rlfleet.io/run={RUN}")
    for region in REGIONS:
        pods += world.items(region, "pods", "-l", f"rlfleet.io/run={RUN}")
    components = {p["metadata"]["labels"]["rlfleet.io/component"] for p in pods}
    assert components == {"trainer", "feed", "rollout"}
    for pod in pods:
        assert_sized_and_scraped(pod)
        assert pod["status"]["phase"] == "Running", pod["metadata"]["name"]
    trainer = next(p for p in pods if p["metadata"]["labels"]["rlfleet.io/component"] == "trainer")
    gpus = trainer["spec"]["containers"][0]["resources"]["limits"]["nvidia.com/gpu"]
    assert gpus == "8"  # the spec's trainer.gpusPerReplica, as it was before sizes


class Sampler:
    """Samples a region's serving and rollout pods until stopped."""

    def __init__(self, world: World, region: str) -> None:
        self.samples: list[tuple[int, int, int]] = []  # (serving pods, rollout pods, replicas)
        self._stop = threading.Event()
        self.thread = threading.Thread(target=self._run, args=(world, region), daemon=True)
        self.thread.start()

    def _run(self, world: World, region: str) -> None:
        while not self._stop.is_set():
            pods = world.items(region, "pods")
            alive = [p for p in pods if p["status"].get("phase") not in ("Succeeded", "Failed")]
            serving = sum(1 for p in alive if p["metadata"]["labels"].get("app") == "chat-vllm")
            rollout = sum(
                1 for p in alive if p["metadata"]["labels"].get("rlfleet.io/component") == "rollout"
            )
            replicas = world.get(region, "deployment", "chat-vllm")["spec"]["replicas"]
            self.samples.append((serving, rollout, replicas))

    def stop(self) -> list[tuple[int, int, int]]:
        self._stop.set()
        self.thread.join()
        return self.samples


@pytest.mark.usefixtures("lending")
def test_a_traffic_spike_reclaims_the_gpus_and_serving_never_dips_below_its_floor(
    world: World,
) -> None:
    sampler = Sampler(world, "region-b")
    world.traffic.load["region-b"] = 200.0  # 100 requests per serving replica
    wait_for("serving back to 4", lambda: world.serving_pods("region-b") == 4)
    assert world.rollout_pods("region-b") == 0
    pool = world.get("region-b", "inferencepool", POOL)["status"]
    assert pool.get("lent", []) == [] and pool["observedTraffic"] == 200.0
    assert {"GPUsReclaiming", "GPUsReclaimed"} <= world.reasons("region-b", POOL)
    # The other regions kept lending; the hub's count follows.
    assert world.rollout_pods("region-a") == 2 and world.rollout_pods("region-c") == 1
    wait_for("hub sees 24 GPUs", lambda: world.run_status().get("gpusRunning") == 24)
    samples = sampler.stop()
    assert samples
    assert min(serving for serving, _, _ in samples) >= 1  # the floor
    assert min(replicas for _, _, replicas in samples) >= 1
    assert max(serving + rollout for serving, rollout, _ in samples) <= 4  # lent once
    # Quiet again: the GPUs go back to the run.
    world.traffic.load["region-b"] = 0.0
    wait_for("lending again", world.lent_everywhere)


@pytest.mark.usefixtures("lending")
def test_a_rollout_pod_still_draining_past_the_reclaim_deadline_is_killed(
    world: World,
) -> None:
    """A worker that does not finish its groups in time must not keep production waiting:
    past `reclaimDeadlineSeconds` the operator deletes its pod with no grace. A finalizer
    stands for a pod whose process will not stop (kwok's pods stop at once)."""
    region, hold = "region-c", "rlfleet.io/test-hold"
    deadline = {"spec": {"reclaimDeadlineSeconds": 2}}
    world.fleet.kubectl(
        region, "-n", world.ns, "patch", "inferencepool", POOL, "--type=merge",
        "-p", json.dumps(deadline),
    )  # fmt: skip
    (pod,) = world.items(region, "pods", "-l", "rlfleet.io/component=rollout")
    name = pod["metadata"]["name"]
    held = {"metadata": {"finalizers": [hold]}}
    world.fleet.kubectl(
        region, "-n", world.ns, "patch", "pod", name, "--type=merge", "-p", json.dumps(held)
    )
    try:
        world.traffic.load[region] = 200.0
        killed = wait_for(
            "the reclaim deadline's kill",
            lambda: [
                e for e in world.events(region, POOL) if e["reason"] == "ReclaimDeadlineExceeded"
            ],
        )
        assert killed[0]["type"] == "Warning"
        assert killed[0]["message"].startswith("1 rollout pods did not finish within 2s")
        stuck = world.get(region, "pod", name)["metadata"]
        assert stuck["deletionGracePeriodSeconds"] == 0  # deleted again, with no grace
        assert world.serving_pods(region) == 3  # its GPUs are not given twice meanwhile
    finally:
        world.fleet.kubectl(
            region, "-n", world.ns, "patch", "pod", name, "--type=merge",
            "-p", json.dumps({"metadata": {"finalizers": None}}),
        )  # fmt: skip
        deadline["spec"]["reclaimDeadlineSeconds"] = 20
        world.fleet.kubectl(
            region, "-n", world.ns, "patch", "inferencepool", POOL, "--type=merge",
            "-p", json.dumps(deadline),
        )  # fmt: skip
        world.traffic.load[region] = 0.0
    wait_for("lending again", world.lent_everywhere)


@pytest.mark.usefixtures("lending")
def test_an_operator_killed_mid_lend_converges_without_flapping(world: World) -> None:
    world.traffic.load["region-a"] = 200.0
    wait_for(
        "the reclaim to start",
        lambda: world.get("region-a", "inferencepool", POOL)["status"].get("lent") in ([], None),
    )
    world.fleet.crash_and_restart("region-a")
    world.traffic.load["region-a"] = 0.0
    wait_for(
        "the decision to lend",
        lambda: world.get("region-a", "inferencepool", POOL)["status"].get("lent"),
    )
    world.fleet.crash_and_restart("region-a")
    wait_for("lending", world.lent_everywhere)
    # Settled: nothing moves while nothing changes.
    sampler = Sampler(world, "region-a")
    time.sleep(8)
    samples = sampler.stop()
    assert set(samples) == {(2, 2, 2)}, samples


@pytest.mark.usefixtures("lending")
def test_a_region_cut_off_is_reported_and_rejoins_without_duplicates(world: World) -> None:
    world.fleet.links["region-c"].cut()
    try:
        wait_for(
            "region-c marked unreachable",
            lambda: world.condition("RolloutsDegraded").get("reason") == "RegionUnreachable",
        )
        status = world.run_status()
        entry = next(e for e in status["regions"] if e["name"] == "region-c")
        assert entry["reachable"] is False
        assert status["gpusRunning"] == 32  # region-c's 8 are not counted
        assert "RegionUnreachable" in world.reasons(HUB, RUN)
        # Training goes on; the other regions keep their rollouts.
        assert world.trainer_pods() == 1
        assert world.condition("Training")["status"] == "True"
    finally:
        world.fleet.links["region-c"].restore()
    wait_for("region-c back", lambda: world.condition("RolloutsDegraded").get("status") == "False")
    assert "RegionReachable" in world.reasons(HUB, RUN)
    assert len(world.items("region-c", "rlruns")) == 1
    assert len(world.items("region-c", "deployments", "-l", "rlfleet.io/component=rollout")) == 1
    wait_for("lending", world.lent_everywhere)


@pytest.mark.usefixtures("lending")
def test_a_broken_kubeconfig_secret_is_a_condition_and_an_event_not_a_crash(
    world: World,
) -> None:
    good = world.fleet.kubectl(
        HUB, "-n", RELEASE_NAMESPACE, "get", "secret", "rlfleet-region-region-b", "-o", "json"
    )
    world.fleet.region_secret("region-b", "this is: [not a kubeconfig")
    try:
        wait_for(
            "the credentials condition",
            lambda: world.condition("RolloutsDegraded").get("reason") == "RegionCredentialsInvalid",
        )
        assert "RegionCredentialsInvalid" in world.reasons(HUB, RUN)
        assert "rlfleet-region-region-b" in world.condition("RolloutsDegraded")["message"]
        assert world.fleet.supervisor.check_alive() is None
    finally:
        secret = json.loads(good)
        for key in ("resourceVersion", "uid", "creationTimestamp", "managedFields"):
            secret["metadata"].pop(key, None)
        world.fleet.kubectl(HUB, "apply", "-f", "-", stdin=json.dumps(secret))
    wait_for("healthy again", lambda: world.condition("RolloutsDegraded").get("status") == "False")


@pytest.mark.usefixtures("lending")
def test_a_region_dropped_while_it_refuses_the_hubs_token_is_forgotten_once_it_accepts(
    world: World,
) -> None:
    """Dropping a region from the spec deletes the run's mirror there. A region that
    refuses the hub's token (401) keeps the mirror for a later try, and the rest of the run
    is reconciled meanwhile (the reconcile used to fail whole, leaving the status stale)."""
    good = world.fleet.kubectl(
        HUB, "-n", RELEASE_NAMESPACE, "get", "secret", "rlfleet-region-region-b", "-o", "json"
    )
    refused = world.fleet.token_kubeconfig(
        "region-b", f"{RELEASE}-hub", world.fleet.links["region-b"].url
    )
    refused["users"][0]["user"]["token"] = "not-a-token-region-b-knows"
    spec = world.get(HUB, "rlrun", RUN)["spec"]

    def set_regions(names: set[str]) -> int:
        """The run's regions, and their NATS endpoints, cut down to these."""
        regions = [r for r in spec["rollout"]["regions"] if r["name"] in names]
        endpoints = [e for e in spec["weightSync"]["endpoints"] if e["region"] in names]
        patch = {"spec": {"rollout": {"regions": regions}, "weightSync": {"endpoints": endpoints}}}
        world.fleet.kubectl(
            HUB, "-n", world.ns, "patch", "rlrun", RUN, "--type=merge", "-p", json.dumps(patch)
        )
        return world.get(HUB, "rlrun", RUN)["metadata"]["generation"]

    def region_b() -> dict | None:
        return next((e for e in world.run_status()["regions"] if e["name"] == "region-b"), None)

    world.fleet.region_secret("region-b", refused)
    try:
        wait_for(
            "region-b refusing the hub's token",
            lambda: world.condition("RolloutsDegraded").get("reason") == "RegionCredentialsInvalid",
        )
        generation = set_regions(set(REGIONS) - {"region-b"})
        wait_for(
            "the run reconciled, region-b's mirror left for a later try",
            lambda: (
                world.run_status().get("observedGeneration") == generation
                and (region_b() or {}).get("reachable") is False
            ),
        )
        assert len(world.items("region-b", "rlruns")) == 1
    finally:
        secret = json.loads(good)
        for key in ("resourceVersion", "uid", "creationTimestamp", "managedFields"):
            secret["metadata"].pop(key, None)
        world.fleet.kubectl(HUB, "apply", "-f", "-", stdin=json.dumps(secret))
    wait_for("region-b's mirror deleted", lambda: not world.items("region-b", "rlruns"))
    wait_for("region-b gone from the status", lambda: region_b() is None)
    set_regions(set(REGIONS))
    wait_for("lending", world.lent_everywhere)


@pytest.mark.usefixtures("lending")
def test_an_envpool_serves_the_runs_claims_bursts_past_warm_and_scales_back(
    world: World,
) -> None:
    """Each sandbox pod's session server runs at its pod IP (`testbed.sandboxes`): the
    region operator counts what the servers say, mints the run's token, grows the pool
    while claims hold its sandboxes and, once they are given back, scales it back after
    idleSeconds, the idle pods first."""
    region, pool = "region-c", "arith-sandbox"
    patch = json.dumps({"spec": {"idleSeconds": 3}})  # back soon after the burst, here
    world.fleet.kubectl(
        region, "-n", world.ns, "patch", "envpool", pool, "--type=merge", "-p", patch
    )

    def status() -> dict:
        return world.get(region, "envpool", pool).get("status", {})

    def replicas() -> int:
        return world.get(region, "deployment", f"{pool}-sandbox")["spec"]["replicas"]

    wait_for(
        "four warm in one pod", lambda: (status().get("ready"), status().get("pods")) == (4, 1)
    )
    # The run's rollout pods are told where the pool is, with the token minted for them.
    rollout = world.get(region, "deployment", rollout_name(RUN, POOL))["spec"]["template"]["spec"]
    env = {e["name"]: e.get("value") for e in rollout["containers"][0]["env"]}
    assert env[ENVPOOL_URL_ENV] == f"http://{pool}-sandbox.{world.ns}.svc:{ENVPOOL_PORT}"
    mounted = {v["name"]: v.get("secret", {}).get("secretName") for v in rollout["volumes"]}
    assert mounted["envpool"] == envpool_token_secret(RUN)
    secret = world.get(region, "secret", envpool_token_secret(RUN))
    token = base64.b64decode(secret["data"][ENVPOOL_TOKEN_KEY]).decode()
    url = world.fleet.sandboxes.service_url(region, world.ns, pool)

    async def burst() -> None:
        async with EnvClient(url, "not-" + token, claim_seconds=2) as stranger:
            with pytest.raises(EnvServerError) as refused:
                await stranger.create(None)
            assert refused.value.status == 401
        async with EnvClient(url, token, claim_seconds=90) as env:
            # Six claims at once: four warm, and two that wait for the pool to burst.
            held = await asyncio.gather(*(env.create(None) for _ in range(6)))
            assert len({sandbox.url.split("/v1/")[0] for sandbox in held}) >= 2
            for sandbox in held:
                reply = await sandbox.call({"tool": "run", "command": "echo ok"})
                assert reply["output"] == "ok\n"
            grown = lambda: (  # noqa: E731
                status().get("claimed") == 6 and status().get("pods") == 3 and replicas() == 3
            )
            await asyncio.to_thread(wait_for, "three pods for six claims and four warm", grown)
            assert status()["bursting"] == 8
            table = world.fleet.kubectl(region, "-n", world.ns, "get", "envpool", pool)
            assert table.split()[:6] == ["NAME", "READY", "CLAIMED", "WARMING", "BURSTING", "AGE"]
            for sandbox in held:
                await sandbox.close()

    asyncio.run(burst())
    wait_for(
        "back to one pod, four warm",
        lambda: (status().get("pods"), status().get("claimed"), replicas()) == (1, 0, 1),
    )
    assert status().get("bursting") == 0


@pytest.mark.usefixtures("lending")
def test_a_run_borrowing_from_two_pools_gets_its_demand_once(world: World) -> None:
    """Two pools that could each lend the run all it asks for decide one at a time and see
    each other's decision, however fresh their view of the other pool is. The run's
    rollouts can use L4s only, which both pools serve on, and its two trainer pods need
    H100s: each kind of pod is placed on its GPU type, and the trainer's pods are one job.
    It names an EnvPool the region lacks, which the run says at once, naming the field."""
    region, pools, run = "region-c", ["spare-1", "spare-2"], "two-pools"
    document = example("rlrun.yaml")
    document["metadata"]["name"] = run
    spec = document["spec"]
    spec["rollout"]["regions"] = [
        {"name": region, "minGpus": 0, "maxGpus": 4, "inferencePools": pools, "gpuTypes": [L4]}
    ]
    # Beside the first run's trainer (one 8-GPU pod), 8 of the hub's 16 GPUs are free.
    spec["trainer"] = {"replicas": 2, "gpusPerReplica": 4, "gpuType": H100}
    spec["rollout"]["envPool"] = "no-such-pool"
    spec["weightSync"]["endpoints"] = [
        e for e in spec["weightSync"]["endpoints"] if e["region"] == region
    ]

    def lent() -> list[int]:
        """Replicas each pool lends the run, as decided."""
        found = []
        for name in pools:
            status = world.get(region, "inferencepool", name).get("status") or {}
            found.append(sum(e["replicas"] for e in status.get("lent", []) if e["run"] == run))
        return found

    for name in pools:
        # Each may lend one of its two replicas of 4 GPUs: all the run asks for here.
        world.apply(region, serving_deployment(name, replicas=2, gpus=4))
        pool = example("inferencepool.yaml")
        pool["metadata"]["name"] = name
        pool["spec"]["serving"] |= {
            "deploymentName": name,
            "replicas": 2,
            "gpusPerReplica": 4,
            "gpuType": L4,
        }
        world.traffic.load[name] = 0.0
        pool["spec"]["traffic"]["metricsUrl"] = world.traffic.url(name)
        world.apply(region, pool)
    try:
        world.apply(HUB, document)
        seen = []
        deadline = time.monotonic() + 90
        while time.monotonic() < deadline and (not seen or sum(seen[-1]) < 1):
            seen.append(lent())
            time.sleep(0.2)
        settled = time.monotonic() + 6  # several resyncs of both pools
        while time.monotonic() < settled:
            seen.append(lent())
            time.sleep(0.2)
        assert seen[-1] in ([1, 0], [0, 1]), seen
        assert max(sum(s) for s in seen) == 1, seen
        assert_placed_on_gpu_types(world, region, run)
        assert_one_trainer_job(world, run)
        missing = wait_for(
            "the run told its EnvPool is missing",
            lambda: run_condition(world, run, "EnvPoolNotFound"),
        )
        assert "spec.rollout.envPool: no EnvPool no-such-pool" in missing["message"]
        assert "EnvPoolNotFound" in world.reasons(HUB, run)
        # Narrowed to a type neither pool serves on: both lend it nothing, and the run
        # says why, naming the field.
        narrowed = [{"op": "replace", "path": "/spec/rollout/regions/0/gpuTypes", "value": [A10G]}]
        world.fleet.kubectl(
            HUB, "-n", world.ns, "patch", "rlrun", run, "--type=json", "-p", json.dumps(narrowed)
        )
        wait_for("the pools lend the run nothing", lambda: sum(lent()) == 0)
        degraded = wait_for(
            "the run told why", lambda: run_condition(world, run, "NoPoolOfGpuType")
        )
        assert f"spec.rollout.regions[{region}].gpuTypes {A10G}" in degraded["message"]
        assert "NoPoolOfGpuType" in world.reasons(HUB, run)
    finally:
        world.fleet.kubectl(HUB, "-n", world.ns, "delete", "rlrun", run, "--wait=false")
        for name in pools:
            world.fleet.kubectl(region, "-n", world.ns, "delete", "inferencepool", name)
            world.fleet.kubectl(region, "-n", world.ns, "delete", "deployment", name)


@pytest.mark.attack("kubernetes")
def test_an_inferencepool_naming_another_teams_deployment_scales_nothing(world: World) -> None:
    """An InferencePool scaled an unlabelled Deployment of another team in its namespace
    from 5 replicas to 1 because it named it. Lending takes GPUs from production: naming
    a Deployment is not enough, its owner's label is, and the pool says so."""
    region, name, pool_name = "region-a", "other-team", "poacher"
    theirs = serving_deployment(name, replicas=5, gpus=0)  # no GPU the run's pods need
    del theirs["metadata"]["labels"][LENDABLE_LABEL]
    world.apply(region, theirs)
    pool = example("inferencepool.yaml")
    pool["metadata"]["name"] = pool_name
    pool["spec"]["serving"] |= {"deploymentName": name, "replicas": 5}
    world.traffic.load[pool_name] = 0.0  # idle: it would lend all it may
    pool["spec"]["traffic"]["metricsUrl"] = world.traffic.url(pool_name)
    world.apply(region, pool)

    def told() -> dict | None:
        status = world.get(region, "inferencepool", pool_name).get("status") or {}
        found = [c for c in status.get("conditions", []) if c["reason"] == "ServingNotLendable"]
        return found[0] if found else None

    try:
        ready = wait_for("the pool told why", told)
        assert ready["status"] == "False" and f'{LENDABLE_LABEL}: "true"' in ready["message"]
        assert "ServingNotLendable" in world.reasons(region, pool_name)
        time.sleep(4)  # several of the pool's resyncs
        assert world.get(region, "deployment", name)["spec"]["replicas"] == 5
    finally:
        world.fleet.kubectl(region, "-n", world.ns, "delete", "inferencepool", pool_name)
        world.fleet.kubectl(region, "-n", world.ns, "delete", "deployment", name)


A10G = "NVIDIA-A10G"  # a GPU type no pool of the bed serves on


def run_condition(world: World, run: str, reason: str) -> dict | None:
    """The run's RolloutsDegraded condition, once it gives `reason`."""
    conditions = world.get(HUB, "rlrun", run).get("status", {}).get("conditions", [])
    found = next((c for c in conditions if c["type"] == "RolloutsDegraded"), None)
    return found if found is not None and found["reason"] == reason else None


def node_terms(pod: dict) -> list[dict]:
    affinity = pod["spec"]["affinity"]["nodeAffinity"]
    return affinity["requiredDuringSchedulingIgnoredDuringExecution"]["nodeSelectorTerms"]


def assert_placed_on_gpu_types(world: World, region: str, run: str) -> None:
    """The run's rollout pod may go only to its pool's GPU type (the region's GPUs are all
    taken by now: it waits for one of those), its trainer pods run on the type it needs."""
    rollout = wait_for(
        "the run's rollout pod",
        lambda: world.items(
            region, "pods", "-l", f"rlfleet.io/run={run},rlfleet.io/component=rollout"
        ),
    )
    for pod in rollout:
        assert node_terms(pod) == [
            {"matchExpressions": [{"key": GPU_TYPE_LABEL, "operator": "In", "values": [L4]}]}
        ]
    selector = f"rlfleet.io/run={run},rlfleet.io/component=trainer"
    wait_for("two trainer pods running", lambda: world.running(HUB, selector) == 2)
    for pod in world.items(HUB, "pods", "-l", selector):
        node = world.fleet.kubectl(HUB, "get", "node", pod["spec"]["nodeName"], "-o", "json")
        assert json.loads(node)["metadata"]["labels"][GPU_TYPE_LABEL] == H100
        assert node_terms(pod)[0]["matchExpressions"][0]["values"] == [H100]


def assert_one_trainer_job(world: World, run: str) -> None:
    """`trainer.replicas: 2` is one StatefulSet whose two pods read ranks 0 and 1 of one
    job (`Placement.from_env`, as the trainer does), meeting at pod 0 by its stable name."""
    (statefulset,) = world.items(HUB, "statefulsets", "-l", f"rlfleet.io/run={run}")
    assert statefulset["spec"]["replicas"] == 2
    pods = world.items(HUB, "pods", "-l", f"rlfleet.io/run={run},rlfleet.io/component=trainer")
    ranks = sorted(
        (Placement.from_env(kubelet_env(pod)).ranks for pod in pods),
        key=lambda r: r.node_rank,
    )
    first = next(p for p in pods if p["metadata"]["name"].endswith("-0"))
    master = f"{first['spec']['hostname']}.{first['spec']['subdomain']}.{world.ns}.svc"
    assert [(r.node_rank, r.nodes, r.procs_per_node, r.master_addr) for r in ranks] == [
        (0, 2, 4, master),
        (1, 2, 4, master),
    ]
    assert first["spec"]["subdomain"] == statefulset["spec"]["serviceName"]
    service = world.get(HUB, "service", statefulset["spec"]["serviceName"])
    assert service["spec"]["clusterIP"] == "None"


def kubelet_env(pod: dict) -> dict[str, str]:
    """The container's environment as the kubelet would give it: values, and the downward
    API's labels of the pod (the StatefulSet controller labels each with its ordinal)."""
    env = {}
    for entry in pod["spec"]["containers"][0]["env"]:
        path = entry.get("valueFrom", {}).get("fieldRef", {}).get("fieldPath", "")
        if "value" in entry:
            env[entry["name"]] = entry["value"]
        elif path.startswith("metadata.labels['"):
            env[entry["name"]] = pod["metadata"]["labels"].get(path[17:-2], "")
    return env


def _secret_material(world: World) -> dict[str, str]:
    """Every long unbroken run of characters in the Secrets of the operators' and the run's
    namespaces in every cluster (NATS seeds and JWTs, EnvPool keys and tokens, region
    credentials), named by where it came from."""
    found = {}
    for cluster in [HUB, *REGIONS]:
        for namespace in (RELEASE_NAMESPACE, world.ns):
            listed = world.fleet.kubectl(cluster, "-n", namespace, "get", "secrets", "-o", "json")
            for secret in json.loads(listed)["items"]:
                if secret.get("type") == "helm.sh/release.v1":
                    continue  # the chart's own record: values, not credentials
                for key, value in (secret.get("data") or {}).items():
                    text = base64.b64decode(value).decode(errors="replace")
                    for token in re.findall(r"[A-Za-z0-9+/=_-]{32,}", text):
                        where = f"{cluster}/{namespace}/{secret['metadata']['name']}/{key}"
                        found[token] = where
    return found


@pytest.mark.usefixtures("lending")
def test_no_secret_appears_in_logs_events_status_or_arguments(world: World) -> None:
    """What the on-call reads and what `ps` shows: the operators' logs (and every other
    process the bed runs for the clusters), every event and every rlfleet object's status
    in every cluster, and every process's arguments."""
    secrets = _secret_material(world)
    assert len(secrets) > 10  # the run's NATS users, EnvPool tokens, region credentials
    haystacks = {
        str(path): path.read_text(errors="replace")
        for path in (world.fleet.work / "logs").rglob("*")
        if path.is_file()
    }
    for cluster in [HUB, *REGIONS]:
        haystacks[f"{cluster} events"] = world.fleet.kubectl(
            cluster, "get", "events", "-A", "-o", "json"
        )
        for kind in ("rlruns", "inferencepools", "envpools"):
            listed = json.loads(world.fleet.kubectl(cluster, "get", kind, "-A", "-o", "json"))
            statuses = [o.get("status", {}) for o in listed["items"]]
            haystacks[f"{cluster} {kind} status"] = json.dumps(statuses)
    for name, pid in world.fleet.supervisor.pids().items():
        with contextlib.suppress(OSError):
            haystacks[f"{name} arguments"] = Path(f"/proc/{pid}/cmdline").read_text()
    leaks = sorted(
        f"{where} in {place}"
        for token, where in secrets.items()
        for place, text in haystacks.items()
        if token in text
    )
    print(json.dumps({"secrets": len(secrets), "places": len(haystacks), "leaks": len(leaks)}))
    assert leaks == []


def test_the_operator_account_reads_secrets_only_in_its_namespace(world: World) -> None:
    account = f"system:serviceaccount:{RELEASE_NAMESPACE}:{RELEASE}-operator"

    def can(cluster: str, *args: str) -> str:
        try:
            return world.fleet.kubectl(cluster, "auth", "can-i", *args, f"--as={account}").strip()
        except RuntimeError as error:  # `can-i` exits 1 for "no"
            return str(error).split(":")[-1].strip() or "no"

    assert can(HUB, "get", "secrets", "-n", RELEASE_NAMESPACE) == "yes"
    assert can(HUB, "get", "secrets", "-n", world.ns).startswith("no")
    # The hub writes each run's NATS user beside the run, and cannot read one back.
    assert can(HUB, "create", "secrets", "-n", world.ns) == "yes"
    assert can("region-a", "get", "secrets", "-n", RELEASE_NAMESPACE).startswith("no")
    hub_account = f"system:serviceaccount:{RELEASE_NAMESPACE}:{RELEASE}-hub"
    allowed = world.fleet.kubectl(
        "region-a",
        "auth",
        "can-i",
        "create",
        "rlruns.rlfleet.io",
        "-n",
        world.ns,
        f"--as={hub_account}",
    )
    assert allowed.strip() == "yes"
    # A region writes the EnvPool tokens it mints and reads one Secret: its minting key.
    assert can("region-a", "patch", "secrets", "-n", world.ns) == "yes"
    assert can("region-a", "get", "secrets", "-n", world.ns).startswith("no")
    key = "secrets/rlfleet-envpool-key"
    assert can("region-a", "get", key, "-n", RELEASE_NAMESPACE) == "yes"
    assert can("region-a", "get", "secrets/other", "-n", RELEASE_NAMESPACE).startswith("no")


def test_the_chart_upgrades_cleanly_and_rejects_bad_values(world: World) -> None:
    upgraded = world.fleet.install("region-a", resyncSeconds=2)
    assert upgraded.returncode == 0, upgraded.stderr
    history = world.fleet.helm(
        "region-a", "history", RELEASE, "-n", RELEASE_NAMESPACE, "-o", "json"
    )
    assert json.loads(history.stdout)[-1]["status"] == "deployed"
    bad = world.fleet.install("region-a", role="trainer")
    assert bad.returncode != 0 and "role" in bad.stderr
    crd = json.loads(
        world.fleet.kubectl("region-a", "get", "crd", "rlruns.rlfleet.io", "-o", "json")
    )
    assert crd["metadata"]["annotations"]["helm.sh/resource-policy"] == "keep"


def on_hub_nats(world: World, work) -> object:
    async def connected():
        nc = await world.fleet.bed.nats.hub.connect()
        try:
            return await work(nc)
        finally:
            await nc.close()

    return asyncio.run(connected())


@pytest.mark.usefixtures("lending")
def test_the_hub_makes_the_run_streams_and_reports_the_trainers_progress(world: World) -> None:
    async def streams(nc) -> tuple[list[str], dict[str, str]]:
        hub = nc.jetstream()
        made = [(await hub.stream_info(name)).config.name for name in run_streams(world.key)]
        mirrors = {}
        for region in REGIONS:
            info = await nc.jetstream(domain=region).stream_info(weights_stream(world.key))
            mirrors[region] = info.config.mirror.name
        return made, mirrors

    made, mirrors = on_hub_nats(world, streams)
    # Named by namespace and name: a run of this name in another namespace is another run.
    assert made == run_streams(f"{world.ns}_{RUN}")
    assert mirrors == {r: weights_stream(world.key) for r in REGIONS}

    # The trajectories' bound follows the spec, changed or not.
    def backlog(nc):
        return nc.jetstream().stream_info(trajectory_stream(world.key))

    def backlog_mib(mib: int) -> None:
        patch = {"spec": {"trajectoryBacklogMib": mib}}
        world.fleet.kubectl(
            HUB, "-n", world.ns, "patch", "rlrun", RUN, "--type=merge", "-p", json.dumps(patch)
        )

    assert on_hub_nats(world, backlog).config.max_bytes == 8192 << 20  # the default
    backlog_mib(100)
    wait_for(
        "the trajectories' new bound",
        lambda: on_hub_nats(world, backlog).config.max_bytes == 100 << 20,
    )
    # More than the hub's JetStream can reserve: said, naming the field; the bound stays.
    backlog_mib(16 << 20)
    wait_for("InvalidSpec", lambda: world.condition("Ready").get("reason") == "InvalidSpec")
    assert "spec.trajectoryBacklogMib" in world.condition("Ready")["message"]
    told = [e for e in world.events(HUB, RUN) if e["reason"] == "InvalidSpec"]
    assert told and told[0]["type"] == "Warning"
    assert on_hub_nats(world, backlog).config.max_bytes == 100 << 20
    backlog_mib(8192)
    wait_for(
        "the default bound again",
        lambda: on_hub_nats(world, backlog).config.max_bytes == 8192 << 20,
    )
    wait_for(
        "Ready's InvalidSpec gone", lambda: world.condition("Ready").get("reason") != "InvalidSpec"
    )

    # The hub's API server audits what the operator's account did (`testbed.rbac`): the
    # run's status patches among it.
    audit = audit_log(world.fleet.bed.state_dir / "logs", HUB)
    patched = Grant("rlfleet-operator", "rlfleet.io", "rlruns/status", "patch")
    wait_for("the audit log", lambda: patched in used_grants(audit.read_text().splitlines()))

    def publish(report: StepReport):
        # What the trainer publishes after each durable step.
        return lambda nc: nc.jetstream().publish(step_subject(world.key), encode(report))

    on_hub_nats(world, publish(step_report(world.key, 7, time.time(), dropped_stale=3)))
    wait_for("policy version 7", lambda: world.run_status().get("policyVersion") == 7)
    status = world.run_status()
    assert status["trainerStep"] == 7 and status["staleness"] == 2
    assert status["trajectoriesDroppedStale"] == 3
    sync = status["lastWeightSync"]
    assert (sync["version"], sync["bytes"], sync["seconds"]) == (7, 12345, 0.25)
    assert world.condition("WeightSyncStalled")["status"] == "False"
    dropped = [e for e in world.events(HUB, RUN) if e["reason"] == "StalenessBoundExceeded"]
    assert dropped and dropped[0]["message"].startswith("3 trajectories arrived more than")
    row = world.fleet.kubectl(HUB, "-n", world.ns, "get", "rlrun", RUN).splitlines()[1].split()
    assert row[2:4] == ["7", "2"]  # VERSION, STALENESS

    def stall_after(seconds: int) -> None:
        patch = {"spec": {"weightSync": {"stallSeconds": seconds}}}
        world.fleet.kubectl(
            HUB, "-n", world.ns, "patch", "rlrun", RUN, "--type=merge", "-p", json.dumps(patch)
        )

    stall_after(2)
    wait_for("stalled", lambda: world.condition("WeightSyncStalled").get("status") == "True")
    assert world.condition("Ready")["status"] == "False"
    stalled = [e for e in world.events(HUB, RUN) if e["reason"] == "WeightSyncStalled"]
    assert stalled and "version 7 published at" in stalled[0]["message"]
    stall_after(900)
    on_hub_nats(world, publish(step_report(world.key, 8, time.time(), dropped_stale=3)))
    wait_for("policy version 8", lambda: world.run_status().get("policyVersion") == 8)
    wait_for("flowing", lambda: world.condition("WeightSyncStalled").get("status") == "False")
    wait_for("Ready again", lambda: world.condition("Ready").get("status") == "True")
    # No new drops, no new warning.
    assert len([e for e in world.events(HUB, RUN) if e["reason"] == "StalenessBoundExceeded"]) == 1


@pytest.mark.usefixtures("lending")
def test_a_run_stream_lost_is_made_again_at_the_next_resync(world: World) -> None:
    """Components only bind to a run's streams; the hub makes them. One lost (a NATS store
    wiped, a stream deleted by hand), a region's weights mirror too, comes back at the next
    resync, as a deleted pod would, instead of leaving the run's pods failing to bind."""

    async def delete(nc) -> None:
        await nc.jetstream().delete_stream(task_stream(world.key))
        await nc.jetstream(domain="region-a").delete_stream(weights_stream(world.key))

    async def present(nc) -> bool:
        try:
            await nc.jetstream().stream_info(task_stream(world.key))
            await nc.jetstream(domain="region-a").stream_info(weights_stream(world.key))
        except nats.js.errors.NotFoundError:
            return False
        return True

    on_hub_nats(world, delete)
    wait_for("the lost streams made again", lambda: on_hub_nats(world, present))


@pytest.mark.usefixtures("lending")
def test_the_hub_mints_each_component_its_own_nats_user_where_its_pods_run(
    world: World,
) -> None:
    """Each component's pods connect as a user the hub minted for that component of this
    run alone, from a Secret beside them: the rollout workers' in each region, the
    others' (those the run has) and the observer's in the hub. A worker's reaches its
    run's streams, cannot publish what the trainer does, and reaches no other run's."""

    def minted(cluster: str, role: str) -> tuple[dict, str]:
        secret = world.get(cluster, "secret", f"{RUN}-nats-{role}")
        return secret["metadata"], base64.b64decode(secret["data"]["creds"]).decode()

    for role in ("trainer", "feed", "observer"):
        meta, creds = minted(HUB, role)
        assert [o["kind"] for o in meta["ownerReferences"]] == ["RLRun"]  # it goes with the run
        assert claims_of(parse_creds(creds)[0])["name"] == f"run:{world.key}:{role}"
    # None for a component the run does not have (no gate: no evaluator).
    hub_secrets = world.items(HUB, "secrets", "-l", f"rlfleet.io/run={RUN}")
    assert f"{RUN}-nats-evaluator" not in {s["metadata"]["name"] for s in hub_secrets}
    for region in REGIONS:
        region_meta, creds = minted(region, "rollout")
        assert "ownerReferences" not in region_meta  # the hub deletes it with the mirror
        user = claims_of(parse_creds(creds)[0])
        assert user["name"] == f"run:{world.key}:rollout"
        secrets = world.items(region, "secrets", "-l", f"rlfleet.io/run={RUN}")
        assert {s["metadata"]["name"] for s in secrets} <= {
            f"{RUN}-nats-rollout",
            f"{RUN}-envpool",
        }

    async def reach() -> str:
        nc = await connection.connect(world.fleet.bed.nats.leaves["region-a"].url, creds)
        try:
            js = nc.jetstream(domain="hub", timeout=2)
            with pytest.raises(nats.errors.TimeoutError):
                await js.stream_info(step_stream("another-run"))
            with pytest.raises(nats.errors.TimeoutError):  # the trainer's, not a worker's
                await js.publish(step_subject(world.key), b"forged", timeout=2)
            return (await js.stream_info(trajectory_stream(world.key))).config.name
        finally:
            await nc.close()

    assert asyncio.run(reach()) == trajectory_stream(world.key)


@pytest.mark.usefixtures("lending")
def test_the_evaluation_gate_holds_a_run_that_fails_or_reaches_its_target(
    world: World,
) -> None:
    def gate(evaluation: dict | None) -> None:
        patch = {"spec": {"evaluation": evaluation}}
        world.fleet.kubectl(
            HUB, "-n", world.ns, "patch", "rlrun", RUN, "--type=merge", "-p", json.dumps(patch)
        )

    def replicas(component: str) -> list[int]:
        found = world.items(
            HUB, "statefulsets,deployments", "-l", f"rlfleet.io/component={component}"
        )
        return [o["spec"]["replicas"] for o in found]

    gate({"suite": "rules", "everyVersions": 10, "minReward": 0.5})
    wait_for("an evaluator", lambda: replicas("evaluator") == [1])
    # CPU-only (Hugging Face generate on the host): sized, and asking for no GPU.
    evaluator = wait_for(
        "the evaluator's pod",
        lambda: world.items(HUB, "pods", "-l", "rlfleet.io/component=evaluator"),
    )[0]
    assert_sized_and_scraped(evaluator)
    assert "nvidia.com/gpu" not in evaluator["spec"]["containers"][0]["resources"]["limits"]
    report = EvaluationReport(
        run=world.key,
        suite="rules",
        policy_version=8,
        reward=0.31,
        pass_at_k=0.7,
        attempts=8,
        tasks=80,
        finished_at=time.time(),
    )
    # What the evaluator publishes once it has scored a version.
    subject = evaluation_subject(world.key)
    on_hub_nats(world, lambda nc: nc.jetstream().publish(subject, encode(report)))
    wait_for("failed", lambda: world.run_status().get("phase") == "Failed")
    failed = world.condition("Failed")
    assert (failed["status"], failed["reason"]) == ("True", "EvaluationBelowFloor")
    assert "version 8 scored 0.3100" in failed["message"] and "minReward 0.5" in failed["message"]
    assert world.condition("Ready")["status"] == "False"
    assert world.run_status()["lastEvaluation"]["reward"] == 0.31
    # Held: nothing trains, nothing evaluates, and every region gives its GPUs back.
    for component in ("trainer", "feed", "evaluator"):
        wait_for(f"{component} at zero", lambda c=component: replicas(c) == [0])
    for region in REGIONS:
        wait_for(f"{region} gives back", lambda r=region: world.rollout_pods(r) == 0)
        mirror = world.get(region, "rlrun", RUN)
        assert mirror["spec"]["suspend"] is True
    reasons = world.reasons(HUB, RUN)
    assert {"Evaluated", "EvaluationBelowFloor"} <= reasons
    columns = _columns(world, RUN, "-o", "wide")
    assert (columns["PHASE"], columns["EVAL"]) == ("Failed", "0.31")

    gate({"suite": "rules", "everyVersions": 10, "minReward": 0.3})  # the on-call's call
    wait_for("running again", lambda: world.run_status().get("phase") == "Running")
    assert world.condition("Failed")["reason"] == "EvaluationAboveFloor"
    assert "EvaluationAboveFloor" in world.reasons(HUB, RUN)
    wait_for("lending again", world.lent_everywhere)
    # A target the last score meets: the run is done, and held the same way.
    gate({"suite": "rules", "everyVersions": 10, "minReward": 0.2, "targetReward": 0.3})
    wait_for("succeeded", lambda: world.run_status().get("phase") == "Succeeded")
    assert world.condition("Succeeded")["reason"] == "EvaluationReachedTarget"
    wait_for("trainer at zero", lambda: replicas("trainer") == [0])
    assert "EvaluationReachedTarget" in world.reasons(HUB, RUN)
    gate(None)
    wait_for("the evaluator gone", lambda: replicas("evaluator") == [])
    evaluator_user = f"metadata.name={RUN}-nats-evaluator"
    wait_for(
        "its NATS user gone with it",
        lambda: not world.items(HUB, "secrets", "--field-selector", evaluator_user),
    )
    wait_for("running without a gate", lambda: world.run_status().get("phase") == "Running")
    assert not world.condition("Failed") and not world.condition("Succeeded")


PRODUCTION_RUN = "tiny-moe-realtime"  # examples/realtime.yaml


def test_a_production_runs_cycles_show_in_its_status_columns_and_events(world: World) -> None:
    """A production run gets a collector and a conductor (in the operator's image) in the
    hub instead of a feed, each with its own NATS user, and its pool's servers theirs in
    the pool's region. What its conductor publishes becomes the run's status, its
    printer columns, and an event per transition, in order and once."""
    document = example("realtime.yaml")
    world.apply(HUB, document)
    key = run_key(world.ns, PRODUCTION_RUN)

    def components() -> dict[str, dict]:
        found = world.items(HUB, "deployments", "-l", f"rlfleet.io/run={PRODUCTION_RUN}")
        return {d["metadata"]["labels"]["rlfleet.io/component"]: d for d in found}

    made = wait_for("a collector and a conductor", lambda: len(components()) == 3 and components())
    assert set(made) == {"collector", "conductor", "evaluator"}  # no feed: no task suite
    conductor = made["conductor"]["spec"]["template"]["spec"]["containers"][0]
    assert conductor["image"].startswith("ghcr.io/rlfleet/operator:")
    assert conductor["command"] == ["python", "-m", "rlfleet.operator.conductor"]

    def creds(cluster: str, role: str) -> str:
        secret = wait_for(
            f"{role}'s NATS user in {cluster}",
            lambda: world.items(
                cluster,
                "secrets",
                "--field-selector",
                f"metadata.name={PRODUCTION_RUN}-nats-{role}",
            ),
        )[0]
        return base64.b64decode(secret["data"]["creds"]).decode()

    serving = claims_of(parse_creds(creds("region-a", "serving"))[0])
    assert serving["name"] == f"run:{key}:serving"

    def state(number: int, phase: CyclePhase, serving: int, **more) -> CycleState:
        return CycleState(
            run=key, number=number, phase=phase, since=time.time(), serving=serving, **more
        )

    rejected = FinishedCycle(1, CycleOutcome.REJECTED, 3, "version 3: suite reward -0.0800", 1.0)
    promoted = FinishedCycle(2, CycleOutcome.PROMOTED, 5, "version 5: canary +0.0200", 2.0)
    states = [
        state(1, CyclePhase.COLLECTING, 2),
        state(1, CyclePhase.TRAINING, 2, events=[CycleEvent("CycleCollected", "cycle 1: 64")]),
        state(
            2,
            CyclePhase.COLLECTING,
            2,
            history=[rejected],
            events=[CycleEvent("CandidateRejected", rejected.why)],
        ),
        state(
            2,
            CyclePhase.CANARY,
            2,
            candidate=5,
            history=[rejected],
            events=[CycleEvent("CanaryStarted", "version 5 on the canary set")],
        ),
        state(
            3,
            CyclePhase.COLLECTING,
            5,
            history=[rejected, promoted],
            events=[CycleEvent("CheckpointPromoted", promoted.why)],
            previous=2,
        ),
    ]
    report = CycleReport(
        run=key,
        cycle=2,
        capture_seq=90,
        captured=80,
        with_feedback=70,
        trained_on=64,
        dropped={"silent": 10, "capped": 6},
        signals={"accepted": 50},
        late_feedback=1,
        reward_mean=0.25,
        served_from=1.0,
        served_to=2.0,
        finished_at=3.0,
    )

    async def publish(as_conductor: str, as_collector: str) -> None:
        url = world.fleet.bed.nats.hub.url
        for user, subject, messages in (
            (as_collector, cycle_subject(key), [report]),
            (as_conductor, cycle_state_subject(key), states),
        ):
            nc = await connection.connect(url, user)
            try:
                for message in messages:
                    await nc.jetstream().publish(subject, encode(message))
            finally:
                await nc.close()

    # As the conductor and the collector would, with the users the hub minted them.
    asyncio.run(publish(creds(HUB, "conductor"), creds(HUB, "collector")))

    def production() -> dict:
        return world.get(HUB, "rlrun", PRODUCTION_RUN).get("status", {}).get("production", {})

    wait_for("cycle 3 in the status", lambda: production().get("cycle") == 3)
    shown = production()
    assert (shown["phase"], shown["servingVersion"]) == ("Collecting", 5)
    assert [(c["number"], c["outcome"], c["candidateVersion"]) for c in shown["history"]] == [
        (1, "Rejected", 3),
        (2, "Promoted", 5),
    ]
    assert shown["history"][0]["reason"] == rejected.why
    collected = shown["lastCollection"]
    assert (collected["cycle"], collected["trainedOn"], collected["withFeedback"]) == (2, 64, 70)
    assert collected["dropped"] == [
        {"reason": "capped", "count": 6},
        {"reason": "silent", "count": 10},
    ]
    columns = _columns(world, PRODUCTION_RUN)
    # What production serves, the candidate under way (none: cycle 3 collects), its stage
    # and how the last cycle ended; no staleness, which means nothing here.
    shown_columns = [columns[c] for c in ("SERVING", "CANDIDATE", "STAGE", "LAST", "STALENESS")]
    assert shown_columns == ["5", "", "Collecting", "Promoted", ""]
    conditions = {
        c["type"]: c for c in world.get(HUB, "rlrun", PRODUCTION_RUN)["status"]["conditions"]
    }
    progressing, last = conditions["Progressing"], conditions["Promoted"]
    assert (progressing["status"], progressing["reason"]) == ("False", "Collecting")
    assert progressing["message"].endswith("production serves version 5")
    assert (last["status"], last["reason"]) == ("True", "Promoted")
    assert last["message"].startswith("cycle 2, finished ") and last["message"].endswith(
        promoted.why
    )
    posted = world.events(HUB, PRODUCTION_RUN)
    events = {e["reason"]: e for e in posted}
    for reason in ("CycleCollected", "CandidateRejected", "CanaryStarted", "CheckpointPromoted"):
        # Each transition once, however often the hub reconciled since.
        assert [e.get("count", 1) for e in posted if e["reason"] == reason] == [1], reason
    assert events["CandidateRejected"]["type"] == "Warning"
    assert "GPUsLent" not in events  # it borrows none
    # Ready with its trainer up: it waits for no rollout GPUs.
    ready = wait_for(
        "Ready",
        lambda: next(
            (
                c
                for c in world.get(HUB, "rlrun", PRODUCTION_RUN)["status"]["conditions"]
                if c["type"] == "Ready" and c["status"] == "True"
            ),
            None,
        ),
    )
    assert ready["message"] == "training from the users of production pool chat"
    assert events["CheckpointPromoted"]["message"] == promoted.why

    assert shown["previousVersion"] == 2

    # On call: `rlfleet rollback` writes the order into the spec; the hub passes it on.
    rollback = [sys.executable, "-m", "rlfleet.cli", "rollback", PRODUCTION_RUN, "-n", world.ns]
    env = os.environ | {"KUBECONFIG": str(world.fleet.bed.kubeconfig)}
    done = subprocess.run(
        [*rollback, "--context", HUB], capture_output=True, text=True, env=env, timeout=120
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.startswith("order 1: tiny-moe-realtime serves version 2")
    spec = world.get(HUB, "rlrun", PRODUCTION_RUN)["spec"]["production"]
    assert spec["order"] == {"number": 1, "version": 2}

    async def passed_on(nc) -> ServeOrder | None:
        subject = serve_order_subject(key)
        return await newest(nc.jetstream(), cycle_stream(key), subject, decode_serve_order)

    order = wait_for("the order on NATS", lambda: on_hub_nats(world, passed_on))
    assert (order.run, order.number, order.version) == (key, 1, 2)
    # Asked again for version 5's (not kept) weights: refused before anything is written.
    promote = [*rollback[:3], "promote", PRODUCTION_RUN, "9", "-n", world.ns, "--context", HUB]
    done = subprocess.run(promote, capture_output=True, text=True, env=env, timeout=120)
    assert done.returncode == 1 and "version 9 cannot be served: only 2, 5" in done.stderr

    world.fleet.kubectl(HUB, "-n", world.ns, "delete", "rlrun", PRODUCTION_RUN, "--wait=false")
    wait_for(
        "its pool's NATS user gone with the run",
        lambda: not world.items("region-a", "secrets", "-l", f"rlfleet.io/run={PRODUCTION_RUN}"),
    )
    wait_for(
        "its hub objects gone",
        lambda: not world.items(HUB, "deployments", "-l", f"rlfleet.io/run={PRODUCTION_RUN}"),
    )


@pytest.mark.usefixtures("lending")
def test_a_production_runs_canary_set_comes_out_of_its_pools_serving_not_its_lending(
    world: World,
) -> None:
    """A production run's `canary.replicas` of its pool serve as the canary set: the
    region operator runs them as a Deployment of the serving Deployment's pods, labelled
    and told the canary set, owned by the pool. They come out of serving, not out of what
    the pool lends, and go back to the serving Deployment with the run."""
    region, run = "region-c", "canary-run"
    document = example("realtime.yaml")
    document["metadata"]["name"] = run
    document["spec"]["production"]["pool"] = {"region": region, "name": POOL}

    def lent() -> int:
        status = world.get(region, "inferencepool", POOL).get("status") or {}
        return sum(e["replicas"] for e in status.get("lent", []))

    def replicas(name: str) -> int | None:
        found = world.items(region, "deployments", "--field-selector", f"metadata.name={name}")
        return found[0]["spec"]["replicas"] if found else None

    lending = wait_for("the first run's replica lent", lambda: lent() or None)
    world.apply(HUB, document)
    try:
        wait_for("the canary set made", lambda: replicas("chat-vllm-canary") == 1)
        canary = world.get(region, "deployment", "chat-vllm-canary")
        assert canary["metadata"]["ownerReferences"][0]["kind"] == "InferencePool"
        pod = canary["spec"]["template"]
        assert pod["metadata"]["labels"] == {"app": "chat-vllm", "rlfleet.io/replica-set": "canary"}
        env = pod["spec"]["containers"][0]["env"]
        assert {"name": REPLICA_SET_ENV, "value": "canary"} in env
        wait_for("serving gave the canary a replica", lambda: replicas("chat-vllm") == 3 - lending)
        wait_for("the canary's pod serving", lambda: world.serving_pods(region) == 4 - lending)
        assert lent() == lending  # out of serving, not out of what the first run borrows
    finally:
        world.fleet.kubectl(HUB, "-n", world.ns, "delete", "rlrun", run, "--wait=false")
    wait_for("no canary set without the run", lambda: replicas("chat-vllm-canary") == 0)
    wait_for("serving whole again", lambda: replicas("chat-vllm") == 4 - lending)
    wait_for("every serving pod back", lambda: world.serving_pods(region) == 4 - lending)


def test_a_pools_status_shows_the_version_each_serving_replica_says_it_serves(
    world: World,
) -> None:
    """The region operator asks every running serving pod's server at the pool's port what
    it serves (the info metric `rlfleet.rollout.production.serving` exports) and shows the count per
    run, replica set and version, and in `kubectl get`; pods that say nothing (here
    kwok's) are counted apart."""
    region = "region-a"
    config = ServingConfig(run="prod-run", nats_url="nats://unused", replica_set="stable")
    VersionFollower(config, bus=None).announce(3, "d1ge57")
    pods = [
        p
        for p in world.items(region, "pods", "-l", "app=chat-vllm")
        if p["status"].get("phase") == "Running" and p["status"].get("podIP")
    ]
    assert len(pods) >= 2
    # Two pods answer as the server would (the same metric, from this process's registry).
    servers = [start_http_server(8000, addr=p["status"]["podIP"]) for p in pods[:2]]

    def status() -> dict:
        return world.get(region, "inferencepool", POOL)["status"]

    try:
        served = {"run": "prod-run", "replicaSet": "stable", "version": 3, "digest": "d1ge57"}
        wanted = [served | {"replicas": 2}]
        wait_for("two pods' versions", lambda: status().get("servedVersions") == wanted)
        shown = status()
        assert shown["unversionedReplicas"] == shown["servingReplicas"] - 2
        table = world.fleet.kubectl(region, "-n", world.ns, "get", "inferencepool", POOL)
        header, row = table.splitlines()
        assert row.split()[header.split().index("VERSIONS")] == "3"
    finally:
        for server, thread in servers:
            server.shutdown()
            thread.join()
    wait_for("no answer, no version", lambda: not status().get("servedVersions"))


@pytest.mark.usefixtures("lending")
def test_deleting_the_rlrun_cleans_up_all_four_clusters(world: World) -> None:
    secret = world.get("region-a", "secret", f"{RUN}-nats-rollout")
    leaked = base64.b64decode(secret["data"]["creds"]).decode()  # a worker's, say
    world.fleet.kubectl(HUB, "-n", world.ns, "delete", "rlrun", RUN, "--wait=false")
    wait_for("the hub object gone", lambda: not world.items(HUB, "rlruns"))
    for region in REGIONS:
        wait_for(f"{region} mirror gone", lambda r=region: not world.items(r, "rlruns"))
        wait_for(
            f"{region} rollouts gone",
            lambda r=region: (
                not world.items(r, "deployments", "-l", "rlfleet.io/component=rollout")
            ),
        )
        wait_for(f"{region} serving whole", lambda r=region: world.serving_pods(r) == 4)
        wait_for(
            f"{region} NATS user gone",
            lambda r=region: not world.items(r, "secrets", "-l", f"rlfleet.io/run={RUN}"),
        )
    wait_for("trainer gone", lambda: not world.items(HUB, "statefulsets"))
    wait_for("checkpoint claims gone", lambda: not world.items(HUB, "persistentvolumeclaims"))
    wait_for("feed gone", lambda: not world.items(HUB, "deployments"))
    assert not world.items(HUB, "poddisruptionbudgets")
    wait_for(
        "NATS user gone", lambda: not world.items(HUB, "secrets", "-l", f"rlfleet.io/run={RUN}")
    )

    async def left(nc) -> list[str]:
        """The run's streams still on the hub, and its weights' copies in the regions."""
        where = [("hub", nc.jetstream(), n) for n in run_streams(world.key)]
        where += [(r, nc.jetstream(domain=r), weights_stream(world.key)) for r in REGIONS]
        found = []
        for domain, js, name in where:
            with contextlib.suppress(nats.js.errors.NotFoundError):
                await js.stream_info(name)
                found.append(f"{domain}: {name}")
        return found

    # Nothing of the run is left on NATS for a run made again under its name to read.
    assert on_hub_nats(world, left) == []

    async def logs_in() -> bool:
        url = world.fleet.bed.nats.leaves["region-a"].url
        try:
            nc = await connection.connect(url, leaked, allow_reconnect=False, connect_timeout=5)
        except nats.errors.Error:
            return False
        await nc.close()
        return True

    # Its users were revoked with it: a credential it leaked no longer logs in.
    assert not asyncio.run(logs_in())


@pytest.mark.usefixtures("lending")
def test_no_operator_reconcile_raised(world: World) -> None:
    # What an on-call alerts on: each operator reconciled and says so on its metrics, and
    # none of its reconciles raised (a cut-off region, a broken kubeconfig, a crash and a
    # deletion are handled as conditions and events, not errors). Last in the file, it
    # covers every scenario above.
    for cluster in [HUB, *REGIONS]:
        samples = scrape(f"http://127.0.0.1:{world.fleet.metrics_ports[cluster]}/metrics")
        counted = {k: v for k, v in samples.items() if k.startswith(RECONCILES)}
        raised = {k: v for k, v in samples.items() if k.startswith(RECONCILE_ERRORS) and v}
        assert counted and all(counted.values()), f"operator-{cluster}: {counted}"
        assert raised == {}, f"operator-{cluster}: {raised}\n{world.fleet.log(cluster)[-4000:]}"

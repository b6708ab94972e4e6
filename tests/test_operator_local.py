"""The data plane under the control plane's decisions, on the real bed: the operators
(installed by the chart) create the run's trainer and rollout pods on kwok's nodes, and
`rlfleet.local.pods` runs each of them as a real local process: the trainer on DeepSpeed,
the rollout workers on vLLM, talking through NATS leaf nodes. A traffic spike in one
region reclaims its GPUs and so stops its worker while training goes on with the other
region; when traffic falls, the GPUs come back and a new worker resumes.
"""

from __future__ import annotations

import asyncio
import base64
import json
import threading
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass, field

import pytest
import yaml
from conftest import ROOT, wait_for

from rlfleet.api import launch
from rlfleet.api.rlrun import RLRunSpec
from rlfleet.api.wire import decode_step_report, decode_trajectory, step_subject, trajectory_subject
from rlfleet.local import plan
from rlfleet.local.pods import PodRunner, kube_pods
from rlfleet.local.run import make_model
from rlfleet.testbed.bed import BedInfo
from rlfleet.testbed.fleet import HUB, Fleet, TrafficServer, serving_deployment
from rlfleet.testbed.nats import NatsServer
from rlfleet.testbed.pki import write_secret
from rlfleet.testbed.processes import Supervisor

pytestmark = pytest.mark.bed

REGIONS = ["region-a", "region-b"]
POOL = "chat-prod"


def local_run() -> dict:
    """examples/local.yaml, borrowing one 8-GPU serving replica in each region."""
    run = yaml.safe_load((ROOT / "examples" / "local.yaml").read_text())
    run["spec"]["rollout"]["regions"] = [
        {"name": region, "maxGpus": 8, "inferencePools": [POOL]} for region in REGIONS
    ]
    return run


@dataclass
class Seen:
    """What the data plane says on the hub's NATS: who made each trajectory, each step."""

    workers: list[tuple[float, str]] = field(default_factory=list)
    steps: list[int] = field(default_factory=list)

    def workers_since(self, since: float) -> set[str]:
        return {worker for at, worker in list(self.workers) if at >= since}

    def regions_since(self, since: float) -> set[str]:
        return {region for region in REGIONS for w in self.workers_since(since) if region in w}


class Listener:
    """Subscribes to the run's trajectories and step reports on the hub (core NATS sees
    every message published to the subjects, before the trainer consumes it)."""

    def __init__(self, server: NatsServer, run: str) -> None:
        self.seen = Seen()
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.thread.start()
        asyncio.run_coroutine_threadsafe(self._subscribe(server, run), self.loop).result(30)

    async def _subscribe(self, server: NatsServer, run: str) -> None:
        self.nc = await server.connect()

        async def trajectory(msg) -> None:
            self.seen.workers.append((time.monotonic(), decode_trajectory(msg.data).worker))

        async def step(msg) -> None:
            self.seen.steps.append(decode_step_report(msg.data).step)

        await self.nc.subscribe(trajectory_subject(run), cb=trajectory)
        await self.nc.subscribe(step_subject(run), cb=step)

    def close(self) -> None:
        asyncio.run_coroutine_threadsafe(self.nc.close(), self.loop).result(30)
        self.loop.call_soon_threadsafe(self.loop.stop)


class Binding:
    """Runs `PodRunner.sync` in the background, and the run's processes' supervisor checks:
    a process that dies fails the test with its log."""

    def __init__(self, runner: PodRunner, supervisor: Supervisor) -> None:
        self.runner = runner
        self.supervisor = supervisor
        self.error: Exception | None = None
        self._stop = threading.Event()
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    def _run(self) -> None:
        while not self._stop.wait(0.5):
            try:
                self.runner.sync()
                self.supervisor.check_alive()
            except Exception as error:  # reported by `ok`, which every wait checks
                self.error = error
                return

    def ok(self) -> bool:
        if self.error is not None:
            raise AssertionError(f"the pod runner stopped: {self.error}")
        return True

    def regions_running(self) -> set[str]:
        self.ok()
        names = set(self.runner.running.values())
        return {region for region in REGIONS for name in names if region in name}

    def stop(self) -> None:
        self._stop.set()
        self.thread.join()
        self.supervisor.stop_all(grace_seconds=30)


@dataclass
class World:
    fleet: Fleet
    namespace: str
    traffic: TrafficServer
    run: str
    binding: Binding
    seen: Seen

    def kubectl_json(self, cluster: str, *what: str) -> dict:
        return json.loads(
            self.fleet.kubectl(cluster, "-n", self.namespace, "get", *what, "-o", "json")
        )

    # Generous: a vLLM worker on a shared core takes minutes to start after a busy module.
    def wait(self, what: str, check, timeout: float = 600.0):
        return wait_for(what, lambda: self.binding.ok() and check(), timeout=timeout)


@pytest.fixture(scope="module")
def world(
    bed: BedInfo, crds_installed: None, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[World]:
    work = tmp_path_factory.mktemp("local-fleet")
    namespace = f"local-{uuid.uuid4().hex[:6]}"
    fleet = Fleet(bed, work / "fleet", [namespace], REGIONS)
    fleet.values = {
        "resyncSeconds": 1,
        "runResyncSeconds": 1,
        "regionTimeoutSeconds": 5,
        "callTimeoutSeconds": 2,
    }
    traffic = TrafficServer()
    for cluster in [HUB, *REGIONS]:
        fleet.kubectl(cluster, "create", "namespace", namespace)
    fleet.setup()
    for region in REGIONS:
        traffic.load[region] = 0.0
        apply(fleet, region, namespace, serving_deployment("chat-vllm", replicas=2, gpus=8))
        pool = yaml.safe_load((ROOT / "examples" / "inferencepool.yaml").read_text())
        pool["spec"]["serving"]["replicas"] = 2
        pool["spec"]["traffic"]["metricsUrl"] = traffic.url(region)
        pool["spec"]["reclaimDeadlineSeconds"] = 20
        apply(fleet, region, namespace, pool)
    fleet.start_all()

    document = local_run()
    name, spec = document["metadata"]["name"], RLRunSpec.model_validate(document["spec"])
    layout = plan.Layout(work / "run")
    for folder in (layout.root, layout.logs, layout.configs, layout.nats):
        folder.mkdir(parents=True, exist_ok=True)
    make_model(spec, layout, warmup_steps=20)  # flow, not learning, is under test here
    processes = {p.name: p for p in plan.processes(name, spec, layout, bed.nats, plan.Tuning())}
    supervisor = Supervisor(layout.logs, attached=True)
    runner = PodRunner(
        name,
        processes,
        kube_pods(bed.kubeconfig, namespace, name),
        [HUB, *REGIONS],
        supervisor,
    )
    listener = Listener(bed.nats.hub, name)
    apply(fleet, HUB, namespace, document)
    # The processes connect as the run's own NATS user, the one the hub minted for its pods.
    secret = launch.nats_credentials_secret(name)
    key = launch.NATS_CREDENTIALS_KEY
    jsonpath = "-o=jsonpath={.data." + key + "}"
    minted = wait_for(
        "the run's NATS user",
        lambda: fleet.kubectl(
            HUB, "-n", namespace, "get", "secret", secret, "--ignore-not-found", jsonpath
        ),
    )
    creds = base64.b64decode(minted).decode()
    write_secret(layout.credentials, creds)
    binding = Binding(runner, supervisor)
    try:
        yield World(fleet, namespace, traffic, name, binding, listener.seen)
    finally:
        binding.stop()
        listener.close()
        fleet.release()
        fleet.stop()
        traffic.close()
        for link in fleet.links.values():
            link.listener.close()


def apply(fleet: Fleet, cluster: str, namespace: str, document: dict) -> None:
    fleet.kubectl(cluster, "-n", namespace, "apply", "-f", "-", stdin=json.dumps(document))


def test_the_operators_pods_train_with_rollouts_from_both_regions(world: World) -> None:
    world.wait("a worker per region", lambda: world.binding.regions_running() == set(REGIONS))
    world.wait("trajectories from both", lambda: world.seen.regions_since(0) == set(REGIONS))
    world.wait("training steps", lambda: len(world.seen.steps) >= 3)
    # The hub folds the real trainer's progress into the RLRun an on-call engineer reads.
    world.wait(
        "the policy version in the RLRun's status",
        lambda: (
            world.kubectl_json(HUB, "rlrun", world.run).get("status", {}).get("policyVersion", 0)
            >= 3
        ),
        60,
    )


def test_a_reclaim_stops_a_regions_rollouts_and_training_goes_on(world: World) -> None:
    world.wait("a worker per region", lambda: world.binding.regions_running() == set(REGIONS))
    world.traffic.load["region-a"] = 200.0  # serving needs every replica back
    world.wait("region-a's worker stopped", lambda: world.binding.regions_running() == {"region-b"})
    stopped_at = time.monotonic()
    # It drained: stopped taking tasks, finished its groups and exited cleanly.
    assert [code for name, code in world.binding.runner.exits.items() if "region-a" in name] == [0]
    steps_then = len(world.seen.steps)
    # A grace of a few seconds covers trajectories already in flight on the way to the hub;
    # ten steps can take less than that, so wait for trajectories made after it too.
    world.wait(
        "ten more steps, and trajectories after the grace",
        lambda: (
            len(world.seen.steps) >= steps_then + 10 and world.seen.regions_since(stopped_at + 5)
        ),
    )
    assert world.seen.regions_since(stopped_at + 5) == {"region-b"}
    serving = world.kubectl_json("region-a", "deployment", "chat-vllm")["spec"]["replicas"]
    assert serving == 2

    world.traffic.load["region-a"] = 0.0  # quiet again: the GPUs go back to the run
    world.wait("region-a's worker again", lambda: world.binding.regions_running() == set(REGIONS))
    resumed_at = time.monotonic()
    world.wait(
        "trajectories from region-a again",
        lambda: "region-a" in world.seen.regions_since(resumed_at),
    )
    # The new worker is named after the new pod: region-a has now had two.
    assert len({w for w in world.seen.workers_since(0) if "region-a" in w}) == 2

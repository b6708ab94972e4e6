"""The data plane under the control plane's decisions, on the real bed: the operators
(installed by the chart) create the run's trainer and rollout pods on kwok's nodes, and
`rlfleet.testbed.operated` (what `rlfleet run --operator` runs) binds each of them to a real
local process: the trainer on DeepSpeed, the rollout workers on vLLM, talking through NATS
leaf nodes. A traffic spike in one region reclaims its GPUs and so stops its worker while
training goes on with the other region; when traffic falls, the GPUs come back and a new
worker resumes. Last, on the same plane, the short chaos run: its parts killed and
restarted at random moments while it trains, then an audit from durable state of what was
lost or done twice (`bench/faults.py` is the long one).
"""

from __future__ import annotations

import asyncio
import json
import threading
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import pytest
import yaml
from conftest import ROOT, scrape, wait_for

from rlfleet.api.rlrun import RLRunSpec
from rlfleet.api.wire import decode_step_report, decode_trajectory, step_subject, trajectory_subject
from rlfleet.local import plan
from rlfleet.local.nats import NatsServer
from rlfleet.local.run import make_model
from rlfleet.rollout.environment.envclient import EnvClient
from rlfleet.testbed.audit import step_log
from rlfleet.testbed.bed import Bed
from rlfleet.testbed.chaos import ChaosPlane, FaultKind, faults_and_audit
from rlfleet.testbed.fleet import HUB
from rlfleet.testbed.operated import BUSY, QUIET

REGIONS = ["region-a", "region-b"]


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


@dataclass
class World:
    plane: ChaosPlane
    seen: Seen

    @property
    def run(self) -> str:
        return self.plane.name

    def kubectl_json(self, cluster: str, *what: str) -> dict:
        namespace = self.plane.namespace
        return json.loads(
            self.plane.fleet.kubectl(cluster, "-n", namespace, "get", *what, "-o", "json")
        )

    def regions_running(self) -> set[str]:
        self.plane.check_alive()
        return {region for region, workers in self.plane.binding.workers().items() if workers}

    def set_load(self, region: str, load: float) -> None:
        self.plane.traffic.load[region] = load

    # Generous: a vLLM worker on a shared core takes minutes to start after a busy module.
    def wait(self, what: str, check, timeout: float = 600.0):
        def checked():
            self.plane.check_alive()
            return check()

        return wait_for(what, checked, timeout=timeout)


@pytest.fixture(scope="module")
def world(
    testbed: Bed, crds_installed: None, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[World]:
    # examples/local.yaml as `rlfleet run --operator` runs it: each region borrows one
    # 8-GPU replica of its simulated serving fleet.
    document = yaml.safe_load((ROOT / "examples" / "local.yaml").read_text())
    name, spec = document["metadata"]["name"], RLRunSpec.model_validate(document["spec"])
    assert [r.name for r in spec.rollout.regions] == REGIONS
    layout = plan.Layout(tmp_path_factory.mktemp("local-fleet") / "run")
    for folder in (layout.root, layout.logs, layout.configs, layout.nats):
        folder.mkdir(parents=True, exist_ok=True)
    make_model(spec, layout, warmup_steps=20)  # flow, not learning, is under test here
    assert testbed.info is not None
    # A plane that takes faults once `faults_and_audit` starts them; until then, any of its
    # processes dying fails the test.
    plane = ChaosPlane(
        name,
        spec,
        layout,
        plan.Tuning(),
        bed=testbed.info,
        document=document,
        namespace=f"local-{uuid.uuid4().hex[:6]}",
        running_bed=testbed,
    )
    listener = Listener(testbed.info.nats.hub, plane.key)
    try:
        # Installs the chart, makes each region's serving fleet, applies the run, and
        # binds its pods to processes that log in as the NATS user the hub minted.
        with plane:
            yield World(plane, listener.seen)
    finally:
        listener.close()


async def claim_and_run(url: str, token: str) -> str:
    async with EnvClient(url, token) as env, await env.create(None) as sandbox:
        return (await sandbox.call({"tool": "run", "command": "echo ok"}))["output"]


def test_the_operators_pods_train_with_rollouts_from_both_regions(world: World) -> None:
    world.wait("a worker per region", lambda: world.regions_running() == set(REGIONS))
    world.wait("trajectories from both", lambda: world.seen.regions_since(0) == set(REGIONS))
    world.wait("training steps", lambda: len(world.seen.steps) >= 3)
    # Each bound process serves its metrics, as its pod does on its `metrics` port (a
    # counter moves just after the message it counts is out).
    started = world.plane.runner.started
    trainer = started["trainer"].metrics_url
    world.wait("steps counted", lambda: scrape(trainer)["rlfleet_trainer_steps_total"] >= 2, 30)
    assert scrape(trainer)['rlfleet_weightsync_published_bytes_total{kind="full"}'] > 0
    rollout = next(p for name, p in started.items() if name.startswith("rollout-")).metrics_url
    assert scrape(rollout)["rlfleet_rollout_trajectories_total"] >= 1
    # Each worker claims its sandboxes from its region's EnvPool: the servers bound to the
    # pool's pods, through its Service, with the token the region minted for the run.
    pools = [p.config.envpool for name, p in started.items() if name.startswith("rollout-")]
    assert pools and all(pool is not None for pool in pools)
    for pool in pools:
        assert asyncio.run(claim_and_run(pool.url, Path(pool.token_file).read_text())) == "ok\n"
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
    world.wait("a worker per region", lambda: world.regions_running() == set(REGIONS))
    world.set_load("region-a", BUSY)  # serving needs every replica back
    world.wait("region-a's worker stopped", lambda: world.regions_running() == {"region-b"})
    stopped_at = time.monotonic()
    # It drained: stopped taking tasks, finished its groups and exited cleanly.
    assert [code for name, code in world.plane.runner.exits.items() if "region-a" in name] == [0]
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

    world.set_load("region-a", QUIET)  # quiet again: the GPUs go back to the run
    world.wait("region-a's worker again", lambda: world.regions_running() == set(REGIONS))
    resumed_at = time.monotonic()
    world.wait(
        "trajectories from region-a again",
        lambda: "region-a" in world.seen.regions_since(resumed_at),
    )
    # The new worker is named after the new pod: region-a has now had two.
    assert len({w for w in world.seen.workers_since(0) if "region-a" in w}) == 2


def test_a_run_killed_at_random_loses_nothing(world: World) -> None:
    # Last on the plane: it ends with the run deleted. Each kind below is tried once in
    # the two minutes (seed 1); spikes had their test above, and `bench/faults.py` tries
    # every kind many times.
    kinds = (
        FaultKind.TRAINER,
        FaultKind.ROLLOUT,
        FaultKind.FEED,
        FaultKind.HUB_OPERATOR,
        FaultKind.REGION_OPERATOR,
        FaultKind.NATS_HUB,
        FaultKind.NATS_LEAF,
    )
    checkpoints = world.plane.runner.plan["trainer"].config.checkpoint_dir
    world.wait("a step", lambda: step_log(checkpoints))
    found = faults_and_audit(world.plane, minutes=2, seed=1, kinds=kinds, mean_gap_s=20)
    print(json.dumps(found))
    assert set(found["faults_injected"]) == set(kinds)
    for key in ("tasks_lost", "trajectories_lost", "trajectories_trained_twice"):
        assert found[key] == 0, key
    for key in ("versions_missing", "floor_violations", "pods_left", "crashes"):
        assert found[key] == 0, key
    # The audit read what it audits: every trajectory trained is on the stream.
    audited = found["audit"]
    assert audited["trajectories_published"] >= audited["trajectories_trained"] > 0
    assert audited["tasks_issued"] >= audited["tasks_attempted"] > 0 and found["floor_checks"]

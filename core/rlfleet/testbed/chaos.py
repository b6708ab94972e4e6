"""Faults at random moments in a run under the operators, and an audit of what was lost.

`ChaosPlane` is `rlfleet run --operator`'s plane with a kubelet's and a Deployment's
habits: a run's pod whose process dies is started again, and so is an operator. Its
`inject` kills or stops one part of the system (`FaultKind`); `schedule` says which,
and when, from a seed. After the run, `rlfleet.testbed.audit` says from durable state
what was lost or done twice.
"""

from __future__ import annotations

import dataclasses
import logging
import math
import os
import random
import secrets
import signal
import threading
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from enum import StrEnum
from pathlib import Path

import kubernetes

from rlfleet.api.meta import RUN_LABEL
from rlfleet.api.rlrun import RLRunSpec
from rlfleet.local import plan
from rlfleet.local.run import make_model
from rlfleet.testbed.audit import Ledger, audit, recovery_seconds, step_log
from rlfleet.testbed.bed import Bed
from rlfleet.testbed.fleet import HUB
from rlfleet.testbed.operated import BUSY, QUIET, SERVING, OperatedPlane

log = logging.getLogger(__name__)

SPIKE_S = 60.0  # how long a traffic spike lasts
STOP_S = 12.0  # a region's API server stopped: past the operators' region timeout (5 s)
FLOOR_REPLICAS = 1  # the bed's pools' minServingReplicas


class FaultKind(StrEnum):
    TRAINER = "trainer"  # SIGKILL, whatever it is doing: a step, a checkpoint, a publish
    ROLLOUT = "rollout"  # SIGKILL a rollout worker and its engine, mid-generation or publish
    FEED = "feed"
    EVALUATOR = "evaluator"
    HUB_OPERATOR = "hub-operator"  # SIGKILL, started again at once (a Deployment's pod)
    REGION_OPERATOR = "region-operator"
    NATS_HUB = "nats-hub"  # the hub's NATS server killed and started again on its store
    NATS_LEAF = "nats-leaf"  # a region's leaf node, likewise
    API_SERVER = "api-server"  # a region's kube-apiserver stopped for STOP_S, then resumed
    SPIKE = "spike"  # a region's serving traffic high for SPIKE_S: its GPUs are reclaimed


REGIONAL = {FaultKind.REGION_OPERATOR, FaultKind.NATS_LEAF, FaultKind.API_SERVER, FaultKind.SPIKE}


@dataclass(frozen=True)
class Fault:
    at_s: float  # from the start of the faults
    kind: FaultKind
    region: str | None = None


def schedule(
    seed: int,
    duration_s: float,
    regions: list[str],
    kinds: tuple[FaultKind, ...] = tuple(FaultKind),
    mean_gap_s: float = 30.0,
) -> list[Fault]:
    """Faults at exponentially spaced moments (a Poisson process), every kind in turn in
    a shuffled order before any kind comes again, so a long run tries each many times."""
    rng = random.Random(seed)
    faults: list[Fault] = []
    turn: list[FaultKind] = []
    at = rng.expovariate(1 / mean_gap_s)
    while at < duration_s:
        if not turn:
            turn = rng.sample(kinds, len(kinds))
        kind = turn.pop()
        faults.append(Fault(at, kind, rng.choice(regions) if kind in REGIONAL else None))
        at += rng.expovariate(1 / mean_gap_s)
    return faults


@dataclass
class Floor:
    """Watches each region's serving Deployment: replicas under its floor are violations."""

    plane: OperatedPlane
    checks: int = 0
    violations: int = 0
    _stop: threading.Event = field(default_factory=threading.Event)

    def __post_init__(self) -> None:
        self.apis = {
            region: kubernetes.client.AppsV1Api(
                kubernetes.config.new_client_from_config(
                    str(self.plane.bed.kubeconfig), context=region
                )
            )
            for region in self.plane.regions
        }
        self.thread = threading.Thread(target=self._watch, daemon=True)
        self.thread.start()

    def _watch(self) -> None:
        while not self._stop.wait(2.0):
            for api in self.apis.values():
                try:
                    scale = api.read_namespaced_deployment_scale(
                        SERVING, self.plane.namespace, _request_timeout=5
                    )
                except Exception:  # its API server is stopped: nothing to read
                    continue
                self.checks += 1
                self.violations += scale.spec.replicas < FLOOR_REPLICAS

    def stop(self) -> None:
        self._stop.set()
        self.thread.join()


class ChaosPlane(OperatedPlane):
    """An operated plane whose dead pods' processes and operators start again, and that
    injects faults into itself and the bed (`running_bed`: the bed's processes)."""

    def __init__(self, *args, running_bed: Bed, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.running_bed = running_bed
        self.faulting = False  # until `start_faults`, a death fails the plane as usual
        self.injected: list[tuple[float, FaultKind]] = []  # wall clock, kind
        self.crashes: list[str] = []  # processes that died with no fault to kill them
        self._undo: list[tuple[float, Callable[[], None]]] = []  # (monotonic due, action)

    def start_faults(self) -> None:
        """From now on, what dies is started again (a fault's victim, or a crash)."""
        self.faulting = True
        self.runner.restart_exited = True

    def check_alive(self) -> None:
        """Once faults start, an operator or a bed server that died on its own is a crash:
        counted, and started again (as its Deployment, or systemd, would)."""
        if not self.faulting:
            super().check_alive()
            return
        for name in self.fleet.supervisor.exited():
            log.warning("%s exited on its own: started again", name)
            self.crashes.append(name)
            self.fleet.supervisor.revive(name)
        for name in self.running_bed.supervisor.exited():
            log.warning("the bed's %s exited on its own: started again", name)
            self.crashes.append(name)
            self.running_bed.revive(name)
        self.crashes += self.runner.crashes_since_checked()
        self.undo_due()

    def wait(self, what: str, check, timeout: float = math.inf) -> None:
        """Waits for `check`, keeping the plane alive and ending faults when due."""
        deadline = time.monotonic() + timeout
        while not check():
            self.check_alive()
            if time.monotonic() > deadline:
                raise TimeoutError(f"no {what} in {timeout:.0f}s; logs in {self.layout.root}")
            time.sleep(0.5)

    @property
    def binding_sync_errors(self) -> int:
        return self.binding.sync_errors if self.binding else 0

    def ledger(self, checkpoints: Path) -> Ledger:
        leaves = {r: s.url for r, s in self.bed.nats.leaves.items() if r in self.regions}
        return Ledger.read(self.key, self.url, leaves, self.credentials, checkpoints)

    def delete_run(self) -> None:
        """Deletes the RLRun as a user would, waiting for the hub to let it go."""
        self.fleet.kubectl(
            HUB, "-n", self.namespace, "delete", "rlrun", self.name, "--timeout=120s"
        )

    def undo_due(self) -> None:
        now = time.monotonic()
        for due, action in [u for u in self._undo if u[0] <= now]:
            self._undo.remove((due, action))
            action()

    def inject(self, fault: Fault) -> bool:
        """Injects one fault now; False when its target is not there (no worker runs)."""
        pids = self.supervisor.pids()
        kind, region = fault.kind, fault.region
        if kind in (FaultKind.TRAINER, FaultKind.FEED, FaultKind.EVALUATOR):
            if kind not in pids:
                return False
            self._kill(pids[kind])
        elif kind == FaultKind.ROLLOUT:
            workers = sorted(name for name in pids if name.startswith("rollout-"))
            if not workers:
                return False
            self._kill(pids[random.Random(fault.at_s).choice(workers)])
        elif kind in (FaultKind.HUB_OPERATOR, FaultKind.REGION_OPERATOR):
            self.fleet.crash_and_restart(region or HUB)
        elif kind in (FaultKind.NATS_HUB, FaultKind.NATS_LEAF):
            self.running_bed.restart(f"nats-{region or HUB}")
        elif kind == FaultKind.API_SERVER:
            pid = self.running_bed.supervisor.pids()[f"{region}-kube-apiserver"]
            os.killpg(pid, signal.SIGSTOP)
            self._undo.append((time.monotonic() + STOP_S, lambda: os.killpg(pid, signal.SIGCONT)))
        elif kind == FaultKind.SPIKE:
            self.traffic.load[region] = BUSY
            quiet = lambda: self.traffic.load.__setitem__(region, QUIET)  # noqa: E731
            self._undo.append((time.monotonic() + SPIKE_S, quiet))
        self.injected.append((time.time(), kind))
        log.info("injected %s%s", kind, f" in {region}" if region else "")
        return True

    def _kill(self, pid: int) -> None:
        self.runner.killed.add(pid)
        os.killpg(pid, signal.SIGKILL)

    def finish_faults(self) -> None:
        """Ends what is still under way (a stopped API server, a spike)."""
        for _, action in self._undo:
            action()
        self._undo.clear()

    def pods_left(self, wait_s: float = 60.0) -> int:
        """After the RLRun's deletion: the run's pods still there in any cluster."""
        deadline = time.monotonic() + wait_s
        while True:
            left = 0
            for cluster in [HUB, *self.regions]:
                found = self.fleet.kubectl(
                    cluster, "-n", self.namespace, "get", "pods", "-l",
                    f"{RUN_LABEL}={self.name}", "-o", "name",
                )  # fmt: skip
                left += len(found.split())
            if not left or time.monotonic() > deadline:
                return left
            time.sleep(1.0)


FIRST_STEP_S = 900.0  # for the chart, the operators, vLLM's start and the first step
SETTLE_S = 300.0  # after the last fault, for the run to step again
MIRRORED_S = 60.0  # after the trainer stops, for every region to hold its newest version


def run_with_faults(
    bed: Bed,
    document: dict,
    root: Path,
    *,
    minutes: float,
    seed: int,
    kinds: tuple[FaultKind, ...] = tuple(FaultKind),
    mean_gap_s: float = 30.0,
) -> dict:
    """The RLRun under the bed's operators for `minutes` of faults after its first step,
    then stopped, audited and deleted. Returns the figures `bench/faults.py` prints."""
    assert bed.info is not None, "start the bed first"
    name, spec = document["metadata"]["name"], RLRunSpec.model_validate(document["spec"])
    layout = plan.Layout(root)
    for folder in (layout.root, layout.logs, layout.configs, layout.nats):
        folder.mkdir(parents=True, exist_ok=True)
    make_model(spec, layout, warmup_steps=20)  # faults, not learning, are under test
    plane = ChaosPlane(
        *(name, spec, layout, plan.Tuning()),
        bed=bed.info,
        document=document,
        namespace=f"chaos-{secrets.token_hex(3)}",
        running_bed=bed,
    )
    with plane:
        checkpoints = plane.runner.plan["trainer"].config.checkpoint_dir
        plane.wait("the first step", lambda: step_log(checkpoints), FIRST_STEP_S)
        return faults_and_audit(
            plane, minutes=minutes, seed=seed, kinds=kinds, mean_gap_s=mean_gap_s
        )


def faults_and_audit(
    plane: ChaosPlane,
    *,
    minutes: float,
    seed: int,
    kinds: tuple[FaultKind, ...] = tuple(FaultKind),
    mean_gap_s: float = 30.0,
) -> dict:
    """`minutes` of faults in a plane whose run has stepped, then the run stopped, audited
    and deleted. Returns the figures `bench/faults.py` prints."""
    faults = schedule(seed, minutes * 60, plane.regions, kinds, mean_gap_s)
    checkpoints = plane.runner.plan["trainer"].config.checkpoint_dir
    plane.start_faults()
    floor = Floor(plane)
    started, skipped = time.monotonic(), Counter()
    for fault in faults:
        moment = started + fault.at_s
        plane.wait("the fault's moment", lambda at=moment: time.monotonic() >= at)
        if not plane.inject(fault):
            skipped[fault.kind] += 1
    plane.wait("the end of the faults", lambda: time.monotonic() >= started + minutes * 60)
    plane.finish_faults()
    last = time.time()
    plane.wait("a step after the faults", lambda: _stepped_after(checkpoints, last), SETTLE_S)
    plane.stop_run()
    floor.stop()
    ledger = plane.ledger(checkpoints)
    deadline = time.monotonic() + MIRRORED_S
    while audit(ledger).versions_missing and time.monotonic() < deadline:
        time.sleep(2.0)
        ledger = plane.ledger(checkpoints)
    plane.delete_run()
    left = plane.pods_left()
    found = audit(ledger)
    return {
        "faults_injected": dict(Counter(kind for _, kind in plane.injected)),
        "faults_skipped": dict(skipped),  # no target at its moment (no worker running)
        "runs_completed": 1,
        "tasks_lost": found.tasks_lost,
        "trajectories_lost": found.trajectories_lost,
        "trajectories_trained_twice": found.trajectories_trained_twice,
        "versions_missing": found.versions_missing,
        "floor_violations": floor.violations,
        "floor_checks": floor.checks,
        "pods_left": left,
        "crashes": len(plane.crashes),
        "crashed": sorted(set(plane.crashes)),
        "restarts": plane.runner.restarts,
        "pod_sync_errors": plane.binding_sync_errors,
        "recovery_seconds": recovery_seconds(plane.injected, ledger.steps),
        "audit": dataclasses.asdict(found),
    }


def _stepped_after(checkpoints: Path, at: float) -> bool:
    return any(step.finished_at > at for step in step_log(checkpoints))

"""The operator-driven local mode: the pods the operator creates run as local processes.

On the test bed nodes are kwok's, so a pod reaches Running and nothing runs in it. Here
each of a run's pods is bound to a local process made by the same plan as `rlfleet run`,
so the data plane runs under the control plane's decisions: a rollout pod the operator
creates on lent GPUs starts a worker; a pod deleted on reclaim stops it (SIGTERM: the
worker stops taking tasks and publishes the groups under way); training goes on with the
workers left.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Callable, Iterable
from dataclasses import dataclass, replace
from pathlib import Path

import kubernetes
import msgspec

from rlfleet.api.meta import COMPONENT_LABEL, RUN_LABEL
from rlfleet.launch.pods import REGION_ENV
from rlfleet.launch.settings import PoolConfig
from rlfleet.local.plan import Process
from rlfleet.local.processes import Supervisor, free_port
from rlfleet.local.run import launch

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Pod:
    cluster: str
    name: str
    component: str
    region: str | None  # a rollout pod's region

    @property
    def key(self) -> str:
        return f"{self.cluster}/{self.name}"


# The components whose pods stand for a local process: the trainer, the feed, the rollout
# workers, the evaluator, and a production run's collector and conductor.
BOUND = ("trainer", "feed", "rollout", "evaluator", "collector", "conductor")


def live_pods(cluster: str, run: str, items: Iterable[dict]) -> list[Pod]:
    """The run's pods that stand for a process and are Running, not being deleted."""
    found = []
    for item in items:
        meta, status = item["metadata"], item.get("status", {})
        labels = meta.get("labels", {})
        component = labels.get(COMPONENT_LABEL)
        if labels.get(RUN_LABEL) != run or component not in BOUND:
            continue
        if meta.get("deletionTimestamp") or status.get("phase") != "Running":
            continue
        env = {
            e["name"]: e.get("value")
            for container in item["spec"]["containers"]
            for e in container.get("env", [])
        }
        found.append(Pod(cluster, meta["name"], component, env.get(REGION_ENV)))
    return found


def process_for(
    pod: Pod, plan: dict[str, Process], envpool: PoolConfig | None = None
) -> Process | None:
    """The local process a pod stands for: the plan's process of its component (one pod
    each), or its region's rollout worker named after the pod (`cluster/pod`, so
    trajectories say which pod made them), with a metrics port of its own (two pods of a
    region may run at once), claiming its sandboxes from `envpool` (its region's
    EnvPool), if given."""
    if pod.component != "rollout":
        return plan.get(pod.component)
    template = plan.get(f"rollout-{pod.region}")
    if template is None:
        return None
    name = f"rollout-{pod.cluster}-{pod.name}"
    config_path = str(Path(template.argv[-1]).with_name(f"{name}.json"))
    return replace(
        template,
        name=name,
        argv=[*template.argv[:-1], config_path],
        config=msgspec.structs.replace(
            template.config,
            name=pod.key,
            metrics_port=free_port(),
            **({"envpool": envpool} if envpool else {}),
        ),
    )


def kube_pods(kubeconfig: Path, namespace: str, run: str) -> Callable[[str], list[dict]]:
    """Lists the run's pods in `namespace` of a kubeconfig context (one client per context)."""
    apis: dict[str, kubernetes.client.CoreV1Api] = {}

    def list_pods(cluster: str) -> list[dict]:
        if cluster not in apis:
            client = kubernetes.config.new_client_from_config(str(kubeconfig), context=cluster)
            apis[cluster] = kubernetes.client.CoreV1Api(client)
        response = apis[cluster].list_namespaced_pod(
            namespace,
            label_selector=f"{RUN_LABEL}={run}",
            _preload_content=False,
            _request_timeout=10,
        )
        return json.loads(response.data)["items"]

    return list_pods


@dataclass
class PodRunner:
    """Keeps one local process per live pod: `sync` starts what is new, stops what is gone."""

    run: str
    plan: dict[str, Process]  # by name, from `plan.processes`
    list_pods: Callable[[str], list[dict]]  # cluster -> its pods in the run's namespace
    clusters: list[str]
    supervisor: Supervisor
    stop_grace_s: float = 30.0
    # Where a rollout pod's worker claims sandboxes: its region's EnvPool (None: its own).
    envpool_for: Callable[[Pod], PoolConfig | None] = lambda pod: None
    # As a kubelet: a live pod's process that exited is started again (restartPolicy
    # Always). Off, an exit is an error for whoever checks the supervisor.
    restart_exited: bool = False

    def __post_init__(self) -> None:
        self.running: dict[str, str] = {}  # pod key -> process name
        self.started: dict[str, Process] = {}  # process name -> as last started
        self.exits: dict[str, int | None] = {}  # process name -> exit code once stopped
        self.unbound: set[str] = set()  # pods with no process of their own, warned about once
        self.restarts: dict[str, int] = {}  # process name -> times started again
        self.killed: set[int] = set()  # pids killed on purpose (a fault injected)
        self._crashed: list[str] = []  # processes that died otherwise, not yet told

    def sync(self) -> None:
        if self.restart_exited:
            self._restart_exited()
        pods = {
            pod.key: pod
            for cluster in self.clusters
            for pod in live_pods(cluster, self.run, self.list_pods(cluster))
        }
        for key in sorted(set(self.running) - set(pods)):
            name = self.running[key]
            log.info("pod %s is gone: stopping %s", key, name)
            self.exits[name] = self.supervisor.stop(name, self.stop_grace_s)
            del self.running[key]  # only now: until it has exited, it still runs
        self.unbound &= set(pods)
        for key in sorted(set(pods) - set(self.running) - self.unbound):
            pod = pods[key]
            envpool = self.envpool_for(pod) if pod.component == "rollout" else None
            process = process_for(pod, self.plan, envpool)
            if process is None or process.name in self.running.values():
                # A region the plan lacks, or a second trainer replica: one machine runs one.
                log.warning("pod %s gets no local process of its own", key)
                self.unbound.add(key)
                continue
            url = process.metrics_url
            log.info("pod %s is running: starting %s, metrics at %s", key, process.name, url)
            launch(process, self.supervisor)
            self.running[key] = process.name
            self.started[process.name] = process

    def _restart_exited(self) -> None:
        pids = self.supervisor.pids()
        for name in self.supervisor.exited():
            if name in self.running.values():
                self.restarts[name] = self.restarts.get(name, 0) + 1
                log.warning("%s exited: started again (restart %d)", name, self.restarts[name])
                if pids[name] not in self.killed:
                    self._crashed.append(name)
                self.supervisor.revive(name)

    def crashes_since_checked(self) -> list[str]:
        """Processes that died with no fault to kill them, since the last call."""
        crashed, self._crashed = self._crashed, []
        return crashed

"""Attacks on the Kubernetes boundary, each tried against the bed's real API
servers with the chart installed by the real helm, watching one namespace. The attacker
holds an operator's ServiceAccount token (a region's above all: it runs beside
production), minted by the API server as the operator's own is, and calls the API with the
operator's own client (`rlfleet.operator.kube.Kube`). Requests that would change
something are server-side dry runs: the API server authorizes and admits them as it would
the real one, and stores nothing.

What no API server decides is read from the objects it stores: the mode a credential is
mounted with (which uid can read it is the kubelet's business, and kwok has none), and
who a NetworkPolicy admits to the trainer (the bed has no network plugin to enforce one),
by the NetworkPolicy API's own rules (`admits`)."""

from __future__ import annotations

import json
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import pytest
import yaml
from conftest import ROOT, Kubectl, wait_for
from kubernetes.client.exceptions import ApiException

from rlfleet.api.inferencepool import InferencePoolSpec
from rlfleet.api.meta import API_VERSION, COMPONENT_LABEL, RUN_LABEL
from rlfleet.operator.config import Images, NatsAccess, Workloads
from rlfleet.operator.kube import FIELD_MANAGER, Kube, Ref
from rlfleet.operator.workloads.envpool import envpool_objects
from rlfleet.operator.workloads.hub import TRAINER_PORT, hub_objects, mirror
from rlfleet.operator.workloads.rollout import rollout_deployment
from rlfleet.testbed.bed import BedInfo
from rlfleet.testbed.fleet import HUB, RELEASE, RELEASE_NAMESPACE, Fleet

REGION = "region-a"
RUN = "tiny-moe-arith"
VICTIM = "victim"
VICTIM_TOKEN = "s3cr3t-of-another-team"  # what a Secret outside the operator's reach holds
MERGE = "application/merge-patch+json"
NATS = NatsAccess(url="nats://nats.hub:4222", credentials_secret="rlfleet-nats")
METRICS_PORT = Workloads().metrics_port
HUB_IN_REGION = f"hub@{REGION}"
RLRUNS = f"/apis/{API_VERSION}/namespaces/{{}}/rlruns"
# Where the chart's default metrics scraper runs (`workloads.metricsScrapers`).
MONITORING = {"kubernetes.io/metadata.name": "monitoring"}


def example(name: str) -> dict:
    return yaml.safe_load((ROOT / "examples" / f"{name}.yaml").read_text())


@dataclass
class Boundary:
    kubectl: Kubectl
    # each cluster's, with its operator's ServiceAccount token; and HUB_IN_REGION, the
    # identity the hub acts as in the region (the chart's hub-access account)
    operators: dict[str, Kube]
    watched: str  # the namespace the operators watch (the chart's watchNamespaces)
    outside: str  # another team's namespace in the same clusters

    def admin(self, cluster: str, *args: str, stdin: str | None = None) -> str:
        return self.kubectl.run(cluster, *args, stdin=stdin).stdout

    def get(self, cluster: str, namespace: str, *what: str) -> dict:
        return json.loads(self.admin(cluster, "-n", namespace, "get", *what, "-o", "json"))

    def attempt(
        self, cluster: str, method: str, path: str, body: Any = None, content_type: str = MERGE
    ) -> tuple[int, str]:
        """The API server's answer to the operator's account: its status and body. A
        write is a dry run."""
        query = [] if method == "GET" else [("dryRun", "All")]
        try:
            answer = self.operators[cluster].request(
                method, path, body, query=query, content_type=content_type
            )
        except ApiException as error:
            body = error.body.decode() if isinstance(error.body, bytes) else str(error.body)
            return error.status, body
        return 200, json.dumps(answer)

    def apply(self, cluster: str, manifest: dict, dry_run: bool) -> dict:
        """A server-side apply as the operator makes one (`Kube.apply`)."""
        query = [("fieldManager", FIELD_MANAGER), ("force", "true")]
        return self.operators[cluster].request(
            "PATCH",
            Ref.of(manifest).path(),
            manifest,
            query=query + ([("dryRun", "All")] if dry_run else []),
            content_type="application/apply-patch+yaml",
        )


def victims(namespace: str) -> list[dict]:
    """What another team keeps in its namespace: a pod, a Secret, a Deployment (at zero:
    nothing of it runs), a NetworkPolicy that shuts its pods off."""
    labels = {"app": VICTIM}
    pod_spec = {"containers": [{"name": "app", "image": "busybox"}]}
    return [
        {
            "apiVersion": "v1",
            "kind": "Pod",
            "metadata": {"name": VICTIM, "namespace": namespace, "labels": labels},
            "spec": pod_spec,
        },
        {
            "apiVersion": "v1",
            "kind": "Secret",
            "metadata": {"name": VICTIM, "namespace": namespace},
            "stringData": {"token": VICTIM_TOKEN},
        },
        {
            "apiVersion": "apps/v1",
            "kind": "Deployment",
            "metadata": {"name": VICTIM, "namespace": namespace, "labels": labels},
            "spec": {
                "replicas": 0,
                "selector": {"matchLabels": labels},
                "template": {"metadata": {"labels": labels}, "spec": pod_spec},
            },
        },
        {
            "apiVersion": "networking.k8s.io/v1",
            "kind": "NetworkPolicy",
            "metadata": {"name": VICTIM, "namespace": namespace},
            "spec": {"podSelector": {}, "policyTypes": ["Ingress"]},
        },
    ]


@pytest.fixture(scope="module")
def boundary(
    bed: BedInfo, kubectl: Kubectl, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Boundary]:
    """The chart in the hub and a region, watching one namespace; another team's objects
    in a namespace beside it (and their pod and Deployment in the watched one, but not
    their NetworkPolicy, which would isolate the trainer there); and a run (suspended:
    nothing runs) whose objects the hub's account applied as its operator does."""
    suffix = uuid.uuid4().hex[:6]
    watched, outside = f"atk-{suffix}", f"atk-out-{suffix}"
    fleet = Fleet(bed, tmp_path_factory.mktemp("attacks-fleet"), [watched], [REGION])
    clusters = (HUB, REGION)
    try:
        for cluster in clusters:
            for namespace in (watched, outside):
                kubectl.run(cluster, "create", "namespace", namespace)
            installed = fleet.install(cluster)
            assert installed.returncode == 0, installed.stderr
            kubectl.run(cluster, "wait", "--for=condition=Established", "crd", "--all")
        operators = {
            cluster: Kube.from_kubeconfig(
                fleet.token_kubeconfig(cluster, f"{RELEASE}-operator"), cluster, timeout_s=30
            )
            for cluster in clusters
        }
        operators[HUB_IN_REGION] = Kube.from_kubeconfig(
            fleet.token_kubeconfig(REGION, f"{RELEASE}-hub"), REGION, timeout_s=30
        )
        world = Boundary(kubectl, operators, watched, outside)
        for cluster in clusters:
            for namespace in (watched, outside):
                wait_for(
                    f"{namespace}'s default ServiceAccount in {cluster}",
                    lambda c=cluster, n=namespace: (
                        kubectl.run(
                            c, "-n", n, "get", "serviceaccount", "default", check=False
                        ).returncode
                        == 0
                    ),
                    timeout=60,
                )
                theirs = victims(namespace)
                if namespace == watched:
                    theirs = [o for o in theirs if o["kind"] != "NetworkPolicy"]
                listed = {"apiVersion": "v1", "kind": "List", "items": theirs}
                world.admin(cluster, "apply", "-f", "-", stdin=json.dumps(listed))
        kubectl.forget_discovery()
        run = example("rlrun")
        run["spec"]["suspend"] = True
        world.admin(HUB, "-n", watched, "apply", "-f", "-", stdin=json.dumps(run))
        run = world.get(HUB, watched, "rlrun", RUN)
        for manifest in hub_objects(run, Images(), Workloads(), NATS):
            world.apply(HUB, manifest, dry_run=False)
        yield world
    finally:
        for cluster in clusters:
            for namespace in (watched, outside):
                kubectl.run(cluster, "delete", "namespace", namespace, "--wait=false", check=False)
        fleet.stop()


def refused(answer: tuple[int, str]) -> bool:
    """The API server refused the request for want of a permission."""
    return answer[0] == 403


# --- an operator's account, used outside its namespaces ---------------------------------


@pytest.mark.attack("kubernetes")
def test_region_operator_patches_a_pod_of_another_namespace(boundary: Boundary) -> None:
    """A pod patched by the region's account: its labels (which Service sends it
    traffic), its deletion cost, its image (changed in place, the pod runs it)."""
    relabel = {"metadata": {"labels": {"app": "x"}}}
    mine = boundary.attempt(
        REGION, "PATCH", f"/api/v1/namespaces/{boundary.watched}/pods/{VICTIM}", relabel
    )
    assert mine[0] == 200, mine  # its own namespace's pods: counted, costed
    theirs = boundary.attempt(
        REGION, "PATCH", f"/api/v1/namespaces/{boundary.outside}/pods/{VICTIM}", relabel
    )
    assert refused(theirs), theirs


@pytest.mark.attack("kubernetes")
def test_region_operator_deletes_a_pod_of_another_namespace(boundary: Boundary) -> None:
    path = f"/api/v1/namespaces/{boundary.outside}/pods/{VICTIM}"
    answer = boundary.attempt(REGION, "DELETE", path, content_type="application/json")
    assert refused(answer), answer


@pytest.mark.attack("kubernetes")
def test_region_operator_lists_the_pods_of_every_namespace(boundary: Boundary) -> None:
    """Every pod of the cluster, with its environment and the Secrets it mounts."""
    answer = boundary.attempt(REGION, "GET", "/api/v1/pods")
    assert refused(answer), answer[0]


@pytest.mark.attack("kubernetes")
def test_region_operator_reads_a_secret_of_another_namespace_through_a_patch(
    boundary: Boundary,
) -> None:
    """The account may not get a Secret, but a PATCH answers with the whole object: an
    empty patch reads it."""
    path = f"/api/v1/namespaces/{boundary.outside}/secrets/{VICTIM}"
    answer = boundary.attempt(REGION, "PATCH", path, {})
    assert refused(answer), answer[0]
    assert VICTIM_TOKEN not in answer[1] and '"data"' not in answer[1]


@pytest.mark.attack("kubernetes")
def test_region_operator_opens_a_network_policy_of_another_namespace(
    boundary: Boundary,
) -> None:
    """Another team's pods, shut off by a NetworkPolicy, opened to every pod of the
    cluster."""
    path = f"/apis/networking.k8s.io/v1/namespaces/{boundary.outside}/networkpolicies/{VICTIM}"
    answer = boundary.attempt(REGION, "PATCH", path, {"spec": {"ingress": [{}]}})
    assert refused(answer), answer


@pytest.mark.attack("kubernetes")
def test_hub_operator_runs_its_image_in_another_namespaces_deployment(
    boundary: Boundary,
) -> None:
    """A Deployment of another team rewritten to run the attacker's image, with all that
    namespace's pods may reach and mount."""
    image = {"spec": {"template": {"spec": {"containers": [{"name": "app", "image": "evil"}]}}}}
    deployments = "/apis/apps/v1/namespaces/{}/deployments/" + VICTIM
    mine = boundary.attempt(HUB, "PATCH", deployments.format(boundary.watched), image)
    assert mine[0] == 200, mine  # its runs' feeds and evaluators
    theirs = boundary.attempt(HUB, "PATCH", deployments.format(boundary.outside), image)
    assert refused(theirs), theirs


@pytest.mark.attack("kubernetes")
def test_hub_operator_plants_a_secret_in_another_namespace(boundary: Boundary) -> None:
    """A Secret written where another team's pods mount it by name (a pod waiting for
    its Secret takes whichever is made first)."""
    planted = {
        "apiVersion": "v1",
        "kind": "Secret",
        "metadata": {"name": "planted"},
        "stringData": {"token": "attacker"},
    }
    path = f"/api/v1/namespaces/{boundary.outside}/secrets"
    answer = boundary.attempt(HUB, "POST", path, planted, content_type="application/json")
    assert refused(answer), answer


@pytest.mark.attack("kubernetes")
def test_hub_identity_in_a_region_plants_a_secret_or_a_run_in_another_namespace(
    boundary: Boundary,
) -> None:
    """The account a region lends the hub (its token sits in the hub's cluster, a WAN away)
    writes Secrets and RLRuns: where the region's operators watch, nowhere else."""
    secret = {"apiVersion": "v1", "kind": "Secret", "metadata": {"name": "planted"}}
    run = example("rlrun") | {"metadata": {"name": "planted"}}
    for path, body in (("/api/v1/namespaces/{}/secrets", secret), (RLRUNS, run)):
        mine = boundary.attempt(
            HUB_IN_REGION, "POST", path.format(boundary.watched), body, "application/json"
        )
        assert mine[0] == 200, mine  # a run's mirror and its NATS user Secret
        theirs = boundary.attempt(
            HUB_IN_REGION, "POST", path.format(boundary.outside), body, "application/json"
        )
        assert refused(theirs), theirs


# --- what a run's pods are given ---------------------------------------------------------


def operators_pod_templates(boundary: Boundary) -> dict[str, dict]:
    """Every workload the operators make for a run, as the API server stores it (dry run,
    applied by the operator's own account): the hub's for the example run and a
    production run, with NATS users; a region's rollout workers, with their EnvPool's
    token; and the EnvPool's session servers."""
    run = example("rlrun")
    run["metadata"] |= {"namespace": boundary.watched, "uid": "run-uid"}
    production = example("realtime")
    production["metadata"] |= {"namespace": boundary.watched, "uid": "realtime-uid"}
    hub = [
        o
        for document in (run, production)
        for o in hub_objects(document, Images(), Workloads(), NATS)
        if o["kind"] in ("StatefulSet", "Deployment")
    ]
    copy = mirror(run, HUB, NATS) | {"apiVersion": run["apiVersion"]}
    copy["metadata"]["uid"] = "mirror-uid"
    pool = InferencePoolSpec.model_validate(example("inferencepool")["spec"])
    envpool = example("envpool")
    envpool["metadata"] |= {"namespace": boundary.watched, "uid": "envpool-uid"}
    region = [
        rollout_deployment(copy, "chat-prod", pool, 1, "img", Workloads(), REGION),
        *(
            o
            for o in envpool_objects(envpool, 1, {}, RELEASE_NAMESPACE)
            if o["kind"] == "Deployment"
        ),
    ]
    templates = {}
    for cluster, made in ((HUB, hub), (REGION, region)):
        for manifest in made:
            stored = boundary.apply(cluster, manifest, dry_run=True)
            templates[f"{cluster}/{stored['metadata']['name']}"] = stored["spec"]["template"]
    return templates


@pytest.mark.attack("kubernetes")
def test_another_uid_reads_a_credential_a_run_mounts(boundary: Boundary) -> None:
    """A mounted credential (a NATS user, an EnvPool token) read by a uid other than the
    one it is for. Its mode, as the API server stores it (0644 when none is given), must
    give others nothing and nobody a write; its group (the kubelet's fsGroup) may read it
    only where that group is the pod's own (fsGroup = runAsGroup, no supplementary
    groups): the pod's uid reads it, no other uid does."""
    credentials, found = 0, {}
    for name, template in operators_pod_templates(boundary).items():
        pod = template["spec"]
        context = pod.get("securityContext", {})
        own_group = (
            context.get("fsGroup") is not None
            and context.get("fsGroup") == context.get("runAsGroup")
            and not context.get("supplementalGroups")
        )
        for volume in pod.get("volumes", []):
            if "secret" not in volume:
                continue
            credentials += 1
            secret = volume["secret"]
            modes = [
                secret["defaultMode"],
                *(i["mode"] for i in secret.get("items", []) if "mode" in i),
            ]
            for mode in modes:
                if mode & 0o337 or (mode & 0o040 and not own_group):
                    found[f"{name}: {volume['name']}"] = oct(mode)
    print(json.dumps({"credentials_mounted": credentials, "readable_by_others": len(found)}))
    assert credentials >= 9, credentials  # six components' NATS users, EnvPool tokens
    assert not found, found


# --- who reaches the trainer -------------------------------------------------------------


def selects(selector: dict, labels: dict[str, str]) -> bool:
    """A label selector's verdict (`{}` selects everything)."""
    if any(labels.get(k) != v for k, v in selector.get("matchLabels", {}).items()):
        return False
    for term in selector.get("matchExpressions", []):
        present, value = term["key"] in labels, labels.get(term["key"])
        match term["operator"]:
            case "In":
                ok = present and value in term["values"]
            case "NotIn":
                ok = not present or value not in term["values"]
            case "Exists":
                ok = present
            case _:  # DoesNotExist
                ok = not present
        if not ok:
            return False
    return True


@dataclass(frozen=True)
class Peer:
    """A pod that opens a connection: its namespace's labels and its own."""

    namespace: dict[str, str]
    labels: dict[str, str]


def admits(policies: list[dict], target: dict, source: Peer, port: int) -> bool:
    """Whether the NetworkPolicies of the target pod's namespace let `source` reach
    `target` (a pod template and its namespace: {"namespace", "labels", "ports"}) on TCP
    `port`, by the API's rules: a pod no policy selects for ingress takes anything; a
    selected one, what some rule of some policy selecting it allows. A peer with a
    podSelector alone is a pod of the policy's namespace; a namespaceSelector alone,
    every pod of the namespaces it selects; both, those pods in those namespaces."""
    named = target["ports"]  # container port name -> number
    isolating = [
        p
        for p in policies
        if p["metadata"]["namespace"] == target["namespace"]
        and "Ingress" in p["spec"].get("policyTypes", ["Ingress"])
        and selects(p["spec"]["podSelector"], target["labels"])
    ]
    if not isolating:
        return True

    def peer_matches(peer: dict, namespace: str) -> bool:
        if "ipBlock" in peer:
            return True  # an address range may hold any pod: admitted, to be safe
        if "namespaceSelector" in peer:
            in_namespace = selects(peer["namespaceSelector"], source.namespace)
        else:
            in_namespace = source.namespace.get("kubernetes.io/metadata.name") == namespace
        return in_namespace and selects(peer.get("podSelector", {}), source.labels)

    def port_matches(entry: dict) -> bool:
        number = entry.get("port")
        if entry.get("protocol", "TCP") != "TCP":
            return False
        if number is None:
            return True
        number = named.get(number, number)
        return number <= port <= entry.get("endPort", number)

    for policy in isolating:
        namespace = policy["metadata"]["namespace"]
        for rule in policy["spec"].get("ingress", []):
            ports = rule.get("ports") or [{}]
            peers = rule.get("from")
            if any(port_matches(e) for e in ports) and (
                not peers or any(peer_matches(p, namespace) for p in peers)
            ):
                return True
    return False


def trainer_and_policies(boundary: Boundary) -> tuple[dict, list[dict]]:
    """The run's trainer pod as its StatefulSet (applied by the hub's account) makes it,
    and the NetworkPolicies the API server holds in its namespace."""
    statefulset = boundary.get(HUB, boundary.watched, "statefulset", f"{RUN}-trainer")
    template = statefulset["spec"]["template"]
    (container,) = template["spec"]["containers"]
    target = {
        "namespace": boundary.watched,
        "labels": template["metadata"]["labels"] | {"apps.kubernetes.io/pod-index": "0"},
        "ports": {p["name"]: p["containerPort"] for p in container["ports"]},
    }
    assert target["ports"] == {"metrics": METRICS_PORT, "rendezvous": TRAINER_PORT}
    policies = boundary.get(HUB, boundary.watched, "networkpolicies")["items"]
    return target, policies


def namespace_labels(name: str) -> dict[str, str]:
    return {"kubernetes.io/metadata.name": name}


@pytest.mark.attack("kubernetes")
def test_a_pod_of_another_run_joins_the_trainers_rendezvous(boundary: Boundary) -> None:
    """A pod of another run in the same namespace (or any pod there: a sandbox's, a
    user's) connects to rank 0's rendezvous port, where a process that joins the job's
    store can stall it or join it as a rank."""
    trainer, policies = trainer_and_policies(boundary)
    here = namespace_labels(boundary.watched)
    rank = Peer(here, {RUN_LABEL: RUN, COMPONENT_LABEL: "trainer"})
    assert admits(policies, trainer, rank, TRAINER_PORT)  # its own ranks meet there
    intruders = [
        Peer(here, {RUN_LABEL: "another-run", COMPONENT_LABEL: "trainer"}),
        Peer(here, {RUN_LABEL: RUN, COMPONENT_LABEL: "feed"}),  # its own feed has no need
        Peer(here, {"app": VICTIM}),
    ]
    for port in (TRAINER_PORT, 29501, 43117):  # the rendezvous, and collectives' ports
        let_in = [p.labels for p in intruders if admits(policies, trainer, p, port)]
        assert not let_in, f"port {port}: {let_in}"


@pytest.mark.attack("kubernetes")
def test_a_pod_of_another_namespace_posing_as_a_rank_reaches_the_trainer(
    boundary: Boundary,
) -> None:
    """Labels are anyone's to set on their own pods: a pod in another namespace labelled
    as one of the run's ranks, and one in the monitoring namespace, try the rendezvous;
    the monitoring one may scrape the metrics port, which nobody else may."""
    trainer, policies = trainer_and_policies(boundary)
    impostor = Peer(
        namespace_labels(boundary.outside), {RUN_LABEL: RUN, COMPONENT_LABEL: "trainer"}
    )
    scraper = Peer(MONITORING, {"app.kubernetes.io/name": "prometheus"})
    assert not admits(policies, trainer, impostor, TRAINER_PORT)
    assert not admits(policies, trainer, impostor, METRICS_PORT)
    assert not admits(policies, trainer, scraper, TRAINER_PORT)
    assert admits(policies, trainer, scraper, METRICS_PORT)  # Prometheus, as the chart says

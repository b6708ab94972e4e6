"""Every pod the operator makes, and the operator's own, as the bed's real API server judges
it: a namespace labelled `pod-security.kubernetes.io/enforce=restricted` makes the built-in
PodSecurity admission refuse any pod that runs as root, keeps a capability, may escalate
its privileges or has no seccomp profile. Each pod template is created there as a Pod with
a server-side dry run (nothing is stored, nothing runs), beside the checks the profile
leaves out: no ServiceAccount token where the pod does not call the API server, and a
read-only root wherever the process can live with one."""

from __future__ import annotations

import json
import uuid
from collections.abc import Iterator

import pytest
import yaml
from conftest import ROOT, Kubectl, wait_for
from kubernetes.client.exceptions import ApiException

from rlfleet.api.inferencepool import InferencePoolSpec
from rlfleet.api.meta import COMPONENT_LABEL
from rlfleet.operator.config import Images, NatsAccess, Workloads
from rlfleet.operator.kube import Kube
from rlfleet.operator.workloads.envpool import SANDBOX_CAPABILITIES, envpool_objects
from rlfleet.operator.workloads.hub import hub_objects, mirror
from rlfleet.operator.workloads.rollout import rollout_deployment
from rlfleet.testbed.bed import BedInfo
from rlfleet.testbed.fleet import rendered_chart

RESTRICTED = {
    "pod-security.kubernetes.io/enforce": "restricted",
    "pod-security.kubernetes.io/enforce-version": "latest",
}
# Only the operator talks to the API server.
NEEDS_TOKEN = {"operator-hub", "operator-region"}
WORKLOADS = ("StatefulSet", "Deployment")
PRODUCTION = ("collector", "conductor")  # a production run's own components


def _example(name: str) -> dict:
    document = yaml.safe_load((ROOT / "examples" / f"{name}.yaml").read_text())
    document["metadata"] |= {"namespace": "team-a", "uid": f"{name}-uid"}
    return document


def operator_pod_specs() -> dict[str, dict]:
    """What every pod the operator makes for a run runs as: the trainer (with checkpoint
    claims and a NATS user), the feed, the evaluator, a rollout worker (with its
    EnvPool's token), and a production run's collector and conductor."""
    run = _example("rlrun")
    run["spec"]["evaluation"] = {"suite": "rules", "everyVersions": 10}
    run["spec"].setdefault("trainer", {})["checkpointStorage"] = {"size": "10Gi"}
    nats = NatsAccess(url="nats://nats.hub:4222", credentials_secret="rlfleet-nats")
    workloads = Workloads()
    made = [o for o in hub_objects(run, Images(), workloads, nats) if o["kind"] in WORKLOADS]
    production = hub_objects(_example("realtime"), Images(), workloads, nats)
    made += [
        o
        for o in production
        if o["kind"] in WORKLOADS and o["metadata"]["labels"][COMPONENT_LABEL] in PRODUCTION
    ]
    copy = mirror(run, "hub", nats) | {"apiVersion": run["apiVersion"]}
    copy["metadata"]["uid"] = "mirror-uid"
    pool_spec = InferencePoolSpec.model_validate(_example("inferencepool")["spec"])
    made.append(rollout_deployment(copy, "chat-prod", pool_spec, 1, "img", workloads, "a"))
    specs = {}
    for workload in made:
        template = workload["spec"]["template"]
        # A StatefulSet's pod mounts the claim its controller makes from each template.
        claims = [
            {"name": claim["metadata"]["name"], "persistentVolumeClaim": {"claimName": "c"}}
            for claim in workload["spec"].get("volumeClaimTemplates", [])
        ]
        template["spec"].setdefault("volumes", []).extend(claims)
        specs[template["metadata"]["labels"][COMPONENT_LABEL]] = template["spec"]
    return specs


def chart_pod_specs(namespace: str) -> dict[str, dict]:
    """The operator's own pod, as the chart renders it in each role."""
    specs = {}
    for role in ("hub", "region"):
        values = ["-n", namespace, "--set", f"role={role}", "--set", "crds.install=false"]
        (deployment,) = [d for d in rendered_chart(*values) if d["kind"] == "Deployment"]
        specs[f"operator-{role}"] = deployment["spec"]["template"]["spec"]
    return specs


@pytest.fixture(scope="module")
def restricted(bed: BedInfo, kubectl: Kubectl) -> Iterator[tuple[Kube, str]]:
    kube = Kube.from_kubeconfig(yaml.safe_load(bed.kubeconfigs["hub"].read_text()), "hub")
    namespace = f"restricted-{uuid.uuid4().hex[:6]}"
    # A pod is admitted only once its ServiceAccount exists: the default, and the chart's.
    manifests = [
        {
            "apiVersion": "v1",
            "kind": "Namespace",
            "metadata": {"name": namespace, "labels": RESTRICTED},
        },
        {
            "apiVersion": "v1",
            "kind": "ServiceAccount",
            "metadata": {"name": "rlfleet-operator", "namespace": namespace},
        },
    ]
    kubectl.run("hub", "apply", "-f", "-", stdin=yaml.safe_dump_all(manifests))
    wait_for(
        "the namespace's default ServiceAccount",
        lambda: (
            kubectl.run(
                "hub", "-n", namespace, "get", "serviceaccount", "default", check=False
            ).returncode
            == 0
        ),
        timeout=30,
    )
    try:
        yield kube, namespace
    finally:
        kubectl.run("hub", "delete", "namespace", namespace, "--wait=false", check=False)


def refusal(kube: Kube, namespace: str, name: str, pod_spec: dict) -> str | None:
    """The API server's reason for refusing this pod, or None if it admits it."""
    pod = {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": name, "namespace": namespace},
        "spec": pod_spec,
    }
    try:
        kube.request("POST", f"/api/v1/namespaces/{namespace}/pods", pod, query=[("dryRun", "All")])
    except ApiException as error:
        return json.loads(error.body).get("message", str(error))
    return None


def test_the_api_server_refuses_a_pod_the_restricted_profile_forbids(
    restricted: tuple[Kube, str],
) -> None:
    """The check itself can fail: a default pod (root allowed, capabilities kept, no
    seccomp profile) is refused, naming what it lacks."""
    kube, namespace = restricted
    plain = {"containers": [{"name": "main", "image": "busybox"}]}
    message = refusal(kube, namespace, "plain", plain)
    assert message is not None and "restricted" in message, message
    assert "runAsNonRoot" in message and "seccompProfile" in message, message


def test_every_pod_runs_with_least_privilege(restricted: tuple[Kube, str]) -> None:
    kube, namespace = restricted
    specs = operator_pod_specs() | chart_pod_specs(namespace)
    assert set(specs) >= {"trainer", "feed", "evaluator", "rollout", "operator-hub"}
    checks, violations = 0, {}
    for name, spec in sorted(specs.items()):
        found = []
        checks += 1
        if (message := refusal(kube, namespace, name, spec)) is not None:
            found.append(message)
        checks += 1
        token = spec.get("automountServiceAccountToken", True)
        if token != (name in NEEDS_TOKEN):
            found.append(f"automountServiceAccountToken is {token}")
        for container in spec["containers"]:
            checks += 1
            read_only = container.get("securityContext", {}).get("readOnlyRootFilesystem")
            if not read_only:
                found.append(f"container {container['name']}: readOnlyRootFilesystem {read_only}")
        if found:
            violations[name] = found
    print(json.dumps({"permission_checks": checks, "permission_violations": len(violations)}))
    assert not violations, violations


def test_an_envpool_server_is_root_only_inside_its_vm_with_the_least_it_needs() -> None:
    """A session server makes sandboxes (namespaces, mounts, uids), so it runs as root,
    which the restricted profile forbids: it is sound only in the pool's VM-grade
    runtime, which the schema requires. Beyond that it holds nothing it need not."""
    (deployment,) = [
        o
        for o in envpool_objects(_example("envpool"), 1, {}, "rlfleet-system")
        if o["kind"] in WORKLOADS
    ]
    spec = deployment["spec"]["template"]["spec"]
    assert spec["runtimeClassName"] == "gvisor"
    assert spec["automountServiceAccountToken"] is False
    assert not any(spec.get(host) for host in ("hostNetwork", "hostPID", "hostIPC"))
    assert all("hostPath" not in volume for volume in spec["volumes"])
    (container,) = spec["containers"]
    context = container["securityContext"]
    assert context["readOnlyRootFilesystem"] and not context["allowPrivilegeEscalation"]
    assert not context.get("privileged")
    assert context["capabilities"] == {"drop": ["ALL"], "add": SANDBOX_CAPABILITIES}
    assert "SYS_ADMIN" in SANDBOX_CAPABILITIES and "NET_ADMIN" not in SANDBOX_CAPABILITIES

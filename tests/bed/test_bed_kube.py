"""Four real Kubernetes clusters: API servers, scheduler, controller-manager, kwok GPU nodes,
and the rlfleet.io CRDs with validation done by the API server itself."""

from __future__ import annotations

import json
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import yaml
from conftest import CLUSTERS, ROOT, Kubectl, wait_for

from rlfleet.operator.config import Images, Workloads
from rlfleet.operator.workloads.hub import hub_objects
from rlfleet.testbed.kube import H100, L4


@pytest.fixture
def namespace(kubectl: Kubectl) -> Iterator[str]:
    name = f"t-{uuid.uuid4().hex[:8]}"
    for context in CLUSTERS:
        kubectl.run(context, "create", "namespace", name)
    wait_for(
        "the namespace's default ServiceAccount",
        lambda: all(
            kubectl.run(c, "-n", name, "get", "serviceaccount", "default", check=False).returncode
            == 0
            for c in CLUSTERS
        ),
    )
    yield name
    # The bed is shared by the session: give back what the test held (GPUs above all).
    for context in CLUSTERS:
        kubectl.run(context, "delete", "namespace", name, "--wait=false")
    wait_for(
        "the test's pods gone",
        lambda: not kubectl.run("hub", "-n", name, "get", "pods", "-o", "name").stdout.strip(),
    )


def test_four_api_servers_answer_with_gpu_nodes(kubectl: Kubectl) -> None:
    for context in CLUSTERS:
        version = json.loads(kubectl.run(context, "version", "-o", "json").stdout)
        assert version["serverVersion"]["gitVersion"].startswith("v1.36")
        nodes = json.loads(kubectl.run(context, "get", "nodes", "-o", "json").stdout)["items"]
        assert len(nodes) == (2 if context == "hub" else 4)
        # Each names its GPU type: the hub trains on H100s, a region serves on two types.
        types = {n["metadata"]["labels"]["nvidia.com/gpu.product"] for n in nodes}
        assert types == ({H100} if context == "hub" else {H100, L4})
        for node in nodes:
            assert node["status"]["allocatable"]["nvidia.com/gpu"] == "8"
            assert node["metadata"]["labels"]["rlfleet.io/region"] == context
            ready = {c["type"]: c["status"] for c in node["status"]["conditions"]}
            assert ready["Ready"] == "True"


def test_clusters_are_separate(kubectl: Kubectl) -> None:
    name = f"only-in-hub-{uuid.uuid4().hex[:6]}"
    kubectl.run("hub", "create", "configmap", name)
    assert kubectl.run("region-a", "get", "configmap", name, check=False).returncode != 0


@pytest.mark.usefixtures("crds_installed")
def test_crds_installed_and_listed_by_category(kubectl: Kubectl) -> None:
    for context in CLUSTERS:
        result = kubectl.run(context, "get", "rlfleet", "-A")
        assert "error" not in result.stderr.lower()
        resources = kubectl.run(
            context, "api-resources", "--api-group=rlfleet.io", "-o", "name"
        ).stdout.split()
        assert sorted(resources) == [
            "envpools.rlfleet.io",
            "inferencepools.rlfleet.io",
            "rlruns.rlfleet.io",
        ]


@pytest.mark.usefixtures("crds_installed")
def test_examples_apply_and_show_printer_columns(kubectl: Kubectl, namespace: str) -> None:
    for context in CLUSTERS:
        kubectl.run(context, "-n", namespace, "apply", "-f", str(ROOT / "examples"))
    table = kubectl.run("hub", "-n", namespace, "get", "rlr").stdout
    assert table.split("\n")[0].split() == [
        "NAME",
        "PHASE",
        "VERSION",
        "STALENESS",
        "GPUS-LENT",
        "SERVING",
        "CANDIDATE",
        "STAGE",
        "LAST",
        "READY",
        "AGE",
    ]
    applied = json.loads(
        kubectl.run("hub", "-n", namespace, "get", "rlrun", "tiny-moe-arith", "-o", "json").stdout
    )
    # Defaults come from the schema, applied by the API server.
    assert applied["spec"]["rollout"]["regions"][1]["minGpus"] == 0
    assert applied["spec"]["maxStaleness"] == 2
    for short in ("ipool", "envp"):
        assert kubectl.run("region-a", "-n", namespace, "get", short, "-o", "name").stdout.strip()


def _rlrun(**spec_changes: object) -> dict:
    document = yaml.safe_load((ROOT / "examples" / "rlrun.yaml").read_text())
    document["metadata"]["name"] = f"bad-{uuid.uuid4().hex[:6]}"
    document["spec"].update(spec_changes)
    return document


def _rlrun_with_rollout(**rollout_changes: object) -> dict:
    document = _rlrun()
    document["spec"]["rollout"].update(rollout_changes)
    return document


def _production(**spec_changes: object) -> dict:
    document = yaml.safe_load((ROOT / "examples" / "realtime.yaml").read_text())
    document["metadata"]["name"] = f"bad-{uuid.uuid4().hex[:6]}"
    document["spec"].update(spec_changes)
    document["spec"] = {k: v for k, v in document["spec"].items() if v is not None}
    return document


def _production_with(**production_changes: object) -> dict:
    document = _production()
    document["spec"]["production"].update(production_changes)
    return document


_TASKS = {"path": "train.parquet", "volume": {"configMap": "tasks"}, "columns": {"prompt": "q"}}

BAD_SPECS = {
    "wrong type": (_rlrun(maxStaleness="two"), "spec.maxStaleness"),
    "out of range": (_rlrun(maxStaleness=5000), "spec.maxStaleness"),
    "missing required field": (
        _rlrun() | {"spec": {"rollout": {"regions": [{"name": "region-a", "maxGpus": 1}]}}},
        "spec.model",
    ),
    # Experience from rollouts or from a production pool's users: exactly one.
    "neither rollouts nor production": (
        _rlrun() | {"spec": {"model": {"uri": "file:///m"}}},
        "spec.production",
    ),
    "rollouts and production": (
        _rlrun(production={"pool": {"region": "region-a", "name": "chat"}}),
        "spec.production",
    ),
    "production without the gate's suite": (
        _production(evaluation=None),
        "spec.evaluation",
    ),
    "a weight for a feedback kind nobody sends": (
        _production_with(feedback={"weights": {"clicked": 1.0}}),
        "spec.production.feedback.weights",
    ),
    "a cycle that may take fewer completions than it needs": (
        _production_with(cycle={"minSamples": 64, "maxSamples": 10}),
        "spec.production.cycle.maxSamples",
    ),
    "unknown field": (_rlrun(maxStalenes=1), "maxStalenes"),
    "cross-field rule": (
        _rlrun(rollout={"regions": [{"name": "region-a", "minGpus": 9, "maxGpus": 8}]}),
        "spec.rollout.regions[0].minGpus",
    ),
    "bad enum": (_rlrun(rewards=[{"kind": "rubric"}]), "spec.rewards[0].kind"),
    "endpoint for an unknown region": (
        _rlrun(weightSync={"endpoints": [{"region": "region-z", "url": "nats://leaf-z:4222"}]}),
        "spec.weightSync.endpoints",
    ),
    "judge without an endpoint": (_rlrun(rewards=[{"kind": "judge"}]), "spec.rewards[0].endpoint"),
    "judge without the model it serves": (
        _rlrun(rewards=[{"kind": "judge", "endpoint": "http://judge:8000/v1"}]),
        "spec.rewards[0].judgeModel",
    ),
    "python without its function": (
        _rlrun(rewards=[{"kind": "python"}]),
        "spec.rewards[0].function",
    ),
    "a function on a reward that is no python": (
        _rlrun(rewards=[{"kind": "exactAnswer", "function": "graders:score"}]),
        "spec.rewards[0].function",
    ),
    "remote without an endpoint": (
        _rlrun(rewards=[{"kind": "remote"}]),
        "spec.rewards[0].endpoint",
    ),
    "an environment name that is no entry point": (
        _rlrun_with_rollout(environment={"name": "my env"}),
        "spec.rollout.environment.name",
    ),
    "a model volume for a uri that is no path": (
        _rlrun(model={"uri": "s3://bucket/tiny-moe", "volumeClaimName": "models"}),
        "spec.model.volumeClaimName",
    ),
    "a model in a store no component reads": (
        _rlrun(model={"uri": "gs://bucket/tiny-moe"}),
        "spec.model.uri",
    ),
    "an object store's endpoint for a model folder": (
        _rlrun(model={"uri": "file:///models/tiny-moe", "endpoint": "http://store:7070"}),
        "spec.model.endpoint",
    ),
    "a checkpoint size that is no quantity": (
        _rlrun(trainer={"checkpointStorage": {"size": "lots"}}),
        "spec.trainer.checkpointStorage.size",
    ),
    "an evaluation target at or under its floor": (
        _rlrun(evaluation={"suite": "rules", "minReward": 0.5, "targetReward": 0.5}),
        "spec.evaluation.targetReward",
    ),
    # The name is the run's NATS subjects' token: a '.' would split it.
    "a name with a dot": (_rlrun() | {"metadata": {"name": "tiny.moe"}}, "metadata.name"),
    "a name too long for its trainer's pod labels": (
        _rlrun() | {"metadata": {"name": "r" * 45}},
        "metadata.name",
    ),
    "a group of one attempt": (
        _rlrun(rollout={"groupSize": 1, "regions": [{"name": "region-a", "maxGpus": 8}]}),
        "spec.rollout.groupSize",
    ),
    # Greedy rollouts would give every attempt of a group the same answer: no signal.
    "a sampling temperature of zero": (
        _rlrun_with_rollout(temperature=0),
        "spec.rollout.temperature",
    ),
    "a step in tokens and in groups": (
        _rlrun(trainer={"stepTokens": 4096, "stepGroups": 8}),
        "spec.trainer.stepGroups",
    ),
    # The schema's default clipHigh (0.28) is narrower than this clipLow.
    "an upper clip narrower than the lower": (
        _rlrun(trainer={"clipLow": 0.3}),
        "spec.trainer.clipHigh",
    ),
    "task data and a task suite": (
        _rlrun_with_rollout(taskSuite="rules", tasks=_TASKS),
        "spec.rollout.tasks",
    ),
    "task data that climbs out of its volume": (
        _rlrun_with_rollout(tasks=_TASKS | {"path": "train/../../etc"}),
        "spec.rollout.tasks.path",
    ),
    "task data asked by prompt and by messages": (
        _rlrun_with_rollout(tasks=_TASKS | {"columns": {"prompt": "q", "messages": "m"}}),
        "spec.rollout.tasks.columns",
    ),
    "task data on two volumes": (
        _rlrun_with_rollout(
            tasks=_TASKS | {"volume": {"configMap": "tasks", "persistentVolumeClaim": "data"}}
        ),
        "spec.rollout.tasks.volume",
    ),
    "a window with no room for a turn and its summary": (
        _rlrun_with_rollout(contextTokens=512, turnTokens=256),
        "spec.rollout.contextTokens",
    ),
}


@pytest.mark.usefixtures("crds_installed")
@pytest.mark.parametrize("case", sorted(BAD_SPECS))
def test_bad_specs_are_rejected_naming_the_field(
    kubectl: Kubectl, namespace: str, case: str, tmp_path: Path
) -> None:
    document, field = BAD_SPECS[case]
    result = kubectl.run(
        "hub", "-n", namespace, "apply", "-f", "-", stdin=yaml.safe_dump(document), check=False
    )
    assert result.returncode != 0, f"{case} was accepted"
    assert field in result.stderr, result.stderr
    listed = kubectl.run(
        "hub", "-n", namespace, "get", "rlrun", document["metadata"]["name"], check=False
    )
    assert listed.returncode != 0, "a rejected spec must not be stored"


def _new_model(spec: dict) -> None:
    spec["model"]["uri"] = "file:///another"


def _hotter(spec: dict) -> None:
    # The run was made without one, so it holds the default, 1.
    spec["rollout"]["temperature"] = 1.5


@pytest.mark.usefixtures("crds_installed")
@pytest.mark.parametrize(
    ("field", "change"),
    [("spec.model", _new_model), ("spec.rollout.temperature", _hotter)],
    ids=["model", "temperature"],
)
def test_fields_fixed_for_the_runs_life_refuse_a_change(
    kubectl: Kubectl, namespace: str, field: str, change: Callable[[dict], None]
) -> None:
    document = _rlrun()
    kubectl.run("hub", "-n", namespace, "apply", "-f", "-", stdin=yaml.safe_dump(document))
    change(document["spec"])
    result = kubectl.run(
        "hub", "-n", namespace, "apply", "-f", "-", stdin=yaml.safe_dump(document), check=False
    )
    assert result.returncode != 0
    assert field in result.stderr and "immutable" in result.stderr


@pytest.mark.usefixtures("crds_installed")
def test_checkpoint_storage_is_fixed_once_the_run_exists(kubectl: Kubectl, namespace: str) -> None:
    bare, without = _rlrun(), _rlrun(trainer={"replicas": 1})
    stored = _rlrun(trainer={"checkpointStorage": {"size": "500Gi"}})
    for document in (bare, without, stored):
        kubectl.run("hub", "-n", namespace, "apply", "-f", "-", stdin=yaml.safe_dump(document))
    for document in (bare, without):
        document["spec"]["trainer"] = {"checkpointStorage": {"size": "500Gi"}}
    stored["spec"]["trainer"]["checkpointStorage"]["size"] = "1Ti"
    # Neither adding claims to a run (with a trainer section or without one) nor resizing
    # them is taken.
    for document in (bare, without, stored):
        result = kubectl.run(
            "hub", "-n", namespace, "apply", "-f", "-", stdin=yaml.safe_dump(document), check=False
        )
        assert result.returncode != 0, "a StatefulSet's claims cannot change"
        assert "spec.trainer.checkpointStorage" in result.stderr, result.stderr
        assert "claims cannot change" in result.stderr


def gpu_pod(name: str, gpus: int) -> dict:
    return {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": name},
        "spec": {
            "containers": [
                {
                    "name": "main",
                    "image": "busybox",
                    "resources": {"limits": {"nvidia.com/gpu": str(gpus)}},
                }
            ]
        },
    }


def test_gpu_pods_schedule_until_the_gpus_run_out(kubectl: Kubectl, namespace: str) -> None:
    # The hub has 2 nodes x 8 GPUs: four pods of 4 fit, the fifth cannot.
    for index in range(4):
        kubectl.run(
            "hub", "-n", namespace, "apply", "-f", "-", stdin=json.dumps(gpu_pod(f"gpu-{index}", 4))
        )

    def phases() -> dict[str, str]:
        pods = json.loads(kubectl.run("hub", "-n", namespace, "get", "pods", "-o", "json").stdout)[
            "items"
        ]
        return {p["metadata"]["name"]: p["status"].get("phase", "") for p in pods}

    wait_for("four GPU pods Running", lambda: list(phases().values()).count("Running") == 4)
    kubectl.run("hub", "-n", namespace, "apply", "-f", "-", stdin=json.dumps(gpu_pod("gpu-4", 4)))

    def unschedulable() -> bool:
        pod = json.loads(
            kubectl.run("hub", "-n", namespace, "get", "pod", "gpu-4", "-o", "json").stdout
        )
        conditions = {c["type"]: c for c in pod["status"].get("conditions", [])}
        scheduled = conditions.get("PodScheduled", {})
        return scheduled.get("status") == "False" and scheduled.get("reason") == "Unschedulable"

    wait_for("the fifth pod to be found unschedulable", unschedulable)
    assert phases()["gpu-4"] == "Pending"
    events = kubectl.run(
        "hub", "-n", namespace, "get", "events", "--field-selector", "involvedObject.name=gpu-4"
    ).stdout
    assert "Insufficient nvidia.com/gpu" in events


@pytest.mark.usefixtures("crds_installed")
def test_deleting_an_rlrun_takes_the_objects_the_operator_made_for_it(
    kubectl: Kubectl, namespace: str
) -> None:
    kubectl.run("hub", "-n", namespace, "apply", "-f", str(ROOT / "examples" / "rlrun.yaml"))
    run = json.loads(
        kubectl.run("hub", "-n", namespace, "get", "rlrun", "tiny-moe-arith", "-o", "json").stdout
    )
    # What the hub operator applies for the run, with the owner references it sets: the
    # cluster's garbage collector alone removes them once the run is deleted.
    made = hub_objects(run, Images(), Workloads(), None)
    assert {o["kind"] for o in made} >= {"ConfigMap", "StatefulSet", "Deployment", "Service"}
    listed = {"apiVersion": "v1", "kind": "List", "items": made}
    kubectl.run("hub", "-n", namespace, "apply", "-f", "-", stdin=json.dumps(listed))
    names = [f"{o['kind'].lower()}/{o['metadata']['name']}" for o in made]

    def left() -> list[str]:
        found = kubectl.run("hub", "-n", namespace, "get", *names, "--ignore-not-found", "-o=name")
        return found.stdout.split()

    assert len(left()) == len(made)
    kubectl.run("hub", "-n", namespace, "delete", "rlrun", "tiny-moe-arith", "--wait=false")
    wait_for("the garbage collector to delete the run's objects", lambda: not left())

"""The pods the operator makes for a run, as it writes them: each asks for what it uses
(CPU and memory requested and capped, GPUs where it runs on them) and serves its metrics
on a named port Prometheus is told of. Pure: the bed's check is in test_operator_fleet."""

from __future__ import annotations

import base64

import pytest
import yaml
from conftest import ROOT
from pydantic import ValidationError

from rlfleet.api.inferencepool import InferencePoolSpec
from rlfleet.api.meta import COMPONENT_LABEL, GPU_RESOURCE, GPU_TYPE_LABEL
from rlfleet.api.rlrun import RLRunSpec
from rlfleet.launch import pods
from rlfleet.operator.config import Images, NatsAccess, OperatorConfig, Workloads
from rlfleet.operator.workloads.hub import hub_objects, mirror
from rlfleet.operator.workloads.inferencepool import canary_deployment, pool_feedback
from rlfleet.operator.workloads.rollout import rollout_deployment

NATS = NatsAccess(url="nats://nats.hub:4222")


def _run(model: dict | None = None) -> dict:
    run = yaml.safe_load((ROOT / "examples" / "rlrun.yaml").read_text())
    run["metadata"] |= {"namespace": "team-a", "uid": "hub-uid"}
    run["spec"]["evaluation"] = {"suite": "rules", "everyVersions": 10}
    if model is not None:
        run["spec"]["model"] = model
    return run


def pod_templates(workloads: Workloads, model: dict | None = None) -> dict[str, dict]:
    """The example run's trainer, feed, evaluator and a rollout worker's pod templates."""
    run = _run(model)
    made = hub_objects(run, Images(), workloads, NATS)
    templates = {
        o["metadata"]["labels"][COMPONENT_LABEL]: o["spec"]["template"]
        for o in made
        if o["kind"] in ("StatefulSet", "Deployment")
    }
    copy = mirror(run, "hub", NATS)
    copy["metadata"]["uid"] = "mirror-uid"
    pool = yaml.safe_load((ROOT / "examples" / "inferencepool.yaml").read_text())
    pool_spec = InferencePoolSpec.model_validate(pool["spec"])
    rollout = rollout_deployment(copy, "chat-prod", pool_spec, 1, "img", workloads, "region-a")
    templates["rollout"] = rollout["spec"]["template"]
    return templates


def test_every_pod_requests_and_caps_its_cpu_and_memory_and_the_gpus_it_runs_on() -> None:
    templates = pod_templates(Workloads())
    assert set(templates) == {"trainer", "feed", "evaluator", "rollout"}
    run = _run()
    pool = yaml.safe_load((ROOT / "examples" / "inferencepool.yaml").read_text())
    gpus = {
        "trainer": RLRunSpec.model_validate(run["spec"]).trainer.gpus_per_replica,
        "rollout": pool["spec"]["serving"]["gpusPerReplica"],
        # CPU-only: it generates with Hugging Face `generate` on the host.
        "evaluator": 0,
        "feed": 0,
    }
    for component, template in templates.items():
        (container,) = template["spec"]["containers"]
        resources = container["resources"]
        for kind in ("requests", "limits"):
            assert {"cpu", "memory"} <= set(resources[kind]), (component, kind)
            assert resources[kind].get(GPU_RESOURCE) == (
                str(gpus[component]) if gpus[component] else None
            ), component


def test_the_charts_sizes_merge_over_the_operators_key_by_key() -> None:
    config = OperatorConfig.model_validate(
        {
            "role": "hub",
            "cluster": "hub",
            "namespace": "rlfleet-system",
            "workloads": {"resources": {"trainer": {"limits": {"memory": "512Gi"}}}},
        }
    )
    trainer = pod_templates(config.workloads)["trainer"]["spec"]["containers"][0]["resources"]
    default = pod_templates(Workloads())["trainer"]["spec"]["containers"][0]["resources"]
    assert trainer["limits"] == default["limits"] | {"memory": "512Gi"}
    assert trainer["requests"] == default["requests"]
    with pytest.raises(ValidationError, match="trainr"):
        Workloads.model_validate({"resources": {"trainr": {"limits": {"cpu": "1"}}}})
    # Asking for more than the limit: the API server would refuse every trainer apply.
    over = {"resources": {"trainer": {"requests": {"memory": "300Gi"}}}}
    with pytest.raises(ValidationError, match=r"requests.memory 300Gi is over limits.memory"):
        Workloads.model_validate(over)


def test_every_pod_serves_its_metrics_on_the_port_it_names_and_its_annotations_say() -> None:
    for component, template in pod_templates(Workloads(metrics_port=9555)).items():
        (container,) = template["spec"]["containers"]
        ports = {p["name"]: p["containerPort"] for p in container["ports"]}
        assert ports["metrics"] == 9555, component
        assert template["metadata"]["annotations"] == {
            "prometheus.io/scrape": "true",
            "prometheus.io/port": "9555",
            "prometheus.io/path": "/metrics",
        }
        # What the component reads back (`Placement.from_env`) and serves on.
        env = resolved_env(template, ordinal=0)
        assert pods.Placement.from_env(env).metrics_port == 9555, component


def resolved_env(template: dict, ordinal: int) -> dict[str, str]:
    """The container environment of a workload's pod `ordinal` as the kubelet gives it:
    values, and the downward API's labels of the pod, which a StatefulSet's controller
    labels with its ordinal (the pod's name stays out: this reads ranks and places)."""
    labels = template["metadata"]["labels"] | {"apps.kubernetes.io/pod-index": str(ordinal)}
    pod = {"metadata": {"labels": labels}, "spec": template["spec"]}
    env = {}
    for entry in pod["spec"]["containers"][0]["env"]:
        if "value" in entry:
            env[entry["name"]] = entry["value"]
            continue
        path = entry["valueFrom"]["fieldRef"]["fieldPath"]
        if path.startswith("metadata.labels['"):
            env[entry["name"]] = pod["metadata"]["labels"].get(path[17:-2], "")
    return env


def test_the_trainers_pods_are_the_nodes_of_one_job() -> None:
    run = _run()
    run["spec"]["trainer"] = {"replicas": 2, "gpusPerReplica": 4}
    made = hub_objects(run, Images(), Workloads(), NATS)
    (statefulset,) = [o for o in made if o["kind"] == "StatefulSet"]
    service = next(o for o in made if o["kind"] == "Service")
    template = statefulset["spec"]["template"]
    ranks = [pods.Placement.from_env(resolved_env(template, i)).ranks for i in (0, 1)]
    name, namespace = run["metadata"]["name"], run["metadata"]["namespace"]
    # Rank 0's pod, by its stable name under the headless Service, on the named port.
    master = f"{name}-trainer-0.{service['metadata']['name']}.{namespace}.svc"
    assert statefulset["spec"]["serviceName"] == service["metadata"]["name"]
    assert service["spec"]["clusterIP"] == "None"
    assert [(r.node_rank, r.nodes, r.procs_per_node, r.master_addr) for r in ranks] == [
        (0, 2, 4, master),
        (1, 2, 4, master),
    ]
    ports = {p["name"]: p["containerPort"] for p in template["spec"]["containers"][0]["ports"]}
    assert ranks[0].master_port == ranks[1].master_port == ports["rendezvous"]


def node_affinity(template: dict) -> list[dict] | None:
    """The node-selector terms a pod must match, if any."""
    affinity = template["spec"].get("affinity")
    if affinity is None:
        return None
    return affinity["nodeAffinity"]["requiredDuringSchedulingIgnoredDuringExecution"][
        "nodeSelectorTerms"
    ]


def test_rollout_and_trainer_pods_go_to_nodes_of_the_gpu_type_they_need() -> None:
    run = _run()
    copy = mirror(run, "hub", NATS)
    copy["metadata"]["uid"] = "mirror-uid"
    pool = yaml.safe_load((ROOT / "examples" / "inferencepool.yaml").read_text())
    workloads = Workloads(gpu_type_label="example.com/gpu-kind")
    untyped = InferencePoolSpec.model_validate(pool["spec"])
    typed = untyped.model_copy(
        update={"serving": untyped.serving.model_copy(update={"gpu_type": "NVIDIA-L4"})}
    )
    rollout = rollout_deployment(copy, "chat-prod", typed, 1, "img", workloads, "region-a")
    want = [
        {
            "matchExpressions": [
                {"key": "example.com/gpu-kind", "operator": "In", "values": ["NVIDIA-L4"]}
            ]
        }
    ]
    assert node_affinity(rollout["spec"]["template"]) == want
    plain = rollout_deployment(copy, "chat-prod", untyped, 1, "img", workloads, "region-a")
    assert node_affinity(plain["spec"]["template"]) is None

    def trainer(spec: dict) -> dict:
        made = hub_objects(run | {"spec": run["spec"] | spec}, Images(), workloads, NATS)
        return next(o for o in made if o["kind"] == "StatefulSet")["spec"]["template"]

    assert node_affinity(trainer({})) is None
    assert node_affinity(trainer({"trainer": {"gpuType": "NVIDIA-L4"}})) == want
    # The label's default has one home, which the chart's empty value leaves in place.
    assert Workloads().gpu_type_label == GPU_TYPE_LABEL == "nvidia.com/gpu.product"


def test_a_canary_set_is_the_serving_pods_told_the_canary_set_and_selected_apart() -> None:
    serving = yaml.safe_load((ROOT / "examples" / "serving.yaml").read_text())
    serving["spec"]["selector"]["matchExpressions"] = [
        {"key": "tier", "operator": "In", "values": ["prod"]}
    ]
    pool = yaml.safe_load((ROOT / "examples" / "inferencepool.yaml").read_text())
    pool["metadata"] |= {"namespace": "serving", "uid": "u-1"}
    pool["spec"]["serving"]["deploymentName"] = "chat"
    canary = canary_deployment(pool, serving, 1)
    assert canary["metadata"]["name"] == "chat-canary"
    assert canary["metadata"]["ownerReferences"][0]["uid"] == "u-1"
    assert canary["spec"]["replicas"] == 1
    # Its own pods only, which the serving selector also matches (the pool counts them).
    selector = canary["spec"]["selector"]
    assert selector["matchLabels"] == {"app": "chat", "rlfleet.io/replica-set": "canary"}
    assert selector["matchExpressions"] == serving["spec"]["selector"]["matchExpressions"]
    labels = canary["spec"]["template"]["metadata"]["labels"]
    assert labels.items() >= serving["spec"]["selector"]["matchLabels"].items()
    # The stable set's name replaced, not repeated; the rest of the pod as served.
    (container,) = canary["spec"]["template"]["spec"]["containers"]
    told = [e for e in container["env"] if e["name"] == pods.REPLICA_SET_ENV]
    assert told == [{"name": pods.REPLICA_SET_ENV, "value": "canary"}]
    served = serving["spec"]["template"]["spec"]["containers"][0]
    assert container["image"] == served["image"] and container["args"] == served["args"]
    assert serving["spec"]["template"]["metadata"]["labels"] == {"app": "chat"}  # a copy


def test_a_pools_feedback_secret_holds_its_key_and_its_gateways_header() -> None:
    """What the pool's servers mount: the key their feedback tokens are signed with and
    the header the pool's gateway names users in (the spec's, else the API's default),
    owned by the pool so it goes with it."""
    pool = yaml.safe_load((ROOT / "examples" / "inferencepool.yaml").read_text())
    pool["metadata"] |= {"namespace": "serving", "uid": "u-1"}
    secret = pool_feedback(pool, "minted")
    assert (secret["kind"], secret["metadata"]["name"]) == ("Secret", "chat-prod-feedback")
    assert secret["metadata"]["ownerReferences"][0]["uid"] == "u-1"
    data = {name: base64.b64decode(value).decode() for name, value in secret["data"].items()}
    assert data == {"key": "minted", "user-header": "x-forwarded-user"}
    pool["spec"]["serving"]["userHeader"] = "x-auth-request-user"
    assert base64.b64decode(pool_feedback(pool, "minted")["data"]["user-header"]) == (
        b"x-auth-request-user"
    )
    with pytest.raises(ValidationError, match="userHeader"):
        pool["spec"]["serving"]["userHeader"] = "X-Not Lower"
        pool_feedback(pool, "minted")


def test_an_s3_model_is_fetched_by_an_init_container_that_alone_holds_the_stores_keys() -> None:
    model = {
        "uri": "s3://models/tiny-moe",
        "endpoint": "http://store:7070",
        "credentialsSecret": "store-keys",
    }
    cache = {"hostPath": {"path": "/var/cache/rlfleet/models", "type": "Directory"}}
    templates = pod_templates(Workloads(model_cache=cache), model)
    for component in ("trainer", "evaluator", "rollout"):
        pod = templates[component]["spec"]
        (fetch,) = pod["initContainers"]
        (container,) = pod["containers"]
        assert fetch["image"] == container["image"], component
        assert fetch["command"][-5:] == [
            *("s3://models/tiny-moe", "--cache", pods.MODEL_CACHE_DIR),
            *("--endpoint", "http://store:7070"),
        ]
        keys = {e["name"]: e["valueFrom"]["secretKeyRef"] for e in fetch["env"] if "valueFrom" in e}
        assert {k: ref["name"] for k, ref in keys.items()} == dict.fromkeys(
            ["AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_SESSION_TOKEN", "AWS_REGION"],
            "store-keys",
        )
        held = [e for e in container["env"] if "secretKeyRef" in e.get("valueFrom", {})]
        assert not held, component
        assert fetch["securityContext"]["capabilities"] == {"drop": ["ALL"]}
        assert fetch["securityContext"]["allowPrivilegeEscalation"] is False
        assert {"name": "model-cache", **cache} in pod["volumes"]
        assert {
            "name": "model-cache",
            "mountPath": pods.MODEL_CACHE_DIR,
            "readOnly": True,
        } in container["volumeMounts"]
    assert "initContainers" not in templates["feed"]["spec"]


def test_a_model_cache_is_one_volume_source() -> None:
    with pytest.raises(ValidationError, match="one volume source"):
        Workloads(model_cache={"emptyDir": {}, "hostPath": {"path": "/x"}})


def test_the_trackers_credentials_reach_the_trainer_alone() -> None:
    run = _run()
    run["spec"]["tracking"] = {
        "mlflow": {"trackingUri": "http://mlflow:5000", "credentialsSecret": "mlflow-keys"}
    }
    made = hub_objects(run, Images(), Workloads(), NATS)
    for workload in (o for o in made if o["kind"] in ("StatefulSet", "Deployment")):
        (container,) = workload["spec"]["template"]["spec"]["containers"]
        refs = {
            e["name"]: e["valueFrom"]["secretKeyRef"]["name"]
            for e in container["env"]
            if "secretKeyRef" in e.get("valueFrom", {})
        }
        component = workload["metadata"]["labels"][COMPONENT_LABEL]
        if component == "trainer":
            assert refs == dict.fromkeys(
                ["MLFLOW_TRACKING_TOKEN", "MLFLOW_TRACKING_USERNAME", "MLFLOW_TRACKING_PASSWORD"],
                "mlflow-keys",
            )
        else:
            assert refs == {}, component

"""The pods the operator makes for a run, as it writes them: each asks for what it uses
(CPU and memory requested and capped, GPUs where it runs on them) and serves its metrics
on a named port Prometheus is told of. Pure: the bed's check is in test_operator_fleet."""

from __future__ import annotations

import pytest
import yaml
from conftest import ROOT
from pydantic import ValidationError

from rlfleet import launch
from rlfleet.api.inferencepool import InferencePoolSpec
from rlfleet.api.meta import COMPONENT_LABEL, GPU_RESOURCE
from rlfleet.api.rlrun import RLRunSpec
from rlfleet.operator.config import Images, NatsAccess, OperatorConfig, Workloads
from rlfleet.operator.workloads import hub_objects, mirror, rollout_deployment

NATS = NatsAccess(url="nats://nats.hub:4222")


def _run() -> dict:
    run = yaml.safe_load((ROOT / "examples" / "rlrun.yaml").read_text())
    run["metadata"] |= {"namespace": "team-a", "uid": "hub-uid"}
    run["spec"]["evaluation"] = {"suite": "rules", "everyVersions": 10}
    return run


def pod_templates(workloads: Workloads) -> dict[str, dict]:
    """The example run's trainer, feed, evaluator and a rollout worker's pod templates."""
    run = _run()
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
        env = {e["name"]: e.get("value") for e in container["env"]}
        # What the component reads back (`Placement.from_env`) and serves on.
        assert launch.Placement.from_env(env).metrics_port == 9555, component

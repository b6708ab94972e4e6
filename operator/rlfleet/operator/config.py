"""The operator's settings: one YAML file, written by the Helm chart from its values."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Any, Literal

import yaml
from kubernetes.utils.quantity import parse_quantity
from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from rlfleet.api.meta import GPU_TYPE_LABEL, Quantity
from rlfleet.bus.permissions import USER_TTL_S

Name = Annotated[
    str, Field(min_length=1, max_length=63, pattern=r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?$")
]
RuntimeClassName = Annotated[
    str,
    Field(min_length=1, max_length=253, pattern=r"^[a-z0-9]([-a-z0-9.]*[a-z0-9])?$"),
]


class RegionAccess(BaseModel):
    """A region the hub mirrors runs into, and the Secret holding its kubeconfig."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    name: Name
    kubeconfig_secret: Annotated[str, Field(min_length=1, max_length=253)]
    kubeconfig_key: str = "kubeconfig"


class Images(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    trainer: str = "ghcr.io/rlfleet/trainer:0.1.0"
    rollout: str = "ghcr.io/rlfleet/rollout:0.1.0"
    # A production run's conductor runs in the operator's own image (the chart's image).
    operator: str = "ghcr.io/rlfleet/operator:0.1.0"


class Amounts(BaseModel):
    # `cpu: 16` in the chart's values is a quantity as much as `cpu: "16"`.
    model_config = ConfigDict(extra="forbid", frozen=True, coerce_numbers_to_str=True)

    cpu: Quantity
    memory: Quantity


class Resources(BaseModel):
    """A container's CPU and memory, both asked for and capped: the scheduler places the
    pod by what it asks, and the kubelet stops it past what it may use."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    requests: Amounts
    limits: Amounts

    @model_validator(mode="after")
    def _requests_within_limits(self) -> Resources:
        # The API server refuses a pod asking for more than its limit, at every apply:
        # refused here, the chart's values name the mistake at install instead.
        for kind in ("cpu", "memory"):
            asked, cap = getattr(self.requests, kind), getattr(self.limits, kind)
            if parse_quantity(asked) > parse_quantity(cap):
                raise ValueError(f"requests.{kind} {asked} is over limits.{kind} {cap}")
        return self


ComponentName = Literal["trainer", "feed", "evaluator", "rollout", "collector", "conductor"]

# The one home of each workload's CPU and memory; the chart's `workloads.resources` is
# merged over it key by key. GPUs come from the run (a trainer replica's
# `gpusPerReplica`) and the pool a rollout worker borrows from (its `gpusPerReplica`).
# Sized for the one pod on an 8-GPU node of 96 cores or more, leaving room for the node's
# own daemons: the trainer (DeepSpeed's host-side optimizer work, checkpoint writes) and a
# rollout worker (vLLM's scheduler and tokenizers, the sessions' local sandboxes). Memory limits
# equal requests: a pod never uses memory the scheduler did not set aside for it. The feed
# holds a suite and a queue. The evaluator is CPU-only: it generates with Hugging Face
# `generate` in float32 on the host (`rlfleet.rollout.evaluation.suite`), so a GPU would sit
# idle; its memory must hold two float32 copies of the model (the weights it received and
# the model it loads): 32Gi suits models of up to about 4B parameters. A production run's
# collector holds one cycle's completions (`maxSamples`, token ids and log-probs: 20 000
# of 4k tokens are ~1 GiB) and its conductor a few reports.
DEFAULT_RESOURCES: dict[str, dict[str, dict[str, str]]] = {
    "trainer": {
        "requests": {"cpu": "16", "memory": "256Gi"},
        "limits": {"cpu": "32", "memory": "256Gi"},
    },
    "rollout": {
        "requests": {"cpu": "16", "memory": "128Gi"},
        "limits": {"cpu": "32", "memory": "128Gi"},
    },
    "feed": {
        "requests": {"cpu": "250m", "memory": "512Mi"},
        "limits": {"cpu": "1", "memory": "1Gi"},
    },
    "evaluator": {
        "requests": {"cpu": "8", "memory": "32Gi"},
        "limits": {"cpu": "16", "memory": "32Gi"},
    },
    "collector": {
        "requests": {"cpu": "1", "memory": "2Gi"},
        "limits": {"cpu": "2", "memory": "2Gi"},
    },
    "conductor": {
        "requests": {"cpu": "100m", "memory": "256Mi"},
        "limits": {"cpu": "500m", "memory": "256Mi"},
    },
}


def _merged(default: Any, given: Any) -> Any:
    """`given` over `default`, key by key at every depth."""
    if isinstance(default, dict) and isinstance(given, dict):
        return default | {k: _merged(default.get(k), v) for k, v in given.items()}
    return given


class MetricsScraper(BaseModel):
    """Where a Prometheus that scrapes the runs' pods runs: a NetworkPolicy peer, as the
    chart's `workloads.metricsScrapers` names it (both selectors: pods so labelled in
    namespaces so labelled; a podSelector alone: the run's own namespace)."""

    model_config = ConfigDict(extra="forbid", frozen=True, validate_by_name=True)

    namespace_selector: dict[str, Any] | None = Field(None, alias="namespaceSelector")
    pod_selector: dict[str, Any] | None = Field(None, alias="podSelector")

    @model_validator(mode="after")
    def _some_selector(self) -> MetricsScraper:
        if self.namespace_selector is None and self.pod_selector is None:
            raise ValueError("a metrics scraper needs a namespaceSelector or a podSelector")
        return self

    def peer(self) -> dict[str, Any]:
        return self.model_dump(by_alias=True, exclude_none=True)


# Prometheus where kube-prometheus-stack (and kube-prometheus) is usually installed.
MONITORING_NAMESPACE = MetricsScraper(
    namespace_selector={"matchLabels": {"kubernetes.io/metadata.name": "monitoring"}}
)


class Workloads(BaseModel):
    """What every pod the operator makes for a run asks for and serves."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    resources: dict[ComponentName, Resources]
    # Each pod serves its Prometheus metrics here: its container's `metrics` port, its
    # `prometheus.io/port` annotation and the component's settings all take this number.
    metrics_port: Annotated[int, Field(ge=1, le=65535)] = 9400
    # Who besides a run's own ranks may reach that port on its trainer pods (their
    # NetworkPolicy, `workloads.hub.trainer_network_policy`); empty: no one.
    metrics_scrapers: list[MetricsScraper] = Field(default_factory=lambda: [MONITORING_NAMESPACE])
    # The node label whose value is a node's GPU type: rollout pods are placed by their
    # pool's `serving.gpuType`, trainer pods by the run's `trainer.gpuType`, on its value.
    gpu_type_label: Annotated[str, Field(min_length=1, max_length=316)] = GPU_TYPE_LABEL
    # The volume an s3:// model is fetched into (a Volume's source: `emptyDir`, `hostPath`,
    # `persistentVolumeClaim`, ...). The default, an emptyDir, is each pod's own; a hostPath
    # is shared by the pods of a node, which then fetch a model once, but the Pod Security
    # Standards' baseline and restricted profiles refuse hostPath volumes.
    model_cache: dict[str, Any] = Field(default_factory=lambda: {"emptyDir": {}})

    @field_validator("model_cache")
    @classmethod
    def _one_source(cls, source: dict[str, Any]) -> dict[str, Any]:
        if len(source) != 1 or "name" in source:
            raise ValueError("model_cache is one volume source, e.g. {hostPath: {path: ...}}")
        return source

    @model_validator(mode="before")
    @classmethod
    def _over_defaults(cls, data: Any) -> Any:
        if isinstance(data, dict):
            return data | {"resources": _merged(DEFAULT_RESOURCES, data.get("resources") or {})}
        return data


class NatsAccess(BaseModel):
    """The hub's NATS server: the hub makes each run's streams there and reads its progress."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    url: Annotated[str, Field(pattern=r"^(nats|tls)://")]
    domain: Name = "hub"  # the hub's JetStream domain; a region's domain is its name
    # A Secret in the operator's namespace: `creds`, the operator's NATS user (a .creds
    # file), and `signing-seed`, the account's signing key, with which the hub mints each
    # run's users (one per component). None: anonymous, and runs' pods get no user.
    # With `operator-seed` (the NATS operator's key, or one of its signing keys) and
    # `system-creds` (a user of the system account) too, a deleted run's users are revoked
    # on every server (`rlfleet.bus.connection.revoke_run_users`); without, they only expire.
    credentials_secret: str | None = None
    # How long a run's user JWT is valid; the hub signs it again before it expires.
    user_ttl_seconds: Annotated[float, Field(ge=10, le=30 * 86400)] = USER_TTL_S


class OperatorConfig(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    role: Literal["hub", "region"]
    cluster: Name  # this cluster's name: the origin label of mirrors, or the region's name
    namespace: Annotated[str, Field(min_length=1, max_length=63)]  # where its Secrets live
    watch_namespaces: list[str] = Field(default_factory=list)  # empty: every namespace
    regions: list[RegionAccess] = Field(default_factory=list)
    images: Images = Images()
    workloads: Workloads = Workloads()
    nats: NatsAccess | None = None  # hub only; without it, no streams and no progress
    # Pools and sandboxes are re-read this often: traffic and pods change without an event
    # the operator sees, and a reclaim must start within its deadline.
    resync_seconds: Annotated[float, Field(gt=0, le=3600)] = 2.0
    # Runs (the hub's, and the regions' mirrors) this often: a spec change acts at once,
    # and what a resync adds (regions' reports, the trainer's progress, the versions a
    # pool's serving pods say they serve) can wait seconds.
    run_resync_seconds: Annotated[float, Field(gt=0, le=3600)] = 15.0
    region_timeout_seconds: Annotated[float, Field(gt=0, le=86400)] = 30.0
    call_timeout_seconds: Annotated[float, Field(gt=0, le=300)] = 3.0
    traffic_timeout_seconds: Annotated[float, Field(gt=0, le=300)] = 2.0
    metrics_port: Annotated[int, Field(ge=0, le=65535)] = 9090  # 0: no metrics endpoint
    health_port: Annotated[int, Field(ge=0, le=65535)] = 8080  # 0: no liveness endpoint
    # A Secret in the operator's namespace: the key a region mints EnvPool tokens with
    # (`rlfleet.operator.envtokens`), made on first use.
    envpool_key_secret: Annotated[str, Field(min_length=1, max_length=253)] = "rlfleet-envpool-key"
    # The RuntimeClasses an EnvPool's pods may run under: VM-grade ones, as a pool's session
    # server runs as root with SYS_ADMIN (`workloads.envpool.SANDBOX_CAPABILITIES`). A pool
    # naming another runs no pod (`envpools.refusals`).
    envpool_runtime_classes: Annotated[list[RuntimeClassName], Field(min_length=1)] = [
        "gvisor",
        "kata",
    ]
    # Where an EnvPool's image may come from: registries or repository prefixes, each
    # matched up to a "/"; empty: anywhere.
    envpool_image_registries: list[Annotated[str, Field(min_length=1, max_length=255)]] = []


def load(path: Path) -> OperatorConfig:
    return OperatorConfig.model_validate(yaml.safe_load(path.read_text()))

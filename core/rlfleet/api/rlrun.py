"""RLRun: one asynchronous RL post-training job, trained in the hub, rolled out in regions."""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import ConfigDict, Field

from rlfleet.api.meta import (
    AGE,
    DNS_LABEL,
    ApiModel,
    Conditions,
    PrinterColumn,
    ResourceKind,
    cel,
    map_list,
)

Name = Annotated[str, Field(min_length=1, max_length=63, pattern=DNS_LABEL)]


class ModelSource(ApiModel):
    """The base policy the run starts from."""

    uri: Annotated[
        str,
        Field(
            min_length=1,
            max_length=2048,
            description="Where the checkpoint lives (file://, s3://, hf://).",
        ),
    ]
    format: Literal["hf-safetensors"] = "hf-safetensors"


class TrainerSpec(ApiModel):
    replicas: Annotated[int, Field(ge=1, le=4096)] = 1
    gpus_per_replica: Annotated[int, Field(ge=0, le=16)] = 8
    zero_stage: Annotated[int, Field(ge=0, le=3, description="DeepSpeed ZeRO stage.")] = 2
    batch_invariant: Annotated[
        bool,
        Field(description="Batch-invariant kernels: log-probs do not depend on the batch."),
    ] = True
    router_replay: Annotated[
        bool, Field(description="Score MoE layers with the experts the rollout used.")
    ] = True


class RegionDemand(ApiModel):
    """How many rollout GPUs the run wants in one region, and whose GPUs it may borrow."""

    model_config = ConfigDict(
        json_schema_extra={
            "x-kubernetes-validations": [
                cel("self.minGpus <= self.maxGpus", "minGpus must not exceed maxGpus", ".minGpus")
            ]
        }
    )

    name: Name
    min_gpus: Annotated[int, Field(ge=0, le=100000)] = 0
    max_gpus: Annotated[int, Field(ge=1, le=100000)]
    inference_pools: Annotated[
        list[Name],
        Field(
            default_factory=list,
            max_length=64,
            description="InferencePools in that region the run may borrow from.",
        ),
    ]


class RolloutSpec(ApiModel):
    group_size: Annotated[
        int, Field(ge=1, le=1024, description="Attempts per task (GRPO group).")
    ] = 8
    regions: Annotated[
        list[RegionDemand], Field(min_length=1, max_length=64, json_schema_extra=map_list("name"))
    ]


class WeightSyncSpec(ApiModel):
    snapshot_interval: Annotated[
        int, Field(ge=1, le=10000, description="A full snapshot every N versions.")
    ] = 20
    shard_size_mib: Annotated[int, Field(ge=1, le=4096)] = 64


class RLRunSpec(ApiModel):
    model: Annotated[
        ModelSource,
        Field(
            json_schema_extra={
                "x-kubernetes-validations": [cel("self == oldSelf", "model is immutable")]
            }
        ),
    ]
    trainer: TrainerSpec = TrainerSpec()
    rollout: RolloutSpec
    max_staleness: Annotated[
        int,
        Field(
            ge=0,
            le=1024,
            description="Trajectories more than this many policy versions old are dropped.",
        ),
    ] = 2
    weight_sync: WeightSyncSpec = WeightSyncSpec()
    environments: Annotated[
        list[Name],
        Field(default_factory=list, max_length=64, description="EnvPools the rollouts act in."),
    ]
    suspend: bool = False


class RLRunStatus(ApiModel):
    phase: Literal["Pending", "Running", "Suspended", "Succeeded", "Failed"] | None = None
    observed_generation: Annotated[int, Field(ge=0)] | None = None
    conditions: Conditions
    policy_version: Annotated[int, Field(ge=0)] | None = None
    trainer_step: Annotated[int, Field(ge=0)] | None = None
    staleness: Annotated[int, Field(ge=0)] | None = None
    gpus_lent: Annotated[int, Field(ge=0)] | None = None


RLRUN = ResourceKind(
    kind="RLRun",
    description="One asynchronous RL post-training job: trained in the hub, rolled out in regions.",
    plural="rlruns",
    singular="rlrun",
    short_names=("rlr",),
    spec=RLRunSpec,
    status=RLRunStatus,
    columns=(
        PrinterColumn("Phase", ".status.phase", "string"),
        PrinterColumn("Version", ".status.policyVersion", "integer", "Current policy version"),
        PrinterColumn("Staleness", ".status.staleness", "integer", "Versions behind, worst region"),
        PrinterColumn("GPUs-Lent", ".status.gpusLent", "integer", "Rollout GPUs borrowed"),
        AGE,
    ),
)

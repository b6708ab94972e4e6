"""RLRun: one asynchronous RL post-training job, trained in the hub, rolled out in regions."""

from __future__ import annotations

import re
from typing import Annotated, Literal

from pydantic import ConfigDict, Field, model_validator

from rlfleet.api.environment import EnvironmentSpec
from rlfleet.api.meta import (
    AGE,
    DNS_LABEL,
    ApiModel,
    Conditions,
    Count,
    GpuType,
    ObservedGeneration,
    PrinterColumn,
    Quantity,
    ResourceKind,
    cel,
    map_list,
)
from rlfleet.api.production import ProductionSpec, ProductionStatus
from rlfleet.api.taskdata import TaskSource
from rlfleet.api.tracking import TrackingSpec
from rlfleet.api.wire import MAX_GROUP_SIZE

Name = Annotated[str, Field(min_length=1, max_length=63, pattern=DNS_LABEL)]
Precision = Literal["fp32", "bf16"]

# An RLRun's own name names its NATS streams and subjects, where `.` cannot go, and its
# trainer's pods carry the label `<name>-trainer-<hash of up to 10>`, which must fit 63.
RUN_NAME_MAX = 44
RUN_NAME_RULE = cel(
    f"size(self.metadata.name) <= {RUN_NAME_MAX} && self.metadata.name.matches('{DNS_LABEL}')",
    f"metadata.name: an RLRun's name must be a DNS label (lowercase letters, digits and "
    f"'-', no '.') of at most {RUN_NAME_MAX} characters",
)


def check_run_name(name: object) -> str:
    """The name, if the API server would take it for an RLRun (`RUN_NAME_RULE`)."""
    if not (isinstance(name, str) and len(name) <= RUN_NAME_MAX and re.match(DNS_LABEL, name)):
        raise ValueError(RUN_NAME_RULE["message"] + f", not {name!r}")
    return name


class ModelSource(ApiModel):
    """The base policy the run starts from."""

    model_config = ConfigDict(
        json_schema_extra={
            "x-kubernetes-validations": [
                cel(
                    "!has(self.volumeClaimName) || self.uri.startsWith('file:///')",
                    "volumeClaimName needs a file:/// uri: the folder it is mounted at",
                    ".volumeClaimName",
                ),
                # What pods (`launch.model_dir`) and `rlfleet run` (`local.plan`) can read.
                cel(
                    "self.uri.startsWith('file:///') || self.uri.startsWith('tiny://') ||"
                    " self.uri.matches('^s3://[a-z0-9][a-z0-9.-]{1,61}[a-z0-9](/.*)?$')",
                    "uri must be file:///FOLDER, as the pods see it, s3://BUCKET/PREFIX, or "
                    "tiny://KIND (rlfleet run only)",
                    ".uri",
                ),
                cel(
                    "!has(self.endpoint) || self.uri.startsWith('s3://')",
                    "endpoint is an object store's: it needs an s3:// uri",
                    ".endpoint",
                ),
                cel(
                    "!has(self.credentialsSecret) || self.uri.startsWith('s3://')",
                    "credentialsSecret is an object store's: it needs an s3:// uri",
                    ".credentialsSecret",
                ),
            ]
        }
    )

    uri: Annotated[
        str,
        Field(
            min_length=1,
            max_length=2048,
            description=(
                "Where the checkpoint is: file:///FOLDER as the pods see it; "
                "s3://BUCKET/PREFIX in an S3-compatible store, fetched and checked by each "
                "pod's init container into the node's model cache; tiny://KIND makes a tiny "
                "model (rlfleet run only)."
            ),
        ),
    ]
    endpoint: (
        Annotated[
            str,
            Field(
                max_length=2048,
                pattern=r"^https?://[^/?#\s]+/?$",
                description=(
                    "The S3-compatible store's URL (scheme, host and port), for an s3:// "
                    "uri; none: AWS S3."
                ),
            ),
        ]
        | None
    ) = None
    credentials_secret: Annotated[
        Name | None,
        Field(
            description=(
                "A Secret in the run's namespace of every cluster the run uses, whose keys "
                "AWS_ACCESS_KEY_ID, AWS_SECRET_ACCESS_KEY and optional AWS_SESSION_TOKEN "
                "and AWS_REGION the init container alone reads to fetch an s3:// model; "
                "none: an anonymous read."
            )
        ),
    ] = None
    tool_call_parser: Annotated[
        str,
        Field(
            min_length=1,
            max_length=63,
            pattern=r"^[a-z0-9_]+$",
            description=(
                "vLLM's tool-call parser for the model's own format (a --tool-call-parser"
                " name: hermes for Qwen and the tiny models, deepseek_v3, kimi_k2, ...): how"
                " the rollout endpoint reads the tool calls a harness's model makes."
            ),
        ),
    ] = "hermes"
    volume_claim_name: Annotated[
        Name | None,
        Field(
            description=(
                "A PersistentVolumeClaim holding the checkpoint, mounted read-only at the "
                "uri's folder in trainer and rollout pods; a claim of this name in every "
                "cluster the run uses."
            )
        ),
    ] = None


Image = Annotated[str, Field(min_length=1, max_length=1024)]


class CheckpointStorage(ApiModel):
    """A PersistentVolumeClaim per trainer rank for its checkpoints and step log."""

    size: Annotated[Quantity, Field(description="Requested storage per rank, e.g. 200Gi.")]
    storage_class_name: Annotated[
        Name | None,
        Field(description="The claims' StorageClass; the cluster's default when unset."),
    ] = None


# A step's size when the spec names neither stepTokens nor stepGroups (both have to be
# optional for the two to be exclusive): the trainer's `step_tokens` default.
STEP_TOKENS = 4096
STEP_SIZE_RULE = cel(
    "!has(self.stepTokens) || !has(self.stepGroups)",
    "stepTokens and stepGroups are exclusive: a step counts tokens or groups, not both",
    ".stepGroups",
)
CLIP_RULE = cel(
    "self.clipHigh >= self.clipLow",
    "clipHigh must be at least clipLow: the upper clip may only be the wider (DAPO)",
    ".clipHigh",
)


class TrainerSpec(ApiModel):
    """The trainer's job, and the recipe it learns by (`launch.from_spec.trainer_settings`)."""

    model_config = ConfigDict(
        json_schema_extra={"x-kubernetes-validations": [STEP_SIZE_RULE, CLIP_RULE]}
    )

    replicas: Annotated[
        int,
        Field(
            ge=1,
            le=4096,
            description=(
                "Trainer pods, each a node of one distributed job; it trains once all are ready."
            ),
        ),
    ] = 1
    gpus_per_replica: Annotated[
        int,
        Field(
            ge=0,
            le=16,
            description="GPUs of each trainer pod, a training process on each; 0 trains on CPU.",
        ),
    ] = 8
    image: Annotated[
        Image | None, Field(description="Trainer image; the chart's default when unset.")
    ] = None
    deep_speed_config_map: Annotated[
        Name | None,
        Field(
            description=(
                "A ConfigMap in the run's namespace whose ds_config.json the trainer merges "
                "under its own DeepSpeed settings (bucket sizes, communication overlap, ...). "
                "Keys the trainer sets itself (batch sizes, gradient accumulation and "
                "clipping, zero_optimization.stage, optimizer and its offload, scheduler, "
                "bf16, fp16) are refused; the file is read when a trainer pod starts."
            )
        ),
    ] = None
    gpu_type: Annotated[
        GpuType | None,
        Field(
            description=(
                "The GPU type every trainer pod needs: the value of the operator's GPU-type "
                "node label (nvidia.com/gpu.product by default); any type when unset."
            )
        ),
    ] = None
    zero_stage: Annotated[int, Field(ge=0, le=3, description="DeepSpeed ZeRO stage.")] = 2
    batch_invariant: Annotated[
        bool,
        Field(description="Batch-invariant kernels: log-probs do not depend on the batch."),
    ] = True
    precision: Annotated[
        Precision,
        Field(
            description=(
                "What the trainer computes in. bf16: bfloat16 weights, activations and "
                "gradients over float32 master weights and Adam state (about 20 bytes a "
                "parameter before ZeRO partitions it, half fp32's activations), the GPU's "
                "fast path, batch-invariant with the model's own kernels on Hopper and "
                "newer. fp32: float32 throughout (16 bytes a parameter), what CPUs train in."
                " Published versions are in the checkpoint's dtype either way."
            )
        ),
    ] = "fp32"
    router_replay: Annotated[
        bool,
        Field(
            description="Score MoE layers with the experts the rollout used. A production "
            "pool's servers then run eager (--enforce-eager) to record them."
        ),
    ] = True
    kl_coef: Annotated[
        float,
        Field(
            ge=0,
            le=10,
            description=(
                "Weight of a KL penalty to the starting model (k3 estimator), which keeps the"
                " policy from collapsing onto one answer per task; 0 turns it off."
            ),
        ),
    ] = 0.0
    learning_rate: Annotated[
        float, Field(gt=0, le=1, description="AdamW's learning rate, once warmed up.")
    ] = 1e-5
    learning_rate_warmup_steps: Annotated[
        int,
        Field(
            ge=0,
            le=1_000_000,
            description="Optimiser updates over which the learning rate ramps up from 0.",
        ),
    ] = 0
    learning_rate_decay_steps: Annotated[
        int,
        Field(
            ge=0,
            le=1_000_000,
            description=(
                "Optimiser updates after the warm-up over which the learning rate falls "
                "along a half cosine to learningRateFloor of itself, where it then stays: "
                "a run of a known length ends on small steps, so its last version is not a "
                "large step's noise away from where it was heading. 0 keeps the rate "
                "constant, as an open-ended run (a production one) wants."
            ),
        ),
    ] = 0
    learning_rate_floor: Annotated[
        float,
        Field(
            ge=0,
            le=1,
            description="Where learningRateDecaySteps ends, as a fraction of learningRate.",
        ),
    ] = 0.1
    step_tokens: Annotated[
        int | None,
        Field(
            ge=1,
            le=1 << 30,
            description=(
                "Each optimiser step trains on at least this many tokens of complete groups,"
                f" and on up to twice as many when ready; {STEP_TOKENS} when neither this nor"
                " stepGroups is set."
            ),
        ),
    ] = None
    step_groups: Annotated[
        int | None,
        Field(
            ge=1,
            le=65536,
            description=(
                "Or each step trains on exactly this many groups (tasks): a batch the task "
                "feed issues exactly, so a synchronous run wastes no rollout."
            ),
        ),
    ] = None
    updates_per_step: Annotated[
        int,
        Field(
            ge=1,
            le=64,
            description=(
                "Optimiser passes over each step's batch (PPO epochs), each clipped against"
                " the first pass's log-probs."
            ),
        ),
    ] = 1
    clip_low: Annotated[
        float,
        Field(
            ge=0,
            lt=1,
            description="The policy ratio is clipped below at 1 - clipLow (PPO's epsilon).",
        ),
    ] = 0.2
    clip_high: Annotated[
        float,
        Field(
            ge=0,
            le=10,
            description=(
                "And above at 1 + clipHigh; wider than clipLow, it keeps low-probability "
                "tokens learning (DAPO's clip-higher)."
            ),
        ),
    ] = 0.28
    importance_weight_cap: Annotated[
        float,
        Field(
            ge=1,
            le=1000,
            description=(
                "Truncated importance sampling: a token's weight, trainer over rollout "
                "probability, is capped here, bounding what off-policy tokens can do."
            ),
        ),
    ] = 2.0
    checkpoint_storage: Annotated[
        CheckpointStorage | None,
        Field(
            description=(
                "Keep checkpoints on a claim per rank, so a rank moved to another node "
                "resumes; unset, they survive a container restart only (emptyDir). Claims "
                "are kept while the run is suspended and deleted with it."
            ),
            json_schema_extra={
                "x-kubernetes-validations": [
                    cel(
                        "self == oldSelf",
                        "checkpointStorage is immutable: a StatefulSet's claims cannot change",
                    )
                ]
            },
        ),
    ] = None

    @model_validator(mode="after")
    def _recipe_rules(self) -> TrainerSpec:
        """The CEL rules, for a spec no API server checks (`rlfleet run`)."""
        if self.step_tokens is not None and self.step_groups is not None:
            raise ValueError(STEP_SIZE_RULE["message"])
        if self.clip_high < self.clip_low:
            raise ValueError(CLIP_RULE["message"])
        return self


class RegionDemand(ApiModel):
    """How many rollout GPUs the run wants in one region, and whose GPUs it may borrow."""

    model_config = ConfigDict(
        json_schema_extra={
            "x-kubernetes-validations": [
                cel("self.minGpus <= self.maxGpus", "minGpus must not exceed maxGpus", ".minGpus")
            ]
        }
    )

    name: Annotated[
        Name,
        Field(description="The region: the cluster name its region operator runs under."),
    ]
    min_gpus: Annotated[
        int,
        Field(
            ge=0,
            le=100000,
            description=(
                "Rollout GPUs the run needs there: pools lend every run its floor before more, "
                "and under it the run's RolloutsDegraded condition is true (BelowMinGpus)."
            ),
        ),
    ] = 0
    max_gpus: Annotated[
        int,
        Field(
            ge=1,
            le=100000,
            description="The most rollout GPUs the run borrows there, from all its pools together.",
        ),
    ]
    inference_pools: Annotated[
        list[Name],
        Field(
            default_factory=list,
            max_length=64,
            description="InferencePools in that region the run may borrow from.",
        ),
    ]
    gpu_types: Annotated[
        list[GpuType],
        Field(
            default_factory=list,
            max_length=16,
            json_schema_extra={"x-kubernetes-list-type": "set"},
            description=(
                "GPU types the rollouts can use there (InferencePool serving.gpuType): a pool "
                "of another type, or of none named, lends the run nothing; any pool when empty."
            ),
        ),
    ]


# A window holds the task's prompt, a model turn and room to summarise
# (`rlfleet.rollout.environment.session`).
WINDOW_RULE = cel(
    "self.turnTokens + self.summaryTokens < self.contextTokens",
    "contextTokens must exceed turnTokens + summaryTokens: a window holds the task, a turn "
    "and room to summarise",
    ".contextTokens",
)
MAX_TOKENS = 1 << 24  # bounds a token budget of the spec
DEFAULT_SUITE = "toy"
ONE_TASK_SOURCE_RULE = cel(
    f"!has(self.tasks) || self.taskSuite == '{DEFAULT_SUITE}'",
    "tasks replaces the task suite: leave taskSuite unset",
    ".tasks",
)


class RolloutSpec(ApiModel):
    """The rollouts' demand per region, and how their agent sessions run
    (`rlfleet.launch.from_spec.rollout_settings`)."""

    model_config = ConfigDict(
        json_schema_extra={"x-kubernetes-validations": [WINDOW_RULE, ONE_TASK_SOURCE_RULE]}
    )

    group_size: Annotated[
        int,
        Field(
            ge=2,
            le=MAX_GROUP_SIZE,
            description="Attempts per task (a GRPO group; one alone gives no signal).",
        ),
    ] = 8
    image: Annotated[
        Image | None, Field(description="Rollout worker image; the chart's default when unset.")
    ] = None
    task_suite: Annotated[
        str,
        Field(
            min_length=1,
            max_length=253,
            description="A shipped task suite the run trains on (or a path); unused with tasks.",
        ),
    ] = DEFAULT_SUITE
    tasks: Annotated[
        TaskSource | None,
        Field(
            description=(
                "The run's own data as tasks (JSON Lines, Parquet or a datasets folder, on a"
                " volume the feed mounts), instead of the task suite and of an environment's"
                " own tasks."
            )
        ),
    ] = None
    environment: Annotated[
        EnvironmentSpec,
        Field(description="The harness, tasks and reward rollouts run; unset: rlfleet's agent."),
    ] = EnvironmentSpec()
    env_pool: Annotated[
        Name | None,
        Field(
            description=(
                "The EnvPool, in the run's namespace in each of its regions, where agents'"
                " tool calls and hidden tests run; unset: none, and such tasks score 0."
            )
        ),
    ] = None
    regions: Annotated[
        list[RegionDemand],
        Field(
            min_length=1,
            max_length=64,
            json_schema_extra=map_list("name"),
            description="Where rollouts run: per region, the GPUs the run wants and whose.",
        ),
    ]
    uniform_group_revisit: Annotated[
        float,
        Field(
            gt=0,
            le=1,
            description=(
                "The chance a task is asked again when its last trained group was all right"
                " or all wrong (it taught nothing); 1 asks every task in turn."
            ),
        ),
    ] = 1.0
    # Fixed for the run's life: pods read it when they start, and the trajectories in flight
    # were sampled at the old one, so a change would mix temperatures in one step unseen.
    temperature: Annotated[
        float,
        Field(
            gt=0,
            le=2,
            description=(
                "Rollouts' sampling temperature. The trainer scores their tokens at the same"
                " temperature, so the off-policy correction compares like with like; above 1"
                " explores answers the policy rarely gives. Fixed once the run exists."
            ),
            json_schema_extra={
                "x-kubernetes-validations": [
                    cel("self == oldSelf", "rollout.temperature is immutable")
                ]
            },
        ),
    ] = 1.0
    max_turns: Annotated[
        int,
        Field(ge=1, le=10000, description="Model turns an agent session may take at most."),
    ] = 50
    turn_tokens: Annotated[
        int, Field(ge=1, le=MAX_TOKENS, description="New tokens one model turn may take at most.")
    ] = 256
    context_tokens: Annotated[
        int,
        Field(
            ge=1,
            le=MAX_TOKENS,
            description=(
                "A context window's budget: when the next turn would not fit, the model "
                "summarises its progress and a new window starts from the task and summary."
            ),
        ),
    ] = 4096
    summary_tokens: Annotated[
        int, Field(ge=1, le=MAX_TOKENS, description="New tokens a summary may take at most.")
    ] = 256

    @model_validator(mode="after")
    def _rollout_rules(self) -> RolloutSpec:
        """The CEL rules, for a spec no API server checks (`rlfleet run`)."""
        if self.turn_tokens + self.summary_tokens >= self.context_tokens:
            raise ValueError(WINDOW_RULE["message"])
        if self.tasks is not None and self.task_suite != DEFAULT_SUITE:
            raise ValueError(ONE_TASK_SOURCE_RULE["message"])
        return self


class NatsEndpoint(ApiModel):
    """One region's NATS server, for the rollout pods there."""

    region: Annotated[Name, Field(description="The region, one of rollout.regions.")]
    url: Annotated[
        str,
        Field(
            max_length=2048,
            pattern=r"^(nats|tls)://",
            description="Where the region's rollout pods connect to NATS: nats:// or tls://.",
        ),
    ]


class WeightSyncSpec(ApiModel):
    """How the trainer's policy versions reach the regions, over NATS."""

    snapshot_interval: Annotated[
        int, Field(ge=1, le=10000, description="A full snapshot every N versions.")
    ] = 20
    shard_size_mib: Annotated[
        int,
        Field(
            ge=1, le=12, description="Encoded shards stay below this; eight are fetched at once."
        ),
    ] = 8
    endpoints: Annotated[
        list[NatsEndpoint],
        Field(
            default_factory=list,
            max_length=64,
            json_schema_extra=map_list("region"),
            description="The NATS server (leaf node) rollouts of each region connect to.",
        ),
    ]
    stall_seconds: Annotated[
        int,
        Field(ge=1, le=86400, description="WeightSyncStalled when no version lands this long."),
    ] = 900


# The reward kinds a run may name: one vocabulary from the spec (`spec.rewards[].kind`)
# through the worker's settings to its scorers (`rlfleet.rollout.environment.rewards.SCORERS`)
# and each trajectory's reward breakdown.
RewardKind = Literal["exactAnswer", "hiddenTests", "judge", "python", "remote"]
# A Python callable on the rollout image's path: `package.module:function`.
FUNCTION = r"^[A-Za-z_][A-Za-z0-9_.]*:[A-Za-z_][A-Za-z0-9_.]*$"


class RemoteRequests(ApiModel):
    """How a remote reward's requests are made."""

    timeout_seconds: Annotated[
        float, Field(gt=0, le=3600, description="One request's timeout.")
    ] = 30.0
    retries: Annotated[
        int,
        Field(
            ge=0,
            le=10,
            description=(
                "Tries after the first, for a timeout, a refused connection, 429 or 5xx; then"
                " the attempt fails (reason reward) and its group is tried again."
            ),
        ),
    ] = 2
    concurrency: Annotated[
        int, Field(ge=1, le=4096, description="Requests one rollout worker has open at once.")
    ] = 16


class RewardSpec(ApiModel):
    """One part of the reward, combined with the others by weight."""

    model_config = ConfigDict(
        json_schema_extra={
            "x-kubernetes-validations": [
                cel(
                    "self.kind != 'judge' || has(self.endpoint)",
                    "a judge reward needs an endpoint",
                    ".endpoint",
                ),
                cel(
                    "self.kind != 'judge' || has(self.judgeModel)",
                    "a judge reward needs judgeModel, the model the endpoint serves",
                    ".judgeModel",
                ),
                cel(
                    "self.kind != 'python' || has(self.function)",
                    "a python reward needs function, module:function",
                    ".function",
                ),
                cel(
                    "!has(self.function) || self.kind == 'python'",
                    "function is a python reward's",
                    ".function",
                ),
                cel(
                    "self.kind != 'remote' || has(self.endpoint)",
                    "a remote reward needs an endpoint, the URL each attempt is POSTed to",
                    ".endpoint",
                ),
                cel(
                    "!has(self.requests) || self.kind == 'remote'",
                    "requests are a remote reward's",
                    ".requests",
                ),
            ]
        }
    )

    kind: Annotated[
        RewardKind,
        Field(
            description=(
                "What earns it, on tasks that have it: exactAnswer, the task's answer "
                "(whitespace aside); hiddenTests, the task's tests passing in a fresh sandbox "
                "of the run's EnvPool; judge, a model's mean 0-10 score on the task's rubric, "
                "divided by 10; python, what `function` returns; remote, what a service at"
                " `endpoint` answers. The last two apply to every task and return a number"
                " from 0 to 1, or parts by name whose mean it is."
            )
        ),
    ]
    weight: Annotated[
        float,
        Field(
            gt=0,
            le=1000,
            description=(
                "A task's reward is the weighted mean of the kinds that apply to it; a kind "
                "not listed weighs nothing."
            ),
        ),
    ] = 1.0
    endpoint: (
        Annotated[
            str,
            Field(
                max_length=2048,
                pattern=r"^https?://",
                description=(
                    "A judge's OpenAI-compatible endpoint; a remote reward's URL, to which"
                    " each attempt is POSTed as JSON (task, answer, transcript, files)."
                ),
            ),
        ]
        | None
    ) = None
    judge_model: (
        Annotated[
            str,
            Field(
                min_length=1,
                max_length=253,
                description="The model the judge's endpoint serves, named in each request.",
            ),
        ]
        | None
    ) = None
    function: (
        Annotated[
            str,
            Field(
                max_length=253,
                pattern=FUNCTION,
                description=(
                    "A python reward's grader, module:function on the rollout image's path,"
                    " sync or async, called with the task and the attempt's outcome (answer,"
                    " files, transcript)."
                ),
            ),
        ]
        | None
    ) = None
    requests: RemoteRequests | None = None


class EvaluationGate(ApiModel):
    """Held-out evaluation every few versions: the run fails when a score falls under
    `minReward`, and succeeds when one reaches `targetReward`; either way it stops."""

    model_config = ConfigDict(
        json_schema_extra={
            "x-kubernetes-validations": [
                cel(
                    "!has(self.targetReward) || self.targetReward > self.minReward",
                    "targetReward must be above minReward",
                    ".targetReward",
                )
            ]
        }
    )

    suite: Annotated[
        str,
        Field(min_length=1, max_length=253, description="A shipped suite's name, or a path."),
    ]
    every_versions: Annotated[
        int,
        Field(
            ge=1,
            le=10000,
            description=(
                "The evaluator scores a version once it is this many past the last it scored;"
                " a production run's scores what its cycles ask for instead."
            ),
        ),
    ] = 10
    min_reward: Annotated[
        float,
        Field(
            ge=0,
            le=1,
            description=(
                "The floor: a version scored under it fails the run, which then stops as if "
                "suspended."
            ),
        ),
    ] = 0.0
    target_reward: Annotated[
        float | None,
        Field(gt=0, le=1, description="Stop, succeeded, once a version scores this much."),
    ] = None

    def verdict(self, reward: float) -> Literal["Failed", "Succeeded"] | None:
        """What a version's score means for the run, wherever it runs (the hub operator,
        `rlfleet run`): under the floor fails it, at the target completes it."""
        if reward < self.min_reward:
            return "Failed"
        if self.target_reward is not None and reward >= self.target_reward:
            return "Succeeded"
        return None


ONE_SOURCE_RULE = cel(
    "has(self.rollout) != has(self.production)",
    "a run learns from rollouts of a task suite or from a production pool's users: give "
    "exactly one of rollout and production",
    ".production",
)
GATED_PRODUCTION_RULE = cel(
    "!has(self.production) || has(self.evaluation)",
    "production needs evaluation: its suite is the gate every candidate passes before users see it",
    ".evaluation",
)


class RLRunSpec(ApiModel):
    model_config = ConfigDict(
        json_schema_extra={
            "x-kubernetes-validations": [
                cel(
                    "!has(self.weightSync) || !has(self.weightSync.endpoints) || "
                    "self.weightSync.endpoints.all(e, has(self.rollout) && "
                    "self.rollout.regions.exists(r, r.name == e.region))",
                    "every weightSync endpoint must name a region of rollout.regions",
                    ".weightSync.endpoints",
                ),
                ONE_SOURCE_RULE,
                GATED_PRODUCTION_RULE,
                # Here, not on trainer: a run created without `trainer` has no old one.
                cel(
                    "(has(self.trainer) && has(self.trainer.checkpointStorage)) == "
                    "(has(oldSelf.trainer) && has(oldSelf.trainer.checkpointStorage))",
                    "trainer.checkpointStorage cannot be added or removed: a StatefulSet's "
                    "claims cannot change",
                    ".trainer.checkpointStorage",
                ),
            ]
        }
    )

    model: Annotated[
        ModelSource,
        Field(
            json_schema_extra={
                "x-kubernetes-validations": [cel("self == oldSelf", "model is immutable")]
            }
        ),
    ]
    trainer: TrainerSpec = TrainerSpec()
    rollout: RolloutSpec | None = None
    production: ProductionSpec | None = None
    max_staleness: Annotated[
        int,
        Field(
            ge=0,
            le=1024,
            description="Trajectories more than this many policy versions old are dropped.",
        ),
    ] = 2
    # A bound on the hub's store that no worker or collector, however wrong, can push past.
    # The default holds some 80,000 trajectories of 8k tokens: the trainer uses a few
    # thousand of the newest (its staleness bound), so what goes first was trained long ago.
    trajectory_backlog_mib: Annotated[
        int,
        Field(
            ge=64,
            le=16 << 20,
            description=(
                "MiB of the run's trajectories the hub keeps; past it the oldest go first,"
                " trained long before unless the trainer is that far behind."
            ),
        ),
    ] = 8192
    weight_sync: WeightSyncSpec = WeightSyncSpec()
    rewards: Annotated[
        list[RewardSpec],
        Field(
            default_factory=list,
            max_length=16,
            json_schema_extra=map_list("kind"),
            description="Parts of the reward; the suite's verifiable checks when empty.",
        ),
    ]
    evaluation: EvaluationGate | None = None
    tracking: TrackingSpec | None = None
    priority: Annotated[
        int,
        Field(
            ge=-1000,
            le=1000,
            description="Runs with higher priority borrow GPUs first and give them back last.",
        ),
    ] = 0
    suspend: Annotated[
        bool,
        Field(
            description=(
                "Stops the run and keeps it: its pods in the hub scale to zero and the "
                "regions take back the GPUs lent to it. False resumes it."
            )
        ),
    ] = False

    @model_validator(mode="after")
    def _source_rules(self) -> RLRunSpec:
        """The CEL rules on where experience comes from, for `rlfleet run`."""
        if (self.rollout is None) == (self.production is None):
            raise ValueError(ONE_SOURCE_RULE["message"])
        if self.production is not None and self.evaluation is None:
            raise ValueError(GATED_PRODUCTION_RULE["message"])
        return self

    @property
    def region_names(self) -> list[str]:
        """The regions the run's policy goes to: its rollouts', or its production pool's."""
        if self.production is not None:
            return [self.production.pool.region]
        assert self.rollout is not None
        return [region.name for region in self.rollout.regions]

    @property
    def rollout_regions(self) -> list[RegionDemand]:
        """What the run asks of each region for rollouts: nothing, in a production run."""
        return self.rollout.regions if self.rollout is not None else []

    @property
    def suite(self) -> str:
        """The task suite the run is about: the one it rolls out, or its gate's."""
        if self.rollout is not None:
            return self.rollout.task_suite
        assert self.evaluation is not None
        return self.evaluation.suite


class RegionStatus(ApiModel):
    """Rollout GPUs of the run in one region, as that region's operator last reported."""

    name: Annotated[Name, Field(description="The region.")]
    reachable: Annotated[
        bool,
        Field(
            description=(
                "False once the region has been silent for the hub's region timeout, or at "
                "once when it refuses the hub's credentials; its GPUs then count in no total."
            )
        ),
    ] = True
    requested: Annotated[
        Count, Field(description="The most rollout GPUs the run asks of it (maxGpus there).")
    ] = 0
    lent: Annotated[Count, Field(description="GPUs its InferencePools lend the run.")] = 0
    running: Annotated[
        Count, Field(description="GPUs of the run's running rollout pods there.")
    ] = 0
    last_seen: Annotated[
        str | None,
        Field(
            description=(
                "When the region last answered the hub; rewritten at most once a minute while "
                "it answers."
            ),
            json_schema_extra={"format": "date-time"},
        ),
    ] = None
    gpu_types_unserved: Annotated[
        str | None,
        Field(
            description=(
                "Why the run can borrow nothing there: none of the pools it names serves on "
                "a GPU type its gpuTypes lists."
            )
        ),
    ] = None
    env_pool_missing: Annotated[
        str | None,
        Field(
            description=(
                "Why agents there can act nowhere: the EnvPool spec.rollout.envPool names is"
                " not in the run's namespace of that region."
            )
        ),
    ] = None


class WeightSyncStatus(ApiModel):
    """The trainer's newest publish of its weights to the hub; regions' mirrors get it later."""

    version: Annotated[Count, Field(description="The policy version published.")]
    bytes: Annotated[
        Count, Field(description="Encoded bytes a receiver one version behind fetches.")
    ]
    seconds: Annotated[
        float, Field(ge=0, description="Seconds the trainer took to publish it to the hub.")
    ]
    time: Annotated[
        str | None,
        Field(
            description="When the trainer published it (not when regions have it).",
            json_schema_extra={"format": "date-time"},
        ),
    ] = None


class EvaluationStatus(ApiModel):
    """The evaluator's newest score, which the evaluation gate holds the run to."""

    version: Annotated[Count, Field(description="The policy version scored.")]
    reward: Annotated[
        float,
        Field(ge=0, le=1, description="Its mean reward over every attempt at every task."),
    ]
    pass_at_k: Annotated[
        float,
        Field(ge=0, le=1, description="The share of tasks some attempt got right (pass@k)."),
    ]
    suite: Annotated[str, Field(description="The suite it was scored on.")]
    time: Annotated[
        str | None,
        Field(
            description="When the evaluator finished scoring it.",
            json_schema_extra={"format": "date-time"},
        ),
    ] = None


class RLRunStatus(ApiModel):
    phase: Annotated[
        Literal["Pending", "Running", "Suspended", "Succeeded", "Failed"] | None,
        Field(
            description=(
                "Pending until every trainer pod is ready, then Running; Suspended while "
                "spec.suspend is true; Failed or Succeeded once a score meets the evaluation "
                "gate's floor or target, which holds the run."
            )
        ),
    ] = None
    observed_generation: ObservedGeneration = None
    conditions: Annotated[
        Conditions,
        Field(
            description=(
                "Ready, Training, RolloutsDegraded and Suspended; WeightSyncStalled once it "
                "has been said; Failed under an evaluation gate, and Succeeded with its "
                "targetReward; Progressing and Promoted in a production run."
            )
        ),
    ]
    policy_version: Annotated[
        Count | None,
        Field(description="The policy version the trainer's newest step published."),
    ] = None
    trainer_step: Annotated[
        Count | None, Field(description="Optimiser steps the trainer has taken.")
    ] = None
    staleness: Annotated[
        Count | None,
        Field(
            description=(
                "Versions behind the trainer of the oldest rollout its newest step trained "
                "on, whichever region it came from."
            )
        ),
    ] = None
    trajectories_dropped_stale: Annotated[
        Count | None,
        Field(
            description=(
                "Trajectories the trainer has dropped in all for arriving more than "
                "maxStaleness versions old."
            )
        ),
    ] = None
    trainer_replicas: Annotated[Count | None, Field(description="Trainer pods ready.")] = None
    gpus_lent: Annotated[
        Count | None,
        Field(
            description=(
                "Rollout GPUs lent to the run by the regions the hub reaches, in all (on a "
                "region's mirror of the run, that region's)."
            )
        ),
    ] = None
    gpus_running: Annotated[
        Count | None,
        Field(description="GPUs of the run's running rollout pods, counted the same way."),
    ] = None
    regions: Annotated[
        list[RegionStatus],
        Field(
            default_factory=list,
            json_schema_extra=map_list("name"),
            description=(
                "Each region's report, as the hub last read it from the run's mirror there."
            ),
        ),
    ]
    last_weight_sync: WeightSyncStatus | None = None
    last_evaluation: EvaluationStatus | None = None
    production: ProductionStatus | None = None


RLRUN = ResourceKind(
    kind="RLRun",
    description="One asynchronous RL post-training job: trained in the hub, rolled out in regions.",
    plural="rlruns",
    singular="rlrun",
    short_names=("rlr",),
    spec=RLRunSpec,
    status=RLRunStatus,
    rules=(RUN_NAME_RULE,),
    columns=(
        PrinterColumn("Phase", ".status.phase", "string"),
        PrinterColumn("Version", ".status.policyVersion", "integer", "Current policy version"),
        # A production run's trainer learns from what production served: it has no
        # staleness to show, and shows the next four instead, which a run with rollouts
        # leaves empty.
        PrinterColumn(
            "Staleness",
            ".status.staleness",
            "integer",
            "Versions behind of the oldest rollout in the newest step",
        ),
        PrinterColumn("GPUs-Lent", ".status.gpusLent", "integer", "Rollout GPUs borrowed"),
        PrinterColumn(
            "Serving", ".status.production.servingVersion", "integer", "Version production serves"
        ),
        PrinterColumn(
            "Candidate",
            ".status.production.candidateVersion",
            "integer",
            "The production cycle's candidate, once trained",
        ),
        PrinterColumn(
            "Stage",
            ".status.production.phase",
            "string",
            "The production cycle's: Collecting, Training, Evaluating or Canary",
        ),
        PrinterColumn(
            "Last", ".status.production.lastOutcome", "string", "How the last cycle ended"
        ),
        PrinterColumn(
            "Ready", '.status.conditions[?(@.type=="Ready")].status', "string", "All well"
        ),
        PrinterColumn(
            "Running", ".status.gpusRunning", "integer", "Rollout GPUs in running pods", 1
        ),
        PrinterColumn(
            "Cycle", ".status.production.cycle", "integer", "Production cycle under way", 1
        ),
        PrinterColumn(
            "Eval", ".status.lastEvaluation.reward", "number", "Newest evaluation reward", 1
        ),
        AGE,
    ),
)

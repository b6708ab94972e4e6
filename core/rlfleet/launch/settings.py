"""What each component runs with, typed: the settings `rlfleet.launch.from_spec` derives
from a run's spec and a placement, which a pod builds at start and `rlfleet run` writes as
JSON. A production run's own components' are in `rlfleet.launch.production`.

A field the spec decides takes its default from the API model (`rlfleet.api.rlrun`), its
one home (`spec_default`); the other fields are the components' own tunables. The types
live here, not in the components, because core builds them and may not import those.

Unlike the wire's messages (`rlfleet.api.wire`), settings forbid unknown fields: they are
built by the release that reads them (in the pod at its start, or by the `rlfleet run` of
the same checkout), never by another release, so an unknown field is a mistake to stop on.
"""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Any, ClassVar, TypeVar

import msgspec
from pydantic import BaseModel

from rlfleet.api.environment import EnvironmentSpec
from rlfleet.api.rlrun import (
    STEP_TOKENS,
    EvaluationGate,
    ModelSource,
    Precision,
    RemoteRequests,
    RewardKind,
    RLRunSpec,
    RolloutSpec,
    TrainerSpec,
    WeightSyncSpec,
)
from rlfleet.api.wire import MAX_SHARD_BYTES, WEIGHT_CHUNK_BYTES

Positive = Annotated[int, msgspec.Meta(ge=1)]
Weight = Annotated[float, msgspec.Meta(ge=0)]
MIB = 1 << 20
# Where a component serves its Prometheus metrics (`rlfleet.launch.pods.METRICS_PORT_ENV` in
# a pod, a free port in `rlfleet run`); None serves none.
MetricsPort = Annotated[int, msgspec.Meta(ge=1, le=65535)] | None


def spec_default(model: type[BaseModel], field: str) -> Any:
    """The default of a spec field, from the API model: the one place it is decided."""
    return model.model_fields[field].get_default(call_default_factory=True)


class SyncConfig(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """Weightsync's tunables; the spec sets `snapshot_every` and `shard_bytes`."""

    # A full snapshot every this many versions; the versions between are deltas.
    snapshot_every: Positive = spec_default(WeightSyncSpec, "snapshot_interval")
    # Encoded shards stay below this many bytes, so they move and retry independently.
    # One batched direct get returns at most ~64 MiB, so a shard must stay below that.
    shard_bytes: int = spec_default(WeightSyncSpec, "shard_size_mib") * MIB
    # One JetStream message carries at most this much of a shard; the weights stream
    # (`rlfleet.bus.streams`) takes messages of up to `WEIGHT_CHUNK_BYTES`, no more.
    chunk_bytes: int = WEIGHT_CHUNK_BYTES
    # Snapshots kept on the stream; receivers further behind start from the oldest.
    keep_snapshots: int = 2
    zstd_level: int = 3
    # Dense coding is tried only where at least this fraction of a piece changed.
    dense_from_fraction: float = 0.25
    # Shards fetched at once by a receiver, each over a connection of its own: a server
    # answers one connection's requests one after another (a 16-core host fetched from a
    # region's mirror at 1.1 GB/s over one connection, 2.1 GB/s over eight), and drops
    # a connection with more than its max_pending (64 MiB by default) queued.
    parallel_fetches: int = 8

    # What a receiver buffers for shards in flight: eight of the largest the spec allows.
    MAX_IN_FLIGHT_BYTES: ClassVar[int] = 96 * MIB

    def __post_init__(self) -> None:
        if self.snapshot_every < 1:
            raise ValueError("snapshot_every must be at least 1")
        if not 1024 <= self.chunk_bytes <= WEIGHT_CHUNK_BYTES:
            raise ValueError(
                f"chunk_bytes must be at least 1 KiB and at most {WEIGHT_CHUNK_BYTES}, what "
                "the weights stream takes"
            )
        if self.shard_bytes < self.chunk_bytes:
            raise ValueError("shard_bytes must be at least chunk_bytes")
        if self.keep_snapshots < 1 or self.parallel_fetches < 1:
            raise ValueError("keep_snapshots and parallel_fetches must be at least 1")
        if self.shard_bytes > MAX_SHARD_BYTES:  # what a receiver takes in a manifest
            raise ValueError(f"shard_bytes must be at most {MAX_SHARD_BYTES}")
        if self.shard_bytes * self.parallel_fetches > self.MAX_IN_FLIGHT_BYTES:
            raise ValueError(
                f"shard_bytes * parallel_fetches must be at most {self.MAX_IN_FLIGHT_BYTES}"
            )


class Ranks(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """Where one trainer process sits in the run's one DeepSpeed job: pods of the trainer
    StatefulSet are its nodes (`node_rank` the pod's ordinal), each running one process
    per GPU it was given; rank 0 lives in pod 0, which the others reach through the
    StatefulSet's headless Service. The defaults are a job of one process."""

    node_rank: Annotated[int, msgspec.Meta(ge=0)] = 0
    nodes: Positive = 1  # the trainer's pods (spec.trainer.replicas)
    procs_per_node: Positive = 1  # one rank per GPU in a pod (spec.trainer.gpusPerReplica)
    master_addr: str = "127.0.0.1"  # where rank 0 listens for the rendezvous
    master_port: Annotated[int, msgspec.Meta(ge=1, le=65535)] = 29500

    def __post_init__(self) -> None:
        if self.node_rank >= self.nodes:
            raise ValueError(f"node_rank {self.node_rank} is not below nodes {self.nodes}")

    @property
    def world(self) -> int:
        return self.nodes * self.procs_per_node

    def rank(self, local_rank: int) -> int:
        """The global rank of this node's `local_rank`-th process."""
        return self.node_rank * self.procs_per_node + local_rank


class TrackingConfig(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """An MLflow server the trainer logs the run to (`spec.tracking.mlflow`); its
    credentials come from the environment, as MLflow's own clients read them."""

    uri: str
    experiment: str
    run_name: str  # the run's key: the MLflow run tagged with it is the run's, once made
    params: dict[str, str] = msgspec.field(default_factory=dict)  # the spec, flattened
    queue: Annotated[int, msgspec.Meta(ge=1)] = 1024  # entries held while it is unreachable


class TrainerConfig(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    run: str
    nats_url: str
    model: Path  # the base Hugging Face checkpoint: policy version 0
    checkpoint_dir: Path  # DeepSpeed checkpoints and the step log; resume from here
    jetstream_domain: str | None = None  # the hub's domain, when connected through a leaf
    # Regions' domains whose mirrors of the weights the trainer retires old versions from
    # (a purge does not travel down a mirror).
    weight_mirrors: list[str] = msgspec.field(default_factory=list)
    zero_stage: Annotated[int, msgspec.Meta(ge=0, le=3)] = spec_default(TrainerSpec, "zero_stage")
    batch_invariant: bool = spec_default(TrainerSpec, "batch_invariant")
    precision: Precision = spec_default(TrainerSpec, "precision")
    router_replay: bool = spec_default(TrainerSpec, "router_replay")
    max_staleness: Annotated[int, msgspec.Meta(ge=0)] = spec_default(RLRunSpec, "max_staleness")
    step_tokens: Positive = STEP_TOKENS  # each optimiser step trains on at least this many tokens
    max_step_tokens: Positive | None = None  # and on more when ready, up to this (2x by default)
    # Or on exactly this many groups (tasks), ignoring the token budget: a batch the task
    # feed's staleness-aware admission can issue exactly, so nothing goes stale unused.
    step_groups: Positive | None = None
    micro_batch_tokens: Positive = 8192  # padded tokens per forward/backward
    learning_rate: float = spec_default(TrainerSpec, "learning_rate")
    # The rate ramps up from 0 over these optimiser updates.
    learning_rate_warmup_steps: Annotated[int, msgspec.Meta(ge=0)] = spec_default(
        TrainerSpec, "learning_rate_warmup_steps"
    )
    # Then it falls along a half cosine to learning_rate_floor x learning_rate over these
    # (0: it stays at learning_rate).
    learning_rate_decay_steps: Annotated[int, msgspec.Meta(ge=0)] = spec_default(
        TrainerSpec, "learning_rate_decay_steps"
    )
    learning_rate_floor: Annotated[float, msgspec.Meta(ge=0, le=1)] = spec_default(
        TrainerSpec, "learning_rate_floor"
    )
    # Optimiser passes over each batch (PPO epochs).
    updates_per_step: Positive = spec_default(TrainerSpec, "updates_per_step")
    weight_decay: float = 0.0
    grad_clip: float = 1.0
    clip_low: float = spec_default(TrainerSpec, "clip_low")
    clip_high: float = spec_default(TrainerSpec, "clip_high")
    importance_weight_cap: float = spec_default(TrainerSpec, "importance_weight_cap")
    kl_coef: float = spec_default(TrainerSpec, "kl_coef")
    # The user's DeepSpeed JSON (`spec.trainer.deepSpeedConfigMap`): the trainer merges it
    # under its own settings and refuses the keys it sets itself.
    deepspeed: dict[str, Any] = msgspec.field(default_factory=dict)
    # The rollouts' sampling temperature: tokens are scored under logits / temperature, the
    # distribution they were sampled from, else importance ratios compare two different
    # distributions. The KL to the reference is taken at it too.
    temperature: Annotated[float, msgspec.Meta(gt=0)] = spec_default(RolloutSpec, "temperature")
    group_timeout_s: float = 600.0
    keep_checkpoints: Positive = 2
    max_steps: int | None = None  # stop after this step (tests, fixed-budget runs)
    # A production run's: keeps the serving version's checkpoint and goes back to it when
    # its conductor says (`rlfleet.trainer.loop`).
    production: bool = False
    seed: int = 0
    metrics_port: MetricsPort = None
    tracking: TrackingConfig | None = None
    weightsync: SyncConfig = SyncConfig()
    ranks: Ranks = Ranks()


class SessionConfig(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """One agent session's budget (`rlfleet.rollout.environment.session`)."""

    max_turns: int = spec_default(RolloutSpec, "max_turns")
    turn_tokens: int = spec_default(RolloutSpec, "turn_tokens")  # most new tokens per model turn
    # A window's budget; over it, the model summarises.
    context_tokens: int = spec_default(RolloutSpec, "context_tokens")
    summary_tokens: int = spec_default(RolloutSpec, "summary_tokens")
    observation_chars: int = 4000  # longer tool output is cut in the middle
    temperature: float = spec_default(RolloutSpec, "temperature")


class EnvironmentConfig(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """The run's environment (`rlfleet.rollout.environment.plugins`): its registered name
    and its own settings, which it checks itself."""

    name: str = spec_default(EnvironmentSpec, "name")
    settings: dict[str, Any] = {}
    episode_s: float = spec_default(EnvironmentSpec, "episode_seconds")
    # How the episode endpoint reads the model's tool calls (vLLM's parser names).
    tool_call_parser: str = spec_default(ModelSource, "tool_call_parser")


class Limits(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """A sandbox's limits (`rlfleet.rollout.envpool.server`)."""

    cpu_seconds: int = 60  # per process
    memory_bytes: int = 1 << 30  # address space per process
    file_bytes: int = 64 * MIB  # largest file
    disk_bytes: int = 256 * MIB  # the whole working tree
    processes: int = 64
    open_files: int = 256
    wall_seconds: float = 600.0  # the sandbox's whole life
    call_seconds: float = 30.0  # one tool call


class PoolConfig(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """Where a worker claims its sandboxes: an EnvPool's session server
    (`rlfleet.rollout.envpool.server`)."""

    url: str
    token_file: str  # the run's bearer token for the pool, from a Secret's file
    claim_seconds: float = 30.0  # an attempt that gets no sandbox this soon fails


# The session server's package, run as `python -I -m ENVPOOL_SERVER SETTINGS_JSON` by an
# EnvPool's pods (whose image installs it), a local pool and the bed alike.
ENVPOOL_SERVER = "rlfleet.rollout.envpool"


class ServerConfig(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """The environment session server's (`rlfleet.rollout.envpool.server`): the one home of
    their defaults."""

    tokens_file: str  # JSON {run: token}, re-read when it changes
    host: str | None = "127.0.0.1"  # None: every address
    port: int = 0  # 0: any free port, printed when listening
    # One folder per named environment snapshot the image provides; each run's own builds
    # go under it too. Outside private_dirs: sandboxes fork from it once those are covered.
    snapshots_dir: str = "/var/lib/rlfleet/snapshots"
    limits: Limits = Limits()  # a session's, and the most a session may ask for
    max_sessions: int = 256
    max_body_bytes: int = 32 * MIB  # a request's body, and an envserver reply line
    max_header_bytes: int = 16 << 10
    idle_seconds: float = 60.0  # a keep-alive connection with no request is closed
    remembered: int = 4096  # destroyed sessions that still answer 410 rather than 404
    uid_base: int = 800_000  # session i runs as uid_base + i
    # The sandbox's server needs only the standard library: any uid reads the system Python.
    sandbox_python: str = "/usr/bin/python3"
    reply_grace_seconds: float = 5.0  # beyond a call's timeout, for the envserver to answer
    mounts_dir: str = "/run/rlfleet/sandboxes"  # sessions' mountpoints: outside private_dirs
    # Directories anyone may write to: each session gets private ones, so none passes files.
    private_dirs: tuple[str, ...] = ("/tmp", "/var/tmp", "/run/lock", "/dev/shm")
    warm: int = 8  # sandboxes kept ready for claims (namespaces and tmpfs made)
    lease_seconds: float = 60.0  # a claim no request renews for this long is destroyed
    claim_wait_seconds: float = 300.0  # the longest a claim may wait for capacity
    setup_seconds: float = 1800.0  # a snapshot's set-up command
    max_snapshots: int = 16  # a run's built environments kept: the least recently forked go
    # This server's own URL, which claims name (`endpoint`): in a pod behind a Service its
    # pod's address; "": the URL the client used.
    advertise: str = ""


class JudgeConfig(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """An LLM-as-judge over any OpenAI-compatible endpoint (a vLLM server included)."""

    base_url: str
    model: str
    api_key: str | None = None
    timeout_s: float = 60.0
    extra_body: dict = msgspec.field(default_factory=dict)  # e.g. a vLLM guided regex


def _verifiable() -> dict[RewardKind, float]:
    return {"exactAnswer": 1.0, "hiddenTests": 1.0}


class RemoteRewardConfig(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """A remote reward service (`rlfleet.rollout.environment.rewards.Remote`)."""

    url: str
    timeout_s: float = spec_default(RemoteRequests, "timeout_seconds")
    retries: int = spec_default(RemoteRequests, "retries")
    concurrency: Positive = spec_default(RemoteRequests, "concurrency")


class RewardConfig(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """Each reward kind's weight, by the spec's names; of those, the kinds that apply to a
    task make its reward (a kind not listed weighs nothing). With no `spec.rewards`, the
    suite's verifiable checks: an answer and hidden tests."""

    weights: dict[RewardKind, Weight] = msgspec.field(default_factory=_verifiable)
    judge_endpoint: JudgeConfig | None = None  # when `judge` is weighted
    python_function: str | None = None  # module:function, when `python` is weighted
    remote: RemoteRewardConfig | None = None  # when `remote` is weighted


class WorkerConfig(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """A rollout worker's (`rlfleet.rollout`)."""

    run: str
    nats_url: str
    model: str  # the base Hugging Face checkpoint: policy version 0
    name: str = "rollout-0"  # names the worker in trajectories and logs
    jetstream_domain: str | None = None  # the hub's domain, when connected through a leaf
    # The region's own domain, whose mirror of the hub's weights the worker reads: a
    # version then crosses the WAN once per region, not once per worker.
    weights_domain: str | None = None
    max_sessions: Positive = 64  # sessions running at once, across groups
    # Attempts per task, unless the task message says.
    group_size: Positive = spec_default(RolloutSpec, "group_size")
    max_model_len: Positive = 4096
    dtype: str = "bfloat16"
    # Devices per vLLM engine; None: chosen from the model's size and the GPUs the worker
    # sees (`rlfleet.rollout.worker.layout`). On the CPU backend each worker gets its own cores.
    tensor_parallel: Positive | None = None
    prefix_caching: bool = True
    follow_weights: bool = True  # apply the trainer's versions as they arrive
    start_version: int | None = 0  # take no task before this version is loaded
    session: SessionConfig = SessionConfig()
    environment: EnvironmentConfig = EnvironmentConfig()
    limits: Limits = Limits()
    # None: a session server of the worker's own, making namespace sandboxes as root.
    envpool: PoolConfig | None = None
    rewards: RewardConfig = RewardConfig()
    seed: int = 0
    metrics_port: MetricsPort = None
    weightsync: SyncConfig = SyncConfig()


class FeedConfig(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """The task feed's (`rlfleet.rollout.taskfeed.feed`)."""

    run: str
    nats_url: str
    suite: str  # a shipped suite's name, or a path to a JSON Lines file
    jetstream_domain: str | None = None
    # Whose tasks, when the environment brings its own (the suite is then unused).
    environment: EnvironmentConfig = EnvironmentConfig()
    # The run's own data (`spec.rollout.tasks`, as the spec spells it), read in place of
    # both, its path relative to `tasks_dir`.
    tasks: dict[str, Any] | None = None
    tasks_dir: str = "."
    # The trainer's bound.
    max_staleness: Annotated[int, msgspec.Meta(ge=0)] = spec_default(RLRunSpec, "max_staleness")
    groups_per_step: Positive = 8  # a first guess; steps correct it
    depth: Positive = 8
    group_size: Annotated[int, msgspec.Meta(ge=2)] | None = None  # the workers' default
    seed: int = 0
    # The chance a task whose last trained group was all right or all wrong is asked again
    # (`Curriculum`); 1 asks every task in turn.
    revisit_uniform: Annotated[float, msgspec.Meta(gt=0, le=1)] = spec_default(
        RolloutSpec, "uniform_group_revisit"
    )
    poll_s: float = 0.25
    metrics_port: MetricsPort = None


class EvaluatorConfig(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """The evaluator's (`rlfleet.rollout.evaluation.evaluator`)."""

    run: str
    nats_url: str
    model: str  # the run's model folder: its config and tokenizer, and version 0
    suite: str  # a shipped suite's name, or a path to a JSON Lines file
    every_versions: Positive = spec_default(EvaluationGate, "every_versions")
    # A production run's: score the versions its conductor asks for, not every few.
    on_request: bool = False
    jetstream_domain: str | None = None  # the hub's, where the weights and reports live
    attempts: Positive = 8  # per task: the k of pass@k
    poll_seconds: Annotated[float, msgspec.Meta(gt=0)] = 5.0
    weightsync: SyncConfig = SyncConfig()
    metrics_port: MetricsPort = None


S = TypeVar("S", bound=msgspec.Struct)


def _encode_path(value: object) -> object:
    if isinstance(value, Path):
        return str(value)
    raise NotImplementedError(f"{type(value).__name__} in settings")


def _decode_path(kind: type, value: object) -> object:
    if kind is Path and isinstance(value, str):
        return Path(value)
    raise NotImplementedError(f"{kind} in settings")


def to_json(settings: msgspec.Struct) -> bytes:
    """The settings as the readable JSON file a local process is given."""
    return msgspec.json.format(msgspec.json.encode(settings, enc_hook=_encode_path), indent=2)


def from_json(data: bytes, kind: type[S]) -> S:
    return msgspec.json.decode(data, type=kind, dec_hook=_decode_path)

"""What each component runs with: its run's RLRun spec plus where it was placed.

The operator mounts the run's spec into every pod it makes (`SPEC_FILE`, the ConfigMap
`<run>-spec`) and says where the pod sits in environment variables (`Placement`);
`rlfleet run` places the same components as local processes. Both turn the spec into
settings here, so a spec field means the same thing wherever the run trains. Settings are
typed (`rlfleet.launch.settings`); what the spec does not say stays at their defaults (a
local run adds its own tuning with `msgspec.structs.replace`). `COMPONENTS` names the
programs that run them.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Generic, TypeVar

import msgspec

from rlfleet.api.production import ProductionSpec
from rlfleet.api.rlrun import STEP_TOKENS, RLRunSpec, RolloutSpec
from rlfleet.api.wire import BusRole
from rlfleet.launch.caches import own_caches
from rlfleet.launch.settings import (
    CanaryPolicy,
    CollectorConfig,
    ConductorConfig,
    EvaluatorConfig,
    FeedConfig,
    GatePolicy,
    JudgeConfig,
    PoolConfig,
    Ranks,
    RewardConfig,
    ServingConfig,
    SessionConfig,
    SignalRewards,
    SyncConfig,
    TrainerConfig,
    WorkerConfig,
    from_json,
)
from rlfleet.launch.stopping import log_as_components_do

S = TypeVar("S", bound=msgspec.Struct)

SPEC_DIR = "/etc/rlfleet"
SPEC_FILE = f"{SPEC_DIR}/rlrun.json"  # {"run": its key on NATS, "spec": RLRun spec}, as JSON
# The ConfigMap `spec.trainer.deepSpeedConfigMap`, in trainer pods: a folder of its own,
# since a mount inside the read-only spec volume would need a folder made in it.
DEEPSPEED_DIR = "/etc/rlfleet-deepspeed"
DEEPSPEED_KEY = "ds_config.json"
DEEPSPEED_CONFIG_FILE = f"{DEEPSPEED_DIR}/{DEEPSPEED_KEY}"
STATE_DIR = "/var/lib/rlfleet"  # the trainer's checkpoints and step log live under here
# A component's own NATS user (a .creds file, from `nats_credentials_secret(run, role)`).
NATS_CREDENTIALS_DIR = "/var/run/secrets/rlfleet/nats"
NATS_CREDENTIALS_KEY = "creds"
# A rollout pod's bearer token for its run's EnvPool (a Secret the region operator mints).
ENVPOOL_TOKEN_DIR = "/var/run/secrets/rlfleet/envpool"
ENVPOOL_TOKEN_KEY = "token"
ENVPOOL_TOKEN_FILE = f"{ENVPOOL_TOKEN_DIR}/{ENVPOOL_TOKEN_KEY}"

# The environment a pod gets from the operator (`Placement.from_env` reads it back).
NATS_URL_ENV = "RLFLEET_NATS_URL"
JETSTREAM_DOMAIN_ENV = "RLFLEET_JETSTREAM_DOMAIN"
REGION_ENV = "RLFLEET_REGION"
POD_NAME_ENV = "RLFLEET_POD_NAME"
STATE_DIR_ENV = "RLFLEET_STATE_DIR"
ENVPOOL_URL_ENV = "RLFLEET_ENVPOOL_URL"  # a rollout pod's EnvPool Service
# A production pool's server: the set of the pool's servers it is in ("canary", "stable").
REPLICA_SET_ENV = "RLFLEET_REPLICA_SET"
# The port the component serves its Prometheus metrics on (`/metrics`). The operator sets
# it from the same number as the pod's `metrics` port and scrape annotations, so the three
# cannot disagree; processes sharing a host (`rlfleet run`) are each given their own.
METRICS_PORT_ENV = "RLFLEET_METRICS_PORT"
METRICS_PATH = "/metrics"  # where prometheus_client's server answers
# A trainer pod's place in the run's DeepSpeed job (`rlfleet.launch.settings.Ranks`): its
# ordinal in the StatefulSet (the downward API's `apps.kubernetes.io/pod-index` label),
# the job's pods, processes per pod and rank 0's pod, as the operator sizes them.
TRAINER_NODE_RANK_ENV = "RLFLEET_TRAINER_NODE_RANK"
TRAINER_NODES_ENV = "RLFLEET_TRAINER_NODES"
TRAINER_PROCS_PER_NODE_ENV = "RLFLEET_TRAINER_PROCS_PER_NODE"
TRAINER_MASTER_ADDR_ENV = "RLFLEET_TRAINER_MASTER_ADDR"
TRAINER_MASTER_PORT_ENV = "RLFLEET_TRAINER_MASTER_PORT"

FILE_SCHEME = "file://"


@dataclass(frozen=True)
class Placement:
    """Where one component runs: the NATS server it reaches, the JetStream domain of the
    run's streams, for a rollout worker its region and pod, the port it serves its
    metrics on (none: it serves none), and for a trainer its place in the job."""

    nats_url: str
    jetstream_domain: str | None = None
    region: str | None = None
    pod: str | None = None
    state_dir: str = STATE_DIR
    metrics_port: int | None = None
    ranks: Ranks = field(default_factory=Ranks)
    envpool_url: str | None = None  # where a rollout worker claims sandboxes
    replica_set: str | None = None  # a production pool's server's set; None: it follows none

    @classmethod
    def from_env(cls, env: Mapping[str, str]) -> Placement:
        if not env.get(NATS_URL_ENV):
            raise ValueError(f"{NATS_URL_ENV} is not set: which NATS server holds the run?")
        return cls(
            nats_url=env[NATS_URL_ENV],
            jetstream_domain=env.get(JETSTREAM_DOMAIN_ENV) or None,
            region=env.get(REGION_ENV) or None,
            pod=env.get(POD_NAME_ENV) or None,
            state_dir=env.get(STATE_DIR_ENV) or STATE_DIR,
            metrics_port=_port(env, METRICS_PORT_ENV),
            ranks=_ranks(env),
            envpool_url=env.get(ENVPOOL_URL_ENV) or None,
            replica_set=env.get(REPLICA_SET_ENV) or None,
        )


def _ranks(env: Mapping[str, str]) -> Ranks:
    """A trainer pod's place in the job, as the operator tells it; a job of one process
    when it tells none. A job of several pods needs each pod's rank: without it every pod
    would be rank 0 of its own job."""
    one = Ranks()
    if not env.get(TRAINER_NODES_ENV):
        return one
    nodes = _count(env, TRAINER_NODES_ENV, least=1, default=one.nodes)
    if not env.get(TRAINER_NODE_RANK_ENV):
        raise ValueError(
            f"{TRAINER_NODE_RANK_ENV} is not set: which of the {nodes} trainer pods is this "
            "(its StatefulSet's apps.kubernetes.io/pod-index label)?"
        )
    rank = _count(env, TRAINER_NODE_RANK_ENV, least=0, default=one.node_rank)
    if rank >= nodes:
        raise ValueError(
            f"{TRAINER_NODE_RANK_ENV}={rank}: expected below {TRAINER_NODES_ENV}={nodes}"
        )
    return Ranks(
        node_rank=rank,
        nodes=nodes,
        procs_per_node=_count(env, TRAINER_PROCS_PER_NODE_ENV, least=1, default=one.procs_per_node),
        master_addr=env.get(TRAINER_MASTER_ADDR_ENV) or one.master_addr,
        master_port=_port(env, TRAINER_MASTER_PORT_ENV) or one.master_port,
    )


def _count(env: Mapping[str, str], name: str, least: int, default: int) -> int:
    text = env.get(name)
    if not text:
        return default
    if not text.isdigit() or int(text) < least:
        raise ValueError(f"{name}={text!r}: expected a whole number, {least} or more")
    return int(text)


def _port(env: Mapping[str, str], name: str) -> int | None:
    text = env.get(name)
    if not text:
        return None
    if not text.isdigit() or not 0 < int(text) < 65536:
        raise ValueError(f"{name}={text!r}: expected a TCP port, 1 to 65535")
    return int(text)


def envpool_token_secret(run: str) -> str:
    """The Secret holding a run's token for its EnvPool, beside its mirror in a region."""
    return f"{run}-envpool"


# Every user the hub operator mints a run, whatever its kind: one per component, and the
# observer, for people and tools (`kubectl get secret <run>-nats-observer`).
POD_ROLES = tuple(BusRole)


def nats_credentials_secret(run: str, role: BusRole) -> str:
    """The Secret with the NATS user of one of the run's components, in the cluster its
    pods run in: the rollout workers' in each region, the others' in the hub."""
    return f"{run}-nats-{role}"


def run_key(namespace: str, name: str) -> str:
    """An RLRun's name on NATS, in its streams, subjects and user: runs of one name in two
    namespaces are two runs. Neither a namespace nor an RLRun's name may hold `_` (both
    are DNS labels), so two runs never share a key."""
    return f"{namespace}_{name}"


def spec_document(run: str, spec: dict) -> str:
    """The mounted file's text: the run's key on NATS (`run_key`) and its spec."""
    return json.dumps({"run": run, "spec": spec}, sort_keys=True)


def read_spec(path: Path) -> tuple[str, RLRunSpec]:
    """The run's key on NATS and its spec, from the mounted file."""
    document = json.loads(path.read_text())
    return document["run"], RLRunSpec.model_validate(document["spec"])


def model_dir(spec: RLRunSpec) -> str:
    """The base checkpoint's folder; pods read `file://` models from a mounted volume."""
    uri = spec.model.uri
    if not uri.startswith(FILE_SCHEME):
        raise ValueError(
            f"spec.model.uri {uri!r}: components read file:// checkpoints; mount the model "
            "and name its folder"
        )
    return uri.removeprefix(FILE_SCHEME)


def _sync(spec: RLRunSpec) -> SyncConfig:
    return SyncConfig(
        snapshot_every=spec.weight_sync.snapshot_interval,
        shard_bytes=spec.weight_sync.shard_size_mib << 20,
    )


def read_deepspeed(spec: RLRunSpec, path: Path) -> dict[str, Any] | None:
    """The user's DeepSpeed settings, from the mounted `ds_config.json` of the ConfigMap
    the spec names (None when it names none)."""
    config_map = spec.trainer.deep_speed_config_map
    if config_map is None:
        return None
    document = json.loads(path.read_text())
    if not isinstance(document, dict):
        raise ValueError(
            f"spec.trainer.deepSpeedConfigMap {config_map}: {DEEPSPEED_KEY} is not a JSON object"
        )
    return document


def trainer_settings(
    name: str,
    spec: RLRunSpec,
    model: str,
    checkpoint_dir: str,
    at: Placement,
    deepspeed: dict[str, Any] | None = None,
) -> TrainerConfig:
    """`deepspeed` is the user's DeepSpeed JSON, which a spec naming a ConfigMap needs:
    only a pod has it mounted (`read_deepspeed`)."""
    config_map = spec.trainer.deep_speed_config_map
    if config_map is not None and deepspeed is None:
        raise ValueError(
            f"spec.trainer.deepSpeedConfigMap {config_map}: its {DEEPSPEED_KEY} was not "
            "given; only a trainer pod mounts the ConfigMap"
        )
    return TrainerConfig(
        run=name,
        nats_url=at.nats_url,
        jetstream_domain=at.jetstream_domain,
        model=Path(model),
        checkpoint_dir=Path(checkpoint_dir),
        zero_stage=spec.trainer.zero_stage,
        batch_invariant=spec.trainer.batch_invariant,
        precision=spec.trainer.precision,
        router_replay=spec.trainer.router_replay,
        kl_coef=spec.trainer.kl_coef,
        lr=spec.trainer.learning_rate,
        lr_warmup_steps=spec.trainer.learning_rate_warmup_steps,
        lr_decay_steps=spec.trainer.learning_rate_decay_steps,
        lr_floor=spec.trainer.learning_rate_floor,
        step_tokens=STEP_TOKENS if spec.trainer.step_tokens is None else spec.trainer.step_tokens,
        step_groups=spec.trainer.step_groups,
        updates_per_step=spec.trainer.updates_per_step,
        clip_low=spec.trainer.clip_low,
        clip_high=spec.trainer.clip_high,
        is_cap=spec.trainer.importance_weight_cap,
        temperature=_temperature(spec),
        max_staleness=spec.max_staleness,
        production=spec.production is not None,
        weight_mirrors=_weight_mirrors(spec, at),
        deepspeed=deepspeed or {},
        weightsync=_sync(spec),
        metrics_port=at.metrics_port,
        ranks=at.ranks,
    )


def _weight_mirrors(spec: RLRunSpec, at: Placement) -> list[str]:
    """Where streams are named by JetStream domain, each region has its own, named after
    it, holding a mirror of the run's weights (the run's owner makes it; workers bind to
    it): the trainer retires old versions there as on the hub."""
    return spec.region_names if at.jetstream_domain else []


def _temperature(spec: RLRunSpec) -> float:
    """What the trainer scores tokens at: the temperature they were sampled at."""
    if spec.production is not None:
        return spec.production.temperature
    return _rollout(spec).temperature


def _rollout(spec: RLRunSpec) -> RolloutSpec:
    if spec.rollout is None:
        raise ValueError("spec.rollout is not set: a production run has no rollouts")
    return spec.rollout


def _production(spec: RLRunSpec) -> ProductionSpec:
    if spec.production is None:
        raise ValueError("spec.production is not set: the run learns from rollouts")
    return spec.production


def _rewards(spec: RLRunSpec) -> RewardConfig:
    """The worker's reward weights; an empty list keeps the suite's verifiable checks."""
    if not spec.rewards:
        return RewardConfig()
    weights = {r.kind: r.weight for r in spec.rewards}
    judge = next((r for r in spec.rewards if r.kind == "judge"), None)
    endpoint = None
    if judge is not None:
        if judge.endpoint is None or judge.judge_model is None:
            raise ValueError("spec.rewards: a judge reward needs endpoint and judgeModel")
        endpoint = JudgeConfig(base_url=judge.endpoint, model=judge.judge_model)
    return RewardConfig(
        exact=weights.get("exactAnswer", 0.0),
        tests=weights.get("hiddenTests", 0.0),
        judge=weights.get("judge", 0.0),
        judge_endpoint=endpoint,
    )


def rollout_settings(name: str, spec: RLRunSpec, model: str, at: Placement) -> WorkerConfig:
    region, rollout = at.region or "default", _rollout(spec)
    return WorkerConfig(
        run=name,
        nats_url=at.nats_url,
        jetstream_domain=at.jetstream_domain,
        weights_domain=at.region if at.jetstream_domain else None,
        model=model,
        name=f"{region}/{at.pod or 'rollout-0'}",
        group_size=rollout.group_size,
        session=SessionConfig(
            max_turns=rollout.max_turns,
            turn_tokens=rollout.turn_tokens,
            context_tokens=rollout.context_tokens,
            summary_tokens=rollout.summary_tokens,
            temperature=rollout.temperature,
        ),
        rewards=_rewards(spec),
        weightsync=_sync(spec),
        metrics_port=at.metrics_port,
        envpool=(
            PoolConfig(url=at.envpool_url, token_file=ENVPOOL_TOKEN_FILE)
            if at.envpool_url
            else None
        ),
    )


def feed_depth(rollout: RolloutSpec) -> int:
    """Tasks the feed keeps published and unfinished: room for every group the regions'
    workers can run at once (a worker per GPU at most). A fixed 8 left all but a few
    workers of a fleet idle: `rlfleet plan` put 64 rollout GPUs taking batches of 32
    groups at 12% of their speed. Admission still bounds what runs ahead of the trainer."""
    groups = max(1, _default(WorkerConfig, "max_sessions") // rollout.group_size)
    gpus = sum(demand.max_gpus for demand in rollout.regions)
    return max(_default(FeedConfig, "depth"), gpus * groups)


def _default(config: type[msgspec.Struct], name: str) -> Any:
    return next(f.default for f in msgspec.structs.fields(config) if f.name == name)


def feed_settings(name: str, spec: RLRunSpec, at: Placement) -> FeedConfig:
    rollout = _rollout(spec)
    feed = FeedConfig(
        run=name,
        nats_url=at.nats_url,
        jetstream_domain=at.jetstream_domain,
        suite=rollout.task_suite,
        max_staleness=spec.max_staleness,
        group_size=rollout.group_size,
        revisit_uniform=rollout.uniform_group_revisit,
        metrics_port=at.metrics_port,
        depth=feed_depth(rollout),
    )
    # Steps of exactly `stepGroups` groups: the feed issues that many per version from the
    # start, rather than guessing and learning the size from step reports.
    groups = spec.trainer.step_groups
    return feed if groups is None else msgspec.structs.replace(feed, groups_per_step=groups)


def evaluator_settings(name: str, spec: RLRunSpec, model: str, at: Placement) -> EvaluatorConfig:
    """The evaluator follows the hub's copy of the weights, as the trainer publishes them."""
    if spec.evaluation is None:
        raise ValueError("spec.evaluation is not set: there is nothing to evaluate")
    return EvaluatorConfig(
        run=name,
        nats_url=at.nats_url,
        jetstream_domain=at.jetstream_domain,
        model=model,
        suite=spec.evaluation.suite,
        every_versions=spec.evaluation.every_versions,
        on_request=spec.production is not None,  # the gate's two versions, each cycle
        weightsync=_sync(spec),
        metrics_port=at.metrics_port,
    )


def _signal_rewards(production: ProductionSpec) -> SignalRewards:
    feedback = production.feedback
    return SignalRewards(
        weights=dict(feedback.weights),
        window_s=float(feedback.window_seconds),
        max_per_user=feedback.max_per_user,
        max_events_per_response=feedback.max_events_per_response,
        group_size=production.cycle.group_size,
    )


def collector_settings(name: str, spec: RLRunSpec, at: Placement) -> CollectorConfig:
    """The collector reads the hub's capture and feedback streams."""
    production = _production(spec)
    return CollectorConfig(
        run=name,
        nats_url=at.nats_url,
        jetstream_domain=at.jetstream_domain,
        rewards=_signal_rewards(production),
        interval_s=float(production.cycle.interval_seconds),
        min_samples=production.cycle.min_samples,
        max_samples=production.cycle.max_samples,
        metrics_port=at.metrics_port,
    )


def conductor_settings(name: str, spec: RLRunSpec, at: Placement) -> ConductorConfig:
    production = _production(spec)
    gate, canary = production.gate, production.canary
    return ConductorConfig(
        run=name,
        nats_url=at.nats_url,
        jetstream_domain=at.jetstream_domain,
        gate=GatePolicy(
            max_regression=gate.max_regression,
            confidence=gate.confidence,
            max_empty_increase=gate.max_empty_increase,
            length_ratio=(gate.min_length_ratio, gate.max_length_ratio),
            max_malformed_tool_calls=gate.max_malformed_tool_calls,
            max_held_out_loss=gate.max_held_out_loss,
        ),
        canary=CanaryPolicy(
            detectable_drop=canary.detectable_drop,
            false_rollback_rate=canary.false_rollback_rate,
            miss_rate=canary.miss_rate,
            window_s=float(canary.window_seconds),
            min_samples=canary.min_samples,
        ),
        phase_deadline_s=float(production.cycle.phase_deadline_seconds),
        metrics_port=at.metrics_port,
    )


def serving_settings(name: str, spec: RLRunSpec, at: Placement) -> ServingConfig:
    """A production pool's server, in its region: it publishes captures and feedback to
    the hub's streams and reads its set's versions from its region's mirror of the
    weights."""
    production = _production(spec)
    return ServingConfig(
        run=name,
        nats_url=at.nats_url,
        jetstream_domain=at.jetstream_domain,
        sample_rate=production.sample_rate,
        temperature=production.temperature,
        feedback_window_s=float(production.feedback.window_seconds),
        custom_kinds=list(production.feedback.custom_kinds),
        max_events_per_response=production.feedback.max_events_per_response,
        replica_set=at.replica_set,
        weights_domain=at.region if at.jetstream_domain else None,
        weightsync=_sync(spec),
        routed_experts=spec.trainer.router_replay,
    )


@dataclass(frozen=True)
class Program:
    """A program of the components' images: `python -m MODULE ...`."""

    module: str

    def command(self, python: str = "python") -> list[str]:
        return [python, "-m", self.module]


@dataclass(frozen=True)
class Component(Program, Generic[S]):
    """A long-running part of a run: `python -m MODULE SETTINGS.json`, its settings as a
    local run writes them, or `--rlrun [SPEC]` in a pod, which builds them with
    `for_pod` from the mounted spec and the placement its environment gives."""

    name: str
    settings: type[S]
    for_pod: Callable[[str, RLRunSpec, Placement], S]

    def read(self, path: Path) -> S:
        return from_json(path.read_bytes(), self.settings)


def _trainer_pod(name: str, spec: RLRunSpec, at: Placement) -> TrainerConfig:
    deepspeed = read_deepspeed(spec, Path(DEEPSPEED_CONFIG_FILE))
    return trainer_settings(
        name, spec, model_dir(spec), f"{at.state_dir}/checkpoints", at, deepspeed
    )


def _rollout_pod(name: str, spec: RLRunSpec, at: Placement) -> WorkerConfig:
    return rollout_settings(name, spec, model_dir(spec), at)


def _evaluator_pod(name: str, spec: RLRunSpec, at: Placement) -> EvaluatorConfig:
    return evaluator_settings(name, spec, model_dir(spec), at)


TRAINER = Component("rlfleet.trainer", "trainer", TrainerConfig, _trainer_pod)
ROLLOUT = Component("rlfleet.rollout", "rollout", WorkerConfig, _rollout_pod)
FEED = Component("rlfleet.rollout.taskfeed.feed", "feed", FeedConfig, feed_settings)
EVALUATOR = Component(
    "rlfleet.rollout.evaluation.evaluator", "evaluator", EvaluatorConfig, _evaluator_pod
)
# A production run's, in the hub: its cycles' experience, and its cycles.
COLLECTOR = Component(
    "rlfleet.rollout.production.collector", "collector", CollectorConfig, collector_settings
)
CONDUCTOR = Component(
    "rlfleet.operator.conductor", "conductor", ConductorConfig, conductor_settings
)
COMPONENTS = {c.name: c for c in (TRAINER, ROLLOUT, FEED, EVALUATOR, COLLECTOR, CONDUCTOR)}
# A production pool's server: production's own pod, not the run's (the user's Deployment
# runs it, with vLLM's arguments after the settings).
SERVING = Component(
    "rlfleet.rollout.production.serving", "serving", ServingConfig, serving_settings
)


def components_of(spec: RLRunSpec) -> list[Component]:
    """The components a run has: a trainer; rollout workers and their feed, or a
    production run's collector and conductor; and an evaluator, with an evaluation."""
    found: list[Component] = [TRAINER]
    found += [COLLECTOR, CONDUCTOR] if spec.production is not None else [ROLLOUT, FEED]
    return found + ([EVALUATOR] if spec.evaluation is not None else [])


def hub_roles(spec: RLRunSpec) -> list[BusRole]:
    """The users whose Secrets the hub operator writes in the hub: its components' there,
    and the observer's."""
    return [BusRole(c.name) for c in components_of(spec) if c is not ROLLOUT] + [BusRole.OBSERVER]


def region_role(spec: RLRunSpec) -> BusRole:
    """The user whose Secret the hub writes in each region of the run: its rollout
    workers', or its production pool's servers'."""
    return BusRole.SERVING if spec.production is not None else BusRole.ROLLOUT


# What `rlfleet run` runs besides: a tiny model's warm-up and a whole-suite evaluation.
WARMUP = Program("rlfleet.rollout.environment.warmup")
EVALUATION = Program("rlfleet.rollout.evaluation.suite")


def component_settings(argv: list[str], component: Component[S]) -> S:
    """A component's start: logging as every component logs, then its settings from its
    command line: `CONFIG.json` (its own settings, as `rlfleet run` writes them) or
    `--rlrun [SPEC]` (a pod: the mounted spec, `SPEC_FILE` by default, placed by the
    environment). One that cannot run as told exits with the reason, not a traceback, so
    `kubectl logs` says what to fix."""
    log_as_components_do()
    program = " ".join(component.command())
    parser = argparse.ArgumentParser(prog=program)
    source = parser.add_mutually_exclusive_group(required=True)
    source.add_argument("config", nargs="?", type=Path, help="the component's settings")
    source.add_argument(
        "--rlrun", nargs="?", const=SPEC_FILE, type=Path, help="the run's mounted spec"
    )
    args = parser.parse_args(argv)
    own_caches(None)  # a pod's under the root the operator mounts; a local tree's as set
    try:
        if args.config:
            return component.read(args.config)
        run, spec = read_spec(args.rlrun)
        return component.for_pod(run, spec, Placement.from_env(os.environ))
    except (OSError, ValueError, msgspec.DecodeError) as error:
        sys.exit(f"{program}: cannot run {args.config or args.rlrun}: {error}")

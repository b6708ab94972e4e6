"""Each component's settings, made from its run's spec and where it was placed: the one
mapping, so that a spec field means the same thing in a pod and in `rlfleet run`. What the
spec does not say stays at the settings' defaults (`rlfleet.launch.settings`); a local run
adds its own tuning with `msgspec.structs.replace`.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import msgspec

from rlfleet.api.production import ProductionSpec
from rlfleet.api.rlrun import STEP_TOKENS, RemoteRequests, RLRunSpec, RolloutSpec
from rlfleet.api.taskdata import MOUNT_DIR
from rlfleet.launch.pods import DEEPSPEED_KEY, ENVPOOL_TOKEN_FILE, Placement
from rlfleet.launch.production import (
    CanaryPolicy,
    CollectorConfig,
    ConductorConfig,
    GatePolicy,
    ServingConfig,
    SignalRewards,
)
from rlfleet.launch.settings import (
    EnvironmentConfig,
    EvaluatorConfig,
    FeedConfig,
    JudgeConfig,
    PoolConfig,
    RemoteRewardConfig,
    RewardConfig,
    SessionConfig,
    SyncConfig,
    TrackingConfig,
    TrainerConfig,
    WorkerConfig,
)


def _sync(spec: RLRunSpec) -> SyncConfig:
    return SyncConfig(
        snapshot_every=spec.weight_sync.snapshot_interval,
        shard_bytes=spec.weight_sync.shard_size_mib << 20,
    )


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
        learning_rate=spec.trainer.learning_rate,
        learning_rate_warmup_steps=spec.trainer.learning_rate_warmup_steps,
        learning_rate_decay_steps=spec.trainer.learning_rate_decay_steps,
        learning_rate_floor=spec.trainer.learning_rate_floor,
        step_tokens=STEP_TOKENS if spec.trainer.step_tokens is None else spec.trainer.step_tokens,
        step_groups=spec.trainer.step_groups,
        updates_per_step=spec.trainer.updates_per_step,
        clip_low=spec.trainer.clip_low,
        clip_high=spec.trainer.clip_high,
        importance_weight_cap=spec.trainer.importance_weight_cap,
        temperature=_temperature(spec),
        max_staleness=spec.max_staleness,
        production=spec.production is not None,
        weight_mirrors=_weight_mirrors(spec, at),
        deepspeed=deepspeed or {},
        weightsync=_sync(spec),
        metrics_port=at.metrics_port,
        ranks=at.ranks,
        tracking=tracking_settings(name, spec),
    )


def tracking_settings(name: str, spec: RLRunSpec) -> TrackingConfig | None:
    """The run's MLflow server, its experiment (the namespace's, by default: the part of
    the run's key before `_`) and the spec as its parameters."""
    if spec.tracking is None:
        return None
    mlflow = spec.tracking.mlflow
    experiment = mlflow.experiment or name.partition("_")[0]
    return TrackingConfig(mlflow.tracking_uri, experiment, name, flat_params(spec))


def flat_params(spec: RLRunSpec) -> dict[str, str]:
    """The spec as a tracker's parameters: one per leaf, named by its path."""
    found: dict[str, str] = {}

    def walk(prefix: str, value: Any) -> None:
        if isinstance(value, dict):
            for key, inner in value.items():
                walk(f"{prefix}.{key}" if prefix else key, inner)
        else:
            found[prefix] = json.dumps(value) if isinstance(value, list) else str(value)

    walk("", spec.model_dump(by_alias=True, exclude_none=True, mode="json"))
    return found


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
    python = next((r for r in spec.rewards if r.kind == "python"), None)
    if python is not None and python.function is None:
        raise ValueError("spec.rewards: a python reward needs function")
    return RewardConfig(
        weights=weights,
        judge_endpoint=endpoint,
        python_function=python.function if python is not None else None,
        remote=_remote_reward(spec),
    )


def _remote_reward(spec: RLRunSpec) -> RemoteRewardConfig | None:
    remote = next((r for r in spec.rewards if r.kind == "remote"), None)
    if remote is None:
        return None
    if remote.endpoint is None:
        raise ValueError("spec.rewards: a remote reward needs an endpoint")
    requests = remote.requests or RemoteRequests()
    return RemoteRewardConfig(
        url=remote.endpoint,
        timeout_s=requests.timeout_seconds,
        retries=requests.retries,
        concurrency=requests.concurrency,
    )


def environment_settings(spec: RLRunSpec) -> EnvironmentConfig:
    environment = _rollout(spec).environment
    return EnvironmentConfig(
        name=environment.name,
        settings=environment.settings,
        episode_s=environment.episode_seconds,
        tool_call_parser=spec.model.tool_call_parser,
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
        environment=environment_settings(spec),
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
        environment=environment_settings(spec),
        tasks=None if rollout.tasks is None else rollout.tasks.model_dump(mode="json"),
        tasks_dir=MOUNT_DIR if rollout.tasks and rollout.tasks.volume else ".",
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

"""A production run's settings, typed: its pool's servers (`ServingConfig`), the collector
that turns their captures and users' feedback into trajectories, the conductor that gates,
canaries and promotes each cycle's candidate, and the simulated users of the local
real-time run. Kept apart from the other components' (`rlfleet.launch.settings`), whose
rules they follow: defaults from the API model, unknown fields refused.
"""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import msgspec

from rlfleet.api.inferencepool import ServingWorkload
from rlfleet.api.production import CanarySpec, CycleSpec, FeedbackSpec, GateSpec, ProductionSpec
from rlfleet.api.wire import MAX_GROUP_SIZE, FeedbackKindName, SubjectToken
from rlfleet.launch.settings import MetricsPort, Positive, SyncConfig, Weight, spec_default

Confidence = Annotated[float, msgspec.Meta(gt=0.5, lt=1)]
ErrorRate = Annotated[float, msgspec.Meta(gt=0, lt=0.5)]

# How long after a completion its users' feedback counts towards its reward.
FEEDBACK_WINDOW_S = float(spec_default(FeedbackSpec, "window_seconds"))


class SignalRewards(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """How users' feedback on a completion becomes its reward
    (`rlfleet.rollout.production.signals`)."""

    # Each kind's weight; a kind given a value (thumbs, a pool's own kinds) counts it
    # times the weight; edited counts (2 x similarity of the final text - 1) times it. A
    # kind without a weight counts nothing.
    weights: dict[FeedbackKindName, float] = msgspec.field(
        default_factory=lambda: spec_default(FeedbackSpec, "weights")
    )
    window_s: Annotated[float, msgspec.Meta(gt=0)] = FEEDBACK_WINDOW_S
    # Completions of one user (as the pool's gateway named them; all anonymous ones are
    # one) trained on per cycle, and tallied per version in a canary, so one client cannot
    # steer a cycle or a canary.
    max_per_user: Positive = spec_default(FeedbackSpec, "max_per_user")
    # Events of one completion read at most (its first ones): the pool's servers refuse
    # more, and what several servers let through past it is never loaded.
    max_events_per_response: Positive = spec_default(FeedbackSpec, "max_events_per_response")
    # Completions per baseline group (`rlfleet.rollout.production.signals.batch`).
    group_size: Annotated[int, msgspec.Meta(ge=2, le=MAX_GROUP_SIZE)] = spec_default(
        CycleSpec, "group_size"
    )


class CollectorConfig(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """A production run's collector's (`rlfleet.rollout.production.collector`): it closes a cycle
    once `interval_s` has passed since the last and `min_samples` completions whose
    feedback window has closed were answered in it."""

    run: str
    nats_url: str
    jetstream_domain: str | None = None  # the hub's, where the run's streams live
    rewards: SignalRewards = SignalRewards()
    interval_s: Annotated[float, msgspec.Meta(ge=0)] = spec_default(CycleSpec, "interval_seconds")
    min_samples: Positive = spec_default(CycleSpec, "min_samples")
    # Completions one cycle takes at most (what it holds in memory); the rest wait.
    max_samples: Positive = spec_default(CycleSpec, "max_samples")
    # After a completion's window closes, how long its last events may still be in flight.
    settle_s: Annotated[float, msgspec.Meta(ge=0)] = 10.0
    poll_s: Annotated[float, msgspec.Meta(gt=0)] = 5.0
    metrics_port: MetricsPort = None


# A pool's server reads its feedback key and user header from files in this folder.
FEEDBACK_DIR_ENV = "RLFLEET_FEEDBACK_DIR"


class ServingConfig(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """A production pool's vLLM server's capture, feedback and policy versions
    (`rlfleet.rollout.production.serving`).

    The API key feedback is checked against is vLLM's own, `VLLM_API_KEY` in the
    server's environment, never a setting: settings are files and arguments. Nor are the
    pool's feedback key and the header its gateway names users in: they are files in the
    folder `FEEDBACK_DIR_ENV` names (the pool's Secret, `rlfleet.api.inferencepool`)."""

    run: str
    nats_url: str
    jetstream_domain: str | None = None  # the hub's, where the run's streams live
    base_version: Annotated[int, msgspec.Meta(ge=0)] = 0  # what the served checkpoint is
    # The share of eligible completions captured (a request may opt out).
    sample_rate: Annotated[float, msgspec.Meta(ge=0, le=1)] = spec_default(
        ProductionSpec, "sample_rate"
    )
    # Only completions sampled at it are captured: the trainer scores at it.
    temperature: Annotated[float, msgspec.Meta(gt=0)] = spec_default(ProductionSpec, "temperature")
    # Feedback later than this after its completion is kept and counted as late.
    feedback_window_s: Annotated[float, msgspec.Meta(gt=0)] = FEEDBACK_WINDOW_S
    custom_kinds: list[FeedbackKindName] = []
    # Feedback events one completion may receive; more are refused.
    max_events_per_response: Positive = spec_default(FeedbackSpec, "max_events_per_response")
    # Captures waiting for NATS; a full buffer drops new captures, never requests.
    buffer: Positive = 10_000
    # Response ids this server remembers capturing, so feedback on them needs no lookup.
    remembered: Positive = 100_000
    # The set of the pool's servers this one is in ("canary", "stable"): it serves the
    # version the run's serving stream names for its set, loaded in place. None: it
    # serves its checkpoint and follows nothing.
    replica_set: SubjectToken | None = None
    weights_domain: str | None = None  # where its region's copy of the weights is
    weightsync: SyncConfig = SyncConfig()
    poll_s: Annotated[float, msgspec.Meta(gt=0)] = 1.0  # how often it reads its set's version
    # Captures carry the experts an MoE model routed each token to, for the trainer's router
    # replay (the run's `trainer.routerReplay`). The server then runs eager: vLLM's
    # compiled graphs are traced before a recorder can be put in them.
    routed_experts: bool = False


class GatePolicy(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """When a production candidate may go before users (`rlfleet.operator.promotion.gate`)."""

    max_regression: Weight = spec_default(GateSpec, "max_regression")  # in suite reward
    confidence: Confidence = spec_default(GateSpec, "confidence")  # of the paired bound
    max_empty_increase: Weight = spec_default(GateSpec, "max_empty_increase")  # share
    # The candidate's mean answer length over the serving version's, low and high.
    length_ratio: tuple[Weight, Weight] = (
        spec_default(GateSpec, "min_length_ratio"),
        spec_default(GateSpec, "max_length_ratio"),
    )
    max_malformed_tool_calls: Annotated[float, msgspec.Meta(ge=0, le=1)] = spec_default(
        GateSpec, "max_malformed_tool_calls"
    )
    # Per generated token, on the cycle before's trajectories (`rlfleet.trainer.held_out`).
    max_held_out_loss: Annotated[float, msgspec.Meta(ge=0)] = spec_default(
        GateSpec, "max_held_out_loss"
    )


class CanaryPolicy(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """How a candidate is judged on a share of live traffic
    (`rlfleet.operator.promotion.judge_canary`)."""

    # In mean live reward: a candidate this much worse is to be rolled back.
    detectable_drop: Annotated[float, msgspec.Meta(gt=0)] = spec_default(
        CanarySpec, "detectable_drop"
    )
    false_rollback_rate: ErrorRate = spec_default(CanarySpec, "false_rollback_rate")
    miss_rate: ErrorRate = spec_default(CanarySpec, "miss_rate")
    window_s: Annotated[float, msgspec.Meta(gt=0)] = spec_default(CanarySpec, "window_seconds")
    # Answered completions on each side before any verdict.
    min_samples: Positive = spec_default(CanarySpec, "min_samples")


class ConductorConfig(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """A production run's conductor's (`rlfleet.operator.conductor`): it runs the cycles."""

    run: str
    nats_url: str
    jetstream_domain: str | None = None  # the hub's, where the run's streams live
    base_version: Annotated[int, msgspec.Meta(ge=0)] = 0  # what production serves at first
    gate: GatePolicy = GatePolicy()
    canary: CanaryPolicy = CanaryPolicy()
    # Training, or evaluating, a candidate longer than this ends the cycle.
    phase_deadline_s: Annotated[float, msgspec.Meta(gt=0)] = spec_default(
        CycleSpec, "phase_deadline_seconds"
    )
    poll_s: Annotated[float, msgspec.Meta(gt=0)] = 2.0
    metrics_port: MetricsPort = None


class UsersConfig(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """A simulated population of a production pool's users (`rlfleet.rollout.production.users`), for
    the local real-time run and its benchmark: it only speaks HTTP to the pool's servers.
    The pool's API key is `VLLM_API_KEY` in its environment, as the servers have it."""

    # The pool's servers by name (their replica set's in it), base URLs: asked in turn.
    servers: Annotated[dict[str, str], msgspec.Meta(min_length=1)]
    model: str  # the served model's name
    suite: str  # what users ask: a shipped suite's name, or a JSON Lines file
    record: Path  # one JSON line per request: what was asked, served and said
    users: Positive = 16  # each asks, reads, answers, asks again
    # Some questions are asked far more than others: the suite's n-th most popular task
    # (a seeded order) is asked in proportion to 1 / n ** popularity (Zipf; 0: uniform).
    popularity: Annotated[float, msgspec.Meta(ge=0, le=4)] = 1.0
    # Users who never say anything about an answer, and the chance a user says the
    # opposite of what they think (a misclick).
    silent_share: Annotated[float, msgspec.Meta(ge=0, le=1)] = 0.25
    noise: Annotated[float, msgspec.Meta(ge=0, le=1)] = 0.05
    # While this file exists every user says the opposite: a broken client's events.
    inverted_while: Path | None = None
    max_tokens: Positive = 24
    # Where each request names its user, as the pool's gateway would.
    user_header: str = spec_default(ServingWorkload, "user_header")
    # A user's mean pause after an answer before asking again (exponential): the load.
    think_s: Annotated[float, msgspec.Meta(gt=0)] = 1.0
    seed: int = 0

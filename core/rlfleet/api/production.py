"""`spec.production`: a run that learns from a production pool's users, in cycles.

Its experience is what the pool serves and what users say of it, not rollouts of a task
suite: the pool's servers capture completions, users' feedback becomes rewards, and every
cycle a candidate trained from the serving version goes through the gate (the run's
evaluation suite, candidate against serving version) and a canary before it serves
everyone. The defaults here are the one home of each; the components' settings take them.
"""

from __future__ import annotations

from typing import Annotated

from pydantic import ConfigDict, Field, model_validator

from rlfleet.api.meta import DNS_LABEL, ApiModel, Count, cel, map_list
from rlfleet.api.wire import CYCLE_HISTORY, CycleOutcome, CyclePhase, FeedbackKind

Name = Annotated[str, Field(min_length=1, max_length=63, pattern=DNS_LABEL)]
KindName = Annotated[str, Field(pattern=r"^[a-z][a-z0-9-]{0,31}$")]
Share = Annotated[float, Field(ge=0, le=1)]
Confidence = Annotated[float, Field(gt=0.5, lt=1)]
ErrorRate = Annotated[float, Field(gt=0, lt=0.5)]
DAY_S = 24 * 3600


class ProductionPool(ApiModel):
    """The InferencePool whose servers serve the run's policy to users."""

    region: Annotated[Name, Field(description="The region (cluster) the pool is in.")]
    name: Annotated[Name, Field(description="The InferencePool's name there.")]


def _default_weights() -> dict[str, float]:
    weights = {
        FeedbackKind.ACCEPTED: 1.0,
        FeedbackKind.REJECTED: -1.0,
        FeedbackKind.EDITED: 1.0,  # times (2 x similarity of the final text - 1)
        FeedbackKind.RETRIED: -0.5,
        FeedbackKind.FOLLOW_UP: 0.25,
        FeedbackKind.THUMBS: 1.0,
    }
    return {kind.value: weight for kind, weight in weights.items()}


KNOWN_KINDS_RULE = cel(  # weights left out get their default in the model, not the schema
    "!has(self.weights) || self.weights.all(k, k in ["
    + ", ".join(f"'{kind}'" for kind in FeedbackKind)
    + "] || (has(self.customKinds) && k in self.customKinds))",
    "weights: every kind must be a built-in one or in customKinds",
    ".weights",
)
SAMPLES_RULE = cel(
    "self.maxSamples >= self.minSamples", "maxSamples must be at least minSamples", ".maxSamples"
)
LENGTH_RULE = cel(
    "self.maxLengthRatio > self.minLengthRatio",
    "maxLengthRatio must be above minLengthRatio",
    ".maxLengthRatio",
)


class FeedbackSpec(ApiModel):
    """What users' signals on a completion are worth, and for how long they count."""

    model_config = ConfigDict(json_schema_extra={"x-kubernetes-validations": [KNOWN_KINDS_RULE]})

    window_seconds: Annotated[
        int,
        Field(
            ge=1,
            le=7 * DAY_S,
            description="Signals later than this after a completion are kept, counted as "
            "late, and not rewarded.",
        ),
    ] = 3600
    custom_kinds: Annotated[
        list[KindName],
        Field(default_factory=list, max_length=16, description="Kinds of the pool's own."),
    ]
    # Keys: a CRD schema takes no key pattern; the CEL rule above names the kinds.
    weights: Annotated[
        dict[str, Annotated[float, Field(ge=-10, le=10)]],
        Field(
            default_factory=_default_weights,
            max_length=32,
            description="Each kind's weight in a completion's reward (clipped to [-1, 1]); "
            "a kind with a value (thumbs, custom kinds) counts it times the weight.",
        ),
    ]
    max_per_user: Annotated[
        int,
        Field(
            ge=1,
            le=100000,
            description="Completions of one user trained on per cycle, and counted per "
            "version in a canary's live rewards: no one client steers either.",
        ),
    ] = 64
    max_events_per_response: Annotated[
        int,
        Field(
            ge=1,
            le=1000,
            description="Feedback events one completion may receive; the pool's servers "
            "refuse more, and the collector reads no more than this of any one.",
        ),
    ] = 16

    @model_validator(mode="after")
    def _kinds_known(self) -> FeedbackSpec:
        """The CEL rule, for a spec no API server checks (`rlfleet run`)."""
        known = {*FeedbackKind, *self.custom_kinds}
        if any(kind not in known for kind in self.weights):
            raise ValueError(KNOWN_KINDS_RULE["message"])
        return self


class CycleSpec(ApiModel):
    """When a cycle stops collecting and trains."""

    model_config = ConfigDict(json_schema_extra={"x-kubernetes-validations": [SAMPLES_RULE]})

    interval_seconds: Annotated[
        int, Field(ge=0, le=7 * DAY_S, description="At least this long between cycles.")
    ] = 3600
    min_samples: Annotated[
        int, Field(ge=2, le=1000000, description="Answered completions a cycle needs.")
    ] = 64
    max_samples: Annotated[
        int, Field(ge=2, le=1000000, description="Completions a cycle takes at most.")
    ] = 10000
    group_size: Annotated[
        int,
        Field(
            ge=2,
            le=1024,
            description="Completions per baseline group: each one's advantage is its reward "
            "over its group's mean.",
        ),
    ] = 8
    phase_deadline_seconds: Annotated[
        int,
        Field(
            ge=60,
            le=7 * DAY_S,
            description="How long a cycle may train its candidate, and then evaluate it: "
            "past it in either phase the cycle ends TimedOut and the trainer goes back to "
            "the serving version. A canary ends by its own window.",
        ),
    ] = 4 * 3600

    @model_validator(mode="after")
    def _samples_ordered(self) -> CycleSpec:
        if self.max_samples < self.min_samples:
            raise ValueError(SAMPLES_RULE["message"])
        return self


class GateSpec(ApiModel):
    """Before any user sees a candidate: it and the serving version answer the run's
    evaluation suite, item by item."""

    model_config = ConfigDict(json_schema_extra={"x-kubernetes-validations": [LENGTH_RULE]})

    max_regression: Annotated[
        float,
        Field(
            ge=0,
            le=1,
            description="How much worse than the serving version, in mean reward per item, "
            "the candidate may be, shown at `confidence` (a paired bootstrap bound).",
        ),
    ] = 0.02
    confidence: Annotated[
        Confidence,
        Field(description="The confidence of the paired bootstrap bound maxRegression is held to."),
    ] = 0.95
    max_empty_increase: Annotated[
        Share, Field(description="More empty answers than the serving version, as a share.")
    ] = 0.02
    min_length_ratio: Annotated[
        float,
        Field(
            ge=0,
            le=100,
            description=(
                "The candidate's mean answer length over the serving version's: at least this."
            ),
        ),
    ] = 0.5
    max_length_ratio: Annotated[float, Field(gt=0, le=100, description="And at most this.")] = 2.0
    max_malformed_tool_calls: Annotated[
        Share, Field(description="Share of the candidate's tool calls that may be malformed.")
    ] = 0.05
    max_held_out_loss: Annotated[
        float,
        Field(
            ge=0,
            le=10,
            description="How far the candidate's training may lower its preference for what "
            "users rewarded in the newer promoted cycle of the two before it, on those "
            "trajectories (which it did not train on; advantage x log-prob, per generated "
            "token), before it is refused for learning against them: feedback that turned "
            "over, as a broken client's does. The default is measured at the realtime "
            "example's settings: the gain grows with the learning rate and the steps a cycle "
            "takes, and as klCoef weakens.",
        ),
    ] = 0.045

    @model_validator(mode="after")
    def _lengths_ordered(self) -> GateSpec:
        if self.max_length_ratio <= self.min_length_ratio:
            raise ValueError(LENGTH_RULE["message"])
        return self


class CanarySpec(ApiModel):
    """A candidate that passed the gate serves on the canary replicas first, while users'
    rewards on its answers and on the serving version's are compared as they come in: a
    sequential test that stops as soon as the evidence is strong enough either way
    (`rlfleet.operator.promotion`). The defaults hold both rates at the realtime example's
    traffic, about four answered completions a second on each side."""

    replicas: Annotated[
        int,
        Field(
            ge=1,
            le=10000,
            description=(
                "Servers of the pool in the canary set: the region operator runs them as "
                "the Deployment <deploymentName>-canary, out of the pool's serving "
                "replicas (never lent), and always leaves the stable set one."
            ),
        ),
    ] = 1
    window_seconds: Annotated[
        int,
        Field(
            ge=1,
            le=7 * DAY_S,
            description="The longest a canary runs. Its test ends it as soon as the "
            "evidence is strong enough either way; at the window's end an undecided one "
            "goes the likelier way, and one without minSamples answered on each side is "
            "rolled back. Give it several times what a decision takes at the pool's "
            "traffic: the rates below hold for the test, and the window's end adds to them.",
        ),
    ] = 1800
    detectable_drop: Annotated[
        float,
        Field(
            gt=0,
            le=2,
            description="How far below the serving version's mean live reward (rewards "
            "lie in [-1, 1]) a candidate must be caught: one this much worse is promoted "
            "at most missRate of the time.",
        ),
    ] = 0.2
    false_rollback_rate: Annotated[
        ErrorRate,
        Field(
            description="How often a candidate no worse than the serving version may be "
            "rolled back, at most."
        ),
    ] = 0.05
    miss_rate: Annotated[
        ErrorRate,
        Field(description="How often a candidate detectableDrop worse may be promoted, at most."),
    ] = 0.05
    min_samples: Annotated[
        int,
        Field(
            ge=1, le=1000000, description="Answered completions on each side before any verdict."
        ),
    ] = 50


class ServingOrder(ApiModel):
    """An on-call engineer's order, as `rlfleet promote` and `rlfleet rollback` write it:
    production serves `version` on every replica set now, and the cycle under way ends.
    Carried out once per `number`; the spec keeps the last one given."""

    number: Annotated[int, Field(ge=1, description="Counts the run's orders: one more each.")]
    version: Annotated[
        int,
        Field(
            ge=0,
            description="The serving version, the one before it, or a candidate under "
            "evaluation: no other version's weights are kept.",
        ),
    ]


class ProductionSpec(ApiModel):
    """Learn from a production pool's users, in cycles: collect, train, gate, canary."""

    pool: ProductionPool
    temperature: Annotated[
        float,
        Field(
            gt=0,
            le=10,
            description="The sampling temperature the pool serves at: the trainer scores "
            "captured tokens at it, so a request sampled at another is not captured.",
        ),
    ] = 1.0
    sample_rate: Annotated[
        Share, Field(description="The share of eligible completions captured.")
    ] = 1.0
    feedback: FeedbackSpec = FeedbackSpec()
    cycle: CycleSpec = CycleSpec()
    gate: GateSpec = GateSpec()
    canary: CanarySpec = CanarySpec()
    order: ServingOrder | None = None


Moment = Annotated[str, Field(json_schema_extra={"format": "date-time"})]
Number = Annotated[int, Field(ge=1)]


class FinishedCycleStatus(ApiModel):
    """One finished cycle: how it ended and why, with the numbers that decided it."""

    number: Annotated[Number, Field(description="The cycle's number.")]
    outcome: Annotated[CycleOutcome, Field(description="How it ended.")]
    candidate_version: Annotated[
        Count | None, Field(description="The candidate it trained; absent if none.")
    ] = None
    reason: Annotated[str, Field(description="Why it ended so, in the conductor's words.")]
    finished: Annotated[Moment, Field(description="When it ended.")]


class Dropped(ApiModel):
    reason: Annotated[
        str,
        Field(
            description=(
                "no_signal: nobody answered within the window; user_cap: its user had given "
                "maxPerUser already; no_baseline: nothing to compare it with; duplicate: a "
                "second capture of one response; distrusted: its user's feedback runs "
                "against the pool's history."
            )
        ),
    ]
    count: Annotated[Count, Field(description="Completions left out for it.")]


class CollectionStatus(ApiModel):
    """What the newest collected cycle took from production, as its collector reported."""

    cycle: Annotated[Number, Field(description="The cycle it collected for.")]
    captured: Annotated[Count, Field(description="Completions it took.")]
    with_feedback: Annotated[Count, Field(description="Of those, answered within the window.")]
    trained_on: Annotated[Count, Field(description="Trajectories it published for the trainer.")]
    dropped: Annotated[
        list[Dropped],
        Field(
            default_factory=list,
            description="Completions left out, by why.",
            json_schema_extra=map_list("reason"),
        ),
    ]
    late_feedback: Annotated[
        Count,
        Field(description="Feedback events on them after the window: kept, not rewarded."),
    ] = 0
    reward_mean: Annotated[
        float, Field(description="The mean reward of the completions it scored, in [-1, 1].")
    ]


class ProductionStatus(ApiModel):
    """Where a production run's cycles stand, as its conductor last published: the one
    under way, the version production serves, and the last finished cycles."""

    cycle: Annotated[Number, Field(description="The cycle under way.")]
    phase: Annotated[
        CyclePhase,
        Field(
            description="Its stage: collecting, or its candidate training, evaluated or canaried."
        ),
    ]
    since: Annotated[Moment, Field(description="When the phase began.")]
    serving_version: Annotated[Count, Field(description="What production's stable set serves.")]
    previous_version: Annotated[
        Count | None,
        Field(description="What it served before, kept to go back to (`rlfleet rollback`)."),
    ] = None
    candidate_version: Annotated[
        Count | None, Field(description="The cycle's candidate, once trained.")
    ] = None
    last_outcome: Annotated[
        CycleOutcome | None, Field(description="How the newest finished cycle ended.")
    ] = None
    orders_done: Annotated[
        Count, Field(description="The newest spec.production.order carried out, by number.")
    ] = 0
    last_collection: CollectionStatus | None = None
    history: Annotated[
        list[FinishedCycleStatus],
        Field(default_factory=list, max_length=CYCLE_HISTORY, description="Newest last."),
    ]
    state_sequence: Annotated[
        Count,
        Field(
            description="The conductor's state shown here, by its sequence on the run's "
            "cycle stream: every transition up to it has had its event."
        ),
    ]

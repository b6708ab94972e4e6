"""InferencePool: a production vLLM fleet in a region and how much of it may be lent.

Group rlfleet.io, never inference.networking.k8s.io: the Gateway API Inference Extension
has a kind of the same name.
"""

from __future__ import annotations

from typing import Annotated

from pydantic import ConfigDict, Field

from rlfleet.api.meta import (
    AGE,
    GROUP,
    ApiModel,
    Conditions,
    Count,
    GpuType,
    ObservedGeneration,
    PrinterColumn,
    ResourceKind,
    cel,
    map_list,
)

HHMM = r"^([01][0-9]|2[0-3]):[0-5][0-9]$"

# The Prometheus info metric a pool's server exports (`rlfleet.rollout.production.serving`), one
# series labelled with what it serves; the region operator reads it from every serving
# pod for `status.servedVersions`.
SERVED_WEIGHTS = "rlfleet_serving_weights"
# A pool's two sets of servers, each told its own version by a production run's cycles:
# the canary set (the run's `production.canary.replicas`, a Deployment the region operator
# makes from the serving one) and the rest, the serving Deployment.
CANARY, STABLE = "canary", "stable"
REPLICA_SET_LABEL = f"{GROUP}/replica-set"  # on the canary set's pods
# The pool's feedback Secret, which the region operator mints in the pool's namespace and
# its serving pods mount (the folder `RLFLEET_FEEDBACK_DIR` names): the key its servers
# sign each completion's feedback token with, and the header its gateway names users in.
FEEDBACK_KEY_FILE, USER_HEADER_FILE = "key", "user-header"


def feedback_secret(pool: str) -> str:
    return f"{pool}-feedback"


class ServingWorkload(ApiModel):
    """The production serving Deployment this pool scales down to lend and up to reclaim."""

    deployment_name: Annotated[
        str,
        Field(
            min_length=1,
            max_length=253,
            description=(
                "The serving Deployment, in the pool's namespace. Its owner opts it in with "
                'the label rlfleet.io/lendable: "true"; without it the pool scales nothing '
                "and says so (Ready false, reason ServingNotLendable)."
            ),
        ),
    ]
    replicas: Annotated[
        int,
        Field(
            ge=1,
            le=100000,
            description="The pool's whole size: serving replicas when nothing is lent.",
        ),
    ]
    gpus_per_replica: Annotated[
        int,
        Field(
            ge=1,
            le=16,
            description=(
                "GPUs of one serving replica; a run's rollout pod on a lent one gets as many."
            ),
        ),
    ]
    gpu_type: Annotated[
        GpuType | None,
        Field(
            description=(
                "The GPU type of the serving replicas: the value of the operator's GPU-type "
                "node label on their nodes (nvidia.com/gpu.product by default). Rollout pods "
                "on lent replicas are placed on nodes of this type; a run that names GPU "
                "types borrows only from pools of one of them."
            )
        ),
    ] = None
    port: Annotated[
        int,
        Field(
            ge=1,
            le=65535,
            description=(
                "The port of the serving pods' vLLM server (vllm serve's --port). The "
                "operator reads /metrics there for the version each pod serves."
            ),
        ),
    ] = 8000
    user_header: Annotated[
        str,
        Field(
            min_length=1,
            max_length=64,
            pattern=r"^[a-z0-9][a-z0-9-]*$",
            description=(
                "The request header (lower case) in which the pool's gateway forwards the "
                "identity it authenticated: a captured completion's user, and the only one "
                "who may post feedback on it. The gateway must set it on every request and "
                "drop any a client sent; the request body's `user` is never taken."
            ),
        ),
    ] = "x-forwarded-user"


class TrafficSignal(ApiModel):
    """Where load is read from, and the thresholds (with hysteresis) that lend and reclaim."""

    model_config = ConfigDict(
        json_schema_extra={
            "x-kubernetes-validations": [
                cel(
                    "has(self.metricsUrl) != has(self.prometheusQuery)",
                    "exactly one of metricsUrl and prometheusQuery must be set",
                ),
                cel(
                    "has(self.prometheusQuery) == has(self.prometheusUrl)",
                    "prometheusQuery and prometheusUrl go together",
                    ".prometheusUrl",
                ),
                cel(
                    "self.lendBelow < self.reclaimAbove",
                    "lendBelow must be below reclaimAbove",
                    ".lendBelow",
                ),
            ]
        }
    )

    metrics_url: (
        Annotated[
            str,
            Field(
                max_length=2048,
                pattern=r"^https?://",
                description="Prometheus-format endpoint of the serving pods.",
            ),
        ]
        | None
    ) = None
    prometheus_query: (
        Annotated[
            str,
            Field(
                min_length=1,
                max_length=4096,
                description=(
                    "A PromQL query whose result, summed over its series, is the pool's load: "
                    "with prometheusUrl, instead of metricsUrl."
                ),
            ),
        ]
        | None
    ) = None
    prometheus_url: (
        Annotated[
            str,
            Field(
                max_length=2048,
                pattern=r"^https?://",
                description="The Prometheus server prometheusQuery is sent to.",
            ),
        ]
        | None
    ) = None
    metric: Annotated[
        str, Field(min_length=1, max_length=256, description="Metric name read from metricsUrl.")
    ] = "vllm:num_requests_running"
    lend_below: Annotated[
        float, Field(ge=0, description="Lend when load per serving replica falls below this.")
    ]
    reclaim_above: Annotated[
        float, Field(ge=0, description="Reclaim when load per serving replica rises above this.")
    ]


class OffPeakWindow(ApiModel):
    """A time of day when the pool may lend."""

    start: Annotated[
        str, Field(pattern=HHMM, description="When the window opens, HH:MM in timeZone.")
    ]
    end: Annotated[
        str,
        Field(
            pattern=HHMM,
            description="When it closes, HH:MM; an end before start runs past midnight.",
        ),
    ]
    time_zone: Annotated[
        str,
        Field(
            min_length=1,
            max_length=64,
            description=(
                "The IANA time zone of start and end. A window in a zone of no such name "
                "never opens, and the pool's Ready condition says so."
            ),
        ),
    ] = "UTC"


class InferencePoolSpec(ApiModel):
    model_config = ConfigDict(
        json_schema_extra={
            "x-kubernetes-validations": [
                cel(
                    "self.minServingReplicas <= self.serving.replicas",
                    "minServingReplicas must not exceed serving.replicas",
                    ".minServingReplicas",
                )
            ]
        }
    )

    serving: ServingWorkload
    min_serving_replicas: Annotated[
        int, Field(ge=0, le=100000, description="Serving never drops below this many replicas.")
    ]
    max_lend_fraction: Annotated[
        float,
        Field(
            ge=0,
            le=1,
            description="The most of serving.replicas lent at once, as a share (rounded down).",
        ),
    ] = 0.5
    reclaim_deadline_seconds: Annotated[
        int,
        Field(
            ge=1,
            le=3600,
            description=(
                "Seconds rollout pods on a reclaimed replica get to finish their groups "
                "after SIGTERM; past it they are killed."
            ),
        ),
    ] = 60
    traffic: TrafficSignal
    off_peak_windows: Annotated[
        list[OffPeakWindow],
        Field(
            default_factory=list,
            max_length=24,
            description=(
                "When the pool may lend; outside them all it lends nothing and takes back "
                "what it lent. Empty: at any time."
            ),
        ),
    ]


class LentToRun(ApiModel):
    run: Annotated[
        str,
        Field(min_length=1, max_length=253, description="The RLRun, in the pool's namespace."),
    ]
    replicas: Annotated[
        Count,
        Field(description="Serving replicas lent to it: one rollout pod of the run's on each."),
    ]


class ServedVersion(ApiModel):
    """Running serving replicas that say they serve one policy version of a run, in one
    set of the pool's servers (canary or stable)."""

    run: Annotated[
        str,
        Field(
            min_length=1,
            max_length=253,
            description=(
                "The run whose versions they follow, by its key on NATS: <namespace>_<name>."
            ),
        ),
    ]
    replica_set: Annotated[
        str,
        Field(
            min_length=1,
            max_length=63,
            description="The set of the pool's servers they are in: canary or stable.",
        ),
    ]
    version: Annotated[Count, Field(description="The policy version they serve.")]
    digest: Annotated[
        str,
        Field(
            max_length=128,
            description="The served state's digest; empty for a server's starting checkpoint.",
        ),
    ]
    replicas: Annotated[int, Field(ge=1, description="How many replicas say so.")]


class InferencePoolStatus(ApiModel):
    observed_generation: ObservedGeneration = None
    conditions: Annotated[
        Conditions,
        Field(
            description=(
                "Ready: the traffic signal was read (false, reason ServingNotFound, while the "
                "serving Deployment is missing; ServingNotLendable, while it lacks its "
                "owner's opt-in; InvalidSpec, for an off-peak window in an "
                "unknown time zone). Lending: some replicas are lent, its reason the "
                "decision's. Reclaiming: rollout pods are draining."
            )
        ),
    ]
    serving_replicas: Annotated[
        Count | None,
        Field(
            description=("Serving pods running at the last reconcile, the canary set's included.")
        ),
    ] = None
    lent_replicas: Annotated[
        Count | None, Field(description="Serving replicas lent to runs, in all.")
    ] = None
    reclaiming_replicas: Annotated[
        Count | None,
        Field(
            description=(
                "Rollout pods on the pool's GPUs beyond what is lent: draining after SIGTERM, "
                "until they finish or reclaimDeadlineSeconds passes."
            )
        ),
    ] = None
    lent: Annotated[
        list[LentToRun],
        Field(
            default_factory=list,
            json_schema_extra=map_list("run"),
            description="Replicas lent to each run: the decision, recorded before it is acted on.",
        ),
    ]
    observed_traffic: Annotated[
        float | None,
        Field(
            description=(
                "The load the traffic signal read at the last reconcile, summed over the "
                "serving pods; absent when it could not be read."
            )
        ),
    ] = None
    served_versions: Annotated[
        list[ServedVersion],
        Field(
            default_factory=list,
            max_length=64,
            json_schema_extra=map_list("run", "replicaSet", "version", "digest"),
            description=(
                "What the running serving replicas say they serve, per run, replica set "
                "and version, read from each pod's server at the last reconcile."
            ),
        ),
    ]
    unversioned_replicas: (
        Annotated[
            int,
            Field(
                ge=0,
                description=(
                    "Running serving replicas that said no version: not rlfleet's serving "
                    "server, following no run, or not answering."
                ),
            ),
        ]
        | None
    ) = None
    reclaim_started_at: Annotated[
        str | None,
        Field(
            description=(
                "When the reclaim under way began: the first reconcile that found rollout "
                "pods draining. Cleared once none is left."
            ),
            json_schema_extra={"format": "date-time"},
        ),
    ] = None


INFERENCEPOOL = ResourceKind(
    kind="InferencePool",
    description="A production vLLM fleet in a region, and how much of it may be lent to RL runs.",
    plural="inferencepools",
    singular="inferencepool",
    short_names=("ipool",),
    spec=InferencePoolSpec,
    status=InferencePoolStatus,
    columns=(
        PrinterColumn("Serving", ".status.servingReplicas", "integer"),
        PrinterColumn("Lent", ".status.lentReplicas", "integer"),
        PrinterColumn("Reclaiming", ".status.reclaimingReplicas", "integer"),
        PrinterColumn("Traffic", ".status.observedTraffic", "number"),
        PrinterColumn("Versions", ".status.servedVersions[*].version", "string"),
        AGE,
    ),
)

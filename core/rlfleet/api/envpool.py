"""EnvPool: sandboxes where rollouts act, kept warm and burst on demand."""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import ConfigDict, Field

from rlfleet.api.meta import (
    AGE,
    DNS_LABEL,
    ApiModel,
    Conditions,
    Count,
    ObservedGeneration,
    PrinterColumn,
    Quantity,
    ResourceKind,
    cel,
)

# Its pods' Service is `<name>-sandbox`, a DNS label of at most 63 characters.
ENVPOOL_NAME_MAX = 55
ENVPOOL_NAME_RULE = cel(
    f"size(self.metadata.name) <= {ENVPOOL_NAME_MAX} && self.metadata.name.matches('{DNS_LABEL}')",
    f"metadata.name: an EnvPool's name must be a DNS label of at most {ENVPOOL_NAME_MAX} "
    "characters",
)


class SandboxTemplate(ApiModel):
    """What each of the pool's pods runs: one session server holding sessionsPerPod sandboxes."""

    image: Annotated[
        str,
        Field(
            min_length=1,
            max_length=1024,
            description="The session server's image: rlfleet's env-sandbox, or one built on it.",
        ),
    ]
    # Required: the session server makes each sandbox's namespaces, so it runs as root with
    # CAP_SYS_ADMIN, which is sound only inside a VM-grade sandbox, never on a shared kernel.
    runtime_class_name: Annotated[
        str,
        Field(
            min_length=1,
            max_length=253,
            description="VM-grade isolation (gvisor or kata): the pod runs as root within it.",
        ),
    ]


class SandboxLimits(ApiModel):
    """One sandbox's; a pod asks for `sessionsPerPod` times these."""

    cpu: Annotated[
        Quantity,
        Field(
            description=(
                "A sandbox's share of its pod's CPU, in cores; each of its processes may use "
                "this times timeoutSeconds of CPU time (RLIMIT_CPU)."
            )
        ),
    ] = "1"
    memory: Annotated[
        Quantity,
        Field(
            description=(
                "A sandbox's share of its pod's memory; also each of its processes' address "
                "space limit (RLIMIT_AS)."
            )
        ),
    ] = "2Gi"
    ephemeral_storage: Annotated[
        Quantity,
        Field(description="Disk of one sandbox: the size of its working tree (a tmpfs)."),
    ] = "10Gi"
    timeout_seconds: Annotated[
        int, Field(ge=1, le=86400, description="Wall-clock limit of one sandbox.")
    ] = 3600


class SandboxNetwork(ApiModel):
    """Where the pool's pods may connect to."""

    egress: Annotated[
        Literal["Deny", "Allow"],
        Field(
            description=(
                "Deny: the pods' NetworkPolicy lets no connection out; Allow: it leaves "
                "outgoing traffic alone."
            )
        ),
    ] = "Deny"


class EnvPoolSpec(ApiModel):
    model_config = ConfigDict(
        json_schema_extra={
            "x-kubernetes-validations": [
                cel("self.warm <= self.maxBurst", "warm must not exceed maxBurst", ".warm")
            ]
        }
    )

    template: SandboxTemplate
    warm: Annotated[
        int,
        Field(ge=0, le=100000, description="Sandboxes kept ready for claims, on one pod at least."),
    ] = 0
    max_burst: Annotated[
        int, Field(ge=1, le=100000, description="The most sandboxes, claimed and ready.")
    ]
    sessions_per_pod: Annotated[
        int,
        Field(ge=1, le=256, description="Sandboxes one pod's session server holds."),
    ] = 8
    idle_seconds: Annotated[
        int,
        Field(
            ge=0,
            le=86400,
            description="How long the pool wants fewer pods before it scales back to them.",
        ),
    ] = 300
    limits: SandboxLimits = SandboxLimits()
    network: SandboxNetwork = SandboxNetwork()


class EnvPoolStatus(ApiModel):
    """Sandboxes as the pool's session servers count them (their `/healthz`)."""

    observed_generation: ObservedGeneration = None
    conditions: Annotated[
        Conditions,
        Field(
            description=(
                "Ready: true once a session server answers; false, reason InvalidSpec, for a "
                "spec this region will not run, which then gets no pod."
            )
        ),
    ]
    pods: Annotated[
        Count | None, Field(description="The pool's session-server pods, not terminating.")
    ] = None
    ready: Annotated[
        Count | None, Field(description="Warm sandboxes waiting for a claim, on all servers.")
    ] = None
    claimed: Annotated[
        Count | None, Field(description="Sandboxes in a session (claimed), on all servers.")
    ] = None
    warming: Annotated[
        Count | None,
        Field(
            description=(
                "Sandboxes being made: those the servers say are warming, and sessionsPerPod "
                "for each pod not answering yet or still to be made."
            )
        ),
    ] = None
    bursting: Annotated[
        Count | None,
        Field(
            description=(
                "Sandbox room in the pods above those the warm floor needs: what the pool "
                "has grown for demand."
            )
        ),
    ] = None
    # Since when the pool has wanted fewer pods than it has: at idleSeconds it scales back.
    idle_since: Annotated[
        str | None,
        Field(
            description=(
                "Since when the pool has wanted fewer pods than it runs; it scales back once "
                "that has lasted idleSeconds, and clears this."
            ),
            json_schema_extra={"format": "date-time"},
        ),
    ] = None


ENVPOOL = ResourceKind(
    kind="EnvPool",
    description="Sandboxes where rollouts act, kept warm and burst on demand.",
    plural="envpools",
    singular="envpool",
    short_names=("envp",),
    spec=EnvPoolSpec,
    status=EnvPoolStatus,
    columns=(
        PrinterColumn("Ready", ".status.ready", "integer"),
        PrinterColumn("Claimed", ".status.claimed", "integer"),
        PrinterColumn("Warming", ".status.warming", "integer"),
        PrinterColumn("Bursting", ".status.bursting", "integer"),
        AGE,
    ),
    rules=(ENVPOOL_NAME_RULE,),
)

"""EnvPool: sandboxes where rollouts act, kept warm and burst on demand."""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import ConfigDict, Field

from rlfleet.api.meta import AGE, ApiModel, Conditions, PrinterColumn, Quantity, ResourceKind, cel


class SandboxTemplate(ApiModel):
    image: Annotated[str, Field(min_length=1, max_length=1024)]
    runtime_class_name: (
        Annotated[
            str,
            Field(
                min_length=1, max_length=253, description="VM-grade isolation, e.g. gvisor or kata."
            ),
        ]
        | None
    ) = None
    command: Annotated[list[str], Field(default_factory=list, max_length=64)]


class SandboxLimits(ApiModel):
    cpu: Quantity = "1"
    memory: Quantity = "2Gi"
    ephemeral_storage: Quantity = "10Gi"
    timeout_seconds: Annotated[
        int, Field(ge=1, le=86400, description="Wall-clock limit of one sandbox.")
    ] = 3600


class SandboxNetwork(ApiModel):
    egress: Literal["Deny", "Allow"] = "Deny"


class EnvPoolSpec(ApiModel):
    model_config = ConfigDict(
        json_schema_extra={
            "x-kubernetes-validations": [
                cel("self.warm <= self.maxBurst", "warm must not exceed maxBurst", ".warm")
            ]
        }
    )

    template: SandboxTemplate
    warm: Annotated[int, Field(ge=0, le=100000)] = 0
    max_burst: Annotated[int, Field(ge=1, le=100000)]
    limits: SandboxLimits = SandboxLimits()
    network: SandboxNetwork = SandboxNetwork()


class EnvPoolStatus(ApiModel):
    observed_generation: Annotated[int, Field(ge=0)] | None = None
    conditions: Conditions
    ready: Annotated[int, Field(ge=0)] | None = None
    busy: Annotated[int, Field(ge=0)] | None = None
    warming: Annotated[int, Field(ge=0)] | None = None


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
        PrinterColumn("Busy", ".status.busy", "integer"),
        PrinterColumn("Warming", ".status.warming", "integer"),
        AGE,
    ),
)

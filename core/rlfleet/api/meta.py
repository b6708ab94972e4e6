"""Shared pieces of the rlfleet.io custom resources: base model, conditions, CRD identity."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field
from pydantic.alias_generators import to_camel

GROUP = "rlfleet.io"
VERSION = "v1alpha1"
API_VERSION = f"{GROUP}/{VERSION}"
CATEGORY = "rlfleet"
GPU_RESOURCE = "nvidia.com/gpu"
# The node label whose value names a node's GPU type (NVIDIA's GPU feature discovery
# sets it, e.g. NVIDIA-H100-80GB-HBM3): the operator's default, which its config may change.
GPU_TYPE_LABEL = "nvidia.com/gpu.product"
# Labels on every object the operator creates for a run: which run, which component.
RUN_LABEL = f"{GROUP}/run"
COMPONENT_LABEL = f"{GROUP}/component"
ENVPOOL_LABEL = f"{GROUP}/envpool"  # on an EnvPool's pods: its name
# A serving Deployment's owner opts it in to being lent and reclaimed (scaled) by the
# InferencePools that name it with this label, valued "true": naming it is not enough.
LENDABLE_LABEL = f"{GROUP}/lendable"

# A DNS-1123 label: names of regions, pools and other objects a spec refers to.
DNS_LABEL = r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?$"
# metav1.Condition's reason pattern: one CamelCase word.
CONDITION_REASON = r"^[A-Za-z]([A-Za-z0-9_,:]*[A-Za-z0-9_])?$"
# A Kubernetes resource quantity such as 500m, 2Gi or 1.5.
QUANTITY = r"^[0-9]+(\.[0-9]+)?(m|k|M|G|T|P|E|Ki|Mi|Gi|Ti|Pi|Ei)?$"
Quantity = Annotated[str, Field(pattern=QUANTITY, max_length=64)]  # a resource quantity
Count = Annotated[int, Field(ge=0)]  # a number of things, 0 or more
# A GPU type: a value of the GPU-type node label (a label value, never empty).
GpuType = Annotated[
    str, Field(min_length=1, max_length=63, pattern=r"^[A-Za-z0-9]([-A-Za-z0-9_.]*[A-Za-z0-9])?$")
]


def cel(rule: str, message: str, field_path: str | None = None) -> dict[str, str]:
    """One x-kubernetes-validations entry; field_path names the field in the API error."""
    entry = {"rule": rule, "message": message}
    if field_path:
        entry["fieldPath"] = field_path
    return entry


def map_list(*keys: str) -> dict[str, Any]:
    """Schema markers for a list merged by key (server-side apply and strategic merge)."""
    return {"x-kubernetes-list-type": "map", "x-kubernetes-list-map-keys": list(keys)}


class ApiModel(BaseModel):
    """Base of every spec and status model: camelCase on the wire, unknown fields rejected."""

    model_config = ConfigDict(
        alias_generator=to_camel, populate_by_name=True, extra="forbid", frozen=True
    )

    def merge_patch(self) -> dict[str, Any]:
        """The fields this model was given, camelCase, as a JSON merge patch: a field left
        out stays as the object has it, and one given None is deleted there."""
        return self.model_dump(by_alias=True, exclude_unset=True, mode="json")


class Condition(ApiModel):
    """A metav1.Condition: the state of one aspect of an object."""

    type: Annotated[
        str,
        Field(
            min_length=1,
            max_length=316,
            description=(
                "The aspect this condition is about, such as Ready; the list holds one per type."
            ),
        ),
    ]
    status: Annotated[
        Literal["True", "False", "Unknown"],
        Field(description="Whether it holds; Unknown while the operator cannot tell yet."),
    ]
    reason: Annotated[
        str,
        Field(
            min_length=1,
            max_length=1024,
            pattern=CONDITION_REASON,
            description="Why, as one CamelCase word that programs and alerts can match on.",
        ),
    ]
    message: Annotated[
        str, Field(max_length=32768, description="Why, in words for a person; may be empty.")
    ] = ""
    last_transition_time: Annotated[
        str,
        Field(
            description=(
                "When status last changed; a new reason or message alone leaves it as it is."
            ),
            json_schema_extra={"format": "date-time"},
        ),
    ]
    observed_generation: Annotated[
        Annotated[int, Field(ge=0)] | None,
        Field(description="The metadata.generation of the spec this condition was set for."),
    ] = None


# Each kind's status describes its own conditions: the types it sets.
Conditions = Annotated[
    list[Condition], Field(default_factory=list, json_schema_extra=map_list("type"))
]
# Every kind's status says which spec it was written for.
ObservedGeneration = Annotated[
    Count | None,
    Field(description="The metadata.generation of the spec this status was written for."),
]


@dataclass(frozen=True)
class PrinterColumn:
    name: str
    json_path: str
    type: Literal["string", "integer", "number", "boolean", "date"]
    description: str = ""
    priority: int = 0


@dataclass(frozen=True)
class ResourceKind:
    """Everything the API server needs to serve one kind, besides its schema."""

    kind: str
    description: str
    plural: str
    singular: str
    short_names: tuple[str, ...]
    spec: type[ApiModel]
    status: type[ApiModel]
    columns: tuple[PrinterColumn, ...] = field(default=())
    rules: tuple[dict[str, str], ...] = ()  # CEL rules on the whole object, its name too

    @property
    def crd_name(self) -> str:
        return f"{self.plural}.{GROUP}"


AGE = PrinterColumn("Age", ".metadata.creationTimestamp", "date")

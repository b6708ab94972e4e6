"""The operator's settings: one YAML file, written by the Helm chart from its values."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field

Name = Annotated[
    str, Field(min_length=1, max_length=63, pattern=r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?$")
]


class RegionAccess(BaseModel):
    """A region the hub mirrors runs into, and the Secret holding its kubeconfig."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    name: Name
    kubeconfig_secret: Annotated[str, Field(min_length=1, max_length=253)]
    kubeconfig_key: str = "kubeconfig"


class Images(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    trainer: str = "ghcr.io/rlfleet/trainer:0.1.0"
    rollout: str = "ghcr.io/rlfleet/rollout:0.1.0"


class NatsAccess(BaseModel):
    """The hub's NATS server: the hub makes each run's streams there and reads its progress."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    url: Annotated[str, Field(pattern=r"^(nats|tls)://")]
    domain: Name = "hub"  # the hub's JetStream domain; a region's domain is its name
    # A Secret in the operator's namespace: `creds`, the operator's NATS user (a .creds
    # file), and `signing-seed`, the account's signing key, with which the hub mints each
    # run's own user. None: anonymous, and runs' pods get no user.
    credentials_secret: str | None = None


class OperatorConfig(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    role: Literal["hub", "region"]
    cluster: Name  # this cluster's name: the origin label of mirrors, or the region's name
    namespace: Annotated[str, Field(min_length=1, max_length=63)]  # where its Secrets live
    watch_namespaces: list[str] = Field(default_factory=list)  # empty: every namespace
    regions: list[RegionAccess] = Field(default_factory=list)
    images: Images = Images()
    nats: NatsAccess | None = None  # hub only; without it, no streams and no progress
    # Pools and sandboxes are re-read this often: traffic and pods change without an event
    # the operator sees, and a reclaim must start within its deadline.
    resync_seconds: Annotated[float, Field(gt=0, le=3600)] = 2.0
    # Runs (the hub's, and the regions' mirrors) this often: a spec change acts at once,
    # and what a resync adds (regions' reports, the trainer's progress) can wait seconds.
    run_resync_seconds: Annotated[float, Field(gt=0, le=3600)] = 15.0
    region_timeout_seconds: Annotated[float, Field(gt=0, le=86400)] = 30.0
    call_timeout_seconds: Annotated[float, Field(gt=0, le=300)] = 3.0
    traffic_timeout_seconds: Annotated[float, Field(gt=0, le=300)] = 2.0
    metrics_port: Annotated[int, Field(ge=0, le=65535)] = 9090  # 0: no metrics endpoint
    health_port: Annotated[int, Field(ge=0, le=65535)] = 8080  # 0: no liveness endpoint


def load(path: Path) -> OperatorConfig:
    return OperatorConfig.model_validate(yaml.safe_load(path.read_text()))

"""How many session-server pods an EnvPool runs, from what its servers say (pure).

Each pod is one session server (`rlfleet.rollout.envpool`) holding up to
`sessionsPerPod` sandboxes, all of its free ones kept warm. The operator reads every
server's `/healthz` and sizes the Deployment so that `warm` sandboxes are free beside the
claimed ones and the claims queued at full servers, within `maxBurst`, on one pod at
least (a pool with no server could not see a claim):

- it grows at once: a claim that waits is an attempt that may fail;
- it shrinks only after the pool has wanted fewer pods for `idleSeconds` (a burst that
  ends and starts again does not churn pods), and never below the pods that hold claims
  or might (a server that did not answer);
- idle pods go first: a pod's deletion cost is 1 while it holds claims and 0 when not
  (a bucket, so the annotation changes when a pod falls idle, not with every claim), so
  the ReplicaSet removes idle servers, not sessions in use.

A pod that does not answer counts as warming: it is starting, or its server is stuck, and
either way it serves no claim now.

Before any of that, `refusals` says what in a pool's spec this region will not run: a
RuntimeClass outside the chart's allowlist (the session server runs as root with
SYS_ADMIN, sound only in a VM-grade sandbox: `runc` would hand that to whoever may create
an EnvPool), or an image from a registry the chart does not list. The chart's admission
policy refuses both when a pool is written; a pool stored before it (or before the list
narrowed) gets no pod, and its Ready condition names the field.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from datetime import datetime, timedelta

from rlfleet.api.envpool import EnvPoolSpec

# The ReplicaSet controller removes the pods of lowest cost first when it scales down.
DELETION_COST = "controller.kubernetes.io/pod-deletion-cost"


@dataclass(frozen=True)
class ServerSeen:
    """One sandbox pod, as its server's `/healthz` answered (None: it did not)."""

    pod: str
    ready: int | None = None  # warm sandboxes waiting for a claim
    warming: int = 0
    claimed: int = 0  # live sessions
    waiting: int = 0  # claims queued for a slot

    @property
    def answered(self) -> bool:
        return self.ready is not None


@dataclass(frozen=True)
class PoolPlan:
    replicas: int
    idle_since: datetime | None  # since when fewer pods would do; None: not so
    ready: int
    claimed: int
    warming: int
    bursting: int  # sandboxes of room above the warm floor's pods, grown for demand
    deletion_costs: dict[str, int]  # answering pod -> 1 if it holds claims, else 0


def floor_pods(spec: EnvPoolSpec) -> int:
    """The pods that hold `warm` sandboxes, with nothing claimed; one at least."""
    return max(1, math.ceil(spec.warm / spec.sessions_per_pod))


def plan_pool(
    spec: EnvPoolSpec,
    servers: list[ServerSeen],
    replicas: int,
    idle_since: datetime | None,
    now: datetime,
) -> PoolPlan:
    """The replicas for the pool's Deployment (now at `replicas`), and its status."""
    per = spec.sessions_per_pod
    claimed = sum(s.claimed for s in servers)
    demand = claimed + sum(s.waiting for s in servers) + spec.warm
    ceiling = math.ceil(spec.max_burst / per)
    wanted = math.ceil(min(spec.max_burst, demand) / per)
    # Scaling one of these away would end sessions, or might.
    holding = sum(1 for s in servers if s.claimed or not s.answered)
    wanted = min(ceiling, max(wanted, floor_pods(spec), holding))
    if wanted >= replicas:
        target, idle_since = wanted, None
    else:
        idle_since = idle_since or now
        if now - idle_since >= timedelta(seconds=spec.idle_seconds):
            target, idle_since = wanted, None
        else:
            target = replicas
    silent = [s for s in servers if not s.answered]
    return PoolPlan(
        replicas=target,
        idle_since=idle_since,
        ready=sum(s.ready or 0 for s in servers),
        claimed=claimed,
        # A pod not answering yet will hold a server's worth; pods not yet made, too.
        warming=sum(s.warming for s in servers)
        + per * (len(silent) + max(0, target - len(servers))),
        bursting=per * max(0, target - floor_pods(spec)),
        deletion_costs={s.pod: int(s.claimed > 0) for s in servers if s.answered},
    )


def refusals(
    spec: EnvPoolSpec, runtime_classes: Sequence[str], registries: Sequence[str]
) -> list[str]:
    """Why this region runs no pod for the pool, each naming its field; [] if it may."""
    problems = []
    runtime = spec.template.runtime_class_name
    if runtime not in runtime_classes:
        problems.append(
            f"spec.template.runtimeClassName: {runtime!r} is not a RuntimeClass this region "
            f"runs EnvPools under ({', '.join(runtime_classes)}): the session server runs as "
            "root with SYS_ADMIN, which only a VM-grade sandbox holds"
        )
    image = spec.template.image
    if registries and not image_allowed(image, registries):
        problems.append(
            f"spec.template.image: {image!r} is from none of the registries this region "
            f"runs EnvPools from ({', '.join(registries)})"
        )
    return problems


def image_allowed(image: str, registries: Sequence[str]) -> bool:
    """Whether `image` lies under one of `registries` (each a registry or a repository
    prefix, matched up to a "/": "ghcr.io/rlfleet" takes neither "ghcr.io/rlfleet-x/y"
    nor "ghcr.io.evil/y")."""
    return any(image.startswith(f"{registry.rstrip('/')}/") for registry in registries)

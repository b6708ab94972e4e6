"""An EnvPool's sizing alone (`rlfleet.operator.envpools.plan_pool`, pure): how many
session-server pods it runs for the claims its servers report; and which pools a region
refuses to run (`refusals`). The operator acting on them is tested on the bed
(`test_operator_fleet.py`, `test_attacks_sandbox.py`)."""

from __future__ import annotations

import math
from datetime import UTC, datetime, timedelta

from hypothesis import given
from hypothesis import strategies as st

from rlfleet.api.envpool import EnvPoolSpec
from rlfleet.operator.config import OperatorConfig
from rlfleet.operator.envpools import ServerSeen, floor_pods, image_allowed, plan_pool, refusals

NOW = datetime(2026, 11, 25, 12, 0, 0, tzinfo=UTC)


@st.composite
def pools(draw) -> EnvPoolSpec:
    burst = draw(st.integers(1, 200))
    return EnvPoolSpec(
        template={"image": "env-sandbox", "runtimeClassName": "gvisor"},
        warm=draw(st.integers(0, burst)),
        maxBurst=burst,
        sessionsPerPod=draw(st.integers(1, 16)),
        idleSeconds=draw(st.integers(0, 600)),
    )


@st.composite
def worlds(draw):
    spec = draw(pools())
    per = spec.sessions_per_pod
    servers = []
    for i in range(draw(st.integers(0, 12))):
        if draw(st.booleans()):
            claimed = draw(st.integers(0, per))
            waiting = draw(st.integers(0, 8)) if claimed == per else 0
            servers.append(
                ServerSeen(f"p{i}", ready=per - claimed, claimed=claimed, waiting=waiting)
            )
        else:
            servers.append(ServerSeen(f"p{i}"))  # starting, or not answering
    replicas = draw(st.integers(len(servers), len(servers) + 3))
    idle = draw(st.none() | st.integers(0, 900).map(lambda s: NOW - timedelta(seconds=s)))
    return spec, servers, replicas, idle


@given(worlds())
def test_a_pool_never_leaves_its_bounds_nor_scales_away_a_pod_holding_claims(world) -> None:
    spec, servers, replicas, idle = world
    plan = plan_pool(spec, servers, replicas, idle, NOW)
    per = spec.sessions_per_pod
    assert plan.replicas >= 1  # a pool with no server would never see a claim
    assert floor_pods(spec) <= plan.replicas or plan.replicas == replicas
    assert plan.replicas <= max(replicas, math.ceil(spec.max_burst / per))
    # Never below the pods that hold claims, or might (they did not answer).
    holding = sum(1 for s in servers if s.claimed or not s.answered)
    assert plan.replicas >= min(holding, math.ceil(spec.max_burst / per))
    # Room for warm beside the claims and the queued ones, as far as maxBurst allows, at once.
    claimed = sum(s.claimed for s in servers)
    demand = claimed + sum(s.waiting for s in servers) + spec.warm
    assert plan.replicas * per >= min(spec.max_burst, demand) - per + 1
    assert plan.claimed == claimed
    # Idle pods go first; a pod that did not answer keeps whatever cost it had.
    assert plan.deletion_costs == {s.pod: int(s.claimed > 0) for s in servers if s.answered}


@given(worlds())
def test_a_pool_shrinks_only_once_it_has_wanted_fewer_pods_for_idle_seconds(world) -> None:
    spec, servers, replicas, idle = world
    plan = plan_pool(spec, servers, replicas, idle, NOW)
    if plan.replicas < replicas:
        # Wanted fewer since `idle` (since now, if not before): for idleSeconds at least.
        assert NOW - (idle or NOW) >= timedelta(seconds=spec.idle_seconds)
        assert plan.idle_since is None  # the next shrink waits its own idle time
    if plan.replicas == replicas and plan.idle_since is not None:
        assert plan.idle_since == (idle or NOW)  # the clock keeps running, from its start
    # Deciding again on its own outcome, at once, changes nothing.
    again = plan_pool(spec, servers, plan.replicas, plan.idle_since, NOW)
    assert (again.replicas, again.idle_since) == (plan.replicas, plan.idle_since)


def test_a_burst_grows_at_once_and_scales_back_after_idle_seconds() -> None:
    spec = EnvPoolSpec(
        template={"image": "env-sandbox", "runtimeClassName": "gvisor"},
        warm=4,
        maxBurst=64,
        sessionsPerPod=4,
        idleSeconds=300,
    )
    busy = [ServerSeen("a", ready=0, claimed=4), ServerSeen("b", ready=2, claimed=2)]
    grown = plan_pool(spec, busy, 2, None, NOW)
    assert grown.replicas == 3 and grown.bursting == 8 and grown.warming == 4
    # Claims queued at a full server are demand too: with nothing warm wanted, a pool of
    # one full pod grows only for them.
    lean = spec.model_copy(update={"warm": 0})
    full = [ServerSeen("a", ready=0, claimed=4)]
    assert plan_pool(lean, full, 1, None, NOW).replicas == 1
    queued = [ServerSeen("a", ready=0, claimed=4, waiting=5)]
    assert plan_pool(lean, queued, 1, None, NOW).replicas == 3
    quiet = [ServerSeen("a", ready=4), ServerSeen("b", ready=4), ServerSeen("c", ready=4)]
    waiting = plan_pool(spec, quiet, 3, None, NOW)
    assert (waiting.replicas, waiting.idle_since) == (3, NOW)
    later = NOW + timedelta(seconds=300)
    back = plan_pool(spec, quiet, 3, waiting.idle_since, later)
    assert (back.replicas, back.idle_since, back.bursting) == (1, None, 0)


def test_a_region_runs_pools_only_under_its_runtime_classes_and_from_its_registries() -> None:
    config = OperatorConfig(role="region", cluster="region-a", namespace="rlfleet-system")
    allowed = (config.envpool_runtime_classes, config.envpool_image_registries)
    assert allowed == (["gvisor", "kata"], [])  # as the chart's values say

    def pool(runtime: str, image: str = "ghcr.io/rlfleet/env-sandbox:0.1.0") -> EnvPoolSpec:
        return EnvPoolSpec(template={"image": image, "runtimeClassName": runtime}, maxBurst=1)

    assert refusals(pool("gvisor"), *allowed) == refusals(pool("kata"), *allowed) == []
    for runtime in ("runc", "crun", "gvisor-debug", "Kata"):
        (problem,) = refusals(pool(runtime), *allowed)
        assert problem.startswith(f"spec.template.runtimeClassName: {runtime!r} is not")
    registries = ["ghcr.io/rlfleet", "registry.internal:5000/"]
    for image in ("ghcr.io/rlfleet/env-sandbox:1", "registry.internal:5000/team/env@sha256:ab"):
        assert image_allowed(image, registries)
        assert refusals(pool("gvisor", image), ["gvisor"], registries) == []
    for image in ("ghcr.io/rlfleet-lookalike/env", "ghcr.io.evil/rlfleet/env", "env-sandbox"):
        assert not image_allowed(image, registries)
        (problem,) = refusals(pool("gvisor", image), ["gvisor"], registries)
        assert problem.startswith(f"spec.template.image: {image!r}")
    assert len(refusals(pool("runc", "evil.example/x"), ["gvisor"], registries)) == 2

"""The lending decision alone (a pure function): floors, caps, hysteresis, priorities,
windows, and the invariants the region operator relies on."""

from __future__ import annotations

from datetime import UTC, datetime

import yaml
from conftest import ROOT
from hypothesis import given, settings
from hypothesis import strategies as st

from rlfleet.api.inferencepool import InferencePoolSpec, OffPeakWindow
from rlfleet.api.rlrun import RLRunSpec
from rlfleet.pipeline.lending import (
    PoolState,
    RunDemand,
    canary_set,
    decide,
    in_off_peak,
    lent_elsewhere,
    unserved_gpu_types,
)


def pool(load: float | None, lent: dict[str, int] | None = None, **changes) -> PoolState:
    base = dict(
        name="chat",
        replicas=8,
        gpus_per_replica=8,
        min_serving=2,
        max_lend_fraction=0.75,
        lend_below=4.0,
        reclaim_above=12.0,
        load=load,
        lent=lent or {},
    )
    return PoolState(**(base | changes))


def run(name: str, max_gpus: int = 64, priority: int = 0, **changes) -> RunDemand:
    return RunDemand(
        **(dict(run=name, priority=priority, min_gpus=0, max_gpus=max_gpus, pools=("chat",)))
        | changes
    )


def test_idle_pool_lends_up_to_its_cap_and_floor() -> None:
    # 8 replicas, floor 2, fraction 0.75: at most 6 may go.
    decision = decide(pool(load=0.0), [run("a")])
    assert decision.lent == {"a": 6} and decision.reason == "Lend"
    assert decide(pool(load=0.0, min_serving=7), [run("a")]).lent == {"a": 1}


def test_a_canary_set_and_a_stable_replica_serve_before_anything_is_lent() -> None:
    document = yaml.safe_load((ROOT / "examples" / "realtime.yaml").read_text())
    production = RLRunSpec.model_validate(document["spec"])  # canary.replicas 1, region-a
    bigger = document["spec"] | {
        "production": document["spec"]["production"] | {"canary": {"replicas": 3}}
    }
    runs = [production, RLRunSpec.model_validate(bigger)]
    # The most any run learning from the pool asks; other pools, regions and runs: none.
    assert canary_set(runs, "region-a", "chat", 8) == 3
    assert canary_set(runs, "region-b", "chat", 8) == canary_set(runs, "region-a", "x", 8) == 0
    assert canary_set(runs[:1], "region-a", "chat", 8) == 1
    # Never the whole pool: the stable set keeps one.
    assert canary_set(runs, "region-a", "chat", 3) == 2
    spec = InferencePoolSpec.model_validate(
        yaml.safe_load((ROOT / "examples" / "inferencepool.yaml").read_text())["spec"]
        | {"minServingReplicas": 1, "maxLendFraction": 1.0}
    )
    now = datetime(2026, 1, 1, tzinfo=UTC)
    assert PoolState.of("chat", spec, 0.0, {}, now).lendable == 3  # 4 replicas, floor 1
    # A canary set of 2 and a stable replica: only 1 of 4 may go.
    assert PoolState.of("chat", spec, 0.0, {}, now, canary=2).lendable == 1


def test_lends_only_what_keeps_the_load_per_replica_at_the_lend_threshold() -> None:
    # 20 requests want 5 replicas at 4 per replica: 3 may go.
    assert decide(pool(load=20.0), [run("a")]).lent == {"a": 3}


def test_between_the_thresholds_it_holds() -> None:
    # 3 lent, 5 serving: 8 per replica is between 4 and 12, so nothing moves either way.
    decision = decide(pool(load=40.0, lent={"a": 3}), [run("a")])
    assert decision.lent == {"a": 3} and decision.reason == "Hold"
    assert decide(pool(load=40.0), [run("a")]).lent == {}


def test_a_spike_reclaims_down_to_what_serving_needs() -> None:
    # 6 lent, 2 serving, 26 requests: 13 per replica. 7 replicas bring it to 4: keep 1.
    decision = decide(pool(load=26.0, lent={"a": 6}), [run("a")])
    assert decision.lent == {"a": 1} and decision.reason == "Reclaim"
    assert decide(pool(load=1000.0, lent={"a": 6}), [run("a")]).lent == {}


def test_the_decision_is_a_fixed_point_so_a_restart_does_not_flap() -> None:
    for load in (0.0, 10.0, 20.0, 26.0, 60.0, 1000.0):
        first = decide(pool(load=load, lent={"a": 4}), [run("a")])
        again = decide(pool(load=load, lent=first.lent), [run("a")])
        assert again.lent == first.lent, load


def test_higher_priority_borrows_first_and_gives_back_last() -> None:
    runs = [run("low", priority=0), run("high", priority=5)]
    assert decide(pool(load=0.0, max_lend_fraction=0.25), runs).lent == {"high": 2}
    shrunk = decide(pool(load=26.0, lent={"low": 3, "high": 3}), runs)
    assert shrunk.lent == {"high": 1}


def test_floors_are_met_before_anyone_gets_more() -> None:
    runs = [run("big", priority=1, max_gpus=64), run("small", min_gpus=16, max_gpus=16)]
    assert decide(pool(load=0.0, max_lend_fraction=0.5), runs).lent == {"big": 2, "small": 2}


def test_lent_replicas_stay_with_their_run() -> None:
    # A new higher-priority run does not take replicas already lent: it gets the rest.
    runs = [run("old"), run("new", priority=9)]
    decision = decide(pool(load=0.0, lent={"old": 4}), runs)
    assert decision.lent == {"old": 4, "new": 2}


def test_suspended_gone_and_unrelated_runs_get_nothing() -> None:
    runs = [run("paused", active=False), run("other", pools=("batch",))]
    decision = decide(pool(load=0.0, lent={"paused": 3, "deleted": 2}), runs)
    assert decision.lent == {} and decision.reason == "NoDemand"


def test_a_runs_demand_counts_gpus_other_pools_lend_it() -> None:
    decision = decide(pool(load=0.0), [run("a", max_gpus=24)], elsewhere={"a": 16})
    assert decision.lent == {"a": 1}


def test_unknown_traffic_lends_nothing_more_and_takes_nothing_back() -> None:
    decision = decide(pool(load=None, lent={"a": 2}), [run("a")])
    assert decision.lent == {"a": 2} and decision.reason == "TrafficUnknown"


def test_outside_the_off_peak_windows_everything_comes_back() -> None:
    night = [OffPeakWindow(start="22:00", end="06:00", time_zone="America/Los_Angeles")]
    # 10:00 UTC is 02:00 in Los Angeles (PST); 20:00 UTC is noon.
    assert in_off_peak(night, datetime(2026, 11, 21, 10, 0, tzinfo=UTC))
    assert not in_off_peak(night, datetime(2026, 11, 21, 20, 0, tzinfo=UTC))
    assert in_off_peak([], datetime(2026, 11, 21, 20, 0, tzinfo=UTC))
    decision = decide(pool(load=0.0, lent={"a": 6}, in_window=False), [run("a")])
    assert decision.lent == {} and decision.reason == "OffPeakOver"


def test_a_run_that_names_gpu_types_borrows_only_pools_of_those_types() -> None:
    picky = [run("a", gpu_types=("NVIDIA-H100-80GB-HBM3",))]
    assert decide(pool(load=0.0, gpu_type="NVIDIA-H100-80GB-HBM3"), picky).lent == {"a": 6}
    assert decide(pool(load=0.0, gpu_type="NVIDIA-L4"), picky).lent == {}
    # A pool that names no type is none of the run's: the run cannot know what it would get.
    assert decide(pool(load=0.0), picky).lent == {}
    # What was lent before the run narrowed its types comes back.
    assert decide(pool(load=0.0, gpu_type="NVIDIA-L4", lent={"a": 3}), picky).lent == {}
    # A run that names none takes any pool.
    assert decide(pool(load=0.0, gpu_type="NVIDIA-L4"), [run("b")]).lent == {"b": 6}


def test_among_equals_a_pool_lends_first_to_runs_that_named_its_type() -> None:
    # "any" could borrow elsewhere; "l4" can only borrow pools of its type.
    runs = [run("any"), run("l4", gpu_types=("NVIDIA-L4", "NVIDIA-A10G"))]
    scarce = pool(load=0.0, gpu_type="NVIDIA-L4", max_lend_fraction=0.25)
    assert decide(scarce, runs).lent == {"l4": 2}
    # Priority still comes first.
    first = [run("any", priority=1), runs[1]]
    assert decide(scarce, first).lent == {"any": 2}


def test_a_run_is_told_when_no_pool_it_names_serves_on_its_gpu_types() -> None:
    demand = run("a", pools=("chat", "code"), gpu_types=("NVIDIA-L4", "NVIDIA-A10G"))
    pools = {"chat": "NVIDIA-H100-80GB-HBM3", "code": None, "other": "NVIDIA-L4"}
    assert unserved_gpu_types("region-a", demand, pools) == (
        "spec.rollout.regions[region-a].gpuTypes NVIDIA-L4, NVIDIA-A10G: no pool of its "
        "inferencePools serves on them (chat on NVIDIA-H100-80GB-HBM3, code on no named type)"
    )
    assert unserved_gpu_types("region-a", demand, pools | {"code": "NVIDIA-A10G"}) is None
    # A run that names no type, or whose pools do not exist yet, has no GPU-type problem.
    assert unserved_gpu_types("region-a", run("b", pools=("chat",)), pools) is None
    assert unserved_gpu_types("region-a", demand, {"other": "NVIDIA-H100-80GB-HBM3"}) is None


def test_a_region_plan_lends_each_run_its_demand_once_across_pools() -> None:
    # As the region operator decides: pool by pool, each seeing what the others lend.
    demands = [run("a", max_gpus=64, pools=("chat", "code"))]
    chat = decide(pool(load=0.0, name="chat"), demands)
    gpus = {r: n * 8 for r, n in chat.lent.items()}
    code = decide(pool(load=0.0, name="code"), demands, lent_elsewhere([gpus]))
    assert chat.lent == {"a": 6} and code.lent == {"a": 2}


pools_strategy = st.builds(
    pool,
    load=st.one_of(st.none(), st.floats(min_value=0, max_value=500)),
    lent=st.dictionaries(st.sampled_from("abcd"), st.integers(1, 8), max_size=4),
    replicas=st.integers(1, 16),
    min_serving=st.integers(0, 16),
    max_lend_fraction=st.floats(0, 1),
    gpu_type=st.sampled_from([None, "H100", "L4"]),
)
runs_strategy = st.lists(
    st.builds(
        run,
        st.sampled_from("abcde"),
        max_gpus=st.integers(1, 128),
        priority=st.integers(-2, 2),
        min_gpus=st.integers(0, 64),
        active=st.booleans(),
        gpu_types=st.lists(st.sampled_from(["H100", "L4", "A10G"]), unique=True).map(tuple),
    ),
    unique_by=lambda d: d.run,
    max_size=5,
)


@settings(max_examples=400, deadline=None)
@given(pools_strategy, runs_strategy)
def test_invariants_hold_for_any_input(state: PoolState, demands: list[RunDemand]) -> None:
    decision = decide(state, demands)
    by_run = {d.run: d for d in demands}
    # Serving never below its floor (when the floor is possible at all), never over the cap.
    assert decision.total <= state.lendable
    assert state.replicas - decision.total >= min(state.min_serving, state.replicas)
    for name, replicas in decision.lent.items():
        assert replicas > 0 and by_run[name].active
        assert replicas * state.gpus_per_replica <= by_run[name].max_gpus
        # Never a pool of a type the run did not name, when it named any.
        assert by_run[name].accepts(state)
    # Deciding again from the decision changes nothing: no flapping.
    again = decide(PoolState(**(state.__dict__ | {"lent": decision.lent})), demands)
    assert again.lent == decision.lent


@settings(max_examples=400, deadline=None)
@given(pools_strategy, runs_strategy)
def test_a_run_that_named_the_pools_type_is_not_left_short_for_one_that_did_not(
    state: PoolState, demands: list[RunDemand]
) -> None:
    """Lending afresh, a run that named the pool's type and got less than its floor means
    no run of its priority or lower that named no type got any of the pool."""
    fresh = PoolState(**(state.__dict__ | {"lent": {}}))
    decision = decide(fresh, demands)
    for demand in demands:
        floor = min(
            -(-demand.min_gpus // state.gpus_per_replica), demand.max_gpus // state.gpus_per_replica
        )
        if not (demand.active and demand.named(state)) or decision.lent.get(demand.run, 0) >= floor:
            continue
        for other in demands:
            if not other.gpu_types and other.priority <= demand.priority:
                assert other.run not in decision.lent, (demand, other, decision)

"""`rlfleet plan`'s model of the pipeline (`rlfleet.pipeline`): cases whose answer is known
by hand, properties that hold for any costs, and the command a user runs.

`bench/plan.py` checks the model against measured runs; these pin down its arithmetic."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import yaml
from hypothesis import given, settings
from hypothesis import strategies as st

from rlfleet.api.inferencepool import InferencePoolSpec
from rlfleet.api.profile import (
    Profile,
    RegionLink,
    RolloutCosts,
    TrainerCosts,
    WeightCosts,
    encode_profile,
)
from rlfleet.api.rlrun import RLRunSpec
from rlfleet.api.traffic import decode_traffic
from rlfleet.launch import from_spec, pods
from rlfleet.pipeline.day import Pool, lent_by_hour
from rlfleet.pipeline.model import Feed, Pipeline, Region, simulate
from rlfleet.pipeline.sizing import Split, best_split, pipeline_for, predict

EXAMPLES = Path(__file__).parents[2] / "examples"


def pipeline(**changes) -> Pipeline:
    """Two groups of four 25-token attempts a step, on one engine of 100 tokens/s that runs
    both groups at once: a batch takes 2 s to generate."""
    region = Region("r", engines=1, tokens_per_s=100, groups_at_once=2, arrival_s=0.2, load_s=0.2)
    base = dict(
        step_groups=2,
        group_size=4,
        max_staleness=0,
        tokens_per_attempt=25,
        group_tokens_cv=0.0,
        step_overhead_s=0.5,
        seconds_per_token=0.0,
        publish_s=0.1,
        feed=Feed(depth=8),
        regions=(region,),
    )
    return Pipeline(**(base | changes))


def test_a_synchronous_rollout_bound_pipeline_alternates():
    """Generate 2 s, train 0.5 s, publish 0.1 s, reach the region 0.2 s, load 0.2 s: a
    version every 3 s, the trainer waiting 2.4 s of each."""
    predicted = simulate(pipeline(), 300)
    assert predicted.steps_within(30) == 11  # ends at 2.6 + 3k s
    assert predicted.idle_fraction == pytest.approx(0.8, abs=1e-6)
    assert predicted.staleness_mean == 0 and predicted.dropped_stale == 0


def test_a_trainer_bound_pipeline_never_waits():
    """Rollouts a thousand times faster than the 1 s step, one version of lead allowed:
    the trainer steps back to back."""
    region = Region("r", engines=4, tokens_per_s=1e5, groups_at_once=4, arrival_s=0, load_s=0)
    fast = pipeline(max_staleness=1, step_overhead_s=1.0, publish_s=0.0, regions=(region,))
    predicted = simulate(fast, 100)
    assert predicted.steps_within(50) == 51
    assert predicted.idle_fraction < 0.01
    # A version's batch is generated the moment it lands, by the version before it.
    assert predicted.staleness_mean == pytest.approx(1.0, abs=0.05)


def test_running_ahead_turns_waiting_into_steps():
    """The same costs with a lead of two versions: generation overlaps training, so the
    pipeline goes at generation's pace (2 s a step, plus the loads) instead of 3 s."""
    sync, lead = simulate(pipeline(), 600), simulate(pipeline(max_staleness=2), 600)
    assert lead.steps >= 1.3 * sync.steps
    assert lead.idle_fraction < sync.idle_fraction
    assert 0 < lead.staleness_mean <= 2


costs = st.floats(min_value=0.01, max_value=10)


@settings(max_examples=60, deadline=None)
@given(
    staleness=st.integers(0, 4),
    groups=st.integers(1, 12),
    engines=st.integers(1, 6),
    slots=st.integers(1, 4),
    depth=st.integers(1, 32),
    poll=st.sampled_from([0.0, 0.05, 0.25]),
    step=costs,
    arrival=costs,
    rate=st.floats(min_value=10, max_value=1e4),
)
def test_any_pipeline_steps_within_its_bound(
    staleness, groups, engines, slots, depth, poll, step, arrival, rate
):
    """Whatever the costs, the feed's admission and the engines' holding of tasks never
    deadlock the pipeline (a step at least every step's worth of generation and
    latency), and nothing trained on is staler than the bound. (Groups may still be
    dropped: one that finishes behind the next version's batch comes too late.)"""
    region = Region("r", engines, rate, slots, arrival_s=arrival, load_s=arrival / 2)
    shaped = pipeline(
        max_staleness=staleness,
        step_groups=groups,
        step_overhead_s=step,
        feed=Feed(depth, poll),
        regions=(region,),
    )
    one_step = groups * shaped.group_tokens / rate + step + 0.1 + 1.5 * arrival + poll
    predicted = simulate(shaped, 10 * one_step)
    assert predicted.steps >= 5
    assert predicted.staleness_max <= staleness


def profile(tokens_per_s: float, seconds_per_token: float) -> Profile:
    return Profile(
        measured_on="a test's figures",
        trainer=TrainerCosts(
            seconds_per_token=seconds_per_token, step_overhead_s=1.0, publish_s=2.0
        ),
        rollout=RolloutCosts(
            tokens_per_s=tokens_per_s,
            groups_at_once=8,
            tokens_per_attempt=500,
            load_s=1.0,
            gpus_per_engine=8,
            batch_exponent=1.0,  # a GPU's decoding
        ),
        weights=WeightCosts(bytes_per_version=10**9, latency_s=0.5),
        links=[RegionLink(region="region-b", gbps=0.1)],
    )


def test_a_slower_trainer_gets_more_of_the_gpus():
    spec = RLRunSpec.model_validate(
        {
            "model": {"uri": "file:///m"},
            "trainer": {"gpusPerReplica": 8, "stepGroups": 16},
            "rollout": {
                "groupSize": 8,
                "regions": [
                    {"name": "region-a", "maxGpus": 96},
                    {"name": "region-b", "maxGpus": 96},
                ],
            },
        }
    )
    shares = {}
    for name, seconds_per_token in (("fast", 1e-5), ("slow", 1e-3)):
        best = best_split(spec, profile(2000, seconds_per_token), 96, Feed(256))
        assert best is not None
        shares[name] = best[0].trainer_share
    assert shares["slow"] > shares["fast"]
    # A region behind a slow link waits longer for each version.
    split = Split(8, {"region-a": 32, "region-b": 32})
    a, b = pipeline_for(spec, profile(2000, 1e-4), split, Feed(256)).regions
    assert b.arrival_s == pytest.approx(a.arrival_s + 10 - 0, rel=1e-6)


def plan(profile_file: Path, *args: str, check: bool = True) -> subprocess.CompletedProcess:
    """`rlfleet plan examples/rlrun.yaml --profile PROFILE_FILE ARGS...`."""
    command = [sys.executable, "-m", "rlfleet.cli", "plan", str(EXAMPLES / "rlrun.yaml")]
    return subprocess.run(
        [*command, "--profile", str(profile_file), *args],
        capture_output=True,
        text=True,
        check=check,
    )


@pytest.fixture
def gpu_profile(tmp_path) -> Path:
    path = tmp_path / "profile.json"
    path.write_bytes(encode_profile(profile(2000, 1e-4)))
    return path


def test_rlfleet_plan_predicts_an_example(gpu_profile):
    done = plan(gpu_profile, "--json")
    result = json.loads(done.stdout)
    assert set(result) == {"as_written", "best", "one_third_rule"}
    assert result["best"]["steps_per_hour"] >= result["one_third_rule"]["steps_per_hour"]
    assert result["as_written"]["rollout_gpus"] == {"region-a": 16, "region-b": 16, "region-c": 8}


def test_rlfleet_plan_names_a_bad_profile_field(tmp_path):
    path = tmp_path / "profile.yaml"
    path.write_text(
        "kind: rlfleet.io/profile/v1\nmeasured_on: x\ntrainer: {seconds_per_token: -1}\n"
    )
    done = plan(path, check=False)
    assert done.returncode == 1
    assert "seconds_per_token" in done.stderr and "Traceback" not in done.stderr


def test_a_fleets_feed_keeps_its_workers_busy():
    """The feed in pods keeps room for every group the regions' workers can run. With
    the 8 tasks it kept before, a run of 64 rollout GPUs in batches of 32 groups made
    a fraction of the steps its workers could."""
    spec = RLRunSpec.model_validate(
        {
            "model": {"uri": "file:///m"},
            "trainer": {"gpusPerReplica": 8, "stepGroups": 32},
            "rollout": {"groupSize": 8, "regions": [{"name": "region-a", "maxGpus": 64}]},
        }
    )
    depth = from_spec.feed_settings("r", spec, pods.Placement("nats://x")).depth
    split = Split(8, {"region-a": 64})
    fleet = predict(spec, profile(2000, 1e-5), split, Feed(depth))
    eight = predict(spec, profile(2000, 1e-5), split, Feed(8))
    assert fleet.steps_per_hour > 2 * eight.steps_per_hour
    assert fleet.rollout_utilisation > 0.8


def _example_pools() -> list[Pool]:
    traffic = decode_traffic((EXAMPLES / "planning" / "traffic.yaml").read_bytes())
    document = yaml.safe_load((EXAMPLES / "inferencepool.yaml").read_text())
    spec = InferencePoolSpec.model_validate(document["spec"])
    return [Pool("chat-prod", p.region, spec, tuple(p.hourly_load)) for p in traffic.pools]


def test_pools_lend_by_the_operators_rule_hour_by_hour():
    """examples/planning/traffic.yaml through the region operator's own decision: a region lends
    its pool's half (two 8-GPU replicas) in its night, nothing at its peak, and between
    the two holds what it lent (hysteresis), never past the run's maxGpus."""
    spec = RLRunSpec.model_validate(yaml.safe_load((EXAMPLES / "rlrun.yaml").read_text())["spec"])
    hours = lent_by_hour(spec, _example_pools())
    assert len(hours) == 24
    region_b = [h["region-b"] for h in hours]  # Central Europe, UTC+1
    assert region_b[2] == 16  # load 5: 1.25 a replica, lend the half the pool may
    assert region_b[21] == 8  # load 12: three replicas keep it below 4 each, one lent
    assert region_b[7] == 16  # load 22: 11 a serving replica, between the thresholds: hold
    assert region_b[8] == 0  # load 30: 15 a serving replica, above 12: all back
    assert region_b[11] == 0
    assert max(h["region-c"] for h in hours) == 8  # the run's maxGpus there


def test_rlfleet_plan_plans_a_day_of_traffic(gpu_profile):
    done = plan(gpu_profile, "--traffic", str(EXAMPLES / "planning" / "traffic.yaml"), "--json")
    planned = json.loads(done.stdout)["day"]
    assert [h["hour"] for h in planned["hours"]] == list(range(24))
    assert planned["best_steps"] >= planned["steps"] * 0.99  # the split as lent is a candidate
    assert planned["gpu_hours"]["trainer"] == 24 * 8

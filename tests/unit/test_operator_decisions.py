"""The hub's and the region operator's decisions alone (pure functions): region
reachability, the evaluation gate's verdict, the run's status and events, and a pool's
reclaim clock. A decision over a world that has not changed must tell nothing new and
write nothing, or every resync would post events and patch status."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta

import yaml
from conftest import ROOT, evaluation_report, step_report
from hypothesis import given
from hypothesis import strategies as st

from rlfleet.api.inferencepool import (
    InferencePoolSpec,
    InferencePoolStatus,
    LentToRun,
    ServedVersion,
)
from rlfleet.api.meta import LENDABLE_LABEL
from rlfleet.api.rlrun import EvaluationGate, RegionStatus, RLRunSpec, RLRunStatus
from rlfleet.api.wire import EvaluationReport
from rlfleet.operator.gate import judge
from rlfleet.operator.region.pool_status import (
    decision_events,
    reclaim_clock,
    serving_unusable,
    unusable,
)
from rlfleet.operator.runstatus import (
    REGION_PROBLEMS,
    Observed,
    RegionReport,
    decide,
    region_view,
)
from rlfleet.operator.served import MAX_SHOWN, count_served, parse_served
from rlfleet.operator.status import differs, timestamp
from rlfleet.pipeline.lending import Decision as Lending
from rlfleet.pipeline.lending import PoolState

NOW = datetime(2026, 11, 21, 12, 0, 0, tzinfo=UTC)
SPEC = RLRunSpec.model_validate(
    yaml.safe_load((ROOT / "examples" / "rlrun.yaml").read_text())["spec"]
)
REGIONS = [r.name for r in SPEC.rollout.regions]
TIMEOUT_S = 120.0

ages = st.integers(min_value=0, max_value=600).map(lambda s: NOW - timedelta(seconds=s))
counts = st.integers(min_value=0, max_value=64)
# What a region says when none of the run's pools there serves on its GPU types, or the
# EnvPool the run names is not there: set only when so, as the region writes it.
UNSERVED = "spec.rollout.regions[region-a].gpuTypes NVIDIA-L4: no pool of its inferencePools"
NO_ENVPOOL = "spec.rollout.envPool: no EnvPool arith-sandbox in namespace team-a"
SAID = {"gpu_types_unserved": UNSERVED, "env_pool_missing": NO_ENVPOOL}
problems = st.sets(st.sampled_from(sorted(SAID))).map(lambda found: {f: SAID[f] for f in found})


@st.composite
def previous_entries(draw: st.DrawFn, name: str) -> RegionStatus | None:
    if draw(st.booleans()):
        return None  # the hub has not written this region yet
    return RegionStatus(
        name=name,
        reachable=draw(st.booleans()),
        requested=draw(counts),
        lent=draw(counts),
        running=draw(counts),
        last_seen=draw(st.none() | ages.map(timestamp)),
        **draw(problems),
    )


@st.composite
def reports(draw: st.DrawFn, name: str) -> RegionReport:
    kind = draw(st.sampled_from(["answered", "network", "credentials"]))
    if kind == "answered":
        reported = RegionStatus(
            name=name,
            requested=draw(counts),
            lent=draw(counts),
            running=draw(counts),
            **draw(problems),
        )
        return RegionReport(name, True, reported, draw(ages))
    return RegionReport(name, False, problem="no answer", credentials=kind == "credentials")


@st.composite
def regions(draw: st.DrawFn, name: str = "region-a") -> tuple:
    return (
        draw(reports(name)),
        draw(previous_entries(name)),
        draw(st.none() | ages),  # its last answer in this process
        draw(st.none() | st.just(NOW - timedelta(hours=1))),  # the run's creation
    )


@given(regions())
def test_a_region_is_reachable_exactly_when_it_answers_or_is_not_yet_timed_out(
    region: tuple,
) -> None:
    report, previous, last_answer, created = region
    view = region_view(report, previous, last_answer, created, NOW, TIMEOUT_S)
    was = previous.reachable if previous is not None else True
    assert view.entry.name == report.name
    if report.reachable:
        assert view.entry.reachable and not view.lost and not view.refused
        assert view.entry.lent == report.reported.lent
    elif report.credentials:
        assert not view.entry.reachable and view.refused and not view.lost
    else:
        assert view.lost == (view.silent_s >= TIMEOUT_S)
        assert view.entry.reachable == (was and not view.lost)
        if last_answer is not None:
            assert view.entry.last_seen == timestamp(last_answer)
    # An event exactly when reachability turns, Warning only when it is lost.
    turned = view.entry.reachable != was
    assert (view.event is not None) == turned
    if view.event is not None:
        assert view.event.reason == (
            "RegionReachable"
            if view.entry.reachable
            else "RegionCredentialsInvalid"
            if report.credentials
            else "RegionUnreachable"
        )
        assert (view.event.type == "Warning") == (not view.entry.reachable)


@given(regions())
def test_a_region_seen_again_unchanged_tells_nothing_and_writes_nothing(region: tuple) -> None:
    report, previous, last_answer, created = region
    first = region_view(report, previous, last_answer, created, NOW, TIMEOUT_S)
    again = region_view(report, first.entry, last_answer, created, NOW, TIMEOUT_S)
    assert again.entry == first.entry and again.event is None


GATE = EvaluationGate(suite="rules", min_reward=0.4, target_reward=0.8)
rewards = st.floats(min_value=0, max_value=1)


def evaluation(version: int, reward: float) -> EvaluationReport:
    return evaluation_report(version, reward, NOW.timestamp(), pass_at_k=0.5)


@given(
    st.integers(0, 1000),
    rewards,
    st.floats(min_value=0, max_value=0.9),
    st.floats(min_value=0.01, max_value=0.1) | st.none(),
)
def test_the_gate_holds_a_run_exactly_under_its_floor_or_at_its_target(
    version: int, reward: float, floor: float, above: float | None
) -> None:
    target = None if above is None else min(1.0, floor + above)
    gate = EvaluationGate(suite="rules", min_reward=floor, target_reward=target)
    spec = SPEC.model_copy(update={"evaluation": gate})
    verdict = judge(evaluation(version, reward), spec, RLRunStatus(), 3)
    assert verdict.failed == (reward < floor)
    assert verdict.succeeded == (not verdict.failed and target is not None and reward >= target)
    assert verdict.held == bool(verdict.why)
    assert [c.type for c in verdict.conditions] == ["Failed"] + (
        ["Succeeded"] if target is not None else []
    )
    reasons = [e.reason for e in verdict.events]
    assert reasons[0] == "Evaluated"
    assert ("EvaluationBelowFloor" in reasons) == verdict.failed
    assert ("EvaluationReachedTarget" in reasons) == verdict.succeeded
    # Judged again on the status it wrote: the same verdict, nothing more to tell.
    status = RLRunStatus.model_validate(
        verdict.fields.merge_patch() | {"conditions": verdict.conditions}
    )
    for report in (evaluation(version, reward), None):
        again = judge(report, spec, status, 3)
        assert again.events == [] and again.conditions == verdict.conditions
        assert again.held == verdict.held


@st.composite
def observations(draw: st.DrawFn) -> Observed:
    suspend = draw(st.booleans())
    spec = SPEC.model_copy(update={"suspend": suspend})
    found = [draw(regions(name)) for name in REGIONS]
    leftover = draw(st.lists(st.sampled_from(["region-x", "region-y"]), unique=True))
    old_regions = [p for _, p, _, _ in found if p is not None]
    old_regions += [RegionStatus(name=n, lent=draw(counts), running=draw(counts)) for n in leftover]
    old = RLRunStatus(regions=old_regions, gpus_lent=draw(st.none() | counts))
    stepped = draw(st.booleans())
    step = draw(st.none() | ages.map(lambda t: step_report("r", 7, t.timestamp(), 0)))
    return Observed(
        spec=spec,
        old=old,
        generation=draw(st.integers(1, 5)),
        created=NOW - timedelta(hours=1),
        verdict=judge(None, spec, old, 1),
        ready=draw(st.integers(0, 2)),
        regions=[r for r, _, _, _ in found],
        leftover=leftover,
        last_answer={r.name: a for r, _, a, _ in found if a is not None},
        stepped=stepped,
        step=step if stepped else None,
        moment=NOW,
        region_timeout_s=TIMEOUT_S,
        spec_problems=draw(st.sampled_from([(), (NO_ROOM,)])),
    )


NO_ROOM = "spec.trajectoryBacklogMib: the hub's JetStream cannot reserve 8192 MiB"


@given(observations())
def test_the_run_status_counts_only_reachable_regions_and_ready_means_all_is_well(
    observed: Observed,
) -> None:
    status = decide(observed).status
    reachable = [e for e in status.regions if e.reachable and e.name in REGIONS]
    assert status.gpus_lent == sum(e.lent for e in reachable)
    assert status.gpus_running == sum(e.running for e in reachable)
    assert [e.name for e in status.regions] == REGIONS + list(observed.leftover)
    assert not any(e.reachable for e in status.regions if e.name not in REGIONS)
    said = {c.type: c.status for c in status.conditions}
    assert status.conditions[0].type == "Ready" and len(said) == len(status.conditions)
    # What the hub's JetStream refused in the spec: not ready, the field named, and told.
    if observed.spec_problems:
        ready = status.conditions[0]
        assert (ready.status, ready.reason, ready.message) == ("False", "InvalidSpec", NO_ROOM)
        told = [e for e in decide(observed).events if e.reason == "InvalidSpec"]
        assert [e.message for e in told] == [NO_ROOM]
    if said["Ready"] == "True":
        assert said["Training"] == "True" and said["RolloutsDegraded"] == "False"
        assert status.phase == "Running" and status.gpus_running > 0
    assert (status.phase == "Suspended") == observed.spec.suspend
    if observed.spec.suspend:  # a stopped run wants no GPUs: none are missing
        degraded = next(c for c in status.conditions if c.type == "RolloutsDegraded")
        assert degraded.reason != "BelowMinGpus"
    assert (said["Suspended"] == "True") == observed.spec.suspend
    # A region whose pools serve none of the run's GPU types, or that lacks its EnvPool,
    # degrades the rollouts, saying so.
    degraded = next(c for c in status.conditions if c.type == "RolloutsDegraded")
    for field, reason in REGION_PROBLEMS:
        if any(getattr(e, field) for e in reachable):
            assert degraded.status == "True" and SAID[field] in degraded.message
            assert degraded.reason in (
                "RegionUnreachable",
                "RegionCredentialsInvalid",
                "NoPoolOfGpuType",
                reason,
            )


@given(observations())
def test_a_run_decided_again_on_its_own_status_tells_nothing_and_writes_nothing(
    observed: Observed,
) -> None:
    first = decide(observed)
    again = decide(
        Observed(**(vars(observed) | {"old": first.status}))  # the status it wrote
    )
    assert again.events == []
    assert not differs(first.status.merge_patch(), again.status.merge_patch())


@given(observations())
def test_a_problem_a_region_newly_finds_with_the_run_is_told_once(observed: Observed) -> None:
    """No pool of the run's GPU types, or no EnvPool of the name it gives."""
    for field, reason in REGION_PROBLEMS:
        before = {e.name: getattr(e, field) for e in observed.old.regions}
        newly = {
            r.name
            for r in observed.regions
            if r.reachable
            and getattr(r.reported, field)
            and getattr(r.reported, field) != before.get(r.name)
        }
        told = [e.message for e in decide(observed).events if e.reason == reason]
        assert sorted(told) == sorted(f"region {name}: {SAID[field]}" for name in newly)


@given(observations())
def test_only_what_a_human_may_act_on_is_a_warning(observed: Observed) -> None:
    for event in decide(observed).events:
        warning = event.reason in (
            "RegionUnreachable",
            "RegionCredentialsInvalid",
            "WeightSyncStalled",
            "StalenessBoundExceeded",
            "NoPoolOfGpuType",
            "EnvPoolNotFound",
            "InvalidSpec",
        )
        assert (event.type == "Warning") == warning, event


POOL = InferencePoolSpec.model_validate(
    yaml.safe_load((ROOT / "examples" / "inferencepool.yaml").read_text())["spec"]
)


@given(
    st.none() | st.integers(0, 600).map(lambda s: NOW - timedelta(seconds=s)),
    st.integers(0, 4),
    st.integers(0, 4),
)
def test_a_reclaim_is_timed_from_the_first_draining_pod_to_the_last(
    started: datetime | None, reclaiming: int, lent: int
) -> None:
    clock = reclaim_clock(started, reclaiming, NOW, POOL, lent)
    assert (clock.started is not None) == (reclaiming > 0)
    if reclaiming and started is None:
        assert clock.started == NOW  # it begins now
    done = [e for e in clock.events if e.reason == "GPUsReclaimed"]
    assert len(done) == (1 if started is not None and not reclaiming else 0)
    overdue = started is not None and (NOW - started).total_seconds() > (
        POOL.reclaim_deadline_seconds
    )
    assert clock.overdue == (reclaiming > 0 and overdue)


lent_maps = st.dictionaries(st.sampled_from("abc"), st.integers(1, 4), max_size=3)


@given(lent_maps, lent_maps, st.none() | st.floats(0, 100))
def test_each_run_whose_share_moved_gets_one_event_saying_which_way(
    before: dict[str, int], after: dict[str, int], load: float | None
) -> None:
    state = PoolState.of("chat-prod", POOL, load, before, NOW)
    events = decision_events(POOL, state, Lending(after, "Lend"), before)
    moved = sorted(r for r in set(before) | set(after) if before.get(r, 0) != after.get(r, 0))
    assert len(events) == len(moved)
    for run, event in zip(moved, events, strict=True):
        grew = after.get(run, 0) > before.get(run, 0)
        assert event.reason == ("GPUsLent" if grew else "GPUsReclaiming")
        assert run in event.message and event.type == "Normal"


def _exposition(*series: dict[str, str]) -> str:
    lines = ["# TYPE rlfleet_serving_weights info"]
    for labels in series:
        text = ",".join(f'{k}="{v}"' for k, v in labels.items())
        lines.append(f"rlfleet_serving_weights_info{{{text}}} 1.0")
    return "\n".join(lines) + "\n"


STABLE_7 = {"run": "r", "replica_set": "stable", "version": "7", "digest": "ab"}


def test_a_serving_pod_counts_only_when_it_says_one_readable_version() -> None:
    said = parse_served(_exposition(STABLE_7))
    assert said == ServedVersion(run="r", replica_set="stable", version=7, digest="ab", replicas=1)
    unreadable = [
        "not metrics {",
        "# TYPE vllm:num_requests_running gauge\nvllm:num_requests_running 3\n",  # plain vLLM
        _exposition(STABLE_7, STABLE_7 | {"version": "8"}),  # two answers: neither
        _exposition(STABLE_7 | {"version": "-1"}),
        _exposition(STABLE_7 | {"run": ""}),
        _exposition({k: v for k, v in STABLE_7.items() if k != "replica_set"}),
        _exposition(STABLE_7 | {"digest": "x" * 129}),
    ]
    assert [parse_served(text) for text in unreadable] == [None] * len(unreadable)


def test_served_versions_are_counted_per_set_and_digest_and_silence_apart() -> None:
    def said(replica_set: str, version: int, digest: str = "d") -> ServedVersion:
        return ServedVersion(
            run="r", replica_set=replica_set, version=version, digest=digest, replicas=1
        )

    answers = [
        said("stable", 6),
        None,
        said("canary", 7),
        said("stable", 6),
        said("stable", 6, "x"),
    ]
    served, unversioned = count_served(answers)
    assert [(s.replica_set, s.version, s.digest, s.replicas) for s in served] == [
        ("canary", 7, "d", 1),
        ("stable", 6, "d", 2),
        ("stable", 6, "x", 1),  # a pod whose weights differ from its set's shows apart
    ]
    assert unversioned == 1
    # Past the status's bound, the smallest groups are counted as unversioned, not lost.
    many = [said("stable", v) for v in range(MAX_SHOWN + 5)] + [said("stable", 0)]
    served, unversioned = count_served(many)
    assert len(served) == MAX_SHOWN and unversioned == 5
    assert next(s for s in served if s.version == 0).replicas == 2


def test_a_pool_acts_only_on_a_serving_deployment_its_owner_opted_in() -> None:
    """An InferencePool scaled an unlabelled Deployment of another team from 5 replicas to
    1 because it named it: naming is not consent, the owner's label is."""
    pool = yaml.safe_load((ROOT / "examples" / "inferencepool.yaml").read_text())
    spec = InferencePoolSpec.model_validate(pool["spec"])

    def serving(labels: dict) -> dict:
        return {"metadata": {"name": spec.serving.deployment_name, "labels": labels}}

    assert unusable(None, "ns", spec)[0] == "ServingNotFound"
    for labels in ({"app": "chat-vllm"}, {LENDABLE_LABEL: "yes"}, {LENDABLE_LABEL: "false"}):
        reason, message = unusable(serving(labels), "ns", spec)
        assert reason == "ServingNotLendable"
        assert f"ns/{spec.serving.deployment_name} (spec.serving.deploymentName)" in message
        assert f'{LENDABLE_LABEL}: "true"' in message
    assert unusable(serving({"app": "x", LENDABLE_LABEL: "true"}), "ns", spec) is None
    # Nothing is scaled then: what was lent stays lent, and shown; the warning comes once.
    old = InferencePoolStatus(lent=[LentToRun(run="r", replicas=2)])
    status, events = serving_unusable(old, "ServingNotLendable", "lacks the label", 3)
    assert status.lent == old.lent and [e.reason for e in events] == ["ServingNotLendable"]
    assert serving_unusable(status, "ServingNotLendable", "lacks the label", 3)[1] == []

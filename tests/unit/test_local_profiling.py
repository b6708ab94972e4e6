"""A cost profile measured from local runs' records (`rlfleet.local.profiling`): step
reports and workers' logs of known costs give those costs back, and a run that cannot
tell the rollouts' speed is refused. The runs themselves are `bench/plan.py`'s."""

from __future__ import annotations

import statistics
from pathlib import Path

import msgspec
import pytest
from conftest import step_report

from rlfleet.api.rlrun import RLRunSpec
from rlfleet.local.plan import Tuning
from rlfleet.local.profiling import NotRolloutBound, Profiled, measure

SPEC = RLRunSpec.model_validate(
    {
        "model": {"uri": "tiny://tiny-moe"},
        "rollout": {
            "groupSize": 4,
            "regions": [{"name": "region-a", "maxGpus": 1}, {"name": "region-b", "maxGpus": 1}],
        },
    }
)


def run(tmp_path: Path, name: str, wait_s: float, running: int, steps: int = 30) -> Profiled:
    """Steps of 2 groups and 40 + 8i tokens taking 0.1 s + 1 ms a token, each followed by
    0.05 s of publishing and `wait_s` of waiting; every version loaded by a worker 0.03 s
    after it was published, pausing 0.02 s."""
    reports, at = [], 100.0
    log = []
    for version in range(1, steps + 1):
        tokens = 40 + 8 * (version % 5)
        step_s = 0.1 + 0.001 * tokens
        at += wait_s + step_s
        report = step_report("r", version, at, 0)
        reports.append(
            msgspec.structs.replace(
                report, tokens=tokens, groups=2, step_seconds=step_s, wait_seconds=wait_s
            )
        )
        loaded = at + 0.05 + 0.03 + 0.02
        log.append(
            f"(MainProcess) INFO 11-26 15:00:00 [engine.py:173] policy version {version} "
            f"loaded at {loaded:.3f} with {running} requests running; generation paused 0.020s"
        )
        at += 0.05
    logs = tmp_path / name
    logs.mkdir()
    (logs / "rollout-region-a.log").write_text("\n".join(log) + "\n")
    return Profiled(reports, logs)


def test_known_costs_come_back(tmp_path):
    profile = measure(
        SPEC, run(tmp_path, "ahead", 0.2, running=8), run(tmp_path, "sync", 0.3, 0), Tuning()
    )
    trainer, rollout = profile.trainer, profile.rollout
    assert trainer.seconds_per_token == pytest.approx(0.001, rel=1e-6)
    assert trainer.step_overhead_s == pytest.approx(0.1, abs=1e-6)
    assert trainer.publish_s == pytest.approx(0.05, abs=1e-6)
    assert rollout.notice_busy_s == pytest.approx(0.03, abs=2e-3)
    assert rollout.notice_idle_s == pytest.approx(0.03, abs=2e-3)
    assert rollout.load_s == pytest.approx(0.02)
    # What the trainer received per second of the first run (its first step left out).
    tokens = [40 + 8 * (v % 5) for v in range(2, 31)]
    span = sum(0.2 + 0.1 + 0.001 * t + 0.05 for t in tokens[1:])
    assert rollout.tokens_per_s == pytest.approx(sum(tokens[1:]) / span, rel=1e-6)
    # Two groups a step: a group's spread is a step's times the square root of two.
    cv = statistics.stdev(tokens) / statistics.fmean(tokens) * 2**0.5
    assert rollout.group_tokens_cv == pytest.approx(cv)
    assert rollout.tokens_per_attempt == pytest.approx(
        sum(40 + 8 * (v % 5) for v in range(2, 31)) / (29 * 2 * 4)
    )
    assert rollout.engines_per_device == 2  # both regions' workers on the one core
    assert rollout.groups_at_once == Tuning().max_sessions // 4


def test_a_run_whose_trainer_never_waited_is_refused(tmp_path):
    with pytest.raises(NotRolloutBound, match="waited 0%"):
        measure(SPEC, run(tmp_path, "ahead", 0.0, 8), run(tmp_path, "sync", 0.3, 0), Tuning())


def test_a_profile_needs_loads_seen_both_busy_and_idle(tmp_path):
    with pytest.raises(ValueError, match="0 while idle"):
        measure(SPEC, run(tmp_path, "ahead", 0.2, 8), run(tmp_path, "sync", 0.3, 8), Tuning())

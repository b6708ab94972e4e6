"""Reward kinds: one vocabulary from the spec (`spec.rewards[].kind`) through the worker's
settings to its scorers and each trajectory's breakdown, and one registry (`SCORERS`)
that maps a kind to the scorer it is on the tasks it applies to. The scorers themselves
grade in `tests/servers/test_rollout_rewards.py`."""

from __future__ import annotations

import typing

import pytest

from rlfleet.api.rlrun import RewardKind, RLRunSpec
from rlfleet.api.wire import Task
from rlfleet.launch import from_spec
from rlfleet.launch.settings import JudgeConfig, Limits, RemoteRewardConfig, RewardConfig
from rlfleet.rollout.environment import rewards


def _constant(task: Task, outcome: rewards.Outcome) -> float:
    return 1.0


GRADING = rewards.Grading(
    None,
    Limits(),
    JudgeConfig(base_url="http://judge/v1", model="j"),
    python=rewards.PythonGrader(_constant),
    remote=rewards.Remote(RemoteRewardConfig(url="http://verifier/score")),
)
EVERYTHING = Task(
    id="t",
    suite="s",
    prompt="p",
    answer="42",
    hidden_tests={"test_a.py": "assert True"},
    test_command="python test_a.py",
    rubric={"clarity": "is it clear"},
)


def test_every_kind_the_spec_names_has_a_scorer_keyed_by_that_same_name() -> None:
    assert set(rewards.SCORERS) == set(typing.get_args(RewardKind))
    for kind, make in rewards.SCORERS.items():
        scorer = make(EVERYTHING, GRADING)
        assert scorer is not None and scorer.name == kind  # its key in the breakdown


def test_the_spec_s_rewards_reach_the_worker_by_their_kinds() -> None:
    spec = RLRunSpec.model_validate(
        {
            "model": {"uri": "file:///m"},
            "rollout": {"regions": [{"name": "a", "maxGpus": 1}]},
            "rewards": [
                {"kind": "hiddenTests", "weight": 2},
                {"kind": "judge", "weight": 0.5, "endpoint": "http://j/v1", "judgeModel": "m"},
                {"kind": "python", "function": "graders.style:score"},
                {"kind": "remote", "endpoint": "http://v/score", "requests": {"retries": 0}},
            ],
        }
    )
    config = from_spec._rewards(spec)
    assert config.weights == {"hiddenTests": 2.0, "judge": 0.5, "python": 1.0, "remote": 1.0}
    assert config.judge_endpoint == JudgeConfig(base_url="http://j/v1", model="m")
    assert config.python_function == "graders.style:score"
    assert config.remote == RemoteRewardConfig(url="http://v/score", retries=0)
    assert RewardConfig().weights == {"exactAnswer": 1.0, "hiddenTests": 1.0}  # none named


def test_a_task_is_scored_by_the_weighted_kinds_that_apply_to_it() -> None:
    weights: dict[RewardKind, float] = {"exactAnswer": 1.0, "hiddenTests": 0.0, "judge": 2.0}
    combined = rewards.scorer_for(EVERYTHING, weights, GRADING)
    assert [(w, s.name) for w, s in combined.parts] == [(1.0, "exactAnswer"), (2.0, "judge")]
    bare = Task(id="b", suite="s", prompt="p", answer="7")
    assert [s.name for _, s in rewards.scorer_for(bare, weights, GRADING).parts] == ["exactAnswer"]
    with pytest.raises(ValueError, match="nothing the configured rewards can grade"):
        rewards.scorer_for(Task(id="n", suite="s", prompt="p"), weights, GRADING)

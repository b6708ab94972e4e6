"""The `verifiers` environment loads a taskset module as verifiers does, and refuses a bad
setting naming it, before a worker takes any work."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from rlfleet.rollout.environment.plugins import SettingsError, factory
from rlfleet.rollout.environment.verifiers_env import DATA

ENGINES = Path(__file__).resolve().parents[1] / "engines"


@pytest.fixture(autouse=True)
def taskset_on_path(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(sys, "path", [str(ENGINES), *sys.path])


def test_its_tasks_are_the_tasksets_and_rebuild_as_verifiers_tasks() -> None:
    environment = factory("verifiers")({"taskset": {"id": "vf_questions"}})
    (task,) = environment.tasks()
    assert task.id == "verifiers-apple" and task.prompt == "What is the secret number of apple?"
    assert task.metadata[DATA]["answer"] == "7"
    assert environment._task(task).data.answer == "7"


@pytest.mark.parametrize(
    ("settings", "setting"),
    [
        ({}, "taskset"),
        ({"taskset": {"id": "vf_questions"}, "rewardRange": [1, 0]}, "rewardRange"),
        ({"taskset": {"id": "vf_questions"}, "turns": 3}, "turns"),
        ({"taskset": {"id": "no_such_module_here"}}, "taskset"),
    ],
)
def test_a_bad_setting_is_refused_by_name(settings: dict, setting: str) -> None:
    with pytest.raises(SettingsError, match=f"settings.{setting}"):
        factory("verifiers")(settings)

"""The recipe a run learns by is the spec's: each field of it reaches the settings the
pods build (`rlfleet.launch`), and a combination no component could run is refused by
validation naming the field, before anything starts."""

from __future__ import annotations

import operator
from collections.abc import Callable

import pytest
import yaml
from conftest import ROOT
from pydantic import ValidationError

from rlfleet.api.rlrun import RLRunSpec
from rlfleet.launch import components, pods

AT = pods.Placement("nats://hub:4222", "hub", "region-a", "rollout-0")


def _document(trainer: dict | None = None, rollout: dict | None = None) -> dict:
    spec = yaml.safe_load((ROOT / "examples" / "rlrun.yaml").read_text())["spec"]
    spec["trainer"] = spec.get("trainer", {}) | (trainer or {})
    spec["rollout"] = spec["rollout"] | (rollout or {})
    return spec


def _spec(trainer: dict | None = None, rollout: dict | None = None) -> RLRunSpec:
    return RLRunSpec.model_validate(_document(trainer, rollout))


# (part of the spec, field, a value other than its default, component, where it lands)
RECIPE: list[tuple[str, str, object, components.Component, Callable]] = [
    ("trainer", "learningRate", 3e-4, components.TRAINER, operator.attrgetter("learning_rate")),
    (
        "trainer",
        "learningRateWarmupSteps",
        25,
        components.TRAINER,
        operator.attrgetter("learning_rate_warmup_steps"),
    ),
    (
        "trainer",
        "learningRateDecaySteps",
        1000,
        components.TRAINER,
        operator.attrgetter("learning_rate_decay_steps"),
    ),
    (
        "trainer",
        "learningRateFloor",
        0.5,
        components.TRAINER,
        operator.attrgetter("learning_rate_floor"),
    ),
    ("trainer", "stepTokens", 1000, components.TRAINER, operator.attrgetter("step_tokens")),
    ("trainer", "stepGroups", 4, components.TRAINER, operator.attrgetter("step_groups")),
    ("trainer", "stepGroups", 4, components.FEED, operator.attrgetter("groups_per_step")),
    ("trainer", "updatesPerStep", 2, components.TRAINER, operator.attrgetter("updates_per_step")),
    ("trainer", "clipLow", 0.1, components.TRAINER, operator.attrgetter("clip_low")),
    ("trainer", "clipHigh", 0.4, components.TRAINER, operator.attrgetter("clip_high")),
    (
        "trainer",
        "importanceWeightCap",
        5.0,
        components.TRAINER,
        operator.attrgetter("importance_weight_cap"),
    ),
    ("rollout", "maxTurns", 3, components.ROLLOUT, operator.attrgetter("session.max_turns")),
    ("rollout", "turnTokens", 64, components.ROLLOUT, operator.attrgetter("session.turn_tokens")),
    (
        "rollout",
        "contextTokens",
        2048,
        components.ROLLOUT,
        operator.attrgetter("session.context_tokens"),
    ),
    (
        "rollout",
        "summaryTokens",
        128,
        components.ROLLOUT,
        operator.attrgetter("session.summary_tokens"),
    ),
]


@pytest.mark.parametrize(
    "part,field,value,component,landed",
    RECIPE,
    ids=[f"{part}.{field}-{component.name}" for part, field, _, component, _ in RECIPE],
)
def test_a_recipe_field_changes_the_settings_a_pod_builds(
    part: str, field: str, value: object, component: components.Component, landed: Callable
) -> None:
    unset = landed(component.for_pod("r", _spec(), AT))
    assert unset != value, f"{value!r} is the default: the case shows nothing"
    spec = _spec(**{part: {field: value}})
    assert landed(component.for_pod("r", spec, AT)) == value


def test_a_step_counted_in_tokens_takes_no_count_of_groups() -> None:
    spec = _spec(trainer={"stepTokens": 1000})
    assert components.TRAINER.for_pod("r", spec, AT).step_groups is None
    # The feed keeps its first guess, which the trainer's step reports correct.
    guess = components.FEED.for_pod("r", _spec(), AT).groups_per_step
    assert components.FEED.for_pod("r", spec, AT).groups_per_step == guess


BAD_RECIPES = {
    "a step in tokens and in groups": (
        _document(trainer={"stepTokens": 4096, "stepGroups": 8}),
        "stepGroups",
    ),
    "an upper clip narrower than the lower": (_document(trainer={"clipLow": 0.3}), "clipHigh"),
    "a lower clip that removes the floor": (_document(trainer={"clipLow": 1.0}), "clipLow"),
    "an importance-weight cap under one": (
        _document(trainer={"importanceWeightCap": 0.5}),
        "importanceWeightCap",
    ),
    "a learning rate of zero": (_document(trainer={"learningRate": 0}), "learningRate"),
    "a window with no room for a turn and its summary": (
        _document(rollout={"turnTokens": 256, "summaryTokens": 256, "contextTokens": 512}),
        "contextTokens",
    ),
}


@pytest.mark.parametrize("case", sorted(BAD_RECIPES))
def test_a_recipe_no_component_could_run_is_refused_naming_the_field(case: str) -> None:
    document, field = BAD_RECIPES[case]
    with pytest.raises(ValidationError, match=field):
        RLRunSpec.model_validate(document)

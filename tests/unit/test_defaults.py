"""One home per default: a spec field's default lives in the API model, and nothing else
(component settings, examples) says it again, or says something else."""

from __future__ import annotations

import types
import typing
from pathlib import Path

import msgspec
import pytest
import yaml
from conftest import ROOT
from pydantic import BaseModel

from rlfleet.api.production import CanarySpec, CycleSpec, FeedbackSpec, GateSpec, ProductionSpec
from rlfleet.api.rlrun import (
    STEP_TOKENS,
    EvaluationGate,
    RLRunSpec,
    RolloutSpec,
    TrainerSpec,
    WeightSyncSpec,
)
from rlfleet.launch import components, pods
from rlfleet.launch.production import (
    CanaryPolicy,
    CollectorConfig,
    GatePolicy,
    ServingConfig,
    SignalRewards,
)
from rlfleet.launch.settings import (
    EvaluatorConfig,
    FeedConfig,
    SessionConfig,
    SyncConfig,
    TrainerConfig,
    WorkerConfig,
)
from rlfleet.models.chat import CHAT_TEMPLATE, chat_text

MIB = 1 << 20
# (API model, its field, settings type, its field, the spec's value as the setting's)
SPEC_FIELDS = [
    (RLRunSpec, "max_staleness", TrainerConfig, "max_staleness", None),
    (RLRunSpec, "max_staleness", FeedConfig, "max_staleness", None),
    (TrainerSpec, "zero_stage", TrainerConfig, "zero_stage", None),
    (TrainerSpec, "batch_invariant", TrainerConfig, "batch_invariant", None),
    (TrainerSpec, "precision", TrainerConfig, "precision", None),
    (TrainerSpec, "router_replay", TrainerConfig, "router_replay", None),
    (TrainerSpec, "kl_coef", TrainerConfig, "kl_coef", None),
    (TrainerSpec, "learning_rate", TrainerConfig, "learning_rate", None),
    (TrainerSpec, "learning_rate_warmup_steps", TrainerConfig, "learning_rate_warmup_steps", None),
    (TrainerSpec, "learning_rate_decay_steps", TrainerConfig, "learning_rate_decay_steps", None),
    (TrainerSpec, "learning_rate_floor", TrainerConfig, "learning_rate_floor", None),
    # Unset (so that stepGroups can be set instead), a step is `STEP_TOKENS` tokens.
    (TrainerSpec, "step_tokens", TrainerConfig, "step_tokens", lambda _: STEP_TOKENS),
    (TrainerSpec, "step_groups", TrainerConfig, "step_groups", None),
    (TrainerSpec, "updates_per_step", TrainerConfig, "updates_per_step", None),
    (TrainerSpec, "clip_low", TrainerConfig, "clip_low", None),
    (TrainerSpec, "clip_high", TrainerConfig, "clip_high", None),
    (TrainerSpec, "importance_weight_cap", TrainerConfig, "importance_weight_cap", None),
    (RolloutSpec, "temperature", TrainerConfig, "temperature", None),
    (RolloutSpec, "temperature", SessionConfig, "temperature", None),
    (RolloutSpec, "group_size", WorkerConfig, "group_size", None),
    (RolloutSpec, "max_turns", SessionConfig, "max_turns", None),
    (RolloutSpec, "turn_tokens", SessionConfig, "turn_tokens", None),
    (RolloutSpec, "context_tokens", SessionConfig, "context_tokens", None),
    (RolloutSpec, "summary_tokens", SessionConfig, "summary_tokens", None),
    (RolloutSpec, "uniform_group_revisit", FeedConfig, "revisit_uniform", None),
    (WeightSyncSpec, "snapshot_interval", SyncConfig, "snapshot_every", None),
    (WeightSyncSpec, "shard_size_mib", SyncConfig, "shard_bytes", lambda mib: mib * MIB),
    (EvaluationGate, "every_versions", EvaluatorConfig, "every_versions", None),
    (ProductionSpec, "temperature", TrainerConfig, "temperature", None),
    (ProductionSpec, "temperature", ServingConfig, "temperature", None),
    (ProductionSpec, "sample_rate", ServingConfig, "sample_rate", None),
    (FeedbackSpec, "window_seconds", ServingConfig, "feedback_window_s", float),
    (FeedbackSpec, "custom_kinds", ServingConfig, "custom_kinds", None),
    (FeedbackSpec, "window_seconds", SignalRewards, "window_s", float),
    (FeedbackSpec, "weights", SignalRewards, "weights", None),
    (FeedbackSpec, "max_per_user", SignalRewards, "max_per_user", None),
    (FeedbackSpec, "max_events_per_response", SignalRewards, "max_events_per_response", None),
    (FeedbackSpec, "max_events_per_response", ServingConfig, "max_events_per_response", None),
    (CycleSpec, "group_size", SignalRewards, "group_size", None),
    (CycleSpec, "interval_seconds", CollectorConfig, "interval_s", float),
    (CycleSpec, "min_samples", CollectorConfig, "min_samples", None),
    (CycleSpec, "max_samples", CollectorConfig, "max_samples", None),
    (GateSpec, "max_regression", GatePolicy, "max_regression", None),
    (GateSpec, "confidence", GatePolicy, "confidence", None),
    (GateSpec, "max_empty_increase", GatePolicy, "max_empty_increase", None),
    (GateSpec, "max_malformed_tool_calls", GatePolicy, "max_malformed_tool_calls", None),
    (GateSpec, "max_held_out_loss", GatePolicy, "max_held_out_loss", None),
    (CanarySpec, "detectable_drop", CanaryPolicy, "detectable_drop", None),
    (CanarySpec, "false_rollback_rate", CanaryPolicy, "false_rollback_rate", None),
    (CanarySpec, "miss_rate", CanaryPolicy, "miss_rate", None),
    (CanarySpec, "window_seconds", CanaryPolicy, "window_s", float),
    (CanarySpec, "min_samples", CanaryPolicy, "min_samples", None),
]


def _setting_default(kind: type[msgspec.Struct], name: str) -> object:
    field = next(f for f in msgspec.structs.fields(kind) if f.name == name)
    return field.default_factory() if field.default is msgspec.NODEFAULT else field.default


@pytest.mark.parametrize(
    "model,field,kind,setting,as_setting",
    SPEC_FIELDS,
    ids=[f"{m.__name__}.{f}-{k.__name__}.{s}" for m, f, k, s, _ in SPEC_FIELDS],
)
def test_component_settings_default_to_the_api_models_default(
    model: type[BaseModel], field: str, kind: type[msgspec.Struct], setting: str, as_setting
) -> None:
    api = model.model_fields[field].get_default(call_default_factory=True)
    expected = as_setting(api) if as_setting else api
    assert _setting_default(kind, setting) == expected, (
        f"{kind.__name__}.{setting} defaults to {_setting_default(kind, setting)!r}, but "
        f"{model.__name__}.{field} to {api!r}: take the API model's (`spec_default`)"
    )


def test_a_spec_that_says_nothing_gives_each_component_its_default_settings() -> None:
    bare = RLRunSpec.model_validate(
        {
            "model": {"uri": "file:///m"},
            "rollout": {"regions": [{"name": "a", "maxGpus": 1}]},
            "evaluation": {"suite": "toy"},
        }
    )
    production = RLRunSpec.model_validate(
        {
            "model": {"uri": "file:///m"},
            "production": {"pool": {"region": "a", "name": "chat"}},
            "evaluation": {"suite": "toy"},
        }
    )
    at = pods.Placement("nats://hub:4222")
    runs = [(bare, c) for c in components.components_of(bare)] + [
        (production, c) for c in components.components_of(production) if c != components.TRAINER
    ]
    for spec, component in runs:
        built = component.for_pod("r", spec, at)
        for _, _, kind, setting, _ in SPEC_FIELDS:
            for struct in (
                built,
                getattr(built, "weightsync", None),
                getattr(built, "session", None),
                getattr(built, "rewards", None),
                getattr(built, "gate", None),
                getattr(built, "canary", None),
            ):
                if isinstance(struct, kind):
                    assert getattr(struct, setting) == _setting_default(kind, setting), (
                        f"{component.name}: {kind.__name__}.{setting}"
                    )


def _model_of(annotation: object) -> type[BaseModel] | None:
    """The API model a field holds (itself, optional, or a list of it), if any."""
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return annotation
    if typing.get_origin(annotation) in (types.UnionType, typing.Union, list):
        return next(filter(None, map(_model_of, typing.get_args(annotation))), None)
    return None


def restated(model: type[BaseModel], document: object, path: str) -> list[str]:
    """Where a document sets a field to the default the API model gives it anyway."""
    if isinstance(document, list):
        return [f for i, item in enumerate(document) for f in restated(model, item, f"{path}[{i}]")]
    found = []
    fields = {info.alias or name: info for name, info in model.model_fields.items()}
    for key, value in document.items():
        info = fields[key]
        inner = _model_of(info.annotation)
        if inner is not None and isinstance(value, dict | list):
            found += restated(inner, value, f"{path}.{key}")
        elif not info.is_required() and value == info.get_default(call_default_factory=True):
            found.append(f"{path}.{key}: {value!r}")
    return found


@pytest.mark.parametrize("example", ["rlrun.yaml", "local.yaml"])
def test_examples_do_not_restate_the_api_models_defaults(example: str) -> None:
    document = yaml.safe_load((ROOT / "examples" / example).read_text())
    assert restated(RLRunSpec, document["spec"], "spec") == []


def test_prompts_are_written_in_the_tokenizers_chat_format() -> None:
    jinja2 = pytest.importorskip("jinja2")
    turns = [("system", "rules"), ("user", "2+2?"), ("user", "exit code 0")]
    messages = [{"role": role, "content": content} for role, content in turns]
    rendered = jinja2.Template(CHAT_TEMPLATE).render(messages=messages, add_generation_prompt=True)
    assert rendered == chat_text(turns)


def test_the_trainers_objective_takes_the_specs_knobs_by_their_names_and_defaults() -> None:
    """Each of the objective's knobs is a `spec.trainer` field of the same name, given by
    the settings, with no default of its own."""
    import dataclasses

    from rlfleet.trainer.objective import ObjectiveConfig  # torch: only this test needs it

    settings = TrainerConfig(run="r", nats_url="", model=Path(), checkpoint_dir=Path())
    objective = ObjectiveConfig.of(settings)
    for knob in dataclasses.fields(ObjectiveConfig):
        assert knob.default is dataclasses.MISSING, f"ObjectiveConfig.{knob.name} has a default"
        api = TrainerSpec.model_fields[knob.name].get_default(call_default_factory=True)
        assert getattr(objective, knob.name) == api, knob.name

"""`rlfleet plan RLRUN.yaml --profile FILE`: what a run will do with the GPUs it asks for,
and the split of the same GPUs between training and rollouts that makes the most steps.

Predictions come from `rlfleet.pipeline`'s model of the pipeline, played at the costs a
profile states (`bench/plan.py` measures one and checks the model against measured runs).
Seed 001's rule of thumb, a third of the GPUs sampling and two thirds training, is shown
beside the best split for comparison.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import msgspec
import pydantic
import yaml

from rlfleet import launch
from rlfleet.api.profile import Profile, decode_profile
from rlfleet.api.rlrun import RLRunSpec
from rlfleet.pipeline.model import Prediction
from rlfleet.pipeline.sizing import Split, best_split, predict, spec_split, third_rule_split


class PlanError(Exception):
    pass


def _spec(path: Path) -> RLRunSpec:
    try:
        document = yaml.safe_load(path.read_text())
    except (OSError, yaml.YAMLError) as error:
        raise PlanError(f"{path}: {error}") from error
    if not isinstance(document, dict) or document.get("kind") != "RLRun":
        raise PlanError(f"{path}: not an RLRun document")
    try:
        spec = RLRunSpec.model_validate(document.get("spec"))
    except pydantic.ValidationError as error:
        raise PlanError(f"{path}: {error}") from error
    if spec.rollout is None:
        raise PlanError(f"{path}: spec.rollout: a production run has no task rollouts to plan")
    return spec


def _profile(path: Path) -> Profile:
    try:
        return decode_profile(path.read_bytes())
    except (OSError, msgspec.DecodeError) as error:  # ValidationError included
        raise PlanError(f"{path}: {error}") from error


def figures(split: Split, prediction: Prediction, profile: Profile) -> dict:
    """What one split does, per hour of the pipeline's steady running."""
    hours = prediction.seconds / 3600
    versions_per_hour = prediction.versions / hours
    generated = max(1, prediction.groups_generated)
    return {
        "trainer_gpus": split.trainer_gpus,
        "rollout_gpus": split.rollout_gpus,
        "trainer_share": round(split.trainer_share, 3),
        "steps_per_hour": round(prediction.steps_per_hour, 1),
        "trainer_idle_fraction": round(prediction.idle_fraction, 3),
        "staleness_mean": round(prediction.staleness_mean, 3),
        "staleness_max": prediction.staleness_max,
        "dropped_stale_fraction": round(prediction.dropped_stale / generated, 4),
        "rollout_utilisation": round(prediction.rollout_utilisation, 3),
        "wan_bytes_per_hour": {
            region: int(versions_per_hour * profile.weights.bytes_per_version)
            for region, gpus in split.rollout_gpus.items()
            if gpus
        },
        "gpu_hours_per_hour": {"trainer": split.trainer_gpus, **split.rollout_gpus},
    }


def plan(spec: RLRunSpec, profile: Profile, gpus: int | None) -> dict:
    depth = launch.feed_settings("planned", spec, launch.Placement("nats://planned")).depth
    written = spec_split(spec)
    total = gpus if gpus is not None else written.total
    result: dict = {"as_written": figures(written, predict(spec, profile, written, depth), profile)}
    best = best_split(spec, profile, total, depth)
    if best is not None:
        result["best"] = figures(*best, profile)
    third = third_rule_split(spec, profile, total)
    if third is not None:
        result["one_third_rule"] = figures(third, predict(spec, profile, third, depth), profile)
    return result


TITLES = {"as_written": "as written", "best": "best split", "one_third_rule": "one-third rule"}
ROWS = (
    ("trainer GPUs", "trainer_gpus"),
    ("rollout GPUs", "rollout_gpus"),
    ("steps per hour", "steps_per_hour"),
    ("trainer idle", "trainer_idle_fraction"),
    ("staleness mean", "staleness_mean"),
    ("staleness max", "staleness_max"),
    ("dropped stale", "dropped_stale_fraction"),
    ("rollouts at work", "rollout_utilisation"),
    ("WAN GB per hour", "wan_bytes_per_hour"),
)


def _show(result: dict) -> None:
    """One column per split; a per-region figure gets its total, then a row per region."""
    columns = list(result)
    print(f"{'':18}" + "".join(f"{TITLES[c]:>16}" for c in columns))
    for label, key in ROWS:
        values = [result[c][key] for c in columns]
        if not isinstance(values[0], dict):
            print(f"{label:18}" + "".join(f"{v!s:>16}" for v in values))
            continue
        scale = 1e-9 if key == "wan_bytes_per_hour" else 1
        print(f"{label:18}" + "".join(f"{sum(v.values()) * scale:>16.4g}" for v in values))
        for region in values[0]:
            cells = (v.get(region, 0) * scale for v in values)
            print(f"{'  ' + region:18}" + "".join(f"{c:>16.4g}" for c in cells))


def _plan(args: argparse.Namespace) -> int:
    try:
        result = plan(_spec(args.file), _profile(args.profile), args.gpus)
    except (PlanError, ValueError) as error:
        print(f"rlfleet plan: {error}", file=sys.stderr)
        return 1
    if args.json:
        print(json.dumps(result))
    else:
        _show(result)
    return 0


def register(groups: argparse._SubParsersAction) -> None:
    command = groups.add_parser(
        "plan", help="predict a run's steps, idle time and staleness; the best GPU split"
    )
    command.add_argument("file", type=Path, help="an RLRun YAML document")
    command.add_argument(
        "--profile", type=Path, required=True, help="a cost profile (bench/plan.py writes one)"
    )
    command.add_argument(
        "--gpus", type=int, default=None, help="GPUs to split (default: what the spec asks)"
    )
    command.add_argument("--json", action="store_true", help="one JSON object, for tools")
    command.set_defaults(handler=_plan)

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

from rlfleet.api.inferencepool import InferencePoolSpec
from rlfleet.api.profile import Profile, decode_profile
from rlfleet.api.rlrun import RLRunSpec
from rlfleet.api.traffic import decode_traffic
from rlfleet.launch import from_spec, pods
from rlfleet.local.run import InvalidRun, read_rlrun
from rlfleet.pipeline.day import Pool, plan_day
from rlfleet.pipeline.model import Feed, Prediction
from rlfleet.pipeline.sizing import Split, best_split, predict, spec_split, third_rule_split


class PlanError(Exception):
    pass


def _spec(path: Path) -> RLRunSpec:
    try:
        _, spec = read_rlrun(path)
    except InvalidRun as error:
        raise PlanError(str(error)) from error
    if spec.rollout is None:
        raise PlanError(f"{path}: spec.rollout: a production run has no task rollouts to plan")
    return spec


def _profile(path: Path) -> Profile:
    try:
        return decode_profile(path.read_bytes())
    except (OSError, msgspec.DecodeError) as error:  # ValidationError included
        raise PlanError(f"{path}: {error}") from error


def _pools(path: Path) -> list[Pool]:
    """The traffic file's pools, each with its InferencePool manifest read and checked."""
    try:
        traffic = decode_traffic(path.read_bytes())
    except (OSError, msgspec.DecodeError) as error:
        raise PlanError(f"{path}: {error}") from error
    pools = []
    for index, entry in enumerate(traffic.pools):
        manifest = path.parent / entry.pool
        where = f"{path}: pools[{index}].pool {entry.pool}"
        try:
            document = yaml.safe_load(manifest.read_text())
            if not isinstance(document, dict) or document.get("kind") != "InferencePool":
                raise PlanError(f"{where}: not an InferencePool document")
            spec = InferencePoolSpec.model_validate(document.get("spec"))
        except (OSError, yaml.YAMLError, pydantic.ValidationError) as error:
            raise PlanError(f"{where}: {error}") from error
        name = (document.get("metadata") or {}).get("name")
        if not isinstance(name, str) or not name:
            raise PlanError(f"{where}: metadata.name is missing")
        pools.append(Pool(name, entry.region, spec, tuple(entry.hourly_load)))
    return pools


def figures(split: Split, prediction: Prediction, profile: Profile) -> dict:
    """What one split does, per hour of the pipeline's steady running."""
    hours = prediction.seconds / 3600
    versions_per_hour = prediction.steps / hours  # a version a step
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


def _feed(spec: RLRunSpec) -> Feed:
    """The feed as its pod runs for this spec."""
    settings = from_spec.feed_settings("planned", spec, pods.Placement("nats://planned"))
    return Feed(settings.depth, settings.poll_s)


def day(spec: RLRunSpec, profile: Profile, pools: list[Pool]) -> dict:
    """Hour by hour: what the pools lend, the steps the run makes of it, and what the best
    split and the one-third rule would make of the same GPUs (the rollout share placed
    where GPUs are lent that hour)."""
    feed, hours = _feed(spec), []
    for hour in plan_day(spec, profile, pools, feed):
        split, prediction = hour.split, hour.prediction
        where = {r: n for r, n in split.rollout_gpus.items() if n}
        best = best_split(spec, profile, split.total, feed, where) if where else None
        third = third_rule_split(spec, profile, split.total, where) if where else None
        hours.append(
            {
                "hour": hour.hour,
                "trainer_gpus": split.trainer_gpus,
                "rollout_gpus": split.rollout_gpus,
                "steps_per_hour": round(prediction.steps_per_hour, 1) if prediction else 0.0,
                "staleness_mean": round(prediction.staleness_mean, 3) if prediction else None,
                "best_trainer_gpus": best[0].trainer_gpus if best else None,
                "best_steps_per_hour": round(best[1].steps_per_hour, 1) if best else 0.0,
                "one_third_rule_steps_per_hour": (
                    round(predict(spec, profile, third, feed).steps_per_hour, 1) if third else 0.0
                ),
            }
        )
    gpu_hours = {"trainer": sum(h["trainer_gpus"] for h in hours)}
    for demand in spec.rollout_regions:
        gpu_hours[demand.name] = sum(h["rollout_gpus"].get(demand.name, 0) for h in hours)
    return {
        "hours": hours,
        "steps": round(sum(h["steps_per_hour"] for h in hours)),
        "best_steps": round(sum(h["best_steps_per_hour"] for h in hours)),
        "one_third_rule_steps": round(sum(h["one_third_rule_steps_per_hour"] for h in hours)),
        "gpu_hours": gpu_hours,
    }


def plan(spec: RLRunSpec, profile: Profile, gpus: int | None) -> dict:
    feed = _feed(spec)
    written = spec_split(spec)
    total = gpus if gpus is not None else written.total
    result: dict = {"as_written": figures(written, predict(spec, profile, written, feed), profile)}
    best = best_split(spec, profile, total, feed)
    if best is not None:
        result["best"] = figures(*best, profile)
    third = third_rule_split(spec, profile, total)
    if third is not None:
        result["one_third_rule"] = figures(third, predict(spec, profile, third, feed), profile)
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


def _show_day(planned: dict) -> None:
    regions = list(planned["gpu_hours"])[1:]
    head = ["hour (UTC)", *regions, "steps/h", "best", "trainer", "1/3 rule"]
    print("\n" + "".join(f"{h:>11}" for h in head))
    for hour in planned["hours"]:
        cells = [
            hour["hour"],
            *(hour["rollout_gpus"].get(r, 0) for r in regions),
            hour["steps_per_hour"],
            hour["best_steps_per_hour"],
            hour["best_trainer_gpus"] or "-",
            hour["one_third_rule_steps_per_hour"],
        ]
        print("".join(f"{c!s:>11}" for c in cells))
    print(
        f"steps in the day: {planned['steps']} as written, {planned['best_steps']} with "
        f"each hour's best split, {planned['one_third_rule_steps']} by the one-third rule; "
        "GPU-hours: " + ", ".join(f"{k} {v}" for k, v in planned["gpu_hours"].items())
    )


def _plot(planned: dict, path: Path) -> None:
    """GPUs by kind and region over the day, stacked, and the predicted steps per hour."""
    import matplotlib  # the local dependency set's: only for a plot

    matplotlib.use("Agg")
    from matplotlib import pyplot

    hours = [h["hour"] for h in planned["hours"]]
    layers = {"trainer": [h["trainer_gpus"] for h in planned["hours"]]}
    for region in list(planned["gpu_hours"])[1:]:
        layers[region] = [h["rollout_gpus"].get(region, 0) for h in planned["hours"]]
    figure, gpus = pyplot.subplots(figsize=(9, 4.5))
    gpus.stackplot(hours, *layers.values(), labels=list(layers), step="post", alpha=0.6)
    gpus.set_xlabel("hour of the day (UTC)")
    gpus.set_ylabel("GPUs")
    gpus.legend(loc="upper left")
    steps = gpus.twinx()
    for key, style, label in (
        ("steps_per_hour", "k-", "steps/hour as lent (predicted)"),
        ("best_steps_per_hour", "b:", "steps/hour, best split"),
        ("one_third_rule_steps_per_hour", "k--", "steps/hour, one-third rule"),
    ):
        values = [h[key] for h in planned["hours"]]
        steps.step(hours, values, style, where="post", label=label)
    steps.set_ylabel("steps per hour")
    steps.set_ylim(bottom=0)
    steps.legend(loc="upper right")
    figure.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    figure.savefig(path, dpi=110)


def _plan(args: argparse.Namespace) -> int:
    try:
        spec, profile = _spec(args.file), _profile(args.profile)
        result = plan(spec, profile, args.gpus)
        if args.traffic is not None:
            result["day"] = day(spec, profile, _pools(args.traffic))
    except (PlanError, ValueError) as error:
        print(f"rlfleet plan: {error}", file=sys.stderr)
        return 1
    if args.json:
        print(json.dumps(result))
    else:
        _show({k: v for k, v in result.items() if k != "day"})
        if "day" in result:
            _show_day(result["day"])
    if args.plot is not None:
        if "day" not in result:
            print("rlfleet plan: --plot draws the day: give --traffic", file=sys.stderr)
            return 1
        _plot(result["day"], args.plot)
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
    command.add_argument(
        "--traffic",
        type=Path,
        default=None,
        help="a day of the regions' InferencePool traffic: plan each hour of it",
    )
    command.add_argument("--plot", type=Path, default=None, help="the day's GPUs and steps, PNG")
    command.add_argument("--json", action="store_true", help="one JSON object, for tools")
    command.set_defaults(handler=_plan)

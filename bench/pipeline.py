"""Pipeline benchmark: asynchronous RL against its synchronous baseline, same budget.

`examples/local.yaml` is trained twice from one warmed-up model, for the same wall-clock
budget each (counted from the first step): once with `maxStaleness: 0` (the trainer only
trains on rollouts of its current version, so generation and training take turns) and
once as written (rollouts run ahead while the trainer trains). The trainer and the
rollout workers sit on disjoint cores in both, so the comparison measures overlap.

Reward is compared smoothed (`report.rolling_reward`). Idle fraction is
the trainer's time waiting for trajectories (`StepReport.wait_seconds`) over its time
from its first step to its last. Prints one JSON object; `--minutes` sets the budget.
`--quick` runs both for a few seconds each on 16 of the suite's tasks, from a model
barely warmed up, to check the script.
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
from pathlib import Path

from rlfleet.api.rlrun import RLRunSpec
from rlfleet.api.wire import StepReport
from rlfleet.launch.caches import own_temporary_caches
from rlfleet.local import plan, report
from rlfleet.local.run import load, make_model, train
from rlfleet.rollout.environment.tasks import suite_path

EXAMPLE = Path(__file__).parent.parent / "examples" / "local.yaml"
# --quick's defaults; the plot apart from a full run's.
QUICK = {
    "minutes": 0.1,
    "warmup_steps": 2,
    "tasks": 16,  # the whole suite's evaluation after each run takes half a minute
    "plot": Path(".rlfleet/bench/pipeline-quick.png"),
}


def first_tasks(spec: RLRunSpec, tasks: int, folder: Path) -> RLRunSpec:
    """`spec` on its suite's first `tasks` tasks alone (rolled out and evaluated), written
    into `folder`."""
    path = folder / f"{Path(spec.suite).stem}-{tasks}.jsonl"
    lines = suite_path(spec.suite).read_text().split("\n")  # JSON may hold U+2028: not lines
    path.write_text("\n".join(lines[:tasks]) + "\n")
    rollout = spec.rollout.model_copy(update={"task_suite": str(path)})
    return spec.model_copy(update={"rollout": rollout})


def idle_fraction(reports: list[StepReport]) -> float:
    """Waiting time over the span between the first and the last step's end."""
    span = reports[-1].finished_at - reports[0].finished_at
    return sum(r.wait_seconds for r in reports[1:]) / span if span > 0 else 0.0


def measure(name: str, reports: list[StepReport]) -> dict:
    curve = report.reward_curve(reports)
    return {
        f"{name}_steps": len(reports),
        f"{name}_seconds": round(curve[-1][0], 1),
        f"{name}_reward_start": round(curve[0][1], 4),
        f"{name}_final_reward": round(curve[-1][1], 4),
        f"{name}_idle_fraction": round(idle_fraction(reports), 4),
        f"{name}_staleness_mean": round(statistics.fmean(r.staleness_mean for r in reports), 3),
        f"{name}_dropped_stale": reports[-1].dropped_stale_total,
    }


def main() -> None:
    own_temporary_caches("rlfleet-bench-pipeline-caches-")  # this invocation's, removed after
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--minutes", type=float, default=4.0, help="training budget per run")
    parser.add_argument("--warmup-steps", type=int, default=plan.Tuning.warmup_steps)
    parser.add_argument(
        "--updates-per-step",
        type=int,
        default=None,
        help="optimiser passes per batch: more work for the trainer per rollout (default: "
        "the example's trainer.updatesPerStep)",
    )
    parser.add_argument("--tasks", type=int, help="the suite's first N alone (default: all)")
    parser.add_argument(
        "--plot", type=Path, default=Path(".rlfleet/bench/pipeline.png"), help="reward vs time"
    )
    parser.add_argument("--quick", action="store_true", help="smallest sizes: check the script")
    if parser.parse_known_args()[0].quick:
        parser.set_defaults(**QUICK)
    args = parser.parse_args()
    name, spec = load(EXAMPLE)
    if args.updates_per_step is not None:
        trainer = spec.trainer.model_copy(update={"updates_per_step": args.updates_per_step})
        spec = spec.model_copy(update={"trainer": trainer})
    with tempfile.TemporaryDirectory(prefix="rlfleet-pipeline-") as tmp:
        if args.tasks:
            spec = first_tasks(spec, args.tasks, Path(tmp))
        shared = plan.Layout(Path(tmp) / "shared")
        make_model(spec, shared, args.warmup_steps)
        model = spec.model.model_copy(update={"uri": f"file://{shared.model}"})
        runs, evaluations = {}, {}
        for mode, staleness in (("sync", 0), ("async", spec.max_staleness)):
            moded = spec.model_copy(update={"model": model, "max_staleness": staleness})
            layout = plan.Layout(Path(tmp) / mode)
            trained = train(name, moded, layout, args.minutes * 60, plan.Tuning())
            runs[mode], evaluations[mode] = trained.steps, trained.end
    result = {
        "budget_seconds": args.minutes * 60,
        "async_max_staleness": spec.max_staleness,
        "updates_per_step": spec.trainer.updates_per_step,
    }
    for mode, reports in runs.items():
        result |= measure(mode, reports)
        # The last version on the whole suite: the batch reward is over the tasks the
        # feed's curriculum chose.
        result[f"{mode}_evaluated_reward"] = (evaluations[mode] or {}).get("reward")
    target = result["sync_final_reward"]
    # Only once the smoothing window is full: the first few steps alone are too noisy to
    # count as reaching anything.
    curve = report.reward_curve(runs["async"])[report.SMOOTHING_STEPS - 1 :]
    reached = next((t for t, r in curve if r >= target), None)
    # And the time from which it never fell below again, for a curve that only brushes it.
    held = next(
        (t for i, (t, _) in enumerate(curve) if min(r for _, r in curve[i:]) >= target), None
    )
    for key, seconds in (("reward", reached), ("reward_held", held)):
        result[f"async_seconds_to_sync_{key}"] = None if seconds is None else round(seconds, 1)
    result["async_time_ratio"] = (
        None if reached is None else round(reached / result["sync_seconds"], 3)
    )
    result["idle_ratio"] = round(
        result["async_idle_fraction"] / max(result["sync_idle_fraction"], 1e-9), 3
    )
    report.compare(runs, args.plot)
    print(json.dumps(result))


if __name__ == "__main__":
    main()

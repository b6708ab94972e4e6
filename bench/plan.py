"""Planner benchmark: `rlfleet plan`'s model of the pipeline against runs it did not see.

On this machine, from one warmed-up model of `examples/local.yaml`:

1. two profiling runs (`--profile-minutes` each: one with `maxStaleness` raised so the
   rollouts run ahead, one synchronous) measure the per-unit costs
   (`rlfleet.local.profiling`): the trainer's seconds per token and per step, publishing,
   tokens per attempt, the rollout core's tokens per second, how soon an engine notices
   a version (busy and idle) and its load. They are written as a profile file
   (`.rlfleet/bench/profile.json`, what `rlfleet plan --profile` reads);
2. the pipeline benchmark's two runs, synchronous (`maxStaleness: 0`) and asynchronous
   (as written), each `--minutes` long from its first step, are predicted from that
   profile alone (`rlfleet.local.plan.local_pipeline`), then run and measured.

Prints one JSON object: per run, predicted and measured steps, idle fraction and mean
staleness; `steps_error` (relative), `idle_fraction_error` and `staleness_mean_error`
(absolute: the synchronous run's staleness is 0) are the worst over the two runs. Target:
`steps_error` at most 0.2. `--quick` profiles and runs for a few seconds each on 16 of the
suite's tasks, to check the script (its profile apart from a full run's).
"""

from __future__ import annotations

import argparse
import json
import tempfile
from pathlib import Path

from pipeline import first_tasks, idle_fraction

from rlfleet.api.profile import encode_profile
from rlfleet.launch.caches import own_temporary_caches
from rlfleet.local import plan
from rlfleet.local.profiling import Profiled, measure
from rlfleet.local.run import load, make_model, train
from rlfleet.pipeline.model import simulate

EXAMPLE = Path(__file__).parent.parent / "examples" / "local.yaml"
PROFILE_STALENESS = 16  # far enough ahead that no rollout waits for a version
QUICK = {  # --quick's defaults
    "minutes": 0.1,
    "profile_minutes": 0.5,  # the rollouts' start-up backlog drained: the trainer waits
    "warmup_steps": 2,
    "tasks": 16,
    "out": Path(".rlfleet/bench/profile-quick.json"),
}


def main() -> None:
    own_temporary_caches("rlfleet-bench-plan-caches-")
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--minutes", type=float, default=3.0, help="each measured run")
    parser.add_argument("--profile-minutes", type=float, default=1.0, help="each profiling run")
    parser.add_argument("--warmup-steps", type=int, default=plan.Tuning.warmup_steps)
    parser.add_argument("--tasks", type=int, help="the suite's first N alone (default: all)")
    parser.add_argument("--out", type=Path, default=Path(".rlfleet/bench/profile.json"))
    parser.add_argument("--quick", action="store_true", help="smallest sizes: check the script")
    if parser.parse_known_args()[0].quick:
        parser.set_defaults(**QUICK)
    args = parser.parse_args()
    name, spec = load(EXAMPLE)
    tuning = plan.Tuning()
    result: dict = {"bench": "plan", "budget_seconds": args.minutes * 60}
    with tempfile.TemporaryDirectory(prefix="rlfleet-plan-") as tmp:
        if args.tasks:
            spec = first_tasks(spec, args.tasks, Path(tmp))
        shared = plan.Layout(Path(tmp) / "shared")
        make_model(spec, shared, args.warmup_steps)
        model = spec.model.model_copy(update={"uri": f"file://{shared.model}"})
        spec = spec.model_copy(update={"model": model})

        profiled = {}
        for mode, staleness in (("ahead", PROFILE_STALENESS), ("synchronous", 0)):
            layout = plan.Layout(Path(tmp) / f"profile-{mode}")
            moded = spec.model_copy(update={"max_staleness": staleness})
            steps = train(name, moded, layout, args.profile_minutes * 60, tuning).steps
            profiled[mode] = Profiled(steps, layout.logs)
        profile = measure(spec, profiled["ahead"], profiled["synchronous"], tuning)
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_bytes(encode_profile(profile))

        for mode, staleness in (("sync", 0), ("async", spec.max_staleness)):
            moded = spec.model_copy(update={"max_staleness": staleness})
            pipeline = plan.local_pipeline(moded, profile, tuning)
            layout = plan.Layout(Path(tmp) / mode)
            steps = train(name, moded, layout, args.minutes * 60, tuning).steps
            span = steps[-1].finished_at - steps[0].finished_at
            # The run's budget counts from its first step, the model's from its start: play
            # long enough, and count the steps within the run's span of the first.
            predicted = simulate(pipeline, 2 * span + 60)
            result[mode] = {
                "predicted_steps": predicted.steps_within(span),
                "measured_steps": len(steps),
                "predicted_idle_fraction": round(predicted.idle_fraction, 4),
                "measured_idle_fraction": round(idle_fraction(steps), 4),
                "predicted_staleness_mean": round(predicted.staleness_mean, 3),
                "measured_staleness_mean": round(
                    sum(r.staleness_mean for r in steps) / len(steps), 3
                ),
            }
    runs = [result["sync"], result["async"]]
    result["steps_error"] = max(
        abs(r["predicted_steps"] - r["measured_steps"]) / r["measured_steps"] for r in runs
    )
    for key in ("idle_fraction", "staleness_mean"):
        result[f"{key}_error"] = max(
            abs(r[f"predicted_{key}"] - r[f"measured_{key}"]) for r in runs
        )
    result["profile"] = str(args.out)
    print(json.dumps(result))


if __name__ == "__main__":
    main()

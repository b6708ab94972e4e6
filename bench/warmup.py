"""Benchmark: where the supervised warm-up leaves the tiny MoE for RL, in about 4 minutes.

The same fresh model is warmed up on the rules suite for several step counts (`--steps`;
by default fewer, `rlfleet run`'s and more). Each is then evaluated as a run's report
evaluates it (`rlfleet.rollout.evaluation.suite`: 8 attempts per task at temperature 1, graded
by exact answer). `reward` is where RL starts; `pass_at_8` the share of tasks some
attempt gets right. RL on a tiny model mostly turns "sometimes right"
into "right", so `headroom` (their difference) bounds what a ten-minute run gains, and
`mixed_groups` (groups whose attempts disagree) is what GRPO learns from. A quick way to
try warm-up settings before a ten-minute `make demo`. Prints one JSON object. `--quick`
warms up for two steps and evaluates the suite's first eight tasks, to check the script.
"""

from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

from rlfleet.api.wire import Task
from rlfleet.launch.caches import own_temporary_caches
from rlfleet.local import plan
from rlfleet.models.tiny import init_model
from rlfleet.rollout.environment.tasks import load_suite, suite_path
from rlfleet.rollout.evaluation.suite import evaluate

QUICK = {"steps": [2], "tasks": 8}  # --quick's defaults


def sampled(directory: Path, tasks: list[Task]) -> dict[str, float]:
    found = evaluate(directory, tasks)
    return {
        "reward": found.reward,
        "pass_at_8": found.pass_at_k,
        "headroom": round(found.pass_at_k - found.reward, 4),
        "mixed_groups": found.mixed_groups,
    }


def main() -> None:
    own_temporary_caches("rlfleet-bench-warmup-caches-")  # this invocation's, removed after
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--suite", default="rules")
    default = plan.Tuning.warmup_steps
    parser.add_argument("--steps", type=int, nargs="+", default=[160, default, 280])
    parser.add_argument("--tasks", type=int, help="evaluate the suite's first N (default: all)")
    parser.add_argument("--quick", action="store_true", help="smallest sizes: check the script")
    if parser.parse_known_args()[0].quick:
        parser.set_defaults(**QUICK)
    args = parser.parse_args()
    tasks = load_suite(suite_path(args.suite))[: args.tasks]
    result: dict = {"suite": args.suite, "default_steps": default}
    with tempfile.TemporaryDirectory(prefix="rlfleet-bench-warmup-") as tmp:
        fresh = init_model("tiny-moe", Path(tmp) / "fresh")
        for steps in args.steps:
            model = Path(tmp) / str(steps)
            shutil.copytree(fresh, model)
            subprocess.run(
                [
                    *(
                        sys.executable,
                        "-m",
                        "rlfleet.rollout.environment.warmup",
                        str(model),
                        args.suite,
                    ),
                    *("--steps", str(steps)),
                ],
                check=True,
                stdout=subprocess.DEVNULL,
            )
            result[f"steps_{steps}"] = sampled(model, tasks)
    print(json.dumps(result))


if __name__ == "__main__":
    main()

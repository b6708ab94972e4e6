"""Benchmark: the chaos run. `examples/local.yaml` (with an evaluation gate that never
ends it) under the bed's operators, training for real, while a seeded schedule kills and
restarts its parts at random moments (every `FaultKind`, one every 30 s on average, each
kind in turn); then an audit from durable state of what was lost or done twice.
Prints one JSON object.

`python bench/faults.py [--minutes 30] [--seed 1]`. The keys: `faults_injected` (by kind),
`runs_completed`, `tasks_lost`, `trajectories_lost`, `trajectories_trained_twice`,
`versions_missing`, `floor_violations`, `pods_left`, `crashes` (processes that died with
no fault to kill them), `recovery_seconds` (per kind, p50 and p99 of the seconds from a
fault to the trainer's next step) and the whole `audit`. Bad input and permissions have
their figures from their tests (`tests/unit/test_bad_input.py`, `tests/bed/test_bed_nats.py`).
The run's logs stay in `.rlfleet/bench/faults/`. It exits 1 when any of `LOSSES` is not 0.
`--quick` injects a few faults in half a minute, to check the script (its logs apart).
The short check, two minutes on an already started plane, is the last test of
`tests/bed/test_operator_local.py`.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import logging
import os
import shutil
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path

import yaml

from rlfleet.launch.caches import own_temporary_caches
from rlfleet.testbed.bed import Bed
from rlfleet.testbed.chaos import run_with_faults

ROOT = Path(__file__).resolve().parent.parent
RUN_ROOT = ROOT / ".rlfleet" / "bench" / "faults"
MEAN_GAP_S = 30.0
# What must all be 0; any other is the run's exit status 1.
LOSSES = (
    "tasks_lost",
    "trajectories_lost",
    "trajectories_trained_twice",
    "versions_missing",
    "floor_violations",
    "pods_left",
    "crashes",
)
EVALUATE_EVERY = 100  # versions: the demo makes about 25 a minute here
# --quick's defaults: about three faults, kept apart from a full run's logs.
QUICK = {"minutes": 0.5, "mean_gap": 10.0, "logs": RUN_ROOT.with_name("faults-quick")}


@contextlib.contextmanager
def progress_to_stderr() -> Iterator[None]:
    """Everything written to stdout meanwhile, by subprocesses too, goes to stderr."""
    sys.stdout.flush()
    saved = os.dup(1)
    os.dup2(2, 1)
    try:
        yield
    finally:
        sys.stdout.flush()
        os.dup2(saved, 1)
        os.close(saved)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--minutes", type=float, default=30.0, help="of faults, after step 1")
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--mean-gap", type=float, default=MEAN_GAP_S, help="seconds a fault")
    parser.add_argument("--logs", type=Path, default=RUN_ROOT, help="the run's, kept")
    parser.add_argument("--quick", action="store_true", help="smallest sizes: check the script")
    if parser.parse_known_args()[0].quick:
        parser.set_defaults(**QUICK)
    args = parser.parse_args()
    # Each fault injected and each process started again, on stderr as they happen.
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s")
    for noisy in ("kubernetes", "urllib3", "nats"):
        logging.getLogger(noisy).setLevel(logging.WARNING)
    own_temporary_caches("rlfleet-bench-faults-caches-")  # this invocation's, removed after
    document = yaml.safe_load((ROOT / "examples" / "local.yaml").read_text())
    # An evaluator too, to kill: it scores a version now and then and never ends the run.
    document["spec"]["evaluation"] = {"suite": "rules", "everyVersions": EVALUATE_EVERY}
    # The run's logs stay for a look after it (each run replaces the last's); the bed goes.
    shutil.rmtree(args.logs, ignore_errors=True)
    with tempfile.TemporaryDirectory(prefix="rlfleet-bench-faults-") as state:
        bed = Bed(Path(state) / "bed", attached=True)
        bed.start()
        try:
            with progress_to_stderr():  # stdout is the JSON
                found = run_with_faults(
                    bed,
                    document,
                    args.logs,
                    minutes=args.minutes,
                    seed=args.seed,
                    mean_gap_s=args.mean_gap,
                )
        finally:
            bed.stop()
    print(json.dumps({"bench": "faults", "minutes": args.minutes, "seed": args.seed} | found))
    sys.stdout.flush()
    if any(found[key] for key in LOSSES):
        sys.exit(1)  # something lost, done twice, left or crashed: the JSON says what


if __name__ == "__main__":
    main()

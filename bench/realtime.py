"""Real-time RL benchmark: `examples/realtime.yaml` run end to end on this machine.

The tiny MoE serves "production" from two vLLM OpenAI-compatible servers (one canary,
one stable); simulated users ask them the rules suite's questions over HTTP and accept
right answers, reject wrong ones; every cycle a candidate is trained on their signals,
gated on the whole suite against the serving version, canaried and promoted or sent
back. One cycle's feedback is inverted (`--invert-cycle`), as a client with broken
instrumentation would report: the collector should hold that cycle back
(`inverted_cycle_outcome` Skipped), or else the gate or the canary stop its candidate.

The figures are `rlfleet run`'s own report of the run
(`rlfleet.local.realtime.summary`): cycles and their outcomes, the accept rate of what
production served per cycle (the users' own judgement, right or wrong, not what they
said) and its rise along a line fitted through every cycle's (steadier than the last
cycle's less the first's), the canary's rollbacks of candidates the gate had passed, the
inverted cycle's and the one before it aside (`canary_false_rollbacks`: that one's canary
runs while users say the opposite, `canary_on_inverted_feedback`), and each rolled-back
candidate's answers as the suite judges them beside the stable set's then
(`canary_rollbacks_judged`: a candidate the gate passed may still be worse on what users
ask), requests and feedback lost, serving p99 latency in steady state and around version
switches, and the share of requests the inverted cycle's candidate answered. Prints one
JSON object.

`--operator` runs it through the operators on a four-cluster bed of its own (`rlfleet
run --operator`): the hub makes the run's trainer, evaluator, collector and conductor,
whose pods run as local processes, and the pool serves from region-a.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

from rlfleet.launch.caches import own_temporary_caches
from rlfleet.local.run import run
from rlfleet.testbed import operated

EXAMPLE = Path(__file__).parent.parent / "examples" / "realtime.yaml"
QUICK = {"minutes": 1.0, "warmup_steps": 2}  # --quick's defaults


@contextlib.contextmanager
def _run_folder(keep: Path | None) -> Iterator[str]:
    if keep is None:
        with tempfile.TemporaryDirectory(prefix="rlfleet-bench-realtime-") as root:
            yield root
        return
    if keep.exists() and any(keep.iterdir()):
        # A run's folder is its state: another run in it would resume this one.
        raise SystemExit(f"--keep {keep}: not empty")
    keep.mkdir(parents=True, exist_ok=True)
    yield str(keep)


def main() -> None:
    own_temporary_caches("rlfleet-bench-realtime-caches-")  # this invocation's, removed after
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--minutes", type=float, default=15.0, help="the run's budget")
    parser.add_argument("--invert-cycle", type=int, default=3)
    parser.add_argument("--warmup-steps", type=int, help="default: the run's own")
    parser.add_argument("--file", type=Path, default=EXAMPLE)
    parser.add_argument("--operator", action="store_true", help="through the operators")
    parser.add_argument(
        "--keep", type=Path, help="run in this folder and keep it (logs, users' records)"
    )
    parser.add_argument("--quick", action="store_true", help="smallest sizes: check the script")
    if parser.parse_known_args()[0].quick:
        parser.set_defaults(**QUICK)
    args = parser.parse_args()
    with _run_folder(args.keep) as root:
        started = time.monotonic()
        if args.operator:
            bed = Path(root) / "bed"
            code = operated.run(
                args.file, Path(root), args.minutes, args.warmup_steps, bed, (), args.invert_cycle
            )
        else:
            code = run(
                args.file,
                Path(root),
                args.minutes,
                args.warmup_steps,
                invert_cycle=args.invert_cycle,
            )
        found = json.loads((Path(root) / "report" / "realtime.json").read_text())
    found |= {
        "exit_code": code,
        "wall_seconds": round(time.monotonic() - started, 1),
        "invert_cycle": args.invert_cycle,
        "operator": args.operator,
    }
    print(json.dumps(found))


if __name__ == "__main__":
    main()

"""`rlfleet run FILE`: train an RLRun on this machine (see `rlfleet.local.run`), or with
`--operator` through the operators on the four-cluster bed (see `rlfleet.testbed.operated`)."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from rlfleet.cli.dev import DEFAULT_STATE as DEV_BED


def _spike(text: str):
    from rlfleet.testbed.operated import Spike

    try:
        return Spike.parse(text)
    except ValueError as error:
        raise argparse.ArgumentTypeError(str(error)) from None


def _run(args: argparse.Namespace) -> int:
    # torch, NATS and rich load slowly: only once the arguments are known to be good.
    from rlfleet.local import run

    try:
        if args.operator:
            from rlfleet.testbed import operated

            return operated.run(
                *(args.file, args.state, args.minutes, args.warmup_steps, args.bed),
                *(tuple(args.spike), args.invert_cycle),
            )
        return run.run(
            args.file, args.state, args.minutes, args.warmup_steps, invert_cycle=args.invert_cycle
        )
    except run.InvalidRun as error:  # what the API server would refuse, refused as plainly
        print(f"rlfleet run: {error}", file=sys.stderr)
        return 2


def register(groups: argparse._SubParsersAction) -> None:
    command = groups.add_parser("run", help="train an RLRun locally: NATS, trainer, rollouts")
    command.add_argument("file", type=Path, help="an RLRun YAML document")
    command.add_argument(
        "--state",
        type=Path,
        default=None,
        help="run folder (default .rlfleet/runs/NAME, or NAME-operator with --operator)",
    )
    command.add_argument(
        "--minutes", type=float, default=7.0, help="training budget, from the first step"
    )
    command.add_argument(
        "--warmup-steps", type=int, default=None, help="supervised warm-up (default: Tuning's)"
    )
    command.add_argument(
        "--invert-cycle",
        type=int,
        default=None,
        metavar="N",
        help="a production run: its simulated users say the opposite of what they think "
        "about what cycle N collects, as a client with broken instrumentation would",
    )
    operator = command.add_argument_group(
        "through the operators",
        "the RLRun applied to the four-cluster bed's hub; the pods the operators create "
        "run as local processes, rollouts on GPUs lent by each region's serving fleet",
    )
    operator.add_argument("--operator", action="store_true", help="run through the operators")
    operator.add_argument(
        "--bed",
        type=Path,
        default=DEV_BED,
        help="the bed `rlfleet dev up` runs there, else one started for this run "
        f"(default {DEV_BED})",
    )
    operator.add_argument(
        "--spike",
        type=_spike,
        action="append",
        default=[],
        metavar="REGION:FROM-TO",
        help="serving traffic too high to lend, in minutes of training: region-a:2-4 "
        "reclaims region-a's GPUs from minute 2 to minute 4 (repeatable)",
    )
    command.set_defaults(handler=_run)

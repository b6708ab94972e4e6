"""`rlfleet run FILE`: train an RLRun on this machine (see `rlfleet.local.run`), or with
`--operator` through the operators on the four-cluster bed (see `rlfleet.testbed.operated`)."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from rlfleet.cli.dev import DEFAULT_STATE as DEV_BED

# From the command to the hub's first version: the model's warm-up, the chart in each
# cluster, the operators' first decisions and the pods' start, on two cores.
DETACHED_START_S = 900.0


def _spike(text: str):
    from rlfleet.testbed.operated import Spike

    try:
        return Spike.parse(text)
    except ValueError as error:
        raise argparse.ArgumentTypeError(str(error)) from None


def _run(args: argparse.Namespace) -> int:
    if (args.detach or args.namespace) and not args.operator:
        print("rlfleet run: --detach and --namespace go with --operator", file=sys.stderr)
        return 2
    if args.detach:
        return _detach(args)
    # torch, NATS and rich load slowly: only once the arguments are known to be good.
    from rlfleet.local import run

    try:
        if args.operator:
            from rlfleet.testbed import operated

            return operated.run(
                *(args.file, args.state, args.minutes, args.warmup_steps, args.bed),
                *(tuple(args.spike), args.invert_cycle, args.namespace),
            )
        return run.run(
            args.file, args.state, args.minutes, args.warmup_steps, invert_cycle=args.invert_cycle
        )
    except run.InvalidRun as error:  # what the API server would refuse, refused as plainly
        print(f"rlfleet run: {error}", file=sys.stderr)
        return 2


def _detach(args: argparse.Namespace) -> int:
    """The same command in the background, on the bed `rlfleet dev up` keeps; returns
    once the hub reports the run's first version."""
    from rlfleet.testbed import detached, operated
    from rlfleet.testbed.bed import BedInfo

    bed = BedInfo.running(args.bed)
    if bed is None:
        print(
            f"rlfleet run: --detach needs the bed up in {args.bed}: rlfleet dev up", file=sys.stderr
        )
        return 2
    from rlfleet.local.run import InvalidRun, load

    try:
        name, _ = load(args.file)
    except InvalidRun as error:
        print(f"rlfleet run: {error}", file=sys.stderr)
        return 2
    namespace = args.namespace or operated.namespace_for(name)
    argv = [word for word in args.argv if word != "--detach"]
    log = args.bed / detached.RUNS / f"{namespace}.log"
    run = detached.start([*argv, "--namespace", namespace], args.bed, namespace, log)
    print(f"started in namespace {namespace} of the bed's hub; its output: {log}")
    try:
        version = detached.wait_training(bed, run, DETACHED_START_S)
    except (detached.DetachedRunEnded, TimeoutError, KeyboardInterrupt) as error:
        print(f"rlfleet run: {error or 'interrupted'}; stopping it", file=sys.stderr)
        detached.stop(args.bed, [run])
        return 1
    print(f"training: version {version}; `rlfleet dev down` stops it (it reports first)")
    return 0


def register(groups: argparse._SubParsersAction) -> None:
    command = groups.add_parser(
        "run",
        help="train an RLRun locally: NATS, trainer, rollouts",
        allow_abbrev=False,  # --detach is taken out, word for word, of what it starts
    )
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
    _add_operator_arguments(command)
    command.set_defaults(handler=_run)


def _add_operator_arguments(command: argparse.ArgumentParser) -> None:
    """`--operator` and what goes with it: the bed, serving spikes, the namespace, detaching."""
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
    operator.add_argument(
        "--namespace",
        default=None,
        help="the namespace the run is applied in, in every cluster (default: NAME-random)",
    )
    operator.add_argument(
        "--detach",
        action="store_true",
        help="leave the run training on the `rlfleet dev up` bed, in the background, until "
        "`rlfleet dev down` (which stops it as Ctrl-C does); returns once it has a version",
    )

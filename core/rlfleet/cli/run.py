"""`rlfleet run FILE`: train an RLRun on this machine (see `rlfleet.local.run`)."""

from __future__ import annotations

import argparse
from pathlib import Path


def _run(args: argparse.Namespace) -> int:
    from rlfleet.local.run import run  # torch, NATS and rich load slowly

    return run(args.file, args.state, args.minutes, args.warmup_steps)


def register(groups: argparse._SubParsersAction) -> None:
    command = groups.add_parser("run", help="train an RLRun locally: NATS, trainer, rollouts")
    command.add_argument("file", type=Path, help="an RLRun YAML document")
    command.add_argument(
        "--state", type=Path, default=None, help="run folder (default .rlfleet/runs/NAME)"
    )
    command.add_argument(
        "--minutes", type=float, default=7.0, help="training budget, from the first step"
    )
    command.add_argument(
        "--warmup-steps", type=int, default=None, help="supervised warm-up (default: Tuning's)"
    )
    command.set_defaults(handler=_run)

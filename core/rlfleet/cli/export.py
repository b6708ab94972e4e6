"""`rlfleet export FILE --to DIR`: a version of a run trained locally as a Hugging Face
checkpoint (see `rlfleet.local.export`)."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path


def _export(args: argparse.Namespace) -> int:
    from rlfleet.local import export  # NATS and the run's modules load slowly
    from rlfleet.local.run import InvalidRun

    try:
        return export.export(args.file, args.state, args.version, args.to)
    except InvalidRun as error:
        print(f"rlfleet export: {error}", file=sys.stderr)
        return 2


def register(groups: argparse._SubParsersAction) -> None:
    command = groups.add_parser(
        "export", help="write a version of a local run as a Hugging Face checkpoint"
    )
    command.add_argument("file", type=Path, help="the RLRun YAML document it was run from")
    command.add_argument("--to", type=Path, required=True, help="a new folder for it")
    command.add_argument("--version", type=int, default=None, help="default: the newest")
    command.add_argument(
        "--state", type=Path, default=None, help="run folder (default .rlfleet/runs/NAME)"
    )
    command.set_defaults(handler=_export)

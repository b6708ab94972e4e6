"""The `rlfleet` command line."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence

from rlfleet.cli import crds, dev, docs, export, model, oncall, plan, run
from rlfleet.cli.commands import Handler


def parser() -> argparse.ArgumentParser:
    top = argparse.ArgumentParser(prog="rlfleet", description=__doc__)
    groups = top.add_subparsers(dest="group", required=True)
    for module in (dev, crds, docs, model, run, export, oncall, plan):
        module.register(groups)
    return top


def main(argv: Sequence[str] | None = None) -> None:
    args = parser().parse_args(argv)
    args.argv = list(sys.argv[1:] if argv is None else argv)  # what a command passes on
    handler: Handler = args.handler
    sys.exit(handler(args))

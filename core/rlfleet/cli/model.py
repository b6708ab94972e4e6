"""`rlfleet model init --kind tiny-moe|tiny-dense DIR`."""

from __future__ import annotations

import argparse
from pathlib import Path


def _init(args: argparse.Namespace) -> int:
    from rlfleet.models.tiny import init_model  # torch and transformers load slowly

    path = init_model(args.kind, args.dir, seed=args.seed)
    print(f"wrote {args.kind} checkpoint to {path}")
    return 0


def register(groups: argparse._SubParsersAction) -> None:
    group = groups.add_parser("model", help="tiny models made locally")
    commands = group.add_subparsers(dest="command", required=True)
    init = commands.add_parser("init", help="write a tiny Hugging Face checkpoint")
    init.add_argument("--kind", choices=("tiny-moe", "tiny-dense"), default="tiny-moe")
    init.add_argument("--seed", type=int, default=0)
    init.add_argument("dir", type=Path)
    init.set_defaults(handler=_init)

"""Files generated from the code (the CRDs, the reference pages): one frame for each
`rlfleet <group> generate|check`, so a group names only what it generates."""

from __future__ import annotations

import argparse
from collections.abc import Callable
from pathlib import Path

from rlfleet.cli.commands import add_group

# Every file a group generates under the repository root, with its content.
Generator = Callable[[Path], dict[Path, str]]


def write(files: dict[Path, str]) -> list[Path]:
    for path, text in files.items():
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    return list(files)


def stale(files: dict[Path, str]) -> list[Path]:
    """The files that differ on disk from what the code generates."""
    return [path for path, text in files.items() if not path.is_file() or path.read_text() != text]


def register(
    groups: argparse._SubParsersAction, name: str, text: str, what: str, generated: Generator
) -> None:
    """`rlfleet <name> generate` writes `what`; `check` fails if it drifted from the code."""

    def generate(args: argparse.Namespace) -> int:
        for path in write(generated(args.root)):
            print(f"wrote {path}")
        return 0

    def check(args: argparse.Namespace) -> int:
        drifted = stale(generated(args.root))
        for path in drifted:
            print(f"{path} is out of date: run `rlfleet {name} generate`")
        return 1 if drifted else 0

    add_group(
        groups,
        name,
        text,
        [
            ("generate", generate, f"write {what}"),
            ("check", check, f"fail if {what} drifted from the code"),
        ],
        lambda command: command.add_argument(
            "--root", type=Path, default=Path(), help="the repository root"
        ),
    )

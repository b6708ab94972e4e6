"""`rlfleet crds generate|check`: the CRD manifests in crds/ come from rlfleet.api."""

from __future__ import annotations

import argparse
from pathlib import Path

from rlfleet.api.schema import KINDS, crd_filename, render
from rlfleet.cli.commands import add_group


def generate(directory: Path) -> list[Path]:
    directory.mkdir(parents=True, exist_ok=True)
    written = []
    for kind in KINDS:
        path = directory / crd_filename(kind)
        path.write_text(render(kind))
        written.append(path)
    return written


def stale(directory: Path) -> list[str]:
    """Names of the CRD files in directory that differ from what the models generate."""
    return [
        crd_filename(kind)
        for kind in KINDS
        if not (directory / crd_filename(kind)).is_file()
        or (directory / crd_filename(kind)).read_text() != render(kind)
    ]


def _generate(args: argparse.Namespace) -> int:
    for path in generate(args.dir):
        print(f"wrote {path}")
    return 0


def _check(args: argparse.Namespace) -> int:
    drifted = stale(args.dir)
    for name in drifted:
        print(f"{args.dir / name} is out of date: run `rlfleet crds generate`")
    return 1 if drifted else 0


def register(groups: argparse._SubParsersAction) -> None:
    add_group(
        groups,
        "crds",
        "CustomResourceDefinitions generated from the models",
        [
            ("generate", _generate, "write the CRD manifests"),
            ("check", _check, "fail if the CRD manifests drifted from the models"),
        ],
        lambda command: command.add_argument("--dir", type=Path, default=Path("crds")),
    )

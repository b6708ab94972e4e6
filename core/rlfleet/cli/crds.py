"""`rlfleet crds generate|check`: the CRD manifests in crds/ come from rlfleet.api."""

from __future__ import annotations

import argparse
from pathlib import Path

from rlfleet.api.schema import KINDS, crd_filename, render, render_chart_template
from rlfleet.cli.commands import add_group

CHART_CRDS = Path("helm/rlfleet/templates/crds.yaml")


def generated(root: Path) -> dict[Path, str]:
    """Every generated CRD file under the repository root, with its content."""
    files = {root / "crds" / crd_filename(kind): render(kind) for kind in KINDS}
    files[root / CHART_CRDS] = render_chart_template()
    return files


def generate(root: Path) -> list[Path]:
    for path, text in generated(root).items():
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    return list(generated(root))


def stale(root: Path) -> list[Path]:
    """The generated CRD files under root that differ from what the models generate."""
    return [
        path
        for path, text in generated(root).items()
        if not path.is_file() or path.read_text() != text
    ]


def _generate(args: argparse.Namespace) -> int:
    for path in generate(args.root):
        print(f"wrote {path}")
    return 0


def _check(args: argparse.Namespace) -> int:
    drifted = stale(args.root)
    for path in drifted:
        print(f"{path} is out of date: run `rlfleet crds generate`")
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
        lambda command: command.add_argument(
            "--root", type=Path, default=Path(), help="the repository root"
        ),
    )

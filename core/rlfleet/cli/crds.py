"""`rlfleet crds generate|check`: the CRD manifests in crds/ come from rlfleet.api."""

from __future__ import annotations

import argparse
from pathlib import Path

from rlfleet.api.schema import KINDS, crd_filename, render, render_chart_template
from rlfleet.cli import generated as generated_files

CHART_CRDS = Path("helm/rlfleet/templates/crds.yaml")


def generated(root: Path) -> dict[Path, str]:
    """Every generated CRD file under the repository root, with its content."""
    files = {root / "crds" / crd_filename(kind): render(kind) for kind in KINDS}
    files[root / CHART_CRDS] = render_chart_template()
    return files


def register(groups: argparse._SubParsersAction) -> None:
    generated_files.register(
        groups,
        "crds",
        "CustomResourceDefinitions generated from the models",
        "the CRD manifests",
        generated,
    )

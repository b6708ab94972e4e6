"""The docs site builds with no warning, its reference is the code's, and its commands run.

Commands: every ```sh block of README.md and docs/ is run as written from the repository
root, unless its fence carries a title (`sh title="about 10 minutes"`), which tells the
reader why it is not quick: it takes minutes, needs clusters or changes the tree.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from rlfleet.api.schema import KINDS, crd
from rlfleet.cli import docs
from rlfleet.cli.generated import stale, write

ROOT = Path(__file__).resolve().parents[2]
PAGES = sorted((ROOT / "docs").rglob("*.md"))
GENERATED = {path.resolve() for path in docs.generated(ROOT)}
WRITTEN = [ROOT / "README.md", *(p for p in PAGES if p.resolve() not in GENERATED)]
FENCE = re.compile(r"^```(sh|bash|shell)\b(?P<info>[^\n]*)\n(?P<body>.*?)^```", re.M | re.S)
QUICK_S = 60


def _blocks() -> list[tuple[str, str, str]]:
    """(where, fence info, body) of every shell block in the written pages."""
    found = []
    for page in WRITTEN:
        text = page.read_text()
        for match in FENCE.finditer(text):
            line = text.count("\n", 0, match.start()) + 1
            found.append((f"{page.relative_to(ROOT)}:{line}", match["info"], match["body"]))
    return found


BLOCKS = _blocks()
QUICK = [(where, body) for where, info, body in BLOCKS if "title=" not in info]


def test_the_reference_matches_the_code() -> None:
    assert stale(docs.generated(ROOT)) == [], "docs/reference drifted: run `rlfleet docs generate`"


def _paths(node: dict[str, Any], path: str) -> list[str]:
    """Every field's dotted path, lists as `[]` and maps as `{}`, as the pages show them."""
    found = []
    for name, field in node.get("properties", {}).items():
        found.append(f"{path}.{name}")
        for child_path, child in docs._children(f"{path}.{name}", field):
            found += _paths(child, child_path)
    return found


@pytest.mark.parametrize("kind", KINDS, ids=lambda k: k.kind)
def test_the_api_reference_shows_every_field(kind: Any) -> None:
    schema = crd(kind)["spec"]["versions"][0]["schema"]["openAPIV3Schema"]
    page = docs.render_reference(kind.kind)
    sections = dict(re.findall(r"^#+ `([^`]+)` \{ #([^ ]+) \}$", page, re.M))
    for part in ("spec", "status"):
        for path in _paths(schema["properties"][part], part):
            parent, name = path.rsplit(".", 1)
            assert parent in sections, f"{kind.kind}: no section for {parent}"
            section = page.split(f"`{parent}` {{ #{sections[parent]} }}", 1)[1]
            assert re.search(rf"^\| `{re.escape(name)}`", section, re.M), f"{path} not shown"


def test_a_field_changed_without_the_docs_fails_the_check(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    write(docs.generated(tmp_path))
    assert stale(docs.generated(tmp_path)) == []
    real = docs.crd

    def with_a_new_field(kind: Any) -> dict[str, Any]:
        manifest = real(kind)
        schema = manifest["spec"]["versions"][0]["schema"]["openAPIV3Schema"]
        schema["properties"]["spec"]["properties"]["newField"] = {"type": "integer"}
        return manifest

    monkeypatch.setattr(docs, "crd", with_a_new_field)
    assert len(stale(docs.generated(tmp_path))) == len(KINDS)


def test_the_site_builds_with_no_warning(tmp_path: Path) -> None:
    """--strict: a warning, a page left out of the nav, a broken link or anchor fails."""
    built = subprocess.run(
        [sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", tmp_path / "site"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
        env={**os.environ, "NO_MKDOCS_2_WARNING": "1"},  # Material's notice of its successor
    )
    assert built.returncode == 0, built.stderr
    assert (tmp_path / "site" / "reference" / "rlrun" / "index.html").is_file()


def test_every_shell_block_is_run_or_says_why_not() -> None:
    assert QUICK, "no command in the docs is run"
    for where, info, _ in BLOCKS:
        title = re.search(r'title="([^"]*)"', info)
        assert "title=" not in info or (title and title[1].strip()), f"{where}: empty title"


@pytest.mark.parametrize(("where", "body"), QUICK, ids=[where for where, _ in QUICK])
def test_a_quick_command_in_the_docs_runs_as_written(where: str, body: str) -> None:
    ran = subprocess.run(
        ["bash", "-euo", "pipefail", "-c", body],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=QUICK_S,
    )
    assert ran.returncode == 0, f"{where}:\n{body}\n{ran.stdout[-2000:]}{ran.stderr[-2000:]}"

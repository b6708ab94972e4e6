"""Every component's code stays small enough to read at once: a function on one screen (a
handler parses, a pure function decides, a thin one acts), a module on one subject. A
function or module over its limit is a decision to split, or an exception named here with
why."""

from __future__ import annotations

import ast
from pathlib import Path

from conftest import ROOT

FUNCTION_LIMIT = 60  # lines, decorators and docstring included
MODULE_LIMIT = 500  # lines
COMPONENTS = ("core", "operator", "trainer", "rollout", "weightsync")

# Modules whose length is their fields' descriptions: the API's types, which the CRDs, the
# reference pages and `kubectl explain` are generated from, one field after another.
LONG_MODULES = {
    "core/rlfleet/api/rlrun.py": "RLRun's spec and status types, each field described",
    "core/rlfleet/api/wire.py": "every wire message, each field's meaning and bounds",
}
LONG_FUNCTIONS: dict[str, str] = {}


def sources() -> list[Path]:
    return sorted(p for c in COMPONENTS for p in (ROOT / c / "rlfleet").rglob("*.py"))


def test_no_function_in_any_component_is_longer_than_the_limit() -> None:
    long = []
    for path in sources():
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
                first = min([node.lineno] + [d.lineno for d in node.decorator_list])
                lines = node.end_lineno - first + 1
                name = f"{path.relative_to(ROOT)}:{node.name}"
                if lines > FUNCTION_LIMIT and name not in LONG_FUNCTIONS:
                    long.append(f"{name} ({lines} lines, line {node.lineno})")
    assert long == [], f"functions over {FUNCTION_LIMIT} lines: {long}"


def test_no_module_in_any_component_is_longer_than_the_limit() -> None:
    long = []
    for path in sources():
        lines = len(path.read_text().splitlines())
        name = str(path.relative_to(ROOT))
        if lines > MODULE_LIMIT and name not in LONG_MODULES:
            long.append(f"{name} ({lines} lines)")
    assert long == [], f"modules over {MODULE_LIMIT} lines: {long}"


def test_each_exception_still_needs_to_be_one() -> None:
    """An exception that no longer applies comes off the list, so the list stays true."""
    for name in LONG_MODULES:
        assert len((ROOT / name).read_text().splitlines()) > MODULE_LIMIT, name
    for name in LONG_FUNCTIONS:
        path, function = name.rsplit(":", 1)
        lengths = [
            node.end_lineno - min([node.lineno] + [d.lineno for d in node.decorator_list]) + 1
            for node in ast.walk(ast.parse((ROOT / path).read_text()))
            if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef) and node.name == function
        ]
        assert max(lengths, default=0) > FUNCTION_LIMIT, name

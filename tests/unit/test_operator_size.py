"""The operator's functions stay short enough to read at once: a handler parses, a pure
function decides, a thin one acts. A function over the limit is a decision to split."""

from __future__ import annotations

import ast

from conftest import ROOT

LIMIT = 60  # lines, decorators and docstring included


def test_no_operator_function_is_longer_than_the_limit() -> None:
    long = []
    for path in sorted((ROOT / "operator" / "rlfleet" / "operator").rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
                first = min([node.lineno] + [d.lineno for d in node.decorator_list])
                lines = node.end_lineno - first + 1
                if lines > LIMIT:
                    long.append(f"{path.relative_to(ROOT)}:{node.lineno} {node.name} {lines}")
    assert long == [], f"functions over {LIMIT} lines: {long}"

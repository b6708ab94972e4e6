"""`rlfleet docs generate|check`: the reference in docs/reference/ comes from the code.

The API reference: each kind's page is rendered from the structural schema its CRD
carries (what the API server enforces: types, defaults, bounds, CEL rules), so the
reference, `crds/` and the models cannot disagree. One section per object; a field
that is an object, a list of objects or a map of objects links to its own section. The
command-line reference is every `rlfleet` command's help, as argparse prints it.
"""

from __future__ import annotations

import argparse
import json
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from rlfleet.api.meta import API_VERSION, CATEGORY
from rlfleet.api.schema import KINDS, VALIDATIONS, crd
from rlfleet.cli import generated as generated_files

REFERENCE = Path("docs/reference")
GENERATED = "<!-- Generated from the code by `rlfleet docs generate`; do not edit. -->"


def reference_filename(kind: str) -> str:
    return f"{kind.lower()}.md"


def _cell(text: str) -> str:
    """Text safe inside a Markdown table cell: one line, pipes escaped."""
    return " ".join(text.split()).replace("|", "\\|")


def _code(value: str) -> str:
    """A code span that holds any text, backticks included; Python-Markdown's tables take
    a pipe inside a code span as text."""
    fence = "``" if "`" in value else "`"
    pad = " " if value.startswith("`") or value.endswith("`") else ""
    return f"{fence}{pad}{value}{pad}{fence}"


def _anchor(path: str) -> str:
    return path.lower().replace(".", "-").replace("[]", "-item").replace("{}", "-value")


def _is_object(node: dict[str, Any]) -> bool:
    return "properties" in node


def _children(path: str, node: dict[str, Any]) -> Iterator[tuple[str, dict[str, Any]]]:
    """The object sections under one field: itself, its list items or its map values."""
    if _is_object(node):
        yield path, node
    elif node.get("type") == "array" and isinstance(node.get("items"), dict):
        yield from _children(f"{path}[]", node["items"])
    elif isinstance(node.get("additionalProperties"), dict):
        yield from _children(f"{path}{{}}", node["additionalProperties"])


def _type(path: str, node: dict[str, Any]) -> str:
    if _is_object(node):
        return f"[object](#{_anchor(path)})"
    kind = node.get("type", "any")
    if kind == "array" and isinstance(node.get("items"), dict):
        items = node["items"]
        listed = f"list of {_type(f'{path}[]', items)}"
        list_type = node.get("x-kubernetes-list-type")
        if list_type == "map":
            keys = ", ".join(_code(key) for key in node.get("x-kubernetes-list-map-keys", []))
            return f"{listed}, keyed by {keys}"
        if list_type == "set":
            return f"{listed}, no duplicates"
        return listed
    if kind == "object" and isinstance(node.get("additionalProperties"), dict):
        return f"map of string to {_type(f'{path}{{}}', node['additionalProperties'])}"
    if node.get("format"):
        return f"{kind} ({node['format']})"
    return str(kind)


def _number(value: Any) -> str:
    return json.dumps(value)


def _bounds(node: dict[str, Any]) -> str:
    """What the API server checks of one value besides its type."""
    parts: list[str] = []
    if "enum" in node:
        parts.append("one of " + ", ".join(_code(json.dumps(v)) for v in node["enum"]))
    low, high = node.get("minimum"), node.get("maximum")
    if low is not None:
        parts.append(f"{'>' if node.get('exclusiveMinimum') else '≥'} {_number(low)}")
    if high is not None:
        parts.append(f"{'<' if node.get('exclusiveMaximum') else '≤'} {_number(high)}")
    for prefix, unit in (("Length", "characters"), ("Items", "items"), ("Properties", "keys")):
        low, high = node.get(f"min{prefix}"), node.get(f"max{prefix}")
        if low is not None and high is not None:
            parts.append(f"{low} to {high} {unit}")
        elif low is not None:
            parts.append(f"at least {low} {unit}")
        elif high is not None:
            parts.append(f"at most {high} {unit}")
    if "pattern" in node:
        parts.append(f"matches {_code(node['pattern'])}")
    return "; ".join(parts)


def _default(node: dict[str, Any]) -> str:
    if "default" not in node:
        return ""
    return _code(json.dumps(node["default"], separators=(", ", ": ")))


def _rules(node: dict[str, Any]) -> list[str]:
    lines = []
    for rule in node.get(VALIDATIONS, []):
        where = f" (on {_code(rule['fieldPath'].lstrip('.'))})" if "fieldPath" in rule else ""
        lines.append(f"- {rule['message']}{where}: {_code(rule['rule'])}")
    return lines


def _section(path: str, node: dict[str, Any], depth: int) -> list[str]:
    """One object's section: its description, a table of its fields, its CEL rules."""
    level = "#" * min(depth, 4)
    lines = [f"{level} `{path}` {{ #{_anchor(path)} }}", ""]
    if node.get("description"):
        lines += [" ".join(node["description"].split()), ""]
    required = set(node.get("required", []))
    lines += [
        "| field | type | default | bounds | description |",
        "| --- | --- | --- | --- | --- |",
    ]
    for name, field in node["properties"].items():
        shown = f"`{name}`" + (" (required)" if name in required else "")
        # A list's or map's own bounds and its elements' bounds, both.
        inner = field.get("items") or field.get("additionalProperties")
        bounds = _bounds(field)
        if isinstance(inner, dict) and not _is_object(inner) and _bounds(inner):
            bounds = "; ".join(filter(None, [bounds, "each " + _bounds(inner)]))
        cells = [
            shown,
            _type(f"{path}.{name}", field),
            _default(field),
            bounds,
            _cell(field.get("description", "")),
        ]
        lines.append("| " + " | ".join(cells) + " |")
    rules = _rules(node)
    if rules:
        lines += ["", "Rules the API server checks:", "", *rules]
    lines.append("")
    for name, field in node["properties"].items():
        for child_path, child in _children(f"{path}.{name}", field):
            lines += _section(child_path, child, depth + 1)
    return lines


def render_reference(kind_name: str) -> str:
    """The reference page of one kind, from the schema its CRD serves."""
    kind = next(k for k in KINDS if k.kind == kind_name)
    manifest = crd(kind)
    version = manifest["spec"]["versions"][0]
    schema = version["schema"]["openAPIV3Schema"]
    names = ", ".join(f"`{n}`" for n in (kind.plural, *kind.short_names))
    lines = [
        f"# {kind.kind}",
        "",
        GENERATED,
        "",
        f"`apiVersion: {API_VERSION}`, `kind: {kind.kind}`. {kind.description}",
        "",
        f"`kubectl get` names: {names}; category `{CATEGORY}` (`kubectl get {CATEGORY}`).",
        "",
        "Columns of `kubectl get`:",
        "",
        "| column | type | from | description |",
        "| --- | --- | --- | --- |",
    ]
    for column in version["additionalPrinterColumns"]:
        lines.append(
            f"| {column['name']} | {column['type']} | {_code(column['jsonPath'])} | "
            f"{_cell(column.get('description', ''))} |"
        )
    lines.append("")
    rules = _rules(schema)
    if rules:
        lines += ["Rules on the whole object:", "", *rules, ""]
    for part in ("spec", "status"):
        lines += _section(part, schema["properties"][part], 2)
    return "\n".join(lines).rstrip("\n") + "\n"


def _commands(
    parser: argparse.ArgumentParser, words: tuple[str, ...]
) -> Iterator[tuple[tuple[str, ...], argparse.ArgumentParser]]:
    yield words, parser
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for name, sub in action.choices.items():
                yield from _commands(sub, (*words, name))


def render_cli() -> str:
    """Every `rlfleet` command's --help, at a fixed width so the page is the same anywhere."""
    from rlfleet.cli import parser  # the CLI's root imports this module

    lines = [
        "# Command line",
        "",
        GENERATED,
        "",
        "Every `rlfleet` command's `--help`. After `make setup` the command is",
        "`.venv/bin/rlfleet` in the clone (or `python -m rlfleet.cli`).",
        "",
    ]
    width = os.environ.get("COLUMNS")
    os.environ["COLUMNS"] = "92"  # argparse wraps to the terminal's width
    try:
        for words, command in _commands(parser(), ("rlfleet",)):
            lines += [f"## `{' '.join(words)}`", "", "```text", command.format_help().strip()]
            lines += ["```", ""]
    finally:
        if width is None:
            del os.environ["COLUMNS"]
        else:
            os.environ["COLUMNS"] = width
    return "\n".join(lines).rstrip("\n") + "\n"


def generated(root: Path) -> dict[Path, str]:
    """Every generated reference page under the repository root, with its content."""
    pages = {
        root / REFERENCE / reference_filename(kind.kind): render_reference(kind.kind)
        for kind in KINDS
    }
    pages[root / REFERENCE / "cli.md"] = render_cli()
    return pages


def register(groups: argparse._SubParsersAction) -> None:
    generated_files.register(
        groups,
        "docs",
        "the API and command-line reference in docs/reference, generated",
        "the reference pages",
        generated,
    )

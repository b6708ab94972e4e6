"""Generates CustomResourceDefinitions from the typed models: the one source of truth.

Pydantic emits JSON Schema 2020-12; the API server wants a structural OpenAPI v3.0
schema. The conversion inlines references, turns Optional into "not required", and
rewrites the few keywords the two dialects spell differently.
"""

from __future__ import annotations

from typing import Any

import yaml

from rlfleet.api.envpool import ENVPOOL
from rlfleet.api.inferencepool import INFERENCEPOOL
from rlfleet.api.meta import API_VERSION, CATEGORY, GROUP, VERSION, ApiModel, ResourceKind
from rlfleet.api.rlrun import RLRUN

KINDS: tuple[ResourceKind, ...] = (RLRUN, INFERENCEPOOL, ENVPOOL)

# Keywords of JSON Schema that a structural schema has no use for.
_DROPPED = {"title", "$defs"}


VALIDATIONS = "x-kubernetes-validations"


def _without_nulls(value: Any) -> Any:
    if isinstance(value, dict):
        return {k: _without_nulls(v) for k, v in value.items() if v is not None}
    return value


def _merged(base: dict[str, Any], over: dict[str, Any]) -> dict[str, Any]:
    """A referenced schema under a field's own keys; CEL rules of both apply, so their
    lists join (a plain merge would drop the model's rules for the field's)."""
    rules = base.get(VALIDATIONS, []) + over.get(VALIDATIONS, [])
    return {**base, **over} | ({VALIDATIONS: rules} if rules else {})


def _structural(node: Any, defs: dict[str, Any]) -> Any:
    if isinstance(node, list):
        return [_structural(item, defs) for item in node]
    if not isinstance(node, dict):
        return node
    node = dict(node)
    ref = node.pop("$ref", None)
    if ref is not None:
        node = _merged(defs[ref.rsplit("/", 1)[-1]], node)
    any_of = node.get("anyOf")
    if any_of is not None:
        # Optional[X] is anyOf [X, null]: the field is simply not required.
        non_null = [branch for branch in any_of if branch.get("type") != "null"]
        if len(non_null) == 1:
            del node["anyOf"]
            node = _merged(non_null[0], node)
            if node.get("default", ...) is None:
                del node["default"]
            if "$ref" in node:  # Optional[Model]: resolve the model now
                return _structural(node, defs)
    out: dict[str, Any] = {}
    for key, value in node.items():
        if key in _DROPPED:
            continue
        if key == "additionalProperties" and (
            value is False or node.get("x-kubernetes-preserve-unknown-fields")
        ):
            continue  # structural schemas prune unknown fields; kubectl's strict mode names them
        if key in ("exclusiveMinimum", "exclusiveMaximum"):
            out["minimum" if key == "exclusiveMinimum" else "maximum"] = value
            out[key] = True
            continue
        if key == "const":
            out["enum"] = [value]
            continue
        if key == "default" and isinstance(value, dict):
            out[key] = _without_nulls(value)  # an unset optional field is absent, not null
            continue
        if key == "properties":
            out[key] = {name: _structural(prop, defs) for name, prop in value.items()}
            continue
        out[key] = _structural(value, defs)
    return out


def model_schema(model: type[ApiModel]) -> dict[str, Any]:
    """The structural OpenAPI v3 schema of one spec or status model."""
    raw = model.model_json_schema(by_alias=True, mode="validation")
    return _structural(raw, raw.get("$defs", {}))


def _described(schema: dict[str, Any], description: str) -> dict[str, Any]:
    """A spec's or status's schema under the standard description, its model's after it."""
    own = schema.pop("description", None)
    return {"description": f"{description} {own}" if own else description, **schema}


def _object_schema(kind: ResourceKind) -> dict[str, Any]:
    """The kind's OpenAPI schema: the object's envelope around its spec's and status's."""
    schema = {
        "type": "object",
        "description": kind.description,
        "required": ["spec"],
        "properties": {
            "apiVersion": {
                "type": "string",
                "description": f"The versioned schema of this object: {API_VERSION}.",
            },
            "kind": {
                "type": "string",
                "description": f"The REST resource this object represents: {kind.kind}.",
            },
            # The API server takes nothing but the type here: metadata is its own schema.
            "metadata": {"type": "object"},
            "spec": _described(
                model_schema(kind.spec), f"The desired state of this {kind.kind}, set by its user."
            ),
            "status": _described(
                model_schema(kind.status),
                f"The observed state of this {kind.kind}, written by the rlfleet operator.",
            ),
        },
    }
    if kind.rules:
        schema[VALIDATIONS] = list(kind.rules)
    return schema


def _printer_columns(kind: ResourceKind) -> list[dict[str, Any]]:
    return [
        {
            "name": column.name,
            "type": column.type,
            "jsonPath": column.json_path,
            **({"description": column.description} if column.description else {}),
            **({"priority": column.priority} if column.priority else {}),
        }
        for column in kind.columns
    ]


def crd(kind: ResourceKind) -> dict[str, Any]:
    """The CustomResourceDefinition manifest of one kind."""
    return {
        "apiVersion": "apiextensions.k8s.io/v1",
        "kind": "CustomResourceDefinition",
        "metadata": {"name": kind.crd_name},
        "spec": {
            "group": GROUP,
            "scope": "Namespaced",
            "names": {
                "kind": kind.kind,
                "listKind": f"{kind.kind}List",
                "plural": kind.plural,
                "singular": kind.singular,
                "shortNames": list(kind.short_names),
                "categories": [CATEGORY],
            },
            "versions": [
                {
                    "name": VERSION,
                    "served": True,
                    "storage": True,
                    "subresources": {"status": {}},
                    "additionalPrinterColumns": _printer_columns(kind),
                    "schema": {"openAPIV3Schema": _object_schema(kind)},
                }
            ],
        },
    }


def crd_filename(kind: ResourceKind) -> str:
    return f"{GROUP}_{kind.plural}.yaml"


HEADER = "# Generated from rlfleet.api by `rlfleet crds generate`; do not edit.\n"


def render(kind: ResourceKind) -> str:
    return HEADER + yaml.safe_dump(crd(kind), sort_keys=False, width=100)


def render_chart_template() -> str:
    """The chart's copy of every CRD, as a template so that `helm upgrade` updates them
    (Helm never upgrades files in a chart's crds/ folder) and kept on uninstall, which
    would otherwise delete every run with its CRD."""
    documents = []
    for kind in KINDS:
        manifest = crd(kind)
        manifest["metadata"]["annotations"] = {"helm.sh/resource-policy": "keep"}
        documents.append(yaml.safe_dump(manifest, sort_keys=False, width=100))
    body = "---\n".join(documents)
    return f"{HEADER}{{{{- if .Values.crds.install }}}}\n{body}{{{{- end }}}}\n"

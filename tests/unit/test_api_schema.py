"""The CRDs are generated from the typed models, and the examples are valid against them."""

from __future__ import annotations

import re
from collections.abc import Iterator
from pathlib import Path

import pytest
import yaml
from pydantic import ValidationError

from rlfleet.api.envpool import ENVPOOL
from rlfleet.api.inferencepool import INFERENCEPOOL
from rlfleet.api.meta import API_VERSION
from rlfleet.api.rlrun import RLRUN
from rlfleet.api.schema import KINDS, crd
from rlfleet.cli.crds import generated
from rlfleet.cli.generated import stale

ROOT = Path(__file__).resolve().parents[2]
RE2_MAX_REPEAT = 1000
EXAMPLES = {"rlrun.yaml": RLRUN, "inferencepool.yaml": INFERENCEPOOL, "envpool.yaml": ENVPOOL}


def test_crd_files_match_the_models() -> None:
    assert stale(generated(ROOT)) == [], (
        "the CRDs drifted from rlfleet.api: run `rlfleet crds generate`"
    )


@pytest.mark.parametrize("name", sorted(EXAMPLES))
def test_examples_validate_against_the_models(name: str) -> None:
    document = yaml.safe_load((ROOT / "examples" / name).read_text())
    kind = EXAMPLES[name]
    assert document["apiVersion"] == API_VERSION
    assert document["kind"] == kind.kind
    kind.spec.model_validate(document["spec"])


def test_every_kind_is_findable_by_short_name_and_category() -> None:
    for kind in KINDS:
        names = crd(kind)["spec"]["names"]
        assert names["shortNames"] and names["categories"] == ["rlfleet"]
        version = crd(kind)["spec"]["versions"][0]
        assert version["subresources"] == {"status": {}}
        assert any(c["name"] == "Age" for c in version["additionalPrinterColumns"])


def test_schema_is_structural() -> None:
    """The API server refuses refs, anyOf-with-null and additionalProperties: false."""

    def walk(node: object, path: str) -> None:
        if isinstance(node, dict):
            for banned in ("$ref", "$defs", "anyOf", "title", "const"):
                assert banned not in node, f"{banned} at {path}"
            assert node.get("additionalProperties", True) is not False, path
            for key, value in node.items():
                walk(value, f"{path}.{key}")
        elif isinstance(node, list):
            for index, value in enumerate(node):
                walk(value, f"{path}[{index}]")

    for kind in KINDS:
        walk(crd(kind)["spec"]["versions"][0]["schema"], kind.kind)


def test_patterns_are_ones_the_api_server_compiles() -> None:
    """Its patterns are Go's RE2, which refuses a repeat count over 1000 (Python's does not)."""

    def patterns(node: object, path: str) -> Iterator[tuple[str, str]]:
        if isinstance(node, dict):
            if isinstance(node.get("pattern"), str):
                yield path, node["pattern"]
            for key, value in node.items():
                yield from patterns(value, f"{path}.{key}")
        elif isinstance(node, list):
            for index, value in enumerate(node):
                yield from patterns(value, f"{path}[{index}]")

    for kind in KINDS:
        schema = crd(kind)["spec"]["versions"][0]["schema"]
        for path, pattern in patterns(schema, kind.kind):
            bounds = re.findall(r"(?<!\\)\{(\d*),?(\d*)\}", pattern)
            counts = [int(n) for pair in bounds for n in pair if n]
            assert all(n <= RE2_MAX_REPEAT for n in counts), f"{path}: {pattern}"


def test_every_field_has_a_description() -> None:
    """`kubectl explain` and docs/reference show each field's description: none is blank
    but metadata's, which the API server refuses to have described (its schema is its own)."""

    def walk(node: dict, path: str) -> list[str]:
        missing = []
        for name, prop in node.get("properties", {}).items():
            field = f"{path}.{name}"
            if not prop.get("description"):
                missing.append(field)
            missing += walk(prop, field)
        for key, suffix in (("items", "[]"), ("additionalProperties", "{}")):
            if isinstance(node.get(key), dict):
                missing += walk(node[key], path + suffix)
        return missing

    missing = [
        field
        for kind in KINDS
        for field in walk(crd(kind)["spec"]["versions"][0]["schema"]["openAPIV3Schema"], kind.kind)
        if field != f"{kind.kind}.metadata"
    ]
    assert missing == [], f"{len(missing)} fields without a description: {missing}"


def test_models_reject_what_the_api_server_rejects() -> None:
    spec = yaml.safe_load((ROOT / "examples" / "rlrun.yaml").read_text())["spec"]
    with pytest.raises(ValidationError, match="maxStaleness"):
        RLRUN.spec.model_validate({**spec, "maxStaleness": -1})
    with pytest.raises(ValidationError, match="maxStalenes"):
        RLRUN.spec.model_validate({**spec, "maxStalenes": 1})


@pytest.mark.parametrize(
    ("production", "message"),
    [
        ({"feedback": {"weights": {"clicked": 1.0}}}, "every kind must be a built-in"),
        ({"cycle": {"minSamples": 64, "maxSamples": 10}}, "maxSamples must be at least"),
        ({"gate": {"minLengthRatio": 2, "maxLengthRatio": 1}}, "maxLengthRatio must be above"),
    ],
)
def test_production_models_reject_what_its_cel_rules_reject(production, message) -> None:
    """`rlfleet run` has no API server: the models hold the same rules."""
    spec = yaml.safe_load((ROOT / "examples" / "realtime.yaml").read_text())["spec"]
    with pytest.raises(ValidationError, match=message):
        RLRUN.spec.model_validate(spec | {"production": spec["production"] | production})
    custom = {"feedback": {"customKinds": ["clicked"], "weights": {"clicked": 1.0}}}
    RLRUN.spec.model_validate(spec | {"production": spec["production"] | custom})

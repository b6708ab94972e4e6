"""Bad specs generated from the CRDs themselves: for every constrained field of every kind
that an example reaches, a value its schema forbids (one past a bound, too long, off its
pattern or enum, of the wrong type), created by server-side dry run on the bed's real API
server. Each must be refused, naming the field; none is stored (dry run stores nothing).

`test_bed_kube.BAD_SPECS` holds the hand-written cases (CEL rules across fields, names);
this covers the whole schema, so a field added without its bounds in the CRD, or a bound
the API server does not enforce, shows up here.
"""

from __future__ import annotations

import copy
import json
import re
import uuid
from collections.abc import Iterator
from dataclasses import dataclass

import pytest
import yaml
from conftest import ROOT, Kubectl
from kubernetes.client.exceptions import ApiException

from rlfleet.operator.kube import Kube
from rlfleet.testbed.bed import BedInfo

# (example, CRD file, plural) per kind; the examples are what users start from.
KINDS = [
    ("rlrun", "rlfleet.io_rlruns.yaml", "rlruns"),
    ("inferencepool", "rlfleet.io_inferencepools.yaml", "inferencepools"),
    ("envpool", "rlfleet.io_envpools.yaml", "envpools"),
]
WRONG_TYPE = {
    "integer": "seven",
    "number": "seven",
    "string": 7,
    "boolean": "yes",
    "array": "a list",
    "object": "an object",
}


@dataclass(frozen=True)
class Case:
    kind: str
    path: tuple[str | int, ...]  # ("spec", "rollout", "regions", 0, "minGpus")
    value: object
    why: str

    @property
    def field(self) -> str:
        """The path as the API server names it: spec.rollout.regions[0].minGpus."""
        out = ""
        for part in self.path:
            out += f"[{part}]" if isinstance(part, int) else f".{part}" if out else part
        return out


def _forbidden(schema: dict) -> Iterator[tuple[object, str]]:
    """Values `schema` (a leaf's) forbids, each with why."""
    kind = schema.get("type")
    if kind in WRONG_TYPE:
        yield WRONG_TYPE[kind], f"a {type(WRONG_TYPE[kind]).__name__} for a {kind}"
    if kind in ("integer", "number"):
        step = 1 if kind == "integer" else 0.5
        if "minimum" in schema:
            yield schema["minimum"] - step, f"below its minimum {schema['minimum']}"
        if "maximum" in schema:
            yield schema["maximum"] + step, f"above its maximum {schema['maximum']}"
    if kind == "string":
        if "maxLength" in schema:
            yield "a" * (schema["maxLength"] + 1), f"longer than {schema['maxLength']}"
        if schema.get("minLength", 0) > 0:
            yield "", "empty"
        if "pattern" in schema and not re.search(schema["pattern"], "?? off ??"):
            yield "?? off ??", f"off its pattern {schema['pattern']}"
        if "enum" in schema:
            yield "not-one-of-them", f"not one of {schema['enum']}"
    if kind == "array" and "maxItems" in schema:
        item = {"string": "x", "integer": 1}.get(schema.get("items", {}).get("type"))
        if item is not None:
            yield [item] * (schema["maxItems"] + 1), f"more than {schema['maxItems']} items"


def cases(kind: str, schema: dict, document: object, path: tuple = ()) -> Iterator[Case]:
    """Every forbidden value of every field the example `document` reaches: fields it
    sets, and unset fields of objects it has."""
    if schema.get("type") == "object" and isinstance(document, dict):
        for name, child in schema.get("properties", {}).items():
            if name in document:
                yield from cases(kind, child, document[name], (*path, name))
            elif child.get("type") not in ("object", "array"):
                yield from cases(kind, child, None, (*path, name))
        return
    if schema.get("type") == "array" and isinstance(document, list) and document:
        yield from cases(kind, schema.get("items", {}), document[0], (*path, 0))
    for value, why in _forbidden(schema):
        yield Case(kind, path, value, why)


def _with(document: dict, case: Case) -> dict:
    out = copy.deepcopy(document)
    place = out
    for part in case.path[:-1]:
        place = place[part]
    place[case.path[-1]] = case.value
    return out


def _examples() -> dict[str, tuple[dict, dict, str]]:
    found = {}
    for example, crd_file, plural in KINDS:
        document = yaml.safe_load((ROOT / "examples" / f"{example}.yaml").read_text())
        crd = yaml.safe_load((ROOT / "crds" / crd_file).read_text())
        (version,) = [v for v in crd["spec"]["versions"] if v.get("storage")]
        schema = version["schema"]["openAPIV3Schema"]
        # The document's own fields, from spec down (metadata has its own tests).
        found[example] = (document, schema["properties"]["spec"], plural)
    return found


def test_the_generator_reaches_every_kind_and_every_way_to_be_wrong() -> None:
    generated = [
        c
        for kind, (document, schema, _) in _examples().items()
        for c in cases(kind, schema, document["spec"], ("spec",))
    ]
    assert {c.kind for c in generated} == {example for example, _, _ in KINDS}
    whys = " ".join(c.why for c in generated)
    for way in ("below its minimum", "above its maximum", "longer than", "off its pattern"):
        assert way in whys
    assert len(generated) > 100


@pytest.mark.usefixtures("crds_installed")
def test_every_generated_bad_spec_is_refused_naming_its_field(
    bed: BedInfo, kubectl: Kubectl
) -> None:
    namespace = f"gen-{uuid.uuid4().hex[:6]}"
    kubectl.run("hub", "create", "namespace", namespace)
    kube = Kube.from_kubeconfig(yaml.safe_load(bed.kubeconfigs["hub"].read_text()), "hub")
    accepted, unnamed, tried = [], [], 0
    try:
        for kind, (document, schema, plural) in _examples().items():
            document = copy.deepcopy(document)
            document["metadata"] = {"name": f"gen-{kind}", "namespace": namespace}
            path = f"/apis/rlfleet.io/v1alpha1/namespaces/{namespace}/{plural}"
            dry = [("dryRun", "All")]
            kube.request("POST", path, document, query=dry)  # the example itself is taken
            for case in cases(kind, schema, document["spec"], ("spec",)):
                tried += 1
                try:
                    kube.request("POST", path, _with(document, case), query=dry)
                except ApiException as error:
                    message = json.loads(error.body).get("message", "")
                    if error.status != 422 or case.field not in message:
                        unnamed.append(f"{kind} {case.field} ({case.why}): {message[:300]}")
                    continue
                accepted.append(f"{kind} {case.field} = {case.value!r} ({case.why})")
    finally:
        kubectl.run("hub", "delete", "namespace", namespace, "--wait=false", check=False)
    print(json.dumps({"bad_specs_tried": tried, "bad_specs_accepted": len(accepted)}))
    assert accepted == [] and unnamed == [], (accepted, unnamed)

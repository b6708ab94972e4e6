"""Every field of the three specs does something: some code outside `rlfleet.api` reads it.

A field a user may set that nothing reads is worse than a missing one: it is accepted and
has no effect. A read is an attribute access of the field's Python name (`.zero_stage`)
that is not called (`str.format` is no read of a field `format`), anywhere in the source
roots but the API package. A name shared with other code (`name`, `image`) can pass on
another object's read: this catches the field nobody reads at all, not every wiring bug.
"""

from __future__ import annotations

import ast
import types
import typing
from collections.abc import Iterator
from pathlib import Path

from pydantic import BaseModel

from rlfleet.api.envpool import EnvPoolSpec
from rlfleet.api.inferencepool import InferencePoolSpec
from rlfleet.api.rlrun import RLRunSpec

ROOT = Path(__file__).resolve().parents[2]
SOURCE_ROOTS = ("core", "operator", "trainer", "rollout", "weightsync")
API = ROOT / "core" / "rlfleet" / "api"
SPECS = (RLRunSpec, InferencePoolSpec, EnvPoolSpec)
# Fields no component needs to read, by wire path, each with the reason: the API server
# acts on them itself (a CEL rule), say. Empty: every field is read today.
UNREAD_ALLOWED: dict[str, str] = {}


def _models(annotation: object) -> Iterator[type[BaseModel]]:
    """The models an annotation holds: itself, or inside `list[...]`, `X | None`, ..."""
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        yield annotation
        return
    if isinstance(annotation, types.UnionType) or typing.get_origin(annotation) is not None:
        for argument in typing.get_args(annotation):
            yield from _models(argument)


def spec_fields() -> Iterator[tuple[str, str]]:
    """(wire path, Python name) of every field of the specs, nested models' fields too."""

    def walk(model: type[BaseModel], prefix: str) -> Iterator[tuple[str, str]]:
        for name, field in model.model_fields.items():
            path = f"{prefix}.{field.alias or name}"
            yield path, name
            for nested in _models(field.annotation):
                yield from walk(nested, path)

    for spec in SPECS:
        yield from walk(spec, spec.__name__.removesuffix("Spec") + ".spec")


def reads(source: str) -> set[str]:
    """The attribute names a module reads: loaded, and not called."""
    tree = ast.parse(source)
    called = {id(node.func) for node in ast.walk(tree) if isinstance(node, ast.Call)}
    return {
        node.attr
        for node in ast.walk(tree)
        if isinstance(node, ast.Attribute)
        and isinstance(node.ctx, ast.Load)
        and id(node) not in called
    }


def read_names() -> set[str]:
    """The attribute names the source reads, outside `rlfleet.api`."""
    names: set[str] = set()
    for root in SOURCE_ROOTS:
        for path in (ROOT / root).rglob("*.py"):
            if not path.is_relative_to(API):
                names |= reads(path.read_text())
    return names


def test_the_walk_sees_nested_and_listed_models() -> None:
    paths = dict(spec_fields())
    assert paths["RLRun.spec.trainer.checkpointStorage.storageClassName"] == "storage_class_name"
    assert paths["RLRun.spec.rollout.regions.inferencePools"] == "inference_pools"
    assert paths["InferencePool.spec.offPeakWindows.timeZone"] == "time_zone"
    assert paths["EnvPool.spec.limits.timeoutSeconds"] == "timeout_seconds"


def test_a_read_is_an_attribute_loaded_not_called_nor_set() -> None:
    assert reads("'{}'.format(x)\nconfig.zero = 1\nspec.model.uri\n") == {"model", "uri"}


def test_every_spec_field_is_read_outside_the_api() -> None:
    read = read_names()
    unread = [
        path for path, name in spec_fields() if name not in read and path not in UNREAD_ALLOWED
    ]
    assert not unread, (
        "spec fields nothing outside rlfleet.api reads (a user setting them gets no effect): "
        f"{', '.join(unread)}; wire them, remove them from the API, or allow one in "
        "UNREAD_ALLOWED with the reason"
    )


def test_allowed_unread_fields_exist_and_are_still_unread() -> None:
    names, read = dict(spec_fields()), read_names()
    stale = [path for path in UNREAD_ALLOWED if path not in names or names[path] in read]
    assert not stale, f"UNREAD_ALLOWED entries that are no spec field or are read now: {stale}"

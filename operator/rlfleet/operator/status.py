"""Conditions and timestamps as the API conventions want them."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import TypeVar

from rlfleet.api.meta import ApiModel, Condition

Status = TypeVar("Status", bound=ApiModel)


@dataclass(frozen=True)
class Event:
    """A Kubernetes Event to post on the object being reconciled."""

    type: str  # Normal | Warning
    reason: str  # CamelCase
    message: str


def now() -> datetime:
    return datetime.now(UTC)


def timestamp(moment: datetime | None = None) -> str:
    return (moment or now()).strftime("%Y-%m-%dT%H:%M:%SZ")


def parse_time(text: str | None) -> datetime | None:
    return datetime.strptime(text, "%Y-%m-%dT%H:%M:%SZ").replace(tzinfo=UTC) if text else None


def condition(
    previous: Sequence[Condition],
    kind: str,
    true: bool | None,
    reason: str,
    message: str,
    generation: int,
    moment: datetime | None = None,
) -> Condition:
    """One condition (`true` None: Unknown); its lastTransitionTime moves (to `moment`,
    else now) only when its status changes."""
    status = "Unknown" if true is None else "True" if true else "False"
    old = find(previous, kind)
    changed = old is None or old.status != status
    return Condition(
        type=kind,
        status=status,
        reason=reason,
        message=message,
        last_transition_time=timestamp(moment) if changed else old.last_transition_time,
        observed_generation=generation,
    )


def invalid_spec(
    previous: Sequence[Condition], problems: Sequence[str], generation: int
) -> tuple[Condition, list[Event]]:
    """`Ready` False for spec fields the schema cannot check (each problem names its field),
    and a Warning event when the problems are new: said at once, not every resync."""
    message = "; ".join(problems)
    ready = condition(previous, "Ready", False, "InvalidSpec", message, generation)
    was = find(previous, "Ready")
    told = was is not None and was.reason == "InvalidSpec" and was.message == message
    return ready, [] if told else [Event("Warning", "InvalidSpec", message)]


def find(conditions: Sequence[Condition], kind: str) -> Condition | None:
    return next((c for c in conditions if c.type == kind), None)


def is_present(conditions: Sequence[Condition], kind: str) -> bool:
    return find(conditions, kind) is not None


def is_true(conditions: Sequence[Condition], kind: str) -> bool:
    found = find(conditions, kind)
    return found is not None and found.status == "True"


def merged(kind: type[Status], *parts: ApiModel) -> Status:
    """One status from partial ones, each holding only the fields it was given; a later
    part's field wins."""
    given: dict = {}
    for part in parts:
        given |= {name: getattr(part, name) for name in part.model_fields_set}
    return kind.model_validate(given)


def differs(old: dict | None, new: dict) -> bool:
    """Whether merging `new` into the status `old` would change it (None deletes a key)."""
    old = old or {}
    return any(old.get(key) != value for key, value in new.items())

"""Conditions and timestamps as the API conventions want them."""

from __future__ import annotations

from dataclasses import dataclass
from datetime import UTC, datetime


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
    previous: list[dict], kind: str, true: bool, reason: str, message: str, generation: int
) -> dict:
    """One condition; its lastTransitionTime moves only when its status changes."""
    status = "True" if true else "False"
    old = next((c for c in previous if c.get("type") == kind), None)
    changed = old is None or old.get("status") != status
    return {
        "type": kind,
        "status": status,
        "reason": reason,
        "message": message,
        "lastTransitionTime": timestamp() if changed else old["lastTransitionTime"],
        "observedGeneration": generation,
    }


def is_present(conditions: list[dict], kind: str) -> bool:
    return any(c.get("type") == kind for c in conditions)


def is_true(conditions: list[dict], kind: str) -> bool:
    return any(c.get("type") == kind and c.get("status") == "True" for c in conditions)


def differs(old: dict | None, new: dict) -> bool:
    """Whether merging `new` into the status `old` would change it (None deletes a key)."""
    old = old or {}
    return any(old.get(key) != value for key, value in new.items())

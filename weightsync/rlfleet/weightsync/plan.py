"""Which versions a receiver fetches to reach a target: a pure decision on manifests.

Every version is published as a delta on the one before it; every `snapshot_every`-th
also as a full snapshot. A receiver holding a version walks deltas forward from it; one
that holds nothing, or whose version was retired, or that failed to verify, starts
from the newest snapshot it can reach the target from.
"""

from __future__ import annotations

from collections.abc import Mapping

from rlfleet.api.wire import WeightManifest

Key = tuple[int, str]  # (version, kind)


def _deltas_back(known: Mapping[Key, WeightManifest], target: int, stop: int) -> list[Key] | None:
    """Deltas that lead from `stop` to `target`, oldest first, or None if a link is missing."""
    path: list[Key] = []
    version = target
    while version != stop:
        if version < stop:
            return None
        delta = known.get((version, "delta"))
        if delta is None or delta.base_version is None or delta.base_version >= version:
            return None
        path.append((version, "delta"))
        version = delta.base_version
    return path[::-1]


def plan(known: Mapping[Key, WeightManifest], current: int | None, target: int) -> list[Key] | None:
    """The manifests to apply in order to go from `current` to `target`, or None if none."""
    if current == target:
        return []
    if current is not None and current < target:
        forward = _deltas_back(known, target, current)
        if forward is not None:
            return forward
    snapshots = sorted((v for v, kind in known if kind == "full" and v <= target), reverse=True)
    for snapshot in snapshots:
        forward = _deltas_back(known, target, snapshot)
        if forward is not None:
            return [(snapshot, "full"), *forward]
    return None

"""Trainer ranks publishing one model together: who owns which tensor, and what each rank
tells rank 0 about the shards it put, so that rank 0 can write the one manifest."""

from __future__ import annotations

import heapq
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import msgspec

from rlfleet.api.wire import ShardRef, WeightManifest
from rlfleet.weightsync.state import TensorEntry


@dataclass(frozen=True)
class Part:
    """This process's place among the `world` ranks that publish one model.

    `gather` is a collective: every rank calls it with one object and gets every rank's
    object back, in rank order (`torch.distributed.all_gather_object` does this). The
    publisher calls it from a worker thread, the same number of times on every rank.
    """

    rank: int
    world: int
    gather: Callable[[Any], list[Any]]

    def __post_init__(self) -> None:
        if not 0 <= self.rank < self.world:
            raise ValueError(f"rank {self.rank} is not in a world of {self.world}")


ALONE = Part(0, 1, lambda obj: [obj])


def owned_names(sizes: Mapping[str, int], rank: int, world: int) -> set[str]:
    """The tensors `rank` publishes: largest first, each to the rank with the fewest bytes
    so far (the lowest rank on a tie). The same on every rank for the same sizes."""
    if not 0 <= rank < world:
        raise ValueError(f"rank {rank} is not in a world of {world}")
    loads = [(0, r) for r in range(world)]
    owned: set[str] = set()
    for name in sorted(sizes, key=lambda n: (-sizes[n], n)):
        load, owner = heapq.heappop(loads)
        if owner == rank:
            owned.add(name)
        heapq.heappush(loads, (load + sizes[name], owner))
    return owned


# The ranks' reports cross processes that may run two releases while the trainer's pods
# roll: unknown fields are skipped (`rlfleet.api.wire`'s rules), all else is checked.
class RankEncoding(msgspec.Struct, frozen=True):
    """One encoding (delta or full) of a version, as far as one rank put it."""

    shards: list[ShardRef]
    tensors: list[TensorEntry]
    removed: list[str]  # tensors of this rank's base that it no longer has


class RankReport(msgspec.Struct, frozen=True):
    """What a rank did for a version: its encodings, in the order every rank makes them,
    or why it could not."""

    rank: int
    base_version: int | None
    encodings: list[RankEncoding]
    error: str | None = None


class ManifestReport(msgspec.Struct, frozen=True):
    """Rank 0's word to every rank on a version: the manifests it put, or why it could not."""

    manifests: list[WeightManifest]
    error: str | None = None

"""Weightsync's tunables, in one place. The RLRun spec fills these in production."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class SyncConfig:
    # A full snapshot every this many versions; the versions between are deltas.
    snapshot_every: int = 25
    # Encoded shards stay below this many bytes, so they move and retry independently.
    shard_bytes: int = 32 << 20
    # One JetStream message carries at most this much of a shard (server max_payload).
    chunk_bytes: int = 1 << 20
    # Snapshots kept on the stream; receivers further behind start from the oldest.
    keep_snapshots: int = 2
    zstd_level: int = 3
    # Dense XOR is tried only where at least this fraction of a piece changed.
    dense_from_fraction: float = 0.1
    # Shards fetched at once by a receiver: bounds its memory and the server's burst.
    parallel_fetches: int = 8

    def __post_init__(self) -> None:
        if self.snapshot_every < 1:
            raise ValueError("snapshot_every must be at least 1")
        if self.chunk_bytes < 1024 or self.shard_bytes < self.chunk_bytes:
            raise ValueError("shard_bytes must be at least chunk_bytes, and that at least 1 KiB")
        if self.keep_snapshots < 1 or self.parallel_fetches < 1:
            raise ValueError("keep_snapshots and parallel_fetches must be at least 1")

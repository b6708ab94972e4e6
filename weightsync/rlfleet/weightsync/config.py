"""Weightsync's tunables, in one place. The RLRun spec fills these in production."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class SyncConfig:
    # A full snapshot every this many versions; the versions between are deltas.
    snapshot_every: int = 25
    # Encoded shards stay below this many bytes, so they move and retry independently.
    # One batched direct get returns at most ~64 MiB, so a shard must stay below that.
    shard_bytes: int = 8 << 20
    # One JetStream message carries at most this much of a shard. A server counts
    # headers against its max_payload (1 MiB by default) and a leaf node drops its link
    # on an oversized message, so leave room for the direct-get headers.
    chunk_bytes: int = (1 << 20) - (4 << 10)
    # Snapshots kept on the stream; receivers further behind start from the oldest.
    keep_snapshots: int = 2
    zstd_level: int = 3
    # Dense coding is tried only where at least this fraction of a piece changed.
    dense_from_fraction: float = 0.25
    # Shards fetched at once by a receiver. A server drops a client with more than its
    # max_pending (64 MiB by default) queued, so shards in flight must stay below it.
    parallel_fetches: int = 4

    MAX_SHARD_BYTES = 60 << 20
    MAX_IN_FLIGHT_BYTES = 48 << 20

    def __post_init__(self) -> None:
        if self.snapshot_every < 1:
            raise ValueError("snapshot_every must be at least 1")
        if self.chunk_bytes < 1024 or self.shard_bytes < self.chunk_bytes:
            raise ValueError("shard_bytes must be at least chunk_bytes, and that at least 1 KiB")
        if self.keep_snapshots < 1 or self.parallel_fetches < 1:
            raise ValueError("keep_snapshots and parallel_fetches must be at least 1")
        if self.shard_bytes > self.MAX_SHARD_BYTES:
            raise ValueError(f"shard_bytes must be at most {self.MAX_SHARD_BYTES}")
        if self.shard_bytes * self.parallel_fetches > self.MAX_IN_FLIGHT_BYTES:
            raise ValueError(
                f"shard_bytes * parallel_fetches must be at most {self.MAX_IN_FLIGHT_BYTES}"
            )

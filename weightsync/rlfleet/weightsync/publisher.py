"""The trainer's side: turn each new policy into a published version.

Every version goes out as a delta on the one before it; every `snapshot_every`-th also
as a full snapshot, for receivers that join late, fell behind retention or failed to
verify. Shards go up before their manifest, so a manifest on the stream always means a
complete version. After a snapshot, versions older than the `keep_snapshots`-th newest
snapshot are purged, on the hub and on every region's mirror (purges do not travel
down a mirror): every receiver can still reach the head from what remains.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Mapping, Sequence

import nats.errors
import torch

from rlfleet.api.wire import WeightManifest
from rlfleet.weightsync import metrics
from rlfleet.weightsync.config import SyncConfig
from rlfleet.weightsync.shards import EncodedVersion, encode_version
from rlfleet.weightsync.state import WeightState
from rlfleet.weightsync.transport import WeightStream

log = logging.getLogger(__name__)

MIRROR_RETIRE_TIMEOUT_S = 5.0


class Publisher:
    def __init__(
        self, stream: WeightStream, config: SyncConfig, mirrors: Sequence[WeightStream] = ()
    ) -> None:
        self.stream = stream
        self.config = config
        self.mirrors = list(mirrors)
        self._base: WeightState | None = None
        self._snapshots: list[int] = []

    async def publish(
        self, tensors: Mapping[str, torch.Tensor], version: int
    ) -> list[WeightManifest]:
        """Publish `tensors` as `version`; returns the manifests put on the stream."""
        if self._base is not None and version <= self._base.version:
            raise ValueError(f"version {version} is not after {self._base.version}")
        snapshot = self._base is None or version % self.config.snapshot_every == 0
        # The host copy is the next base; its digests serve every encoding of this version.
        current = await asyncio.to_thread(WeightState.copy_of, tensors, version)
        bases = ([self._base] if self._base is not None else []) + ([None] if snapshot else [])
        encoded: list[EncodedVersion] = []
        for base in bases:
            encoded.append(
                await asyncio.to_thread(
                    encode_version,
                    self.stream.run,
                    version,
                    current.tensors,
                    base,
                    self.config,
                    current.digests,
                )
            )
        for version_data in encoded:
            await self.stream.put_version(version_data)
            m = version_data.manifest
            size = sum(s.size for s in m.shards)
            metrics.PUBLISHED_BYTES.labels(m.kind).inc(size)
            log.info(
                "published version %d (%s): %d shards, %d bytes for %d model bytes",
                m.version,
                m.kind,
                len(m.shards),
                size,
                m.state_bytes,
            )
        self._base = current
        if snapshot:
            await self._retire(version)
        return [version_data.manifest for version_data in encoded]

    async def _retire(self, snapshot: int) -> None:
        self._snapshots.append(snapshot)
        if len(self._snapshots) > self.config.keep_snapshots:
            self._snapshots = self._snapshots[-self.config.keep_snapshots :]
            await self.stream.retire_before(self._snapshots[0])
            await asyncio.gather(
                *(self._retire_mirror(m, self._snapshots[0]) for m in self.mirrors)
            )

    async def _retire_mirror(self, mirror: WeightStream, snapshot: int) -> None:
        """A region that is cut off, or has no mirror yet, keeps its old versions until
        a later snapshot's retirement reaches it; a step waits on it at most the timeout."""
        try:
            await asyncio.wait_for(mirror.retire_before(snapshot), MIRROR_RETIRE_TIMEOUT_S)
        except (TimeoutError, nats.errors.Error) as error:
            log.warning(
                "versions before %d stay on %s's mirror: %r", snapshot, mirror.domain, error
            )

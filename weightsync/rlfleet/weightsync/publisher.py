"""The trainer's side: turn each new policy into a published version.

Every version goes out as a delta on the one before it; every `snapshot_every`-th also
as a full snapshot, for receivers that join late, fell behind retention or failed to
verify. Shards go up before their manifest, so a manifest on the stream always means a
complete version. After a snapshot, versions older than the `keep_snapshots`-th newest
snapshot are purged, on the hub and on every region's mirror (purges do not travel
down a mirror): every receiver can still reach the head from what remains. A `pinned`
version (what a production pool serves, to go back to) is kept too, with the snapshot
it is rebuilt from; while that snapshot is unknown (a publisher restarted since), nothing
is purged.

A trainer whose ranks each hold part of the model publishes with a `Part` per rank: each
rank encodes and puts only its own tensors' shards, streaming them out as they are made,
and rank 0 puts the manifest. The base of the next delta is a copy of only the rank's
own tensors, so no process ever holds the whole model; each is kept where the tensor
is (host or device), so a trainer's GPU finds and compacts its delta and only that
crosses to the host (`Publisher._commit` says what the host keeps of it).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Mapping, Sequence

import msgspec
import nats.errors
import torch

from rlfleet.api.wire import ShardRef, WeightManifest
from rlfleet.weightsync import metrics
from rlfleet.weightsync.config import SyncConfig
from rlfleet.weightsync.ranks import ALONE, ManifestReport, Part, RankEncoding, RankReport
from rlfleet.weightsync.shards import encode_shards, version_manifest
from rlfleet.weightsync.state import WeightState, tensor_entries
from rlfleet.weightsync.transport import SHARDS_IN_FLIGHT, WeightStream

log = logging.getLogger(__name__)

MIRROR_RETIRE_TIMEOUT_S = 5.0


class PublishFailed(RuntimeError):
    """Another rank could not do its part of a version, so no manifest of it went out."""


class Publisher:
    """Publishes a model's versions, alone or as one of the ranks in `part`.

    Among ranks, each passes `publish` only the tensors it owns (`owned_names`) and keeps
    a base of only those; each encodes and puts its own shards, then rank 0, once every
    rank's shards are on the stream, puts the one manifest listing them all with the
    digest of the whole state. Every rank calls `publish` for the same versions, and
    decides delta or snapshot, and what to retire, alike.
    """

    def __init__(
        self,
        stream: WeightStream,
        config: SyncConfig,
        mirrors: Sequence[WeightStream] = (),
        part: Part | None = None,
        on_device: bool | None = None,
    ) -> None:
        """`on_device`: find deltas where each tensor is (None), also for host tensors
        as if they were on a device (True: tests and benchmarks of that path), or always
        on the host, copying device tensors there whole (False)."""
        self.stream = stream
        self.config = config
        self.mirrors = list(mirrors)
        self.part = part or ALONE
        self.on_device = on_device
        self._base: WeightState | None = None
        # Host copies of the base's tensors that live on a device, for their digests.
        self._host_base: dict[str, torch.Tensor] = {}
        self._snapshots: list[int] = []  # this publisher's, oldest first, none purged
        self._purged_before = 0
        self.pinned: int | None = None  # a version never purged, nor the snapshot before it

    async def publish(
        self, tensors: Mapping[str, torch.Tensor], version: int
    ) -> list[WeightManifest]:
        """Publish `tensors` as `version`; returns the manifests put on the stream.

        `tensors` (host or device) must not change until this returns: they are read
        while encoding and copied into the base only once the version is out.
        """
        host_base = self._host_base
        try:
            return await self._publish(tensors, version)
        except BaseException:
            # Unless the version became the base, encoding brought these copies part or
            # all of the way to a version that is not: they are made again from the base
            # as the next version needs them. A new dict, so that an encoding still
            # running in its thread cannot write into the one the next version uses.
            committed = self._base is not None and self._base.version == version
            if not committed and self._host_base is host_base:
                self._host_base = {}
            raise

    async def _publish(
        self, tensors: Mapping[str, torch.Tensor], version: int
    ) -> list[WeightManifest]:
        base = self._base
        if base is not None and version <= base.version:
            raise ValueError(f"version {version} is not after {base.version}")
        snapshot = base is None or version % self.config.snapshot_every == 0
        bases = ([base] if base is not None else []) + ([None] if snapshot else [])
        base_version = base.version if base is not None else None
        digests: dict[str, bytes] = {}
        failure: Exception | None = None
        try:
            encodings = [await self._put_shards(tensors, version, b, digests) for b in bases]
            report = RankReport(self.part.rank, base_version, encodings)
        except Exception as error:
            # Every rank still reports, so that none waits on the gather for ever.
            failure = error
            report = RankReport(self.part.rank, base_version, [], f"{error!r}")
        reports = [
            msgspec.msgpack.decode(data, type=RankReport)
            for data in await self._gather(msgspec.msgpack.encode(report))
        ]
        if failure is not None:
            raise failure
        if problems := [f"rank {r.rank}: {r.error}" for r in reports if r.error is not None]:
            raise PublishFailed(f"version {version}: {'; '.join(problems)}")
        if any(r.base_version != base_version for r in reports):
            raise PublishFailed(
                f"version {version}: ranks hold bases {[r.base_version for r in reports]}"
            )
        outcome = ManifestReport([])
        if self.part.rank == 0:
            try:
                outcome = ManifestReport(
                    await self._put_manifests(
                        version, [b.version if b is not None else None for b in bases], reports
                    )
                )
            except Exception as error:
                failure = error
                outcome = ManifestReport([], f"{error!r}")
        outcome = msgspec.msgpack.decode(
            (await self._gather(msgspec.msgpack.encode(outcome)))[0], type=ManifestReport
        )
        if failure is not None:
            raise failure
        if outcome.error is not None:
            raise PublishFailed(f"version {version}: rank 0 put no manifest: {outcome.error}")
        await asyncio.to_thread(self._commit, tensors, version, digests)
        if snapshot:
            await self._retire(version)
        return outcome.manifests

    async def _gather(self, data: bytes) -> list[bytes]:
        return await asyncio.to_thread(self.part.gather, data)

    async def _put_shards(
        self,
        tensors: Mapping[str, torch.Tensor],
        version: int,
        base: WeightState | None,
        digests: dict[str, bytes],
    ) -> RankEncoding:
        """Encodes this rank's tensors and puts each shard as it is made, a bounded number
        at a time, so that neither the encoded version nor a copy of it is ever held."""
        kind = "delta" if base is not None else "full"
        shards = encode_shards(
            self.stream.run,
            version,
            tensors,
            base,
            self.config,
            digests,
            rank=self.part.rank,
            world=self.part.world,
            host_base=self._host_base,
            on_device=self.on_device,
        )
        window = asyncio.Semaphore(SHARDS_IN_FLIGHT)
        puts: set[asyncio.Task[None]] = set()
        refs: list[ShardRef] = []

        async def put(ref: ShardRef, data: bytes) -> None:
            try:
                await self.stream.put_shard(version, kind, ref, data, connection)
            finally:
                window.release()

        async with self.stream.connection() as connection:
            try:
                while (item := await asyncio.to_thread(next, shards, None)) is not None:
                    refs.append(item[0])
                    await window.acquire()
                    for task in [t for t in puts if t.done()]:
                        puts.discard(task)
                        task.result()  # the first failed put ends the version here
                    puts.add(asyncio.create_task(put(*item)))
                await asyncio.gather(*puts)
            finally:
                for task in puts:
                    task.cancel()
                await asyncio.gather(*puts, return_exceptions=True)
                # Still running in its thread if this task was cancelled: it ends with it.
                with contextlib.suppress(ValueError):
                    shards.close()
        metrics.PUBLISHED_BYTES.labels(kind).inc(sum(ref.size for ref in refs))
        removed = sorted(set(base.tensors) - set(tensors)) if base is not None else []
        return RankEncoding(refs, tensor_entries(tensors, digests), removed)

    async def _put_manifests(
        self, version: int, bases: list[int | None], reports: list[RankReport]
    ) -> list[WeightManifest]:
        """Rank 0's part: for each encoding (on each of `bases`, None for the snapshot),
        one manifest over every rank's shards and tensors."""
        manifests = []
        for i, version_base in enumerate(bases):
            parts = [r.encodings[i] for r in reports]
            entries = [entry for p in parts for entry in p.tensors]
            names = {entry.name for entry in entries}
            if len(names) != len(entries):
                raise ValueError("ranks publish some tensor twice: their parts overlap")
            removed = {name for p in parts for name in p.removed} - names
            shards = [ref for p in parts for ref in p.shards]
            manifest = version_manifest(
                self.stream.run, version, version_base, shards, entries, sorted(removed)
            )
            await self.stream.put_manifest(manifest)
            manifests.append(manifest)
            log.info(
                "published version %d (%s): %d shards from %d ranks, %d bytes for %d model bytes",
                version,
                manifest.kind,
                len(shards),
                len(reports),
                sum(ref.size for ref in shards),
                manifest.state_bytes,
            )
        return manifests

    def _commit(
        self, tensors: Mapping[str, torch.Tensor], version: int, digests: dict[str, bytes]
    ) -> None:
        """Makes `tensors` the next base, into the old base's buffers where they fit, so that
        this rank holds one copy of its tensors, never two, each on the tensor's device:
        a device tensor's next delta is then found there, and the model does not cross
        to the host at every version.

        Digests are computed on the host, so the host also keeps a copy of each device
        tensor (`_host_base`), which encoding brought to this version by applying each
        compacted delta to it, as a receiver would apply the delta. That costs host
        memory for a copy of the rank's device tensors and host time in proportion to
        what changed; copying each tensor to the host to hash it would keep no host
        memory but move the whole model over PCIe at every version (in RL every tensor
        changes at every step), which finding the delta on the device is there to avoid.
        A tensor sent raw (new, reshaped, or in a snapshot) crosses whole anyway, and
        that copy becomes its host copy."""
        old = self._base.tensors if self._base is not None else {}
        copies = {}
        for name, tensor in tensors.items():
            buffer = old.get(name)
            if (
                buffer is None
                or buffer.dtype != tensor.dtype
                or buffer.shape != tensor.shape
                or buffer.device != tensor.device
            ):
                buffer = torch.empty(tensor.shape, dtype=tensor.dtype, device=tensor.device)
            copies[name] = buffer.copy_(tensor.detach())
        for device in {buffer.device for buffer in copies.values() if buffer.is_cuda}:
            torch.cuda.synchronize(device)  # `tensors` are the caller's again on return
        for name in [n for n in self._host_base if n not in tensors]:
            self._host_base.pop(name, None)
        self._base = self._base or WeightState()
        self._base.commit(copies, version, digests)

    async def _retire(self, snapshot: int) -> None:
        self._snapshots.append(snapshot)
        if len(self._snapshots) <= self.config.keep_snapshots:
            return
        oldest = self._snapshots[-self.config.keep_snapshots]
        if self.pinned is not None:
            under = [s for s in self._snapshots if s <= self.pinned]
            if not under:
                return  # the pinned version's snapshot is not known to be ours: keep all
            oldest = min(oldest, under[-1])
        self._snapshots = [s for s in self._snapshots if s >= oldest]
        if oldest <= self._purged_before:
            return
        self._purged_before = oldest
        if self.part.rank == 0:  # every rank keeps the count; one purges
            await self.stream.retire_before(oldest)
            await asyncio.gather(*(self._retire_mirror(m, oldest) for m in self.mirrors))

    async def _retire_mirror(self, mirror: WeightStream, snapshot: int) -> None:
        """A region that is cut off, or has no mirror yet, keeps its old versions until
        a later snapshot's retirement reaches it; a step waits on it at most the timeout."""
        try:
            await asyncio.wait_for(mirror.retire_before(snapshot), MIRROR_RETIRE_TIMEOUT_S)
        except (TimeoutError, nats.errors.Error) as error:
            log.warning(
                "versions before %d stay on %s's mirror: %r", snapshot, mirror.domain, error
            )

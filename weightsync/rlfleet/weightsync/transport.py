"""Weight versions on NATS JetStream: one stream per run, on the hub, mirrored per region.

The stream and its mirrors are declared, made and deleted with the run's other streams
(`rlfleet.bus.streams`); this module publishes into them and reads from them.

Subjects, under ``rlfleet.weights.<run>.<version>``:

- ``.manifest.<kind>``: the version's manifest (JSON), published last;
- ``.<kind>.<shard>``: the shard, as consecutive chunks of at most `chunk_bytes`.

Shards are fetched with JetStream's batched direct get: one request per shard returns
all its chunks, served by whichever server holds the stream (the region's mirror, when
the receiver's JetStream context points at its region), so a version crosses the WAN
once per region however many receivers it has. A bounded number of shard requests is
in flight at once; that window, not the server, sets how much a receiver buffers.
"""

from __future__ import annotations

import asyncio
import json
import logging
from dataclasses import dataclass

import nats.js.errors
from nats.aio.client import Client
from nats.aio.msg import Msg
from nats.js import JetStreamContext

from rlfleet.api.wire import ShardRef, WeightManifest, weights_prefix, weights_stream
from rlfleet.api.wire import encode as encode_message
from rlfleet.bus.streams import bind_stream
from rlfleet.weightsync.config import SyncConfig
from rlfleet.weightsync.errors import CorruptShard
from rlfleet.weightsync.shards import EncodedVersion

log = logging.getLogger(__name__)

CHUNK_HEADER = "Rlfleet-Chunk"
# Shards a publisher has awaiting the stream's acks at once: with shards of up to 8 MiB in
# 1 MiB chunks, about 64 messages in flight, and a bounded amount of memory.
SHARDS_IN_FLIGHT = 8
_END_OF_BATCH = "204"


@dataclass(frozen=True)
class Subjects:
    run: str

    @property
    def prefix(self) -> str:
        return weights_prefix(self.run)

    @property
    def stream(self) -> str:
        return weights_stream(self.run)

    @property
    def manifests(self) -> str:
        return f"{self.prefix}.*.manifest.*"

    def manifest(self, version: int, kind: str) -> str:
        return f"{self.prefix}.{version}.manifest.{kind}"

    def shard(self, version: int, kind: str, index: int) -> str:
        return f"{self.prefix}.{version}.{kind}.{index}"

    def version_of(self, subject: str) -> int:
        return int(subject.removeprefix(self.prefix + ".").split(".", 1)[0])


class WeightStream:
    """One run's weights on one JetStream domain: publish, list, fetch, retire."""

    def __init__(self, nc: Client, run: str, config: SyncConfig, domain: str | None = None):
        self.nc = nc
        self.run = run
        self.config = config
        self.domain = domain
        self.js: JetStreamContext = nc.jetstream(domain=domain)
        self.subjects = Subjects(run)
        prefix = f"$JS.{domain}.API" if domain else "$JS.API"
        self._direct_get = f"{prefix}.DIRECT.GET.{self.subjects.stream}"

    async def bind(self) -> None:
        """Waits for the stream (or mirror) on this domain, which the run's owner makes;
        `StreamMissing`, naming it, when it is not there."""
        await bind_stream(self.js, self.subjects.stream)

    async def put_shard(self, version: int, kind: str, ref: ShardRef, data: bytes) -> None:
        """One shard, as its chunks, all acknowledged by the stream."""
        subject = self.subjects.shard(version, kind, ref.index)
        chunk = self.config.chunk_bytes
        count = max(1, -(-len(data) // chunk))
        await asyncio.gather(
            *(
                self.js.publish(
                    subject,
                    data[i * chunk : (i + 1) * chunk],
                    headers={CHUNK_HEADER: f"{i}/{count}", "Nats-Msg-Id": f"{subject}.{i}"},
                    stream=self.subjects.stream,
                )
                for i in range(count)
            )
        )

    async def put_manifest(self, manifest: WeightManifest) -> None:
        """Put last: receivers take a manifest on the stream as a complete version."""
        subject = self.subjects.manifest(manifest.version, manifest.kind)
        await self.js.publish(
            subject,
            encode_message(manifest),
            headers={"Nats-Msg-Id": subject},
            stream=self.subjects.stream,
        )

    async def put_version(self, version: EncodedVersion) -> None:
        manifest = version.manifest
        window = asyncio.Semaphore(SHARDS_IN_FLIGHT)

        async def put(ref: ShardRef, data: bytes) -> None:
            async with window:
                await self.put_shard(manifest.version, manifest.kind, ref, data)

        await asyncio.gather(
            *(put(ref, data) for ref, data in zip(manifest.shards, version.shards, strict=True))
        )
        await self.put_manifest(manifest)

    async def fetch_shard(self, manifest: WeightManifest, ref: ShardRef) -> bytes:
        """One shard's bytes, all chunks in order, or CorruptShard if any is off.

        Callers bound the wait (`asyncio.timeout`); a cancelled fetch leaves nothing behind.
        """
        subject = self.subjects.shard(manifest.version, manifest.kind, ref.index)
        count = max(1, -(-ref.size // self.config.chunk_bytes))
        inbox = self.nc.new_inbox()
        chunks: dict[int, bytes] = {}
        done = asyncio.get_running_loop().create_future()

        async def collect(msg: Msg) -> None:
            status = msg.headers.get("Status") if msg.headers else None
            if status == _END_OF_BATCH or status is not None:
                if not done.done():
                    done.set_result(status)
                return
            index = int(msg.headers.get(CHUNK_HEADER, "-1/0").split("/", 1)[0])
            chunks.setdefault(index, msg.data)

        sub = await self.nc.subscribe(
            inbox, cb=collect, pending_bytes_limit=2 * ref.size + (1 << 20)
        )
        try:
            request = {"seq": 1, "batch": count, "next_by_subj": subject}
            await self.nc.publish(self._direct_get, json.dumps(request).encode(), reply=inbox)
            status = await done
        finally:
            await sub.unsubscribe()
        data = b"".join(chunks[i] for i in range(count) if i in chunks)
        if status != _END_OF_BATCH or sorted(chunks) != list(range(count)) or len(data) != ref.size:
            raise CorruptShard(
                f"{subject}: got {len(chunks)} of {count} chunks, {len(data)} of {ref.size} bytes"
                f" (status {status})"
            )
        return data

    async def retire_before(self, version: int) -> None:
        """Drop every message of versions before `version` from this domain's stream."""
        try:
            first = await self.js.get_msg(
                self.subjects.stream,
                seq=1,
                subject=f"{self.subjects.prefix}.{version}.>",
                next=True,
            )
        except nats.js.errors.NotFoundError:
            return
        await self.js.purge_stream(self.subjects.stream, seq=first.seq)
        log.info("retired versions before %d from %s", version, self.subjects.stream)

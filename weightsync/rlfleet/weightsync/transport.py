"""Weight versions on NATS JetStream: one stream per run, on the hub, mirrored per region.

The stream and its mirrors are declared, made and deleted with the run's other streams
(`rlfleet.bus.streams`); this module publishes into them and reads from them.

Subjects, under ``rlfleet.weights.<run>.<version>``:

- ``.manifest.<kind>``: the version's manifest (JSON), published last;
- ``.<kind>.<shard>.<checksum>``: the shard, as consecutive chunks of at most
  `chunk_bytes`. The checksum makes the subject name the bytes: a version put again
  with other bytes (a trainer restarted from its checkpoint, over what an attempt that
  failed before its manifest left) lands on subjects of its own, and a put retried with
  the same bytes is dropped by the stream's deduplication, as its message ids are too.

Shards are fetched with JetStream's batched direct get: one request per shard returns
all its chunks, served by whichever server holds the stream (the region's mirror, when
the receiver's JetStream context points at its region), so a version crosses the WAN
once per region however many receivers it has. The requests go over connections of
their own (`rlfleet.weightsync.direct`), which receive chunks in place, one request in
flight on each, since a server answers a connection's requests one after another. That
window of connections, not the server, sets how much a receiver buffers. Shards go up
over one such connection, a bounded number of them awaiting the stream's acks at once:
more connections did not put faster, as the stream stores what it is sent in order.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass

import nats.js.errors
from nats.aio.client import Client
from nats.js import JetStreamContext

from rlfleet.api.wire import ShardRef, WeightManifest, weights_prefix, weights_stream
from rlfleet.api.wire import encode as encode_message
from rlfleet.bus.streams import bind_stream
from rlfleet.weightsync.config import SyncConfig
from rlfleet.weightsync.direct import CHUNK_HEADER, ShardConnection
from rlfleet.weightsync.shards import EncodedVersion

log = logging.getLogger(__name__)

# Shards a publisher has awaiting the stream's acks at once: with shards of up to 8 MiB in
# 1 MiB chunks, about 64 messages in flight, and a bounded amount of memory.
SHARDS_IN_FLIGHT = 8
# How long a chunk's publish waits for the stream's ack, as nats-py's JetStream publish,
# and how many times it is sent before its put fails. Sending again is safe, as the
# stream drops a message id it holds: an ack once came later than 5 s on a busy host
# though the chunk was stored at once, and failed the whole version.
ACK_TIMEOUT_S = 5.0
ACK_ATTEMPTS = 3


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

    def shard(self, version: int, kind: str, ref: ShardRef) -> str:
        return f"{self.prefix}.{version}.{kind}.{ref.index}.{ref.checksum}"

    def version_of(self, subject: str) -> int:
        return int(subject.removeprefix(self.prefix + ".").split(".", 1)[0])


async def _acknowledged(put: Callable[[], Awaitable[object]], message_id: str) -> None:
    """`put` until the stream acknowledges it, up to `ACK_ATTEMPTS` tries: an ack late past
    its wait (a stalled server) sends the same bytes again under the same message id, which
    the stream stores once."""
    for attempt in range(1, ACK_ATTEMPTS + 1):
        try:
            await put()
            return
        except TimeoutError:
            if attempt == ACK_ATTEMPTS:
                raise
            log.warning(
                "%s: no ack in %.0f s (try %d of %d); sending it again",
                message_id,
                ACK_TIMEOUT_S,
                attempt,
                ACK_ATTEMPTS,
            )


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

    async def put_shard(
        self, version: int, kind: str, ref: ShardRef, data: bytes, connection: ShardConnection
    ) -> None:
        """One shard, as its chunks, all acknowledged by the stream."""
        subject = self.subjects.shard(version, kind, ref)
        chunk = self.config.chunk_bytes
        count = max(1, -(-len(data) // chunk))
        view = memoryview(data)
        await asyncio.gather(
            *(
                self._put_chunk(
                    connection,
                    subject,
                    view[i * chunk : (i + 1) * chunk],
                    {
                        CHUNK_HEADER: f"{i}/{count}",
                        "Nats-Msg-Id": f"{subject}.{i}",
                        "Nats-Expected-Stream": self.subjects.stream,
                    },
                )
                for i in range(count)
            )
        )

    @staticmethod
    async def _put_chunk(
        connection: ShardConnection, subject: str, payload: memoryview, headers: dict[str, str]
    ) -> None:
        await _acknowledged(
            lambda: connection.publish(subject, payload, headers, ACK_TIMEOUT_S),
            headers["Nats-Msg-Id"],
        )

    async def put_manifest(self, manifest: WeightManifest) -> None:
        """Put last: receivers take a manifest on the stream as a complete version."""
        subject = self.subjects.manifest(manifest.version, manifest.kind)
        data = encode_message(manifest)
        await _acknowledged(
            lambda: self.js.publish(
                subject,
                data,
                timeout=ACK_TIMEOUT_S,
                headers={"Nats-Msg-Id": subject},
                stream=self.subjects.stream,
            ),
            subject,
        )

    async def put_version(self, version: EncodedVersion) -> None:
        manifest = version.manifest
        window = asyncio.Semaphore(SHARDS_IN_FLIGHT)

        async with self.connection() as connection:

            async def put(ref: ShardRef, data: bytes) -> None:
                async with window:
                    await self.put_shard(manifest.version, manifest.kind, ref, data, connection)

            await asyncio.gather(
                *(put(ref, data) for ref, data in zip(manifest.shards, version.shards, strict=True))
            )
        await self.put_manifest(manifest)

    @contextlib.asynccontextmanager
    async def connection(self) -> AsyncIterator[ShardConnection]:
        """A connection for `put_shard` and `fetch_shard`, to the server this stream's
        client is on, as its user."""
        async with self.connections(1) as (connection,):
            yield connection

    @contextlib.asynccontextmanager
    async def connections(self, count: int) -> AsyncIterator[list[ShardConnection]]:
        """`count` such connections, opened at once. A server answers one connection's
        requests one after another, so requests meant to run side by side each need
        their own."""
        opening = [asyncio.ensure_future(ShardConnection.open(self.nc)) for _ in range(count)]
        try:
            yield list(await asyncio.gather(*opening))
        finally:
            for task in opening:
                if not task.done():
                    task.cancel()
                elif not task.cancelled() and task.exception() is None:
                    task.result().close()

    async def fetch_shard(
        self,
        manifest: WeightManifest,
        ref: ShardRef,
        connection: ShardConnection,
        into: memoryview | None = None,
    ) -> memoryview:
        """One shard's bytes, all chunks in place (in `into`, of its size, when given), or
        CorruptShard if any is off.

        Callers bound the wait (`asyncio.timeout`); a cancelled fetch leaves nothing behind.
        """
        subject = self.subjects.shard(manifest.version, manifest.kind, ref)
        count = max(1, -(-ref.size // self.config.chunk_bytes))
        request = {"seq": 1, "batch": count, "next_by_subj": subject}
        return await connection.get(
            self._direct_get, request, ref.size, self.config.chunk_bytes, subject, into
        )

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

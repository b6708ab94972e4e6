"""Shards fetched over weightsync's own direct-get connections, against real NATS servers:
through a leaf node to the hub's stream, chunks checked, the window of requests kept."""

from __future__ import annotations

import asyncio
import os
import signal
import time
import uuid

import msgspec
import nats.js.errors
import pytest
import torch

from rlfleet.bus.streams import ensure_run_streams
from rlfleet.local.nats import HUB_DOMAIN, StandaloneNats
from rlfleet.weightsync import Publisher
from rlfleet.weightsync.config import SyncConfig
from rlfleet.weightsync.direct import CHUNK_HEADER, ShardConnection
from rlfleet.weightsync.errors import CorruptShard
from rlfleet.weightsync.receiver import Receiver
from rlfleet.weightsync.shards import encode_version
from rlfleet.weightsync.state import WeightState
from rlfleet.weightsync.transport import WeightStream

# Small chunks, so that every shard is several messages; two shards requested at once.
CONFIG = SyncConfig(shard_bytes=64 << 10, chunk_bytes=4 << 10, parallel_fetches=2)


def _model(seed: int) -> dict[str, torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    return {
        f"layers.{i}.w": (torch.randn(160, 160, generator=generator) * 0.02).bfloat16()
        for i in range(6)
    }


def _run() -> str:
    return f"t{uuid.uuid4().hex[:8]}"


async def _published(
    servers: StandaloneNats,
    run: str,
    tensors: dict[str, torch.Tensor],
    config: SyncConfig = CONFIG,
):
    hub = await servers.bed.hub.connect()
    await ensure_run_streams(hub, run, HUB_DOMAIN)
    encoded = encode_version(run, 0, tensors, None, config)
    await WeightStream(hub, run, config).put_version(encoded)
    return hub, encoded


def test_a_version_fetched_at_a_leaf_is_the_published_state(
    nats_servers: StandaloneNats,
) -> None:
    run, tensors = _run(), _model(0)

    async def scenario() -> None:
        hub, encoded = await _published(nats_servers, run, tensors)
        leaf = await nats_servers.bed.leaves[nats_servers.region].connect()
        try:
            stream = WeightStream(leaf, run, CONFIG, domain=HUB_DOMAIN)
            assert len(encoded.manifest.shards) > CONFIG.parallel_fetches
            assert [bytes(s) for s in await Receiver(stream).fetch(encoded.manifest)] == [
                bytes(s) for s in encoded.shards
            ]
            receiver = Receiver(stream)
            assert await receiver.sync() == 0
            assert receiver.state.digest() == WeightState.copy_of(tensors, 0).digest()
        finally:
            await leaf.close()
            await hub.close()

    asyncio.run(scenario())


def test_a_shard_with_a_chunk_missing_or_misnamed_is_corrupt(
    nats_servers: StandaloneNats,
) -> None:
    run = _run()

    async def scenario() -> None:
        hub, encoded = await _published(nats_servers, run, _model(1))
        try:
            stream = WeightStream(hub, run, CONFIG)
            ref = encoded.manifest.shards[0]
            # Shard 0 of version 1: its middle chunk never sent, its last named twice.
            subject = stream.subjects.shard(1, "full", ref)
            chunk, data = CONFIG.chunk_bytes, encoded.shards[0]
            count = -(-len(data) // chunk)
            for index in (0, count - 1, count - 1):
                await hub.publish(
                    subject,
                    data[index * chunk : (index + 1) * chunk],
                    headers={CHUNK_HEADER: f"{index}/{count}"},
                )
            # A shard whose chunks claim another count.
            other = stream.subjects.shard(1, "full", msgspec.structs.replace(ref, index=1))
            await hub.publish(other, data[:chunk], headers={CHUNK_HEADER: "0/1"})
            await hub.flush()
            manifest = encoded.manifest
            version_1 = msgspec.structs.replace(manifest, version=1)
            async with stream.connection() as gets:
                with pytest.raises(CorruptShard, match=f"got 2 of {count} chunks"):
                    await stream.fetch_shard(version_1, ref, gets)
                with pytest.raises(CorruptShard, match="expected"):
                    await stream.fetch_shard(version_1, msgspec.structs.replace(ref, index=1), gets)
                # The connection goes on serving the intact version.
                assert await stream.fetch_shard(manifest, ref, gets) == data
        finally:
            await hub.close()

    asyncio.run(scenario())


def test_the_window_bounds_requests_and_a_cancelled_one_leaves_the_connection_sound(
    nats_servers: StandaloneNats,
) -> None:
    run = _run()

    async def scenario() -> None:
        hub, encoded = await _published(nats_servers, run, _model(2))
        try:
            stream = WeightStream(hub, run, CONFIG)
            in_flight, most = 0, 0
            fetch = stream.fetch_shard

            async def counted(*args):
                nonlocal in_flight, most
                in_flight += 1
                most = max(most, in_flight)
                try:
                    return await fetch(*args)
                finally:
                    in_flight -= 1

            stream.fetch_shard = counted
            assert len(await Receiver(stream).fetch(encoded.manifest)) == len(encoded.shards)
            assert most == CONFIG.parallel_fetches
            # A request given up at once: its chunks still arrive and are read past.
            manifest, refs = encoded.manifest, encoded.manifest.shards
            async with stream.connection() as gets:
                with pytest.raises(TimeoutError):
                    async with asyncio.timeout(0):
                        await fetch(manifest, refs[0], gets)
                assert [await fetch(manifest, ref, gets) for ref in refs] == encoded.shards
        finally:
            await hub.close()

    asyncio.run(scenario())


def test_a_chunk_no_stream_takes_fails_its_put(nats_servers: StandaloneNats) -> None:
    run = _run()

    async def scenario() -> None:
        hub, encoded = await _published(nats_servers, run, _model(3))
        try:
            stream = WeightStream(hub, run, CONFIG)
            subject = stream.subjects.shard(1, "full", encoded.manifest.shards[0])
            async with stream.connection() as connection:
                with pytest.raises(nats.js.errors.NoStreamResponseError):
                    await connection.publish(f"nowhere.{run}", b"chunk", {}, 5.0)
                with pytest.raises(nats.js.errors.APIError, match="expected stream"):
                    await connection.publish(
                        subject,
                        b"chunk",
                        {"Nats-Expected-Stream": "ANOTHER"},
                        5.0,
                    )
                # The connection goes on putting: the stream holds what was acknowledged.
                await connection.publish(subject, b"chunk", {}, 5.0)
            message = await hub.jetstream().get_last_msg(stream.subjects.stream, subject)
            assert message.data == b"chunk"
        finally:
            await hub.close()

    asyncio.run(scenario())


def test_a_window_larger_than_one_connection_may_queue_is_fetched(
    nats_servers: StandaloneNats,
) -> None:
    """Eight shards of about 9 MiB in flight are 72 MiB, more than a server queues for one
    connection (its max_pending, 64 MiB) before it drops it as a slow consumer: each
    request in flight has a connection of its own."""
    run, config = _run(), SyncConfig(shard_bytes=12 << 20, parallel_fetches=8)
    generator = torch.Generator().manual_seed(5)
    # Incompressible, so that every shard is as large as the config allows.
    tensors = {
        f"t{i}": torch.randint(-(2**15), 2**15, (6 << 20,), dtype=torch.int16, generator=generator)
        for i in range(16)
    }

    async def scenario() -> None:
        hub, encoded = await _published(nats_servers, run, tensors, config)
        leaf = await nats_servers.bed.leaves[nats_servers.region].connect()
        try:
            assert len(encoded.manifest.shards) > config.parallel_fetches
            smallest = min(ref.size for ref in encoded.manifest.shards[:-1])
            assert config.parallel_fetches * smallest > 64 << 20
            receiver = Receiver(WeightStream(leaf, run, config, domain=HUB_DOMAIN))
            assert await receiver.sync() == 0
            assert receiver.state.digest() == WeightState.copy_of(tensors, 0).digest()
        finally:
            await leaf.close()
            await hub.close()

    asyncio.run(scenario())


def test_a_receiver_takes_the_next_version_into_the_last_ones_memory(
    nats_servers: StandaloneNats,
) -> None:
    """Fresh memory costs a page fault per 4 KiB on its first write: a receiver fetches a
    version into the buffers of the one it applied last, and keeps no more than those."""
    run, first = _run(), _model(6)
    second = {name: (t.float() + 1e-3).bfloat16() for name, t in first.items()}

    async def scenario() -> None:
        hub = await nats_servers.bed.hub.connect()
        leaf = await nats_servers.bed.leaves[nats_servers.region].connect()
        try:
            await ensure_run_streams(hub, run, HUB_DOMAIN)
            publisher = Publisher(WeightStream(hub, run, CONFIG), CONFIG)
            (snapshot,) = await publisher.publish(first, 0)
            receiver = Receiver(WeightStream(leaf, run, CONFIG, domain=HUB_DOMAIN))
            assert await receiver.sync() == 0
            assert receiver.buffers.kept == sum(ref.size for ref in snapshot.shards)
            (delta,) = await publisher.publish(second, 1)
            assert delta.kind == "delta" and len(delta.shards) > 1
            kept = {id(buffer) for buffer in receiver.buffers._spare}
            shards = await receiver.fetch(delta)
            assert all(id(shard.obj) in kept for shard in shards)
            assert await receiver.sync() == 1
            assert receiver.state.digest() == WeightState.copy_of(second, 1).digest()
            assert receiver.buffers.kept <= sum(ref.size for ref in delta.shards)
        finally:
            await leaf.close()
            await hub.close()

    asyncio.run(scenario())


def test_a_version_put_again_with_other_bytes_is_the_one_received(
    nats_servers: StandaloneNats,
) -> None:
    """A trainer restarted from its checkpoint puts a version number again, and its step,
    not deterministic, gives other bytes than the attempt that failed before its manifest:
    the shards that attempt left (the stream's first on their subjects, their message ids
    still in its deduplication window) must not stand in for the new ones."""
    run, first = _run(), _model(7)
    failed, retried = (
        {n: (t.float() + step).bfloat16() for n, t in first.items()} for step in (1e-3, 2e-3)
    )

    async def scenario() -> None:
        hub, _ = await _published(nats_servers, run, first)
        try:
            stream = WeightStream(hub, run, CONFIG)
            base = WeightState.copy_of(first, 0)
            left = encode_version(run, 1, failed, base, CONFIG)
            async with stream.connection() as connection:
                for ref, data in zip(left.manifest.shards, left.shards, strict=True):
                    await stream.put_shard(1, "delta", ref, data, connection)
            await stream.put_version(encode_version(run, 1, retried, base, CONFIG))
            receiver = Receiver(stream)
            assert await receiver.sync() == 1
            assert receiver.state.digest() == WeightState.copy_of(retried, 1).digest()
        finally:
            await hub.close()

    asyncio.run(scenario())


async def _through_a_stall(hub_pid: int, put) -> None:
    """Runs `put` while the hub is stopped for 7 s, beyond the first 5 s ack wait."""
    os.kill(hub_pid, signal.SIGSTOP)
    try:
        running = asyncio.ensure_future(put)
        await asyncio.sleep(7)
    finally:
        os.kill(hub_pid, signal.SIGCONT)
    await running


def test_a_chunk_whose_ack_comes_late_is_sent_again_and_stored_once(
    nats_servers: StandaloneNats,
) -> None:
    """A hub that stalls past the ack wait (here stopped for 7 s, beyond the first 5 s
    wait) fails no put: the chunk goes again, and the stream keeps one copy of it."""
    run = _run()
    hub_pid = nats_servers.supervisor.pids()["nats-hub"]

    async def scenario() -> None:
        hub, encoded = await _published(nats_servers, run, _model(8))
        try:
            stream = WeightStream(hub, run, CONFIG)
            ref, data = encoded.manifest.shards[0], encoded.shards[0]
            async with stream.connection() as connection:
                await _through_a_stall(hub_pid, stream.put_shard(1, "full", ref, data, connection))
            subject = stream.subjects.shard(1, "full", ref)
            info = await hub.jetstream().stream_info(stream.subjects.stream, subject)
            assert info.state.subjects == {subject: -(-ref.size // CONFIG.chunk_bytes)}
        finally:
            await hub.close()

    asyncio.run(scenario())


def test_a_manifest_whose_ack_comes_late_is_sent_again_and_stored_once(
    nats_servers: StandaloneNats,
) -> None:
    """The manifest, the put that makes a version whole, rides out the same stall: before,
    it had one try, and a late ack failed the whole version for the trainer to publish
    again."""
    run = _run()
    hub_pid = nats_servers.supervisor.pids()["nats-hub"]

    async def scenario() -> None:
        hub, encoded = await _published(nats_servers, run, _model(8))
        try:
            stream = WeightStream(hub, run, CONFIG)
            manifest = msgspec.structs.replace(encoded.manifest, version=7)
            await _through_a_stall(hub_pid, stream.put_manifest(manifest))
            subject = stream.subjects.manifest(7, manifest.kind)
            info = await hub.jetstream().stream_info(stream.subjects.stream, subject)
            assert info.state.subjects == {subject: 1}
        finally:
            await hub.close()

    asyncio.run(scenario())


class _StalledOnce(ShardConnection):
    """A connection whose first open stalls its event loop for 3 s right after the TCP
    handshake, as a loop on a saturated machine does: past the server's 2 s wait for
    CONNECT, so the server drops it with 'Authentication Timeout'."""

    stalls = 1

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        super().connection_made(transport)
        if _StalledOnce.stalls:
            _StalledOnce.stalls -= 1
            time.sleep(3)


def test_a_connection_the_server_timed_out_before_connect_is_opened_again(
    nats_servers: StandaloneNats,
) -> None:
    """A put that opened its connection while its loop was starved fails no version: the
    server's 'Authentication Timeout' is the machine's load, not the credentials'."""

    async def scenario() -> None:
        hub = await nats_servers.bed.hub.connect()
        try:
            connection = await _StalledOnce.open(hub)
            assert _StalledOnce.stalls == 0
            connection.close()
        finally:
            await hub.close()

    asyncio.run(scenario())

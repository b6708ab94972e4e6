"""Weight versions over real NATS JetStream: hub stream, region mirror, receivers."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import signal
import subprocess
import sys
import time
import uuid
from collections.abc import AsyncIterator
from pathlib import Path

import msgspec
import nats
import torch
from prometheus_client import REGISTRY

from rlfleet.api.wire import BusRole
from rlfleet.bus.connection import connect
from rlfleet.bus.streams import ensure_run_streams
from rlfleet.local.nats import HUB_DOMAIN, NatsServer, StandaloneNats
from rlfleet.weightsync.config import SyncConfig
from rlfleet.weightsync.publisher import Publisher
from rlfleet.weightsync.receiver import Receiver
from rlfleet.weightsync.shards import EncodedVersion, encode_version
from rlfleet.weightsync.state import WeightState
from rlfleet.weightsync.transport import WeightStream

REGION = StandaloneNats.region
CONFIG = SyncConfig(snapshot_every=3, shard_bytes=64 << 10, chunk_bytes=16 << 10, keep_snapshots=1)
PROBE = Path(__file__).parents[1] / "probes" / "weights_receive.py"


def _model(seed: int, size: int = 96) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return {
        f"layers.{i}.w": (torch.randn(size, size, generator=gen) * 0.02).bfloat16()
        for i in range(8)
    } | {"norm": torch.ones(size, dtype=torch.bfloat16)}


def _step(tensors: dict[str, torch.Tensor], seed: int) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return {
        n: (t.float() + 3e-4 * torch.randn(t.shape, generator=gen).sign()).bfloat16()
        for n, t in tensors.items()
    }


def _versions(count: int) -> list[dict[str, torch.Tensor]]:
    versions = [_model(0)]
    for v in range(1, count):
        versions.append(_step(versions[-1], v))
    return versions


def _digest(tensors: dict[str, torch.Tensor]) -> str:
    return WeightState.copy_of(tensors, 0).digest()


@contextlib.asynccontextmanager
async def _connected(*servers: NatsServer) -> AsyncIterator[tuple[nats.NATS, ...]]:
    clients = [await s.connect(connect_timeout=5, reconnect_time_wait=0.2) for s in servers]
    try:
        yield tuple(clients)
    finally:
        for client in clients:
            await client.close()


def _run_name() -> str:
    return f"r{uuid.uuid4().hex[:8]}"


def _rejected(reason: str) -> float:
    return REGISTRY.get_sample_value("rlfleet_weightsync_rejected_total", {"reason": reason}) or 0


async def _publish_all(hub: nats.NATS, run: str, versions) -> Publisher:
    await ensure_run_streams(hub, run, HUB_DOMAIN)
    publisher = Publisher(WeightStream(hub, run, CONFIG), CONFIG)
    for version, tensors in enumerate(versions):
        await publisher.publish(tensors, version)
    return publisher


def test_a_region_follows_versions_through_its_own_mirror(nats_servers: StandaloneNats) -> None:
    run, versions = _run_name(), _versions(5)

    async def scenario() -> None:
        async with _connected(
            nats_servers.bed.hub,
            nats_servers.bed.leaves[REGION],
        ) as (hub, leaf):
            assert await ensure_run_streams(hub, run, HUB_DOMAIN, [REGION]) == []
            regional = WeightStream(leaf, run, CONFIG, domain=REGION)
            publisher = Publisher(WeightStream(hub, run, CONFIG), CONFIG)
            seen: list[int] = []

            async def record(manifest, changed) -> None:
                seen.append(manifest.version)

            receiver = Receiver(regional, on_version=record)
            stop = asyncio.Event()
            following = asyncio.create_task(receiver.follow(stop))
            for version, tensors in enumerate(versions):
                await publisher.publish(tensors, version)
                await _until(lambda v=version: receiver.version == v, 30)
                assert receiver.state.digest() == _digest(tensors)
            stop.set()
            await following
            # Every version arrived as the cheapest thing: a snapshot first, then deltas.
            assert seen == list(range(5))
            info = await regional.js.stream_info(regional.subjects.stream)
            assert info.mirror is not None and info.state.messages > 0

    asyncio.run(scenario())


def test_a_late_receiver_starts_from_the_snapshot_retention_kept(
    nats_servers: StandaloneNats,
) -> None:
    run, versions = _run_name(), _versions(8)

    async def scenario() -> None:
        async with _connected(
            nats_servers.bed.hub,
            nats_servers.bed.leaves[REGION],
        ) as (hub, leaf):
            # The hub's client makes the region's mirror through the region's domain.
            assert await ensure_run_streams(hub, run, HUB_DOMAIN, [REGION]) == []
            stream = WeightStream(hub, run, CONFIG)
            mirror = WeightStream(hub, run, CONFIG, domain=REGION)
            publisher = Publisher(stream, CONFIG, mirrors=[mirror])
            for version, tensors in enumerate(versions):
                await publisher.publish(tensors, version)
            for where in (stream, WeightStream(leaf, run, CONFIG, domain=REGION)):
                receiver = Receiver(where)
                await _until_async(lambda r=receiver: r.sync(), 7, 30)
                assert receiver.state.digest() == _digest(versions[-1])
                # Snapshots at 0, 3 and 6; keeping one retires everything before 6.
                assert min(version for version, _ in receiver.known) == 6

    asyncio.run(scenario())


def test_the_trainer_retires_old_versions_on_a_regions_mirror_as_its_run_user(
    nats_servers: StandaloneNats, tmp_path: Path
) -> None:
    """As the trainer does it: as its run's user at the hub, through the region's leaf
    node, whose answers come back to the user's own reply subjects."""
    run, versions = _run_name(), _versions(7)
    (tmp_path / "trainer.creds").write_text(nats_servers.bed.run_user(run, BusRole.TRAINER))

    async def scenario() -> None:
        async with _connected(nats_servers.bed.hub) as (admin,):
            assert await ensure_run_streams(admin, run, HUB_DOMAIN, [REGION]) == []
            trainer = await connect(nats_servers.bed.hub.url, tmp_path / "trainer.creds")
            try:
                stream = WeightStream(trainer, run, CONFIG)
                mirror = WeightStream(trainer, run, CONFIG, domain=REGION)
                publisher = Publisher(stream, CONFIG, mirrors=[mirror])
                for version, tensors in enumerate(versions):
                    await publisher.publish(tensors, version)
                # Snapshots at 0, 3 and 6; keeping one retires everything before 6, on the
                # hub and on the mirror, once the mirror has caught up.
                regional = WeightStream(admin, run, CONFIG, domain=REGION)
                await _until_async(lambda: _newest(regional), 6, 30)
                await mirror.retire_before(6)  # what publishing did, or tried to
                assert await _oldest(regional) == 6
            finally:
                await trainer.close()

    asyncio.run(scenario())


async def _newest(stream: WeightStream) -> int | None:
    info = await stream.js.stream_info(stream.subjects.stream)
    if info.state.last_seq == 0:
        return None
    last = await stream.js.get_msg(stream.subjects.stream, seq=info.state.last_seq)
    return stream.subjects.version_of(last.subject)


async def _oldest(stream: WeightStream) -> int:
    info = await stream.js.stream_info(stream.subjects.stream)
    first = await stream.js.get_msg(stream.subjects.stream, seq=info.state.first_seq)
    return stream.subjects.version_of(first.subject)


def test_a_region_cut_off_keeps_its_old_versions_and_publishing_goes_on(
    nats_servers: StandaloneNats,
) -> None:
    run, versions = _run_name(), _versions(7)

    async def scenario() -> None:
        async with _connected(nats_servers.bed.hub) as (hub,):
            assert await ensure_run_streams(hub, run, HUB_DOMAIN, [REGION]) == []
            stream = WeightStream(hub, run, CONFIG)
            reached = WeightStream(hub, run, CONFIG, domain=REGION)
            # No server answers for this region's domain, as when its link is down.
            cut_off = WeightStream(hub, run, CONFIG, domain="region-cut-off")
            publisher = Publisher(stream, CONFIG, mirrors=[cut_off, reached])
            for version, tensors in enumerate(versions):
                await publisher.publish(tensors, version)
            for where in (stream, reached):
                receiver = Receiver(where)
                await _until_async(lambda r=receiver: r.sync(), 6, 30)
                assert min(version for version, _ in receiver.known) == 6

    asyncio.run(scenario())


def test_a_corrupted_shard_is_refetched_then_refused_and_the_snapshot_used(
    nats_servers: StandaloneNats,
) -> None:
    run, versions = _run_name(), _versions(4)

    async def scenario() -> None:
        async with _connected(nats_servers.bed.hub) as (hub,):
            await ensure_run_streams(hub, run, HUB_DOMAIN)
            stream = WeightStream(hub, run, CONFIG)
            receiver = Receiver(stream, fetch_timeout=5)
            publisher = await _publish_all(hub, run, versions[:3])
            assert await receiver.sync() == 2
            # Version 3's delta goes out with a flipped byte in one shard (its manifest
            # keeps the true checksum); version 3's snapshot is intact.
            delta = encode_version(run, 3, versions[3], publisher._base, CONFIG)
            broken = bytearray(delta.shards[-1])
            broken[-3] ^= 0xFF
            await stream.put_version(
                EncodedVersion(delta.manifest, [*delta.shards[:-1], bytes(broken)])
            )
            await stream.put_version(encode_version(run, 3, versions[3], None, CONFIG))
            corrupt_before = _rejected("corrupt_shard")
            assert await receiver.sync() == 3
            assert receiver.state.digest() == _digest(versions[3])
            assert _rejected("corrupt_shard") - corrupt_before >= 3
            # A message that is not a manifest, on a manifest subject, is counted and ignored.
            foreign_before = _rejected("not_ours")
            await hub.jetstream().publish(stream.subjects.manifest(9, "full"), b'{"hello": 1}')
            assert await receiver.sync() == 3
            assert _rejected("not_ours") == foreign_before + 1

    asyncio.run(scenario())


def test_a_delta_on_an_unknown_base_is_never_applied(nats_servers: StandaloneNats) -> None:
    run, versions = _run_name(), _versions(3)

    async def scenario() -> None:
        async with _connected(nats_servers.bed.hub) as (hub,):
            await ensure_run_streams(hub, run, HUB_DOMAIN)
            stream = WeightStream(hub, run, CONFIG)
            await stream.put_version(encode_version(run, 0, versions[0], None, CONFIG))
            # Version 2 claims version 1 as its base, which was never published.
            base = WeightState.copy_of(versions[1], 1)
            await stream.put_version(encode_version(run, 2, versions[2], base, CONFIG))
            receiver = Receiver(stream)
            unknown_before = _rejected("unknown_base")
            assert await receiver.sync() == 0
            assert receiver.state.digest() == _digest(versions[0])
            assert _rejected("unknown_base") == unknown_before + 1

    asyncio.run(scenario())


def test_a_receiver_survives_its_nats_server_restarting_mid_transfer(
    nats_servers: StandaloneNats,
) -> None:
    run, versions = _run_name(), [_model(0, size=512), _step(_model(0, size=512), 1)]

    async def scenario() -> None:
        async with _connected(nats_servers.bed.hub) as (hub,):
            await _publish_all(hub, run, versions)
            receiver = Receiver(WeightStream(hub, run, CONFIG), fetch_timeout=3)
            syncing = asyncio.create_task(receiver.sync())
            await _until(lambda: _fetched() > 0, 30)
            # From this thread: an attached child dies with the thread that started it.
            nats_servers.restart_hub()
            assert await asyncio.wait_for(syncing, 120) in (0, 1)
            # Whatever the interrupted sync reached, the next one finds the head.
            assert await receiver.sync() == 1
            assert receiver.state.digest() == _digest(versions[1])

    asyncio.run(scenario())


def test_a_receiver_killed_mid_transfer_restarts_onto_the_right_version(
    nats_servers: StandaloneNats, tmp_path: Path
) -> None:
    run, versions = _run_name(), [_model(0, size=512), _step(_model(0, size=512), 1)]

    async def publish() -> None:
        async with _connected(nats_servers.bed.hub) as (hub,):
            await _publish_all(hub, run, versions)

    asyncio.run(publish())
    leaf = nats_servers.bed.leaves[REGION]
    env = os.environ | leaf.client_env()
    argv = [
        sys.executable,
        str(PROBE),
        leaf.url,
        HUB_DOMAIN,
        run,
        json.dumps(msgspec.to_builtins(CONFIG)),
    ]
    first = subprocess.Popen(
        [*argv, str(tmp_path / "first.json")], stdout=subprocess.PIPE, text=True, env=env
    )
    assert first.stdout is not None
    assert first.stdout.readline().startswith("fetching")
    os.kill(first.pid, signal.SIGKILL)
    first.wait(timeout=10)
    subprocess.run([*argv, str(tmp_path / "second.json")], check=True, timeout=300, env=env)
    result = json.loads((tmp_path / "second.json").read_text())
    assert result == {"version": 1, "digest": _digest(versions[1])}


def _fetched() -> float:
    return REGISTRY.get_sample_value("rlfleet_weightsync_fetched_bytes_total") or 0


async def _until(check, within: float) -> None:
    deadline = time.monotonic() + within
    while not check():
        if time.monotonic() > deadline:
            raise TimeoutError("condition not met")
        await asyncio.sleep(0.05)


async def _until_async(step, expected, within: float) -> None:
    """Await `step()` until it returns `expected` (a mirror catches up on its own time)."""
    deadline = time.monotonic() + within
    while (got := await step()) != expected:
        if time.monotonic() > deadline:
            raise TimeoutError(f"got {got}, expected {expected}")
        await asyncio.sleep(0.2)


def test_a_receiver_held_below_its_version_goes_back_to_it_exactly(
    nats_servers: StandaloneNats,
) -> None:
    """A canary rolled back: its receiver, told to hold no newer version than one it has
    passed, rebuilds that version from the snapshot before it, bit for bit, and goes
    forward again once let."""
    run, versions = _run_name(), _versions(4)
    # Versions 0 (a snapshot) to 3 (another) stay on the stream: the version to go back
    # to must be kept, and a snapshot before it.
    config = msgspec.structs.replace(CONFIG, keep_snapshots=2)

    async def scenario() -> None:
        async with _connected(nats_servers.bed.hub) as (hub,):
            await ensure_run_streams(hub, run, HUB_DOMAIN)
            publisher = Publisher(WeightStream(hub, run, config), config)
            for version, tensors in enumerate(versions):
                await publisher.publish(tensors, version)
            receiver = Receiver(WeightStream(hub, run, config))
            stop = asyncio.Event()
            following = asyncio.create_task(receiver.follow(stop))
            try:
                await _until(lambda: receiver.version == 3, 30)
                receiver.take_changed()
                receiver.ceiling = 1
                await _until(lambda: receiver.version == 1, 30)
                assert receiver.state.digest() == _digest(versions[1])
                assert receiver.take_changed() == set(versions[1])  # all of it, for the engine
                receiver.ceiling = None
                await _until(lambda: receiver.version == 3, 30)
                assert receiver.state.digest() == _digest(versions[3])
            finally:
                stop.set()
                await following

    asyncio.run(scenario())


def test_a_pinned_version_outlives_retention_with_the_snapshot_it_needs(
    nats_servers: StandaloneNats,
) -> None:
    """A production pool's serving version stays on the stream however many snapshots
    come after it: a set rolled back to it, or an evaluator asked for it, rebuilds it."""
    run, versions = _run_name(), _versions(8)  # snapshots at 0, 3 and 6; one kept

    async def scenario() -> None:
        async with _connected(nats_servers.bed.hub) as (hub,):
            await ensure_run_streams(hub, run, HUB_DOMAIN)
            publisher = Publisher(WeightStream(hub, run, CONFIG), CONFIG)
            publisher.pinned = 1
            for version, tensors in enumerate(versions):
                await publisher.publish(tensors, version)
            receiver = Receiver(WeightStream(hub, run, CONFIG))
            receiver.ceiling = 1
            assert await receiver.sync() == 1
            assert receiver.state.digest() == _digest(versions[1])
            # Once nothing is pinned, retention takes it at the next snapshot.
            publisher.pinned = None
            await publisher.publish(_versions(10)[9], 9)
            late = Receiver(WeightStream(hub, run, CONFIG))
            late.ceiling = 1
            assert await late.sync() is None

    asyncio.run(scenario())

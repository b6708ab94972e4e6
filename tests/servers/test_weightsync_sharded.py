"""Sharded publishing over real NATS: trainer ranks (separate processes, gathering over gloo)
each put their own tensors' shards, and rank 0 the one manifest of the whole state."""

from __future__ import annotations

import asyncio
import json
import os
import socket
import subprocess
import sys
import uuid
from pathlib import Path

import msgspec
import nats.js.errors
import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from rlfleet.api.wire import WeightManifest
from rlfleet.bus.streams import ensure_run_streams
from rlfleet.local.nats import HUB_DOMAIN, StandaloneNats
from rlfleet.weightsync import (
    Publisher,
    Receiver,
    SyncConfig,
    WeightState,
    WeightStream,
    owned_names,
)

# Snapshots at 0 and 4, none retired: version 4 goes out as a delta and a snapshot.
CONFIG = SyncConfig(snapshot_every=4, shard_bytes=16 << 10, chunk_bytes=4 << 10, keep_snapshots=2)
PROBE = Path(__file__).parents[1] / "probes" / "weights_publish_rank.py"
RANKS = 2


def _model() -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(0)
    return {
        f"layers.{i}.w": (torch.randn(32 + 8 * i, 64, generator=gen) * 0.02).bfloat16()
        for i in range(8)
    } | {"norm": torch.ones(64, dtype=torch.bfloat16)}


def _step(tensors: dict[str, torch.Tensor], seed: int) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return {
        n: (t.float() + 3e-4 * torch.randn(t.shape, generator=gen).sign()).bfloat16()
        for n, t in tensors.items()
    }


def _versions() -> list[dict[str, torch.Tensor]]:
    """Five versions; version 2 drops a tensor and adds one, which moves others between
    ranks' parts."""
    versions = [_model()]
    for v in range(1, 5):
        step = _step(versions[-1], v)
        if v == 2:
            del step["layers.7.w"]
            step["head"] = torch.full((100, 64), 0.5, dtype=torch.bfloat16)
        versions.append(step)
    return versions


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _publish_as_ranks(
    nats_servers: StandaloneNats,
    run: str,
    versions: list[dict[str, torch.Tensor]],
    tmp_path: Path,
    fail_at: int = -1,
) -> list[list[dict]]:
    """Each rank's results, from RANKS processes publishing `versions` together."""
    torch.save(versions, tmp_path / "versions.pt")
    hub = nats_servers.bed.hub
    init = f"tcp://127.0.0.1:{_free_port()}"
    config = json.dumps(msgspec.to_builtins(CONFIG))
    env = os.environ | hub.client_env()
    ranks = [
        subprocess.Popen(
            [
                sys.executable,
                str(PROBE),
                hub.url,
                run,
                config,
                str(tmp_path / "versions.pt"),
                str(rank),
                str(RANKS),
                init,
                str(fail_at),
                str(tmp_path / f"rank{rank}.json"),
            ],
            env=env,
        )
        for rank in range(RANKS)
    ]
    for process in ranks:
        assert process.wait(timeout=120) == 0
    return [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(RANKS)]


def _manifests(results: list[dict]) -> list[WeightManifest]:
    return [msgspec.convert(m, WeightManifest) for r in results for m in r.get("manifests", [])]


def _what_receivers_verify(manifest: WeightManifest) -> tuple:
    return (
        manifest.version,
        manifest.kind,
        manifest.base_version,
        manifest.state_digest,
        manifest.removed,
        manifest.tensor_count,
        manifest.state_bytes,
    )


def _same(state: WeightState, tensors: dict[str, torch.Tensor]) -> bool:
    return state.tensors.keys() == tensors.keys() and all(
        torch.equal(state.tensors[n].view(torch.int16), t.view(torch.int16))
        for n, t in tensors.items()
    )


def _run_name() -> str:
    return f"r{uuid.uuid4().hex[:8]}"


@given(
    st.dictionaries(st.text(min_size=1, max_size=8), st.integers(0, 1 << 30), max_size=40),
    st.integers(1, 8),
)
def test_every_tensor_has_exactly_one_owner_and_parts_are_balanced(
    sizes: dict[str, int], world: int
) -> None:
    parts = [owned_names(sizes, rank, world) for rank in range(world)]
    assert sorted(n for part in parts for n in part) == sorted(sizes)
    assert parts == [owned_names(dict(reversed(sizes.items())), r, world) for r in range(world)]
    loads = [sum(sizes[n] for n in part) for part in parts]
    # Greedy, largest first: no part exceeds another by more than its largest tensor.
    assert max(loads) - min(loads) <= max(sizes.values(), default=0)


def test_two_ranks_publish_what_one_process_would(
    nats_servers: StandaloneNats, tmp_path: Path
) -> None:
    versions = _versions()
    alone, ranked = _run_name(), _run_name()

    async def prepare() -> list[WeightManifest]:
        async with await nats_servers.bed.hub.connect() as hub:
            await ensure_run_streams(hub, alone, HUB_DOMAIN)
            await ensure_run_streams(hub, ranked, HUB_DOMAIN)
            publisher = Publisher(WeightStream(hub, alone, CONFIG), CONFIG)
            return [m for v, t in enumerate(versions) for m in await publisher.publish(t, v)]

    one_process = asyncio.run(prepare())
    results = _publish_as_ranks(nats_servers, ranked, versions, tmp_path)
    # Every rank is told the manifests rank 0 put, and they say what one process said.
    assert _manifests(results[0]) == _manifests(results[1])
    two_ranks = _manifests(results[0])
    assert [_what_receivers_verify(m) for m in two_ranks] == [
        _what_receivers_verify(m) for m in one_process
    ]
    assert two_ranks[2].removed == ["layers.7.w"]
    for manifest in two_ranks:
        indices = [ref.index for ref in manifest.shards]
        assert len(set(indices)) == len(indices)
        assert {i % RANKS for i in indices} == set(range(RANKS)), "a rank's shards are missing"

    async def receive() -> None:
        async with await nats_servers.bed.hub.connect() as hub:
            kinds: list[str] = []

            async def record(manifest: WeightManifest, changed: set[str]) -> None:
                kinds.append(manifest.kind)

            # A receiver that held version 0 walks the two ranks' deltas to the head...
            following = Receiver(
                WeightStream(hub, ranked, CONFIG),
                WeightState.copy_of(versions[0], 0),
                on_version=record,
            )
            assert await following.sync() == 4
            assert kinds == ["delta"] * 4
            assert _same(following.state, versions[4])
            # ...one that joins late takes their snapshot, and either run verifies alike.
            for run in (ranked, alone):
                late = Receiver(WeightStream(hub, run, CONFIG))
                assert await late.sync() == 4
                assert _same(late.state, versions[4])
                assert late.state.digest() == one_process[-1].state_digest

    asyncio.run(receive())


def test_a_rank_that_cannot_put_its_shards_leaves_no_manifest(
    nats_servers: StandaloneNats, tmp_path: Path
) -> None:
    versions, run = _versions()[:3], _run_name()

    async def prepare() -> None:
        async with await nats_servers.bed.hub.connect() as hub:
            await ensure_run_streams(hub, run, HUB_DOMAIN)

    asyncio.run(prepare())
    results = _publish_as_ranks(nats_servers, run, versions, tmp_path, fail_at=1)
    # Rank 1 lost its connection before version 1; rank 0 learns it and puts no manifest.
    assert results[1][-1] == {"version": 1, "error": "ConnectionClosedError"}
    assert results[0][-1] == {"version": 1, "error": "PublishFailed"}

    async def inspect() -> None:
        async with await nats_servers.bed.hub.connect() as hub:
            stream = WeightStream(hub, run, CONFIG)
            # Rank 0's shards of version 1 did go up...
            shard = await stream.js.get_msg(
                stream.subjects.stream,
                seq=1,
                subject=f"{stream.subjects.prefix}.1.delta.>",
                next=True,
            )
            index = shard.subject.removeprefix(f"{stream.subjects.prefix}.1.delta.").split(".")[0]
            assert int(index) % RANKS == 0
            with pytest.raises(nats.js.errors.NotFoundError):
                await stream.js.get_msg(
                    stream.subjects.stream,
                    seq=1,
                    subject=f"{stream.subjects.prefix}.1.manifest.>",
                    next=True,
                )
            # ...but only complete versions have a manifest, and a receiver stays on one.
            receiver = Receiver(stream)
            assert await receiver.sync() == 0
            assert set(receiver.known) == {(0, "full")}
            assert _same(receiver.state, versions[0])

    asyncio.run(inspect())

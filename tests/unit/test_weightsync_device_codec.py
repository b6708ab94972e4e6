"""The delta found on the tensor's device: torch's compaction gives the numpy codec's
bytes exactly, and a publisher that finds its deltas there is received bit for bit.

There is no GPU here: the device path runs on CPU tensors, forced (`on_device=True`),
which runs the same torch operations a GPU would; a CUDA test runs where there is one.
"""

from __future__ import annotations

import asyncio
import contextlib

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from rlfleet.weightsync import codec
from rlfleet.weightsync.bits import (
    NotOnHost,
    as_bits,
    compact_bits,
    device_bits,
    from_bits,
    uint_for,
)
from rlfleet.weightsync.config import SyncConfig
from rlfleet.weightsync.publisher import Publisher
from rlfleet.weightsync.shards import apply_version, encode_shards
from rlfleet.weightsync.state import WeightState, tensor_digests

DTYPES = [torch.bfloat16, torch.float16, torch.float32, torch.float64, torch.int8]
FRACTIONS = [0.0, 1e-4, 0.04, 0.15, 0.6, 1.0]

# Bit patterns floats get wrong when treated as numbers: signed zeros, NaNs with
# payloads (quiet and signalling), infinities, the smallest and largest denormals.
SPECIAL = {
    1: [0x00, 0x80, 0x7F, 0xFF, 0x01, 0x7C, 0x7E],
    2: [0x0000, 0x8000, 0x7FC1, 0x7F81, 0xFFFF, 0x7F80, 0xFF80, 0x0001, 0x807F, 0x7C00, 0x03FF],
    4: [0, 0x80000000, 0x7FC00001, 0x7F800001, 0xFFFFFFFF, 0x7F800000, 0xFF800000, 1, 0x807FFFFF],
    8: [0, 1 << 63, 0x7FF8000000000001, 0x7FF0000000000001, (1 << 64) - 1, 0x7FF0000000000000, 1],
}

SMALL = SyncConfig(shard_bytes=4 << 10, chunk_bytes=1 << 10)


def _bits_pair(dtype, size: int, fraction: float, seed: int) -> tuple[np.ndarray, np.ndarray]:
    """Old bit patterns (a tenth of them special), and new ones where `fraction` of the
    elements changed: to random bits, to special ones, or by one unit in the last place."""
    rng = np.random.default_rng(seed)
    uint = uint_for(dtype)
    specials = np.array(SPECIAL[uint.itemsize], dtype=uint)
    old = rng.integers(0, np.iinfo(uint).max, size, dtype=uint, endpoint=True)
    old[: size // 10] = rng.choice(specials, size // 10)
    new = old.copy()
    changed = rng.random(size) < fraction
    kind = rng.integers(0, 3, size)
    moved = old + rng.choice(np.array([1, np.iinfo(uint).max], dtype=uint), size)  # wraps
    replacement = np.where(
        kind == 0,
        rng.integers(0, np.iinfo(uint).max, size, dtype=uint, endpoint=True),
        np.where(kind == 1, rng.choice(specials, size), moved),
    )
    new[changed] = replacement[changed]
    return old, new


def _tensor(bits: np.ndarray, dtype: torch.dtype) -> torch.Tensor:
    return from_bits(bits.copy(), dtype, (bits.size,))


def _assert_same_compaction(new: np.ndarray, old: np.ndarray, dtype, dense_from: float) -> None:
    """numpy's compaction and torch's agree array for array, and encode to one set of
    bytes, the codec's own (`encode_delta`)."""
    host = codec.compact(new, old, dense_from)
    found = compact_bits(
        device_bits(_tensor(new, dtype)), device_bits(_tensor(old, dtype)), dense_from
    )
    if host is None:
        assert found is None and np.array_equal(new, old)
        assert codec.encode_delta(new, old, 3, dense_from) is None
        return
    assert found is not None
    device = found.host()
    assert (device.size, device.changed) == (host.size, host.changed)
    for field in ("where", "steps", "bitmap", "dense"):
        mine, theirs = getattr(device, field), getattr(host, field)
        assert (mine is None) == (theirs is None), field
        if mine is not None:
            assert mine.dtype == theirs.dtype and np.array_equal(mine, theirs), field
    encoded = codec.encode_compacted(device, 3)
    assert encoded == codec.encode_compacted(host, 3) == codec.encode_delta(new, old, 3, dense_from)
    # What crossed is only the compacted arrays.
    assert found.nbytes == device.nbytes == sum(a.nbytes for a in device.arrays())
    # The compacted delta brings the old bits to the new, as a receiver of it would.
    target = old.copy()
    codec.apply_compacted(device, target)
    assert np.array_equal(target, new)


def test_as_bits_refuses_a_tensor_off_the_host_clearly():
    tensor = torch.empty(4, 8, dtype=torch.bfloat16, device="meta")
    with pytest.raises(NotOnHost, match=r"bfloat16 tensor is on meta"):
        as_bits(tensor)
    assert device_bits(tensor).dtype == torch.int16  # compared where it is instead
    assert device_bits(tensor).device.type == "meta"


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("fraction", FRACTIONS)
@pytest.mark.parametrize("dense_from", [0.25, 1.0])
def test_device_compaction_gives_the_host_codec_bytes(dtype, fraction, dense_from):
    # Not a multiple of 8 (the bitmap's last byte, the word search's tail), and large
    # enough that 1e-4 changes a few elements.
    old, new = _bits_pair(dtype, 50_021, fraction, seed=int(fraction * 1e6) + 7)
    _assert_same_compaction(new, old, dtype, dense_from)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_signed_zeros_nans_and_infinities_are_distinct_bits_on_the_device(dtype):
    width = uint_for(dtype).itemsize
    specials = np.array(SPECIAL[width], dtype=uint_for(dtype))
    # Every special pattern into every other: -0.0 for 0.0, one NaN payload for another,
    # an infinity for its negation; their float values would call many of them equal.
    old = np.repeat(specials, specials.size)
    new = np.tile(specials, specials.size)
    for dense_from in (0.25, 1.0):
        _assert_same_compaction(new, old, dtype, dense_from)


@st.composite
def bit_pairs(draw):
    dtype = draw(st.sampled_from([*DTYPES, torch.int32, torch.float8_e4m3fn, torch.bool]))
    size = draw(st.integers(0, 3000))
    fraction = draw(st.sampled_from([0.0, 0.0005, 0.01, 0.09, 0.1, 0.3, 0.49, 0.5, 0.9, 1.0]))
    old, new = _bits_pair(dtype, size, fraction, draw(st.integers(0, 2**32 - 1)))
    if dtype == torch.bool:
        old, new = old & 1, new & 1
    return dtype, old, new


@settings(max_examples=200, deadline=None)
@given(bit_pairs(), st.sampled_from([0.1, 0.25, 0.5, 1.0]))
def test_device_compaction_is_the_host_codec_property(pair, dense_from):
    dtype, old, new = pair
    _assert_same_compaction(new, old, dtype, dense_from)


def _model(seed: int) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return {
        "embed": (torch.randn(257, 64, generator=gen) * 0.02).bfloat16(),
        "layers.0.mlp.experts.w1": (torch.randn(4, 32, 64, generator=gen) * 0.02).half(),
        "layers.0.norm": torch.ones(64, dtype=torch.float32),
        "master": torch.randn(300, generator=gen, dtype=torch.float64),
        "codes": torch.randint(-128, 128, (999,), generator=gen, dtype=torch.int8),
        "scale": torch.tensor(1.5, dtype=torch.float32),
    }


def _step(tensors: dict[str, torch.Tensor], seed: int, lr: float) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    stepped = {}
    for name, t in tensors.items():
        if t.dtype == torch.int8:
            flip = torch.rand(t.shape, generator=gen) < lr * 100
            stepped[name] = torch.where(flip, -t, t)
        else:
            noise = torch.randn(t.shape, generator=gen, dtype=torch.float64).sign()
            stepped[name] = (t.double() + lr * noise).to(t.dtype)
    return stepped


def _shards(tensors, base, host_base=None, on_device=None):
    digests: dict[str, bytes] = {}
    shards = list(
        encode_shards(
            "run", 1, tensors, base, SMALL, digests, host_base=host_base, on_device=on_device
        )
    )
    return shards, digests


@pytest.mark.parametrize("lr", [0.0, 1e-5, 1e-3, 1e-1])
def test_encoding_on_the_device_gives_the_same_shards_and_keeps_the_host_base(lr):
    old = _model(0)
    new = _step(old, 1, lr)
    new["embed"] = new["embed"].t().contiguous().t()  # not contiguous; its base's shape
    assert not new["embed"].is_contiguous()
    new["layers.0.norm"][3] = -0.0
    new["master"][:5] = torch.tensor([float("nan"), float("inf"), -float("inf"), -0.0, 0.0])
    base = WeightState.copy_of(old, 0)
    host_shards, host_digests = _shards(new, base)
    host_base = {n: t.clone() for n, t in base.tensors.items()}
    shards, digests = _shards(new, base, host_base, on_device=True)
    assert shards == host_shards  # byte for byte, refs and checksums included
    assert digests == host_digests == tensor_digests(new)
    # The compacted deltas brought the host copies to the new bits; the base itself
    # (on the "device") is the old one still, and nothing shares the caller's memory.
    assert host_base.keys() == new.keys()
    for name, tensor in new.items():
        assert np.array_equal(as_bits(host_base[name]), as_bits(tensor))
        assert np.array_equal(as_bits(base.tensors[name]), as_bits(old[name]))
        assert host_base[name].data_ptr() not in (tensor.data_ptr(), old[name].data_ptr())


def test_tensors_sent_raw_from_the_device_keep_a_host_copy_and_others_leave_it():
    old, new = _model(0), _step(_model(0), 1, 1e-3)
    new["new.bias"] = torch.full((7,), float("nan"))
    new["layers.0.norm"] = new["layers.0.norm"].reshape(8, 8)  # a new shape: sent raw
    base = WeightState.copy_of(old, 0)
    host_base = {"gone": torch.zeros(3)}
    shards, digests = _shards(new, base, host_base, on_device=True)
    assert shards == _shards(new, base)[0] and digests == tensor_digests(new)
    assert host_base.keys() == new.keys() | {"gone"}  # the caller prunes what it dropped
    for name, tensor in new.items():
        assert np.array_equal(as_bits(host_base[name]), as_bits(tensor.contiguous()))
        assert host_base[name].data_ptr() != tensor.data_ptr()
    # Found on the host (False), a tensor has no host copy to keep up to date.
    _shards(new, base, host_base, on_device=False)
    assert host_base.keys() == {"gone"}


class MemoryStream:
    """What a Publisher needs of its WeightStream, in memory."""

    run = "run"

    def __init__(self) -> None:
        self.shards: dict[tuple[int, str, int], bytes] = {}
        self.manifests = []
        self.fail_at: int | None = None  # a version whose shards do not go up

    @contextlib.asynccontextmanager
    async def connection(self):
        yield None

    async def put_shard(self, version, kind, ref, data, connection) -> None:
        if version == self.fail_at:
            raise ConnectionError("the stream is down")
        self.shards[(version, kind, ref.index)] = bytes(data)

    async def put_manifest(self, manifest) -> None:
        self.manifests.append(manifest)

    async def retire_before(self, version: int) -> None:
        pass


def _versions() -> list[dict[str, torch.Tensor]]:
    versions = [_model(0)]
    for v, lr in enumerate([1e-5, 1e-3, 3e-6, 0.0, 1e-2, 1e-4], start=1):
        step = _step(versions[-1], v, lr)
        if v == 2:
            step["new.bias"] = torch.full((7,), float("nan"))
            del step["scale"]
        if v == 3:
            step["layers.0.norm"] = step["layers.0.norm"].reshape(8, 8).clone()
            step["new.bias"] = step["new.bias"].half()
        if v == 5:
            step["master"][:4] = torch.tensor([float("nan"), -0.0, float("inf"), -float("inf")])
        versions.append(step)
    return versions


async def _publish_all(publisher: Publisher, versions, fail_at: int | None = None):
    for version, tensors in enumerate(versions):
        publisher.stream.fail_at = fail_at
        if version == fail_at:
            with pytest.raises(ConnectionError):
                await publisher.publish(tensors, version)
            publisher.stream.fail_at = None
        await publisher.publish(tensors, version)


def _receive_deltas(stream: MemoryStream, versions) -> None:
    """A receiver takes the first snapshot and every delta after it: bit for bit, its
    state digest the manifest's (which apply_version proves too)."""
    receiver = WeightState()
    for manifest in stream.manifests:
        if receiver.version is None and manifest.kind != "full":
            continue
        if receiver.version is not None and manifest.kind == "full":
            continue
        shards = [
            stream.shards[(manifest.version, manifest.kind, r.index)] for r in manifest.shards
        ]
        apply_version(receiver, manifest, shards)
        expected = versions[manifest.version]
        assert receiver.tensors.keys() == expected.keys()
        for name, tensor in expected.items():
            assert receiver.tensors[name].dtype == tensor.dtype
            assert np.array_equal(as_bits(receiver.tensors[name]), as_bits(tensor)), name
        assert receiver.digest() == manifest.state_digest
    assert receiver.version == len(versions) - 1


@pytest.mark.parametrize("fail_at", [None, 3])
def test_a_publisher_finding_deltas_on_the_device_is_received_bit_for_bit(fail_at):
    versions = _versions()
    config = SyncConfig(snapshot_every=4, shard_bytes=4 << 10, chunk_bytes=1 << 10)
    on_host, on_device = MemoryStream(), MemoryStream()
    asyncio.run(_publish_all(Publisher(on_host, config), versions))
    publisher = Publisher(on_device, config, on_device=True)
    asyncio.run(_publish_all(publisher, versions, fail_at))
    # The same bytes as finding every delta on the host, snapshots and deltas alike;
    # after a failed version too, whose host copies were dropped and made again.
    assert on_device.shards == on_host.shards
    strip = [(m.version, m.kind, m.shards, m.state_digest) for m in on_host.manifests]
    assert [(m.version, m.kind, m.shards, m.state_digest) for m in on_device.manifests] == strip
    _receive_deltas(on_device, versions)
    # The base is a copy on the tensors' device, the host copies are separate ones.
    last = versions[-1]
    assert publisher._host_base.keys() == last.keys()
    for name, tensor in last.items():
        base = publisher._base.tensors[name]
        assert base.device == tensor.device
        assert base.data_ptr() not in (tensor.data_ptr(), publisher._host_base[name].data_ptr())
        assert np.array_equal(as_bits(publisher._host_base[name]), as_bits(tensor))


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_a_publisher_on_cuda_keeps_its_base_there_and_gives_the_host_bytes():
    versions = _versions()
    config = SyncConfig(snapshot_every=4, shard_bytes=4 << 10, chunk_bytes=1 << 10)
    on_host, on_cuda = MemoryStream(), MemoryStream()
    asyncio.run(_publish_all(Publisher(on_host, config), versions))
    publisher = Publisher(on_cuda, config)
    cuda = [{n: t.cuda() for n, t in v.items()} for v in versions]
    asyncio.run(_publish_all(publisher, cuda))
    assert on_cuda.shards == on_host.shards
    assert [m.state_digest for m in on_cuda.manifests] == [
        m.state_digest for m in on_host.manifests
    ]
    _receive_deltas(on_cuda, versions)
    assert all(t.is_cuda for t in publisher._base.tensors.values())
    assert all(t.device.type == "cpu" for t in publisher._host_base.values())

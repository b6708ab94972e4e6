"""The delta codec and versions: bit-exact round trips, and refusal of bad shards."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import msgspec
import numpy as np
import pytest
import torch
import zstandard
from hypothesis import given, settings
from hypothesis import strategies as st

from rlfleet.weightsync import codec, positions
from rlfleet.weightsync import state as state_module
from rlfleet.weightsync.bits import as_bits, uint_for
from rlfleet.weightsync.config import SyncConfig
from rlfleet.weightsync.errors import CorruptShard, DigestMismatch, UnknownBase
from rlfleet.weightsync.shards import apply_version, encode_version, parse_shard
from rlfleet.weightsync.state import InCallerThread, WeightState, executor_for

DTYPES = [torch.bfloat16, torch.float16, torch.float32, torch.float64, torch.float8_e4m3fn]
DTYPES += [torch.float8_e5m2, torch.int8, torch.int32]

# Bit patterns floats get wrong when treated as numbers: signed zeros, NaNs with
# payloads, infinities, the smallest and largest denormals.
SPECIAL = {
    2: [0x0000, 0x8000, 0x7FC1, 0xFFFF, 0x7F80, 0xFF80, 0x0001, 0x807F, 0x7C00, 0x03FF],
    4: [0, 0x80000000, 0x7FC00001, 0xFFFFFFFF, 0x7F800000, 0xFF800000, 1, 0x807FFFFF],
    1: [0x00, 0x80, 0x7F, 0xFF, 0x01, 0x7C, 0x7E],
    8: [0, 1 << 63, 0x7FF8000000000001, (1 << 64) - 1, 0x7FF0000000000000, 1],
}


@st.composite
def tensor_pairs(draw):
    dtype = draw(st.sampled_from(DTYPES))
    size = draw(st.integers(0, 3000))
    seed = draw(st.integers(0, 2**32 - 1))
    fraction = draw(st.sampled_from([0.0, 0.0005, 0.01, 0.04, 0.08, 0.15, 0.3, 0.45, 0.9, 1.0]))
    rng = np.random.default_rng(seed)
    uint = uint_for(dtype)
    old = rng.integers(0, np.iinfo(uint).max, size, dtype=uint, endpoint=True)
    old[: size // 10] = rng.choice(np.array(SPECIAL[uint.itemsize], dtype=uint), size // 10)
    new = old.copy()
    changed = rng.random(size) < fraction
    replacement = rng.integers(0, np.iinfo(uint).max, size, dtype=uint, endpoint=True)
    specials = rng.choice(np.array(SPECIAL[uint.itemsize], dtype=uint), size)
    new[changed] = np.where(rng.random(size) < 0.5, replacement, specials)[changed]
    return dtype, old, new


@settings(max_examples=300, deadline=None)
@given(tensor_pairs(), st.sampled_from([0.1, 1.0]))
def test_delta_round_trip_is_bit_exact(pair, dense_from):
    _, old, new = pair
    encoded = codec.encode_delta(new, old, 3, dense_from)
    if encoded is None:
        assert np.array_equal(old, new)
        return
    encoding, sections = encoded
    piece = codec.Piece("t", "x", (new.size,), 0, new.size, encoding, tuple(map(len, sections)))
    target = old.copy()
    codec.apply(piece, [memoryview(s) for s in sections], target)
    assert np.array_equal(target, new)
    # Undoing a delta restores the base: how a failed version is rolled back.
    if encoding != "raw":
        codec.apply(piece, [memoryview(s) for s in sections], target, undo=True)
        assert np.array_equal(target, old)


@settings(max_examples=200, deadline=None)
@given(st.lists(st.integers(0, 2**40), unique=True, max_size=400))
def test_positions_round_trip_including_long_gaps(values):
    where = np.array(sorted(values), dtype=np.int64)
    coded = positions.encode(where)
    decoded = positions.decode(memoryview(coded), 2**40 + 1)
    assert np.array_equal(decoded, where)
    # The price given before building is the exact size: the chooser relies on it.
    assert positions.encode(where, within=len(coded)) == coded
    assert positions.encode(where, within=len(coded) - 1) is None


def _ulp_steps(size: int, fraction: float, seed: int) -> tuple[np.ndarray, np.ndarray]:
    """bf16-like bit patterns, `fraction` of them moved one unit in the last place."""
    rng = np.random.default_rng(seed)
    old = (rng.normal(0, 0.02, size).astype(np.float32).view(np.uint32) >> 16).astype(np.uint16)
    new = old.copy()
    where = rng.choice(size, round(size * fraction), replace=False)
    new[where] += rng.choice(np.array([1, 0xFFFF], dtype=np.uint16), where.size)
    return old, new


def test_the_cheaper_position_code_is_chosen_and_both_are_used():
    chosen = set()
    for fraction in (0.01, 0.04, 0.06, 0.1, 0.2, 0.3, 0.45):
        old, new = _ulp_steps(1 << 16, fraction, seed=int(fraction * 1000))
        encoding, sections = codec.encode_delta(new, old, 3, 1.0)
        changed = new != old
        rice = len(positions.encode(np.flatnonzero(changed)))
        bitmap = len(
            zstandard.ZstdCompressor(level=3).compress(np.packbits(changed, bitorder="little"))
        )
        if fraction < codec.BITMAP_FROM_FRACTION:
            assert encoding == "sparse"  # the bitmap is not even priced down there
        else:
            assert encoding == ("bitmap" if bitmap < rice else "sparse"), fraction
        assert len(sections[0]) == (rice if encoding == "sparse" else bitmap)
        chosen.add(encoding)
        piece = codec.Piece("t", "x", (new.size,), 0, new.size, encoding, tuple(map(len, sections)))
        target = old.copy()
        codec.apply(piece, [memoryview(s) for s in sections], target)
        assert np.array_equal(target, new)
        codec.apply(piece, [memoryview(s) for s in sections], target, undo=True)
        assert np.array_equal(target, old)
    assert chosen == {"sparse", "bitmap"}


def test_a_chain_through_both_position_codes_is_exact_and_rolls_back():
    gen = torch.Generator().manual_seed(5)
    master = {f"w{i}": torch.randn(128, 256, generator=gen) * 0.02 for i in range(3)}
    sender = receiver = None
    used = set()
    for version, lr in enumerate([0, 2e-6, 2e-5, 5e-6, 4e-5, 1e-6]):
        for tensor in master.values():
            tensor += lr * torch.randn(tensor.shape, generator=gen).sign()
        current = {n: t.to(torch.bfloat16) for n, t in master.items()}
        encoded = encode_version("run", version, current, sender, SMALL)
        used |= {
            piece.encoding
            for ref, data in zip(encoded.manifest.shards, encoded.shards, strict=True)
            for piece, _ in parse_shard(encoded.manifest, ref, data)
        }
        if version == 0:
            receiver = WeightState()
        _receive(receiver, encoded)
        assert _same(receiver, current) and receiver.digest() == encoded.manifest.state_digest
        sender = WeightState.copy_of(current, version)
    assert {"sparse", "bitmap"} <= used
    # A version whose digest does not match is taken back out, bitmap pieces included.
    for tensor in master.values():
        tensor += 2e-5 * torch.randn(tensor.shape, generator=gen).sign()
    encoded = encode_version(
        "run", 6, {n: t.to(torch.bfloat16) for n, t in master.items()}, sender, SMALL
    )
    with pytest.raises(DigestMismatch):
        apply_version(
            receiver,
            msgspec.structs.replace(encoded.manifest, state_digest="0" * 32),
            encoded.shards,
        )
    assert receiver.version == 5 and _same(receiver, current)


def _model(seed: int, dtype=torch.bfloat16) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return {
        "embed": (torch.randn(257, 64, generator=gen) * 0.02).to(dtype),
        "layers.0.mlp.experts.w1": (torch.randn(4, 32, 64, generator=gen) * 0.02).to(dtype),
        "layers.0.norm": torch.ones(64, dtype=dtype),
        "scale": torch.tensor(1.5, dtype=torch.float32),
    }


def _step(tensors: dict[str, torch.Tensor], seed: int, lr: float = 1e-3) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return {
        name: (t.float() + lr * torch.randn(t.shape, generator=gen).sign()).to(t.dtype)
        for name, t in tensors.items()
    }


SMALL = SyncConfig(shard_bytes=4 << 10, chunk_bytes=1 << 10)


def _receive(state: WeightState, encoded) -> set[str]:
    return apply_version(state, encoded.manifest, encoded.shards)


def _same(state: WeightState, tensors: dict[str, torch.Tensor]) -> bool:
    return state.tensors.keys() == tensors.keys() and all(
        state.tensors[n].dtype == t.dtype and np.array_equal(as_bits(state.tensors[n]), as_bits(t))
        for n, t in tensors.items()
    )


@pytest.fixture(params=["caller_thread", "pool"])
def work_in(request, monkeypatch):
    """Pieces encoded, applied and hashed in the caller's thread, or by a pool of threads
    (large models' pieces), whatever their size."""
    pooled_from = 0 if request.param == "pool" else 1 << 62
    monkeypatch.setattr(state_module, "POOLED_FROM_BYTES", pooled_from)
    monkeypatch.setattr(state_module, "WORKERS", max(2, state_module.WORKERS))
    return request.param


def test_small_items_are_worked_in_the_callers_thread_and_large_ones_by_a_pool():
    small = state_module.POOLED_FROM_BYTES // 2
    assert isinstance(executor_for(small * 100, 100), InCallerThread)
    pooled = executor_for(state_module.POOLED_FROM_BYTES * 100, 100)
    expected = InCallerThread if state_module.WORKERS == 1 else ThreadPoolExecutor
    assert isinstance(pooled, expected)
    pooled.shutdown()
    with InCallerThread() as pool:
        assert list(pool.map(lambda x: 2 * x, [1, 2])) == [2, 4]
        with pytest.raises(ZeroDivisionError):
            pool.submit(lambda: 1 / 0).result()


def test_a_chain_of_versions_with_new_removed_reshaped_and_retyped_tensors_is_exact(work_in):
    v0 = _model(0)
    sender = WeightState.copy_of(v0, 0)
    first = encode_version("run", 0, v0, None, SMALL)
    assert first.manifest.kind == "full" and len(first.shards) > 1
    assert all(ref.size <= SMALL.shard_bytes for ref in first.manifest.shards)
    receiver = WeightState()
    _receive(receiver, first)
    assert _same(receiver, v0) and receiver.digest() == first.manifest.state_digest

    current = v0
    for version in range(1, 6):
        current = _step(current, version)
        if version == 2:
            current["new.bias"] = torch.full((7,), float("nan"))
            del current["scale"]
        if version == 3:
            current["layers.0.norm"] = current["layers.0.norm"].reshape(8, 8).clone()
            current["new.bias"] = current["new.bias"].to(torch.float16)
        encoded = encode_version("run", version, current, sender, SMALL)
        assert encoded.manifest.kind == "delta" and encoded.manifest.base_version == version - 1
        changed = _receive(receiver, encoded)
        assert _same(receiver, current), version
        assert receiver.version == version
        assert receiver.digest() == encoded.manifest.state_digest
        if version == 2:
            assert {"new.bias", "scale"} <= changed
        sender = WeightState.copy_of(current, version)


def test_unchanged_tensors_are_not_sent():
    v0 = _model(0)
    v1 = dict(v0, embed=_step({"embed": v0["embed"]}, 1)["embed"])
    encoded = encode_version("run", 1, v1, WeightState.copy_of(v0, 0), SMALL)
    assert {t for ref in encoded.manifest.shards for t in ref.tensors} == {"embed"}
    receiver = WeightState.copy_of(v0, 0)
    assert _receive(receiver, encoded) == {"embed"}


@pytest.fixture
def pair():
    v0, v1 = _model(0), _step(_model(0), 1)
    encoded = encode_version("run", 1, v1, WeightState.copy_of(v0, 0), SMALL)
    assert len(encoded.shards) >= 3
    return v0, v1, encoded


def _corrupt(shard: bytes) -> bytes:
    broken = bytearray(shard)
    broken[len(broken) // 2] ^= 0x10
    return bytes(broken)


@pytest.mark.parametrize(
    "tamper",
    [
        pytest.param(lambda s: [s[0][:-5], *s[1:]], id="truncated"),
        pytest.param(lambda s: [s[1], s[0], *s[2:]], id="reordered"),
        pytest.param(lambda s: [s[0], s[0], *s[2:]], id="duplicated"),
        pytest.param(lambda s: [*s[:-1], _corrupt(s[-1])], id="corrupted"),
        pytest.param(lambda s: s[:-1], id="missing"),
    ],
)
def test_bad_shards_are_refused_and_nothing_is_applied(pair, tamper, work_in):
    v0, _, encoded = pair
    receiver = WeightState.copy_of(v0, 0)
    with pytest.raises(CorruptShard):
        apply_version(receiver, encoded.manifest, tamper(encoded.shards))
    assert receiver.version == 0 and _same(receiver, v0)


def test_a_delta_on_a_version_the_receiver_lacks_is_refused(pair):
    v0, _, encoded = pair
    receiver = WeightState.copy_of(v0, 7)
    with pytest.raises(UnknownBase):
        apply_version(receiver, encoded.manifest, encoded.shards)
    assert receiver.version == 7 and _same(receiver, v0)


def test_a_state_that_does_not_match_its_digest_is_rolled_back_bit_exactly(pair, work_in):
    v0, _, encoded = pair
    receiver = WeightState.copy_of(v0, 0)
    manifest = msgspec.structs.replace(encoded.manifest, state_digest="0" * 32)
    with pytest.raises(DigestMismatch):
        apply_version(receiver, manifest, encoded.shards)
    assert receiver.version == 0 and _same(receiver, v0)
    assert receiver.digest() == WeightState.copy_of(v0, 0).digest()

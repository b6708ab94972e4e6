"""The delta codec: one piece (a tensor, or a range of a large one) at a time.

A piece is encoded against the receiver's copy of the same range in one of four ways,
whichever is smallest:

- ``sparse``: the changed positions (Rice-coded gaps) and each changed element's step,
  as byte planes under zstd. What an RL step usually needs.
- ``bitmap``: the same steps, the positions as one bit per element under zstd. Where a
  good part of the piece changed it costs about what Rice does, and takes a fraction of
  the time to code and decode, being a few whole-array operations over n/8 bytes.
- ``dense``: the step of every element as byte planes under zstd, for ranges where
  much changed.
- ``raw``: the new bits as byte planes under zstd, for snapshots and for tensors that are
  new or changed shape or dtype.

A step is the difference of the new and old bit patterns as unsigned integers, wrapping
around, then zigzag-mapped so that small moves either way are small numbers. It is not a
float delta: integer arithmetic on bit patterns is exact, so decoding reproduces the new
bits whatever they are (NaN payloads, -0.0, infinities, denormals), and nothing drifts.
It beats XOR because an RL step moves most changed weights by one unit in the last
place: a step of +1 or -1 (about one bit each), where the XOR of those same patterns is
a run of ones of varying length (about three). Subtracting the steps again restores the
old bits, which is how a receiver rolls back a version that fails verification.

Encoding a delta is two steps: compaction compares the new bits with the old and keeps
what the candidate encodings need (`Compacted`: the changed positions and their steps,
the bitmap, every step), and `encode_compacted` prices and builds them. Host pieces are
compacted here with numpy (`compact`); a device tensor's pieces are compacted on the
device (`bits.compact_bits`) and only what that keeps crosses to the host. Both follow
`bits.sections_needed` and meet in `encode_compacted`, so they give the same bytes.
"""

from __future__ import annotations

import threading
from typing import Literal

import msgspec
import numpy as np
import zstandard

from rlfleet.api.wire import Count
from rlfleet.weightsync import positions
from rlfleet.weightsync.bits import (
    BITMAP_FROM_FRACTION as BITMAP_FROM_FRACTION,  # where the bitmap is priced: codec's rule
)
from rlfleet.weightsync.bits import (
    Compacted,
    from_planes,
    sections_needed,
    to_planes,
)
from rlfleet.weightsync.errors import CorruptShard

Encoding = Literal["raw", "sparse", "bitmap", "dense"]


# Strict, unlike the wire's messages: an array-like struct's fields are positions, so an
# unknown trailing one cannot be told from a moved one. Its layout changes with the
# shard's MAGIC (`rlfleet.weightsync.shards`), which an older reader refuses.
class Piece(msgspec.Struct, array_like=True, forbid_unknown_fields=True, frozen=True):
    """Where a piece goes and how its sections decode; lives in the shard's header."""

    tensor: str
    dtype: str
    shape: tuple[Count, ...]
    start: Count
    count: Count
    encoding: Encoding
    sizes: tuple[Count, ...]


# Above one in this many 64-bit words changed, elements are compared one by one.
WORDS_CHANGED_AT_MOST = 4

_local = threading.local()


def _compress(data: bytes | np.ndarray, level: int) -> bytes:
    # zstd contexts are not thread safe and are costly to make: one per thread and level.
    cache = _local.__dict__.setdefault("compressors", {})
    if level not in cache:
        cache[level] = zstandard.ZstdCompressor(level=level)
    return cache[level].compress(data)


def _decompress(data: memoryview, size: int) -> bytes:
    if "decompressor" not in _local.__dict__:
        _local.decompressor = zstandard.ZstdDecompressor()
    try:
        out = _local.decompressor.decompress(data, max_output_size=size)
    except zstandard.ZstdError as error:
        raise CorruptShard(f"zstd section does not decode: {error}") from error
    if len(out) != size:
        raise CorruptShard(f"zstd section holds {len(out)} bytes, expected {size}")
    return out


def encode_raw(new: np.ndarray, level: int) -> tuple[Encoding, list[bytes]]:
    return "raw", [_compress(to_planes(new), level)]


def _steps(new: np.ndarray, old: np.ndarray) -> np.ndarray:
    difference = new - old  # unsigned: wraps around, exactly
    top = difference.dtype.itemsize * 8 - 1
    negative = np.negative(difference >> top)  # all ones where the difference is negative
    return (difference << 1) ^ negative


def _differences(steps: np.ndarray) -> np.ndarray:
    return (steps >> 1) ^ np.negative(steps & 1)


def _few_changes(new: np.ndarray, old: np.ndarray) -> np.ndarray | None:
    """Where `new` differs from `old`, found eight bytes at a time; None when too many
    of those words differ for that to pay.

    An RL step leaves most bf16 elements as they were, so most 64-bit words are equal:
    the changed elements are found within the few words that differ, from their XOR,
    instead of in the whole piece. np.flatnonzero over every element was the dearest
    step of a delta at lr 1e-6 (1.1 of 2.8 ms for 2 MB, 4 % changed); this takes
    0.9 ms for what that and its comparison took 1.3."""
    width = new.dtype.itemsize
    lanes = 8 // width
    head = new.size - new.size % lanes
    if lanes == 1 or head == 0:
        return None
    new_words, old_words = new[:head].view(np.uint64), old[:head].view(np.uint64)
    differs = np.not_equal(new_words, old_words)
    if np.count_nonzero(differs) > differs.size // WORDS_CHANGED_AT_MOST:
        return None
    words = np.flatnonzero(differs)
    flips = (new_words[words] ^ old_words[words]).view(new.dtype)  # lanes per word, in order
    lane = np.flatnonzero(flips != 0)  # numpy finds True in bools several times faster
    shift = lanes.bit_length() - 1  # lanes is 2, 4 or 8: shifts, not integer division
    found = (words[lane >> shift] << shift) | (lane & (lanes - 1))
    tail = head + np.flatnonzero(np.not_equal(new[head:], old[head:]))
    return np.concatenate((found, tail)) if tail.size else found


def compact(
    new: np.ndarray, old: np.ndarray, dense_from_fraction: float
) -> Compacted[np.ndarray] | None:
    """Host bits compared and compacted (what `bits.compact_bits` does on a device);
    None when nothing changed."""
    changed: np.ndarray | None = None
    where = _few_changes(new, old)
    if where is None:
        changed = np.not_equal(new, old)
        count = int(np.count_nonzero(changed))
    else:
        count = where.size
    if count == 0:
        return None
    sparse, bitmap, dense = sections_needed(count, new.size, dense_from_fraction)
    steps = packed = every = None
    if sparse:
        if where is None:
            where = np.flatnonzero(changed)
        steps = _steps(new[where], old[where])
        if bitmap:
            if changed is None:
                changed = np.not_equal(new, old)
            packed = np.packbits(changed, bitorder="little")
    del changed
    if dense:
        every = _steps(new, old)
    return Compacted(new.size, count, where if sparse else None, steps, packed, every)


def encode_compacted(compacted: Compacted[np.ndarray], level: int) -> tuple[Encoding, list[bytes]]:
    """The smallest encoding of a compacted delta (host arrays), wherever it was found."""
    options: list[tuple[Encoding, list[bytes]]] = []
    if compacted.steps is not None:
        steps = _compress(to_planes(compacted.steps), level)
        bitmap = None
        if compacted.bitmap is not None:
            bitmap = _compress(compacted.bitmap, level)
            options.append(("bitmap", [bitmap, steps]))
        # Rice is priced before it is built: built only where it is the cheaper code.
        rice = positions.encode(compacted.where, within=None if bitmap is None else len(bitmap) - 1)
        if rice is not None:
            options.append(("sparse", [rice, steps]))
    if compacted.dense is not None:
        options.append(("dense", [_compress(to_planes(compacted.dense), level)]))
    return min(options, key=lambda option: sum(map(len, option[1])))


def encode_delta(
    new: np.ndarray, old: np.ndarray, level: int, dense_from_fraction: float
) -> tuple[Encoding, list[bytes]] | None:
    """The smallest encoding of `new` against `old`, or None when nothing changed."""
    compacted = compact(new, old, dense_from_fraction)
    return None if compacted is None else encode_compacted(compacted, level)


def apply_compacted(compacted: Compacted[np.ndarray], target: np.ndarray) -> None:
    """Bring `target`, the old bits, to the new ones the compacted delta was found from:
    what a receiver of any of its encodings does, without their coding."""
    if target.size != compacted.size:
        raise ValueError(f"a delta of {compacted.size} elements for {target.size}")
    if compacted.where is not None:
        target[compacted.where] += _differences(compacted.steps)
    else:
        target += _differences(compacted.dense)


def apply(piece: Piece, sections: list[memoryview], target: np.ndarray, undo: bool = False) -> None:
    """Write the piece into `target`, the bit patterns of its element range.

    With `undo`, take a delta piece back out: the bits return to what they were before.
    """
    if target.size != piece.count:
        raise CorruptShard(f"{piece.tensor}: piece of {piece.count} elements for {target.size}")
    expected_sections = 2 if piece.encoding in ("sparse", "bitmap") else 1
    if len(sections) != expected_sections:
        raise CorruptShard(f"{piece.tensor}: {piece.encoding} piece with {len(sections)} sections")
    width = target.dtype.itemsize
    if piece.encoding == "raw":
        if undo:
            raise ValueError("raw pieces are staged, never undone in place")
        raw = _decompress(sections[0], piece.count * width)
        from_planes(raw, target.dtype, target.size, out=target)
        return
    if piece.encoding == "dense":
        where: np.ndarray | slice = slice(None)
        count = piece.count
        data = sections[0]
    elif piece.encoding == "bitmap":
        packed = np.frombuffer(_decompress(sections[0], -(-piece.count // 8)), np.uint8)
        mask = np.unpackbits(packed, count=piece.count, bitorder="little").view(bool)
        # Integer positions index faster than a boolean mask; numpy finds them in a bool
        # array several times faster than in a uint8 one.
        where = np.flatnonzero(mask)
        count = where.size
        data = sections[1]
    else:
        where = positions.decode(sections[0], piece.count)
        count = where.size
        data = sections[1]
    differences = _differences(from_planes(_decompress(data, count * width), target.dtype, count))
    if undo:
        target[where] -= differences
    else:
        target[where] += differences

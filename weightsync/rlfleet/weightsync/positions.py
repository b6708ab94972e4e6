"""Sorted element positions, Rice-coded as gaps.

When a fraction p of the elements changes at random places, the gaps between changed
positions are geometric, and a Rice code with the right parameter comes within a few
percent of the entropy n*H(p). Gaps too long for the unary part (clustered updates leave
whole experts untouched) escape to a plain 64-bit list instead of costing thousands of
bits. Every step is a numpy array operation: there is no Python loop over positions.
"""

from __future__ import annotations

import struct

import numpy as np

from rlfleet.weightsync.errors import CorruptShard

# Quotients at or above this escape; an escaped gap costs ESCAPE + 1 + 64 bits.
ESCAPE = 32
_HEADER = struct.Struct("<QBQQQ")  # count, rice bits, escapes, quotient bits, remainder bytes


def _cost(gaps: np.ndarray, r: int) -> int:
    q = gaps >> r
    escaped = int(np.count_nonzero(q >= ESCAPE))
    unary = int(np.minimum(q, ESCAPE).sum()) + gaps.size
    return unary + (gaps.size - escaped) * r + escaped * 64


def _best_rice_bits(gaps: np.ndarray) -> int:
    # The optimum for a geometric distribution is near log2(mean * ln 2); look around it.
    guess = int(np.log2(max(float(gaps.mean()) * np.log(2), 1.0)))
    candidates = range(max(guess - 1, 0), min(guess + 3, 63))
    return min(candidates, key=lambda r: _cost(gaps, r))


def _pack_low_bits(values: np.ndarray, bits: int) -> bytes:
    if bits == 0 or values.size == 0:
        return b""
    width = (bits + 7) // 8
    as_bytes = values.astype("<u8").view(np.uint8).reshape(-1, 8)[:, :width]
    matrix = np.unpackbits(as_bytes, axis=1, bitorder="little")[:, :bits]
    return np.packbits(matrix, bitorder="little").tobytes()


def _unpack_low_bits(data: memoryview, count: int, bits: int) -> np.ndarray:
    if bits == 0 or count == 0:
        return np.zeros(count, dtype=np.int64)
    flat = np.unpackbits(np.frombuffer(data, np.uint8), count=count * bits, bitorder="little")
    width = (bits + 7) // 8
    matrix = np.zeros((count, 8 * width), dtype=np.uint8)
    matrix[:, :bits] = flat.reshape(count, bits)
    as_bytes = np.zeros((count, 8), dtype=np.uint8)
    as_bytes[:, :width] = np.packbits(matrix, axis=1, bitorder="little")
    return as_bytes.view("<u8").reshape(count).astype(np.int64)


def encode(positions: np.ndarray) -> bytes:
    """Code strictly increasing non-negative positions."""
    gaps = np.diff(positions.astype(np.int64), prepend=-1) - 1
    if gaps.size == 0:
        return _HEADER.pack(0, 0, 0, 0, 0)
    r = _best_rice_bits(gaps)
    q = gaps >> r
    escaped = q >= ESCAPE
    unary_lengths = np.minimum(q, ESCAPE) + 1
    unary = np.ones(int(unary_lengths.sum()), dtype=np.uint8)
    unary[np.cumsum(unary_lengths) - 1] = 0
    unary_bytes = np.packbits(unary).tobytes()
    remainders = _pack_low_bits(gaps[~escaped] & ((1 << r) - 1), r)
    escapes = gaps[escaped].astype("<u8").tobytes()
    header = _HEADER.pack(gaps.size, r, int(escaped.sum()), unary.size, len(remainders))
    return b"".join((header, unary_bytes, remainders, escapes))


def decode(data: memoryview, limit: int) -> np.ndarray:
    """Positions coded by `encode`, checked to be increasing and below `limit`."""
    if len(data) < _HEADER.size:
        raise CorruptShard("position block shorter than its header")
    count, r, n_escaped, unary_bits, remainder_bytes = _HEADER.unpack_from(data)
    if count == 0:
        return np.zeros(0, dtype=np.int64)
    unary_bytes = (unary_bits + 7) // 8
    expected = _HEADER.size + unary_bytes + remainder_bytes + 8 * n_escaped
    if len(data) != expected or n_escaped > count or r > 62:
        raise CorruptShard(f"position block is {len(data)} bytes, its header says {expected}")
    body = data[_HEADER.size :]
    unary = np.unpackbits(np.frombuffer(body[:unary_bytes], np.uint8), count=unary_bits)
    ends = np.flatnonzero(unary == 0)
    if ends.size != count or (ends.size and ends[-1] != unary_bits - 1):
        raise CorruptShard("position block's unary part does not hold its count")
    q = np.diff(ends, prepend=-1) - 1
    escaped = q == ESCAPE
    if int(escaped.sum()) != n_escaped:
        raise CorruptShard("position block's escapes do not match its header")
    gaps = np.empty(count, dtype=np.int64)
    plain = ~escaped
    low = _unpack_low_bits(body[unary_bytes : unary_bytes + remainder_bytes], count - n_escaped, r)
    gaps[plain] = (q[plain] << r) | low
    gaps[escaped] = np.frombuffer(body[unary_bytes + remainder_bytes :], "<u8").astype(np.int64)
    if (gaps < 0).any():
        raise CorruptShard("position block has a negative gap")
    positions = np.cumsum(gaps + 1) - 1
    if positions[-1] >= limit:
        raise CorruptShard(f"position {int(positions[-1])} is beyond the piece's {limit} elements")
    return positions

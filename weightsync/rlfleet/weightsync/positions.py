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
_HEADER = struct.Struct("<IBIQI")  # count, rice bits, escapes, quotient bits, remainder bytes


def _best_rice_bits(gaps: np.ndarray, total: int) -> tuple[int, int, int]:
    """The Rice parameter that codes these gaps in the fewest bits, with the length of
    the unary part and the number of escapes it then has.

    For geometric gaps the optimum is near log2(mean * ln 2); one histogram of the gaps
    shifted by the smallest candidate prices every candidate exactly, since
    (g >> a) >> b == g >> (a + b). `total` is the gaps' sum, known without a pass.
    """
    guess = int(np.log2(max(total / gaps.size * np.log(2), 1.0)))
    low = max(guess - 1, 0)
    spread = 3
    histogram = np.bincount(np.minimum(gaps >> low, ESCAPE << spread))
    buckets = np.arange(histogram.size)

    def parts(extra: int) -> tuple[int, int]:
        q = buckets >> extra
        escaped = int(histogram[q >= ESCAPE].sum())
        return int((np.minimum(q, ESCAPE) * histogram).sum()) + gaps.size, escaped

    def cost(extra: int) -> int:
        unary, escaped = priced[extra]
        return unary + (gaps.size - escaped) * (low + extra) + escaped * 64

    priced = [parts(extra) for extra in range(spread)]
    extra = min(range(spread), key=cost)
    return low + extra, *priced[extra]


def _pack_low_bits(values: np.ndarray, bits: int) -> bytes:
    """The low `bits` bits of each value, back to back: whole bytes as byte planes, the
    last few bits eight values to a group of that many bytes, value j of a group at bit
    j * rest of the group, lowest first.

    The group is built a byte column at a time in 16-bit lanes: a value's few bits span
    at most two of the group's bytes. That is 3-4 times faster than shifting whole
    64-bit groups together, which would be most of the cost of coding positions."""
    whole, rest = divmod(bits, 8)
    planes = [(values >> (8 * i)).astype(np.uint8).tobytes() for i in range(whole)]
    if rest:
        groups = -(-values.size // 8)
        lanes = np.zeros(groups * 8, dtype=np.uint16)
        lanes[: values.size] = (values >> (8 * whole)) & ((1 << rest) - 1)
        columns = lanes.reshape(groups, 8)
        packed = np.zeros((groups, rest), dtype=np.uint8)
        for j in range(8):  # eight columns, each a whole-array operation
            byte, shift = divmod(j * rest, 8)
            placed = columns[:, j] << shift  # at most 15 bits: this byte and the next
            packed[:, byte] |= placed.astype(np.uint8)  # the cast keeps the low byte
            if byte + 1 < rest:
                packed[:, byte + 1] |= (placed >> 8).astype(np.uint8)
        planes.append(packed.tobytes())
    return b"".join(planes)


def _low_bits_size(count: int, bits: int) -> int:
    whole, rest = divmod(bits, 8)
    return count * whole + -(-count // 8) * rest


def _unpack_low_bits(data: memoryview, count: int, bits: int) -> np.ndarray:
    whole, rest = divmod(bits, 8)
    values = np.zeros(count, dtype="<u8")
    for i in range(whole):
        plane = np.frombuffer(data, np.uint8, count=count, offset=i * count)
        values |= plane.astype("<u8") << np.uint64(8 * i)
    if rest:
        groups = np.zeros((-(-count // 8), 8), dtype=np.uint8)
        groups[:, :rest] = np.frombuffer(data, np.uint8, offset=whole * count).reshape(-1, rest)
        shifts = np.arange(8, dtype="<u8") * rest
        tail = (groups.view("<u8") >> shifts) & np.uint64((1 << rest) - 1)
        values |= tail.reshape(-1)[:count] << np.uint64(8 * whole)
    return values.view(np.int64)


def encode(positions: np.ndarray, within: int | None = None) -> bytes | None:
    """Code strictly increasing non-negative positions; None when that takes more than
    `within` bytes. The price is known before the costly part is built, so a caller with
    a cheaper code at hand skips it."""
    if positions.size == 0:
        return _HEADER.pack(0, 0, 0, 0, 0) if within is None or _HEADER.size <= within else None
    positions = positions.astype(np.int64, copy=False)
    gaps = np.empty_like(positions)
    gaps[0] = positions[0]
    np.subtract(positions[1:], positions[:-1], out=gaps[1:])
    gaps[1:] -= 1
    r, unary_bits, n_escaped = _best_rice_bits(gaps, int(positions[-1]) + 1 - gaps.size)
    remainder_bytes = _low_bits_size(gaps.size - n_escaped, r)
    size = _HEADER.size + (unary_bits + 7) // 8 + remainder_bytes + 8 * n_escaped
    if within is not None and size > within:
        return None
    q = gaps >> r
    escaped = q >= ESCAPE
    unary_lengths = np.minimum(q, ESCAPE) + 1
    unary = np.ones(unary_bits, dtype=np.uint8)
    unary[np.cumsum(unary_lengths) - 1] = 0
    unary_bytes = np.packbits(unary).tobytes()
    plain = gaps[~escaped] if n_escaped else gaps
    remainders = _pack_low_bits(plain & ((1 << r) - 1), r)
    escapes = gaps[escaped].astype("<u8").tobytes() if n_escaped else b""
    header = _HEADER.pack(gaps.size, r, n_escaped, unary_bits, remainder_bytes)
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
    if (
        len(data) != expected
        or n_escaped > count
        or r > 62
        or remainder_bytes != _low_bits_size(count - n_escaped, r)
    ):
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

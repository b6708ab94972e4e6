"""Tensors as raw bit patterns.

Everything weightsync computes works on the integer bit patterns of a tensor, never on
its float values: comparisons then treat -0.0, NaN payloads, infinities and denormals
as the distinct bit strings they are, and overwriting bits can never drift.

A delta is found where the tensor lives: `compact_bits` compares a tensor with its base
on their device (a trainer's GPU) and compacts what changed there, and only that
(`Compacted`) crosses to the host, where the codec prices and compresses it. This
module needs numpy and torch only, so a benchmark on a GPU machine can load it alone.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Generic, TypeVar

import numpy as np
import torch

# Bit-pattern container per element width, little-endian like every host we run on.
_UINT = {1: np.dtype("<u1"), 2: np.dtype("<u2"), 4: np.dtype("<u4"), 8: np.dtype("<u8")}
# The same on a device: torch's signed integers, whose wrapping arithmetic and shifts give
# the bits numpy's unsigned ones do (torch has few operations on wide unsigned types).
_INT = {1: torch.int8, 2: torch.int16, 4: torch.int32, 8: torch.int64}

# Below this fraction of changed elements the bitmap is not even priced: on changes
# spread at random it measured 13 % (at 0.1) to 75 % (at 0.01) dearer than Rice coding,
# the two costing the same from about 0.19 up.
BITMAP_FROM_FRACTION = 0.1


class UnsupportedDtype(ValueError):
    pass


class NotOnHost(TypeError):
    """A tensor off the host (on a GPU, or `meta`) where host memory is needed."""


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def torch_dtype(name: str) -> torch.dtype:
    dtype = getattr(torch, name, None)
    if not isinstance(dtype, torch.dtype):
        raise UnsupportedDtype(f"unknown dtype {name!r}")
    return dtype


def uint_for(dtype: torch.dtype) -> np.dtype:
    size = torch.empty((), dtype=dtype).element_size()
    if size not in _UINT or dtype.is_complex:
        raise UnsupportedDtype(f"dtype {dtype_name(dtype)} has no bit-pattern codec")
    return _UINT[size]


def as_bits(tensor: torch.Tensor) -> np.ndarray:
    """A flat view of the tensor's bit patterns; shares memory when it is contiguous.

    Host tensors only: a device tensor is compared where it is (`device_bits`,
    `compact_bits`), never copied here behind the caller's back."""
    if tensor.device.type != "cpu":
        raise NotOnHost(
            f"as_bits reads host memory, and this {dtype_name(tensor.dtype)} tensor is on "
            f"{tensor.device}: compare it there (device_bits, compact_bits) or copy it first"
        )
    flat = tensor.detach().reshape(-1)
    if not flat.is_contiguous():
        flat = flat.contiguous()
    return flat.view(torch.uint8).numpy().view(uint_for(tensor.dtype))


def from_bits(bits: np.ndarray, dtype: torch.dtype, shape: tuple[int, ...]) -> torch.Tensor:
    """A tensor over the given bit patterns (shares memory with `bits`)."""
    raw = torch.from_numpy(np.ascontiguousarray(bits).view(np.uint8))
    return raw.view(dtype).reshape(shape)


def to_planes(values: np.ndarray) -> np.ndarray:
    """Byte planes: all lowest bytes, then the next ones, and so on (a contiguous uint8
    array, which zstd takes as is).

    Small bit-pattern changes live in the low bytes while sign and exponent bytes barely
    vary, so grouping bytes by significance lets zstd see long uniform runs.
    """
    width = values.dtype.itemsize
    if width == 1:
        return values.view(np.uint8)
    # A shift per plane streams through memory; a transposing copy's strided reads are
    # several times slower.
    planes = np.empty((width, values.size), dtype=np.uint8)
    for i in range(width):
        planes[i] = values >> (8 * i)  # the assignment keeps the low byte
    return planes


def from_planes(
    data: bytes | memoryview, dtype: np.dtype, count: int, out: np.ndarray | None = None
) -> np.ndarray:
    """The values whose byte planes `data` holds, written into `out` when given."""
    width = dtype.itemsize
    planes = np.frombuffer(data, dtype=np.uint8, count=count * width)
    if out is None:
        out = np.empty(count, dtype=dtype)
    if width == 1:
        out[:] = planes.view(dtype)
        return out
    # One plane into its byte column at a time: several times faster than a transposing
    # copy, whose strided reads defeat the cache.
    columns = out.view(np.uint8).reshape(count, width)
    for i, plane in enumerate(planes.reshape(width, count)):
        columns[:, i] = plane
    return out


def device_bits(tensor: torch.Tensor) -> torch.Tensor:
    """A flat view of the tensor's bit patterns as signed integers of its width, on its
    own device (host or not); shares memory when it is contiguous."""
    uint_for(tensor.dtype)  # refuses complex and odd widths, as the host path does
    flat = tensor.detach().reshape(-1)
    if not flat.is_contiguous():
        flat = flat.contiguous()
    return flat.view(_INT[flat.element_size()])


def sections_needed(changed: int, size: int, dense_from_fraction: float) -> tuple[bool, bool, bool]:
    """What the codec prices for a piece of `size` elements of which `changed` differ:
    whether the changed positions and their steps (``sparse``, and ``bitmap`` with them),
    the bitmap of changed elements, and the step of every element (``dense``).

    The one rule both compactions (numpy's on the host, torch's on a device) follow."""
    fraction = changed / size
    sparse = fraction < 0.5
    bitmap = sparse and fraction >= BITMAP_FROM_FRACTION
    return sparse, bitmap, fraction >= min(dense_from_fraction, 0.5)


Array = TypeVar("Array", np.ndarray, torch.Tensor)


@dataclass(frozen=True, slots=True)
class Compacted(Generic[Array]):
    """What a piece's delta needs of the comparison of its new bits with the old ones:
    numpy arrays on the host, or torch tensors where they were found until `host()`.

    `where` and `steps` are there when `sections_needed` asks for sparse sections,
    `bitmap` and `dense` when it asks for them. Steps are unsigned on the host (numpy)
    and signed of the same width on a device (the same bits)."""

    size: int  # elements compared
    changed: int  # how many of them differ; never 0
    where: Array | None  # the changed elements' positions, int64, ascending
    steps: Array | None  # their steps: zigzag of the wrapping difference of bits
    bitmap: Array | None  # one bit per element, set where it changed, little-endian, uint8
    dense: Array | None  # the step of every element

    def arrays(self) -> list[Array]:
        return [a for a in (self.where, self.steps, self.bitmap, self.dense) if a is not None]

    @property
    def nbytes(self) -> int:
        """Bytes of the compacted arrays: on a device, what `host()` moves to the host."""
        total = 0
        for a in self.arrays():
            if isinstance(a, np.ndarray):
                total += a.nbytes
            else:
                narrow = a is self.where and self._narrow_where()
                total += a.numel() * (4 if narrow else a.element_size())
        return total

    def _narrow_where(self) -> bool:
        # Positions cross as int32 where they fit (a piece is far below 2**31 elements):
        # the largest array at the fractions RL steps change, halved for the link. A
        # host tensor is left as it is, nothing crossing.
        where = self.where
        return isinstance(where, torch.Tensor) and where.device.type != "cpu" and self.size < 2**31

    def host(self) -> Compacted[np.ndarray]:
        """The same as numpy arrays in host memory (through pinned memory from CUDA, in
        one wait for every copy); itself when it already is."""
        fields = (self.where, self.steps, self.bitmap, self.dense)
        if all(a is None or isinstance(a, np.ndarray) for a in fields):
            return self  # type: ignore[return-value]
        if self._narrow_where():
            fields = (self.where.to(torch.int32), *fields[1:])
        copies = _to_host([a for a in fields if a is not None])
        where, steps, bitmap, dense = (None if a is None else copies.pop(0) for a in fields)
        return Compacted(
            self.size,
            self.changed,
            None if where is None else where.numpy().astype(np.int64, copy=False),
            None if steps is None else _unsigned(steps),
            None if bitmap is None else bitmap.numpy(),
            None if dense is None else _unsigned(dense),
        )


def _unsigned(bits: torch.Tensor) -> np.ndarray:
    return bits.numpy().view(_UINT[bits.element_size()])


def _to_host(tensors: list[torch.Tensor]) -> list[torch.Tensor]:
    if not any(t.is_cuda for t in tensors):
        return [t.cpu() for t in tensors]
    # Pinned buffers (torch caches them) copy at the link's full speed and without a
    # staging copy; all copies are queued, then waited for once.
    copies = []
    for t in tensors:
        if t.is_cuda:
            t = torch.empty(t.shape, dtype=t.dtype, pin_memory=True).copy_(t, non_blocking=True)
        copies.append(t.cpu())
    for device in {t.device for t in tensors if t.is_cuda}:
        torch.cuda.current_stream(device).synchronize()
    return copies


def _zigzag(difference: torch.Tensor) -> torch.Tensor:
    """Steps from wrapped differences: small moves either way become small numbers."""
    top = difference.element_size() * 8 - 1
    return (difference << 1) ^ (difference >> top)  # >> is arithmetic on signed ints


def _pack_little(mask: torch.Tensor) -> torch.Tensor:
    """np.packbits(mask, bitorder="little"), computed where the mask is."""
    size = mask.numel()
    lanes = torch.zeros(-(-size // 8) * 8, dtype=torch.uint8, device=mask.device)
    lanes[:size] = mask
    shifts = torch.arange(8, dtype=torch.uint8, device=mask.device)
    # The eight bits of a byte are distinct, so their sum is their OR.
    return (lanes.view(-1, 8) << shifts).sum(1, dtype=torch.uint8)


def compact_bits(
    new: torch.Tensor, old: torch.Tensor, dense_from_fraction: float
) -> Compacted[torch.Tensor] | None:
    """Compare `new` with `old` (bit views from `device_bits`, of one size, on one
    device) and compact the difference there; None when nothing changed.

    Torch operations only, on any device, CPU included; one wait for the changed
    count, which decides what is built (`sections_needed`), and one in `nonzero`."""
    differs = new != old
    changed = int(torch.count_nonzero(differs))
    if changed == 0:
        return None
    sparse, bitmap, dense = sections_needed(changed, new.numel(), dense_from_fraction)
    where = steps = packed = every = None
    if sparse:
        where = torch.nonzero(differs).view(-1)
        steps = _zigzag(new[where] - old[where])
        if bitmap:
            packed = _pack_little(differs)
    del differs
    if dense:
        every = _zigzag(new - old)
    return Compacted(new.numel(), changed, where, steps, packed, every)

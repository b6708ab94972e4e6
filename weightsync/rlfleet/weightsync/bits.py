"""Tensors as raw bit patterns.

Everything weightsync computes works on the integer bit patterns of a tensor, never on
its float values: comparisons then treat -0.0, NaN payloads, infinities and denormals
as the distinct bit strings they are, and overwriting bits can never drift.
"""

from __future__ import annotations

import numpy as np
import torch

# Bit-pattern container per element width, little-endian like every host we run on.
_UINT = {1: np.dtype("<u1"), 2: np.dtype("<u2"), 4: np.dtype("<u4"), 8: np.dtype("<u8")}


class UnsupportedDtype(ValueError):
    pass


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
    """A flat view of the tensor's bit patterns; shares memory when it is contiguous."""
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

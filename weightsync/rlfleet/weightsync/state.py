"""A set of named tensors at a known version, and the digest that proves which one."""

from __future__ import annotations

import os
from collections.abc import Mapping
from concurrent.futures import ThreadPoolExecutor

import torch
import xxhash

from rlfleet.weightsync.bits import as_bits, dtype_name

WORKERS = os.cpu_count() or 1


def tensor_digests(
    tensors: Mapping[str, torch.Tensor], reuse: Mapping[str, bytes] | None = None
) -> dict[str, bytes]:
    """xxh3-128 of each tensor's bits, taking those in `reuse` as already known."""
    reuse = reuse or {}
    missing = [name for name in tensors if name not in reuse]
    with ThreadPoolExecutor(WORKERS) as pool:
        fresh = pool.map(lambda name: xxhash.xxh3_128(as_bits(tensors[name])).digest(), missing)
        return {name: reuse[name] for name in tensors if name in reuse} | dict(
            zip(missing, fresh, strict=True)
        )


def state_digest(tensors: Mapping[str, torch.Tensor], digests: Mapping[str, bytes]) -> str:
    """xxh3-128 over every tensor's name, dtype, shape and bits digest, in name order."""
    state = xxhash.xxh3_128()
    for name in sorted(tensors):
        tensor = tensors[name]
        shape = ",".join(map(str, tensor.shape))
        state.update(f"{name}\0{dtype_name(tensor.dtype)}\0{shape}\0".encode())
        state.update(digests[name])
    return state.hexdigest()


class WeightState:
    """The tensors a receiver (or a publisher, as its base) holds, host-side.

    Tensor digests are kept so that proving a new version rehashes only what it changed.
    """

    def __init__(self) -> None:
        self.version: int | None = None
        self.tensors: dict[str, torch.Tensor] = {}
        self.digests: dict[str, bytes] = {}

    @classmethod
    def copy_of(cls, tensors: Mapping[str, torch.Tensor], version: int) -> WeightState:
        state = cls()
        copies = {
            name: t.detach().to("cpu").clone(memory_format=torch.contiguous_format)
            for name, t in tensors.items()
        }
        state.commit(copies, version, tensor_digests(copies))
        return state

    def commit(
        self, tensors: dict[str, torch.Tensor], version: int, digests: dict[str, bytes]
    ) -> None:
        self.tensors, self.version, self.digests = tensors, version, digests

    def digest(self) -> str:
        return state_digest(self.tensors, self.digests)

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.tensors.values())

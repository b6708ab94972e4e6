"""A set of named tensors at a known version, and the digest that proves which one."""

from __future__ import annotations

import os
from collections.abc import Callable, Iterable, Mapping
from concurrent.futures import Executor, Future, ThreadPoolExecutor

import msgspec
import torch
import xxhash

from rlfleet.weightsync.bits import as_bits, dtype_name

WORKERS = os.cpu_count() or 1
# Items smaller than this on average are worked through in the caller's thread: handing
# each to a pool costs more than its work. The tiny MoE's versions (1.2 MB) apply in 2.1
# ms of CPU in the caller's thread against 7.6 through a pool of two, and encode in 4.6
# against 9.7 (`bench/small_versions.py`), in every engine's process beside its model; a
# large model's pieces (a quarter of a shard, 2 MiB by default) gain from the pool.
POOLED_FROM_BYTES = 256 << 10


class InCallerThread(Executor):
    """An executor that runs each call at once, in the caller's thread."""

    def submit(self, fn: Callable, /, *args, **kwargs) -> Future:
        future: Future = Future()
        try:
            future.set_result(fn(*args, **kwargs))
        except Exception as error:
            future.set_exception(error)
        return future


def executor_for(total_bytes: int, items: int) -> Executor:
    """A pool of `WORKERS` threads for `items` worth it, or the caller's own thread."""
    if WORKERS > 1 and total_bytes >= POOLED_FROM_BYTES * max(items, 1):
        return ThreadPoolExecutor(WORKERS)
    return InCallerThread()


def tensor_digests(
    tensors: Mapping[str, torch.Tensor], reuse: Mapping[str, bytes] | None = None
) -> dict[str, bytes]:
    """xxh3-128 of each tensor's bits, taking those in `reuse` as already known. Hashed
    on the host: a device tensor's digest is known, or taken from a host copy."""
    reuse = reuse or {}
    missing = [name for name in tensors if name not in reuse]
    nbytes = sum(tensors[name].nbytes for name in missing)
    with executor_for(nbytes, len(missing)) as pool:
        fresh = pool.map(lambda name: xxhash.xxh3_128(as_bits(tensors[name])).digest(), missing)
        return {name: reuse[name] for name in tensors if name in reuse} | dict(
            zip(missing, fresh, strict=True)
        )


# Strict, unlike the wire's messages: an array-like struct's fields are positions, so an
# unknown trailing one cannot be told from a moved one: a change to it is a new struct,
# never an edit in place.
class TensorEntry(msgspec.Struct, array_like=True, frozen=True, forbid_unknown_fields=True):
    """What the state digest knows of one tensor, so ranks holding parts can pool them."""

    name: str
    dtype: str
    shape: tuple[int, ...]
    digest: bytes


def tensor_entries(
    tensors: Mapping[str, torch.Tensor], digests: Mapping[str, bytes]
) -> list[TensorEntry]:
    return [
        TensorEntry(name, dtype_name(t.dtype), tuple(t.shape), digests[name])
        for name, t in tensors.items()
    ]


def entries_digest(entries: Iterable[TensorEntry]) -> str:
    """xxh3-128 over every tensor's name, dtype, shape and bits digest, in name order."""
    state = xxhash.xxh3_128()
    for entry in sorted(entries, key=lambda e: e.name):
        shape = ",".join(map(str, entry.shape))
        state.update(f"{entry.name}\0{entry.dtype}\0{shape}\0".encode())
        state.update(entry.digest)
    return state.hexdigest()


def state_digest(tensors: Mapping[str, torch.Tensor], digests: Mapping[str, bytes]) -> str:
    return entries_digest(tensor_entries(tensors, digests))


class WeightState:
    """The tensors a receiver holds, host-side, or a publisher as its base (each where the
    publisher's tensor is: host or device).

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

"""Versions as bounded shards: encode one against its base, verify and apply one.

A shard is ``MAGIC | u32 header length | header | sections``, the header being zstd over
msgpack (tensor names repeat a lot). Its header names
the run, version and index it belongs to and every piece in it, so a shard delivered
in the wrong place is caught even before its checksum is compared.
"""

from __future__ import annotations

import math
import struct
import threading
import time
from collections import deque
from collections.abc import Iterator, Mapping
from concurrent.futures import Executor, Future
from dataclasses import dataclass

import msgspec
import numpy as np
import torch
import xxhash
import zstandard

from rlfleet.api.wire import ShardRef, WeightManifest
from rlfleet.weightsync import codec
from rlfleet.weightsync.bits import (
    UnsupportedDtype,
    as_bits,
    compact_bits,
    device_bits,
    dtype_name,
    torch_dtype,
)
from rlfleet.weightsync.codec import Piece
from rlfleet.weightsync.config import SyncConfig
from rlfleet.weightsync.errors import CorruptShard, DigestMismatch, UnknownBase
from rlfleet.weightsync.state import (
    WORKERS,
    TensorEntry,
    WeightState,
    entries_digest,
    executor_for,
    state_digest,
    tensor_digests,
    tensor_entries,
)

MAGIC = b"RLWS\x01"
_LENGTH = struct.Struct("<I")
MAX_HEADER_BYTES = 64 << 20


# Strict, unlike the wire's messages: an array-like struct's fields are positions, so an
# unknown trailing one cannot be told from a moved one. Its layout changes with MAGIC,
# which an older reader refuses (a corrupt shard: it rebuilds from a snapshot).
class ShardHeader(msgspec.Struct, array_like=True, forbid_unknown_fields=True, frozen=True):
    run: str
    version: int
    index: int
    pieces: list[Piece]


@dataclass(frozen=True)
class EncodedVersion:
    manifest: WeightManifest
    shards: list[bytes]


def checksum(data: bytes | memoryview) -> str:
    return xxhash.xxh3_128(data).hexdigest()


def _ranges(count: int, piece_elements: int) -> list[tuple[int, int]]:
    return [
        (start, min(piece_elements, count - start)) for start in range(0, count, piece_elements)
    ] or [(0, 0)]


def _encode_piece(
    name: str,
    new: torch.Tensor,
    old: torch.Tensor | None,
    start: int,
    count: int,
    config: SyncConfig,
    host_old: torch.Tensor | None = None,
) -> tuple[Piece, list[bytes]] | None:
    """One piece: raw when there is no `old`; else a delta found on the host, or, given
    `host_old` (a host copy of `old`), found where `new` and `old` are, and applied to
    `host_old`, which then holds the new bits."""
    if host_old is not None:
        end = start + count
        found = compact_bits(
            device_bits(new)[start:end], device_bits(old)[start:end], config.dense_from_fraction
        )
        if found is None:
            return None
        compacted = found.host()
        codec.apply_compacted(compacted, as_bits(host_old)[start:end])
        encoded = codec.encode_compacted(compacted, config.zstd_level)
        return _piece(name, new, start, count, encoded)
    new_bits = as_bits(new)[start : start + count]
    if old is None:
        encoded = codec.encode_raw(new_bits, config.zstd_level)
    else:
        old_bits = as_bits(old)[start : start + count]
        encoded = codec.encode_delta(
            new_bits, old_bits, config.zstd_level, config.dense_from_fraction
        )
        if encoded is None:
            return None
    return _piece(name, new, start, count, encoded)


def _piece(
    name: str,
    new: torch.Tensor,
    start: int,
    count: int,
    encoded: tuple[codec.Encoding, list[bytes]],
) -> tuple[Piece, list[bytes]]:
    encoding, sections = encoded
    piece = Piece(
        name,
        dtype_name(new.dtype),
        tuple(new.shape),
        start,
        count,
        encoding,
        tuple(map(len, sections)),
    )
    return piece, sections


def _shard(
    run: str, version: int, index: int, group: list[tuple[Piece, list[bytes]]]
) -> tuple[ShardRef, bytes]:
    pieces = [piece for piece, _ in group]
    header = zstandard.compress(msgspec.msgpack.encode(ShardHeader(run, version, index, pieces)))
    data = b"".join(
        [MAGIC, _LENGTH.pack(len(header)), header, *(s for _, sections in group for s in sections)]
    )
    raw = sum(piece.count * torch_dtype(piece.dtype).itemsize for piece in pieces)
    tensors = list(dict.fromkeys(piece.tensor for piece in pieces))
    ref = ShardRef(
        index=index, size=len(data), raw_size=raw, checksum=checksum(data), tensors=tensors
    )
    return ref, data


def _encoded_pieces(jobs: Iterator[tuple], pool: Executor) -> Iterator[tuple[Piece, list[bytes]]]:
    """Encoded pieces in job order, a bounded number ahead, so memory holds a few
    pieces in flight and never the whole version."""
    with pool:
        pending: deque[Future] = deque()
        try:
            for job in jobs:
                pending.append(pool.submit(_encode_piece, *job))
                if len(pending) < 2 * WORKERS:
                    continue
                if (item := pending.popleft().result()) is not None:
                    yield item
            while pending:
                if (item := pending.popleft().result()) is not None:
                    yield item
        finally:
            for future in pending:
                future.cancel()


def _host(tensor: torch.Tensor) -> torch.Tensor:
    """The tensor in host memory, contiguous: itself when it already is, else one copy."""
    return tensor.detach().to("cpu").contiguous()


def _host_copy(tensor: torch.Tensor) -> torch.Tensor:
    """A copy of the tensor in host memory, never sharing it."""
    return torch.empty(tensor.shape, dtype=tensor.dtype).copy_(tensor.detach())


def _piece_elements(tensor: torch.Tensor, config: SyncConfig) -> int:
    """A piece's elements at most: a quarter of a shard."""
    return max(1, config.shard_bytes // 4 // tensor.element_size())


def _piece_jobs(
    tensors: Mapping[str, torch.Tensor],
    base: WeightState | None,
    config: SyncConfig,
    digests: dict[str, bytes],
    host_base: dict[str, torch.Tensor],
    on_device: bool | None,
    hashed_late: list[str],
) -> Iterator[tuple]:
    """`_encode_piece`'s arguments for every piece of `tensors`, in name order, as
    `encode_shards` takes them: each tensor's digest and `host_base` entry are settled as
    its pieces are reached (`hashed_late` names those whose digest waits for all of its
    pieces to be encoded)."""
    for name in sorted(tensors):
        tensor = tensors[name]
        old = base.tensors.get(name) if base is not None else None
        if old is not None and (old.dtype != tensor.dtype or old.shape != tensor.shape):
            old = None  # carried whole: new shape or dtype
        off_host = tensor.device.type != "cpu" if on_device is None else on_device
        ranges = _ranges(tensor.numel(), _piece_elements(tensor, config))
        if off_host and old is not None and old.device == tensor.device:
            host = host_base.get(name)
            if host is None or host.dtype != old.dtype or host.shape != old.shape:
                host = host_base[name] = _host_copy(old)
            if name not in digests:
                hashed_late.append(name)
            new, old = tensor.detach().contiguous(), old.contiguous()
            for start, count in ranges:
                yield name, new, old, start, count, config, host
            continue
        new = _host(tensor)
        if old is not None:
            old = _host(old)  # a copy only where base and tensor are on other devices
        if name not in digests:
            digests[name] = xxhash.xxh3_128(as_bits(new)).digest()
        if off_host:  # the host copy made to send it, kept (never the caller's own)
            host_base[name] = new if tensor.device.type != "cpu" else _host_copy(new)
        else:
            host_base.pop(name, None)
        for start, count in ranges:
            yield name, new, old, start, count, config


def encode_shards(
    run: str,
    version: int,
    tensors: Mapping[str, torch.Tensor],
    base: WeightState | None,
    config: SyncConfig,
    digests: dict[str, bytes],
    *,
    rank: int = 0,
    world: int = 1,
    host_base: dict[str, torch.Tensor] | None = None,
    on_device: bool | None = None,
) -> Iterator[tuple[ShardRef, bytes]]:
    """Shards of `tensors` as `version`, a delta on `base` or full when None, each yielded
    as soon as it is full: the caller puts it away before the next is made.

    Fills `digests` with the tensors' digests (those already in it are taken as known).
    Among `world` ranks each encoding its own tensors, shard `i` of rank `rank` gets index
    ``i * world + rank``: indices never collide, and need no agreement beforehand.

    A tensor off the host whose base is on its device has its delta found and compacted
    there (`on_device`: None decides so by where the tensor is; True does it for host
    tensors too, False never), and only the compacted delta crosses to the host. Its
    digest comes from `host_base`, host copies of such tensors' bases (made from the base
    where missing), which the compacted delta brings to the new bits as it is encoded.
    Every tensor encoded so, or sent raw while off the host (or `on_device`), ends with
    its new bits in `host_base`; any other tensor leaves it. Encoding stopped part way
    leaves `host_base` part old, part new: the caller drops it.
    """
    host_base = {} if host_base is None else host_base
    hashed_late: list[str] = []  # digests taken from `host_base` once their pieces are in
    group: list[tuple[Piece, list[bytes]]] = []
    size = local = 0
    pieces = sum(len(_ranges(t.numel(), _piece_elements(t, config))) for t in tensors.values())
    pool = executor_for(sum(t.nbytes for t in tensors.values()), pieces)
    jobs = _piece_jobs(tensors, base, config, digests, host_base, on_device, hashed_late)
    for item in _encoded_pieces(jobs, pool):
        item_size = sum(item[0].sizes) + 64 + len(item[0].tensor)
        if group and size + item_size > config.shard_bytes:
            yield _shard(run, version, local * world + rank, group)
            group, size, local = [], 0, local + 1
        group.append(item)
        size += item_size
    # Every piece is in (the pool is done with them): `host_base` holds the new bits.
    if hashed_late:
        digests.update(tensor_digests({name: host_base[name] for name in hashed_late}))
    if group:
        yield _shard(run, version, local * world + rank, group)


def version_manifest(
    run: str,
    version: int,
    base_version: int | None,
    shards: list[ShardRef],
    entries: list[TensorEntry],
    removed: list[str],
) -> WeightManifest:
    """The manifest of a version from its shards and every tensor's entry, wherever
    (in one process or across ranks) they were encoded."""
    return WeightManifest(
        run=run,
        version=version,
        base_version=base_version,
        kind="delta" if base_version is not None else "full",
        shards=sorted(shards, key=lambda ref: ref.index),
        removed=sorted(removed),
        state_digest=entries_digest(entries),
        state_bytes=sum(math.prod(e.shape) * torch_dtype(e.dtype).itemsize for e in entries),
        tensor_count=len(entries),
        created_at=time.time(),
    )


def encode_version(
    run: str,
    version: int,
    tensors: Mapping[str, torch.Tensor],
    base: WeightState | None,
    config: SyncConfig,
    digests: Mapping[str, bytes] | None = None,
) -> EncodedVersion:
    """Shards and manifest for `tensors` as `version`: a delta on `base`, or full when None.

    `digests` are the tensors' digests when already known.
    """
    known = dict(digests or {})
    shards = list(encode_shards(run, version, tensors, base, config, known))
    removed = sorted(set(base.tensors) - set(tensors)) if base is not None else []
    manifest = version_manifest(
        run,
        version,
        base.version if base is not None else None,
        [ref for ref, _ in shards],
        tensor_entries(tensors, known),
        removed,
    )
    return EncodedVersion(manifest, [data for _, data in shards])


def parse_shard(
    manifest: WeightManifest, ref: ShardRef, data: bytes | memoryview
) -> list[tuple[Piece, list[memoryview]]]:
    """The pieces of a shard, after proving it is the one `ref` describes."""
    where = f"version {manifest.version} shard {ref.index}"
    if len(data) != ref.size:
        raise CorruptShard(f"{where}: {len(data)} bytes, manifest says {ref.size} (truncated?)")
    if checksum(data) != ref.checksum:
        raise CorruptShard(f"{where}: checksum mismatch")
    view = memoryview(data)
    if bytes(view[: len(MAGIC)]) != MAGIC:
        raise CorruptShard(f"{where}: not a weightsync shard")
    (length,) = _LENGTH.unpack_from(view, len(MAGIC))
    offset = len(MAGIC) + _LENGTH.size
    try:
        packed = zstandard.ZstdDecompressor().decompress(
            view[offset : offset + length], max_output_size=MAX_HEADER_BYTES
        )
        header = msgspec.msgpack.decode(packed, type=ShardHeader)
    except (msgspec.DecodeError, zstandard.ZstdError) as error:
        raise CorruptShard(f"{where}: unreadable header: {error}") from error
    if (header.run, header.version, header.index) != (manifest.run, manifest.version, ref.index):
        raise CorruptShard(
            f"{where}: holds {header.run} version {header.version} shard {header.index}"
        )
    offset += length
    pieces = []
    for piece in header.pieces:
        try:
            torch_dtype(piece.dtype)
        except UnsupportedDtype as error:
            raise CorruptShard(f"{where}: {error}") from error
        sections = []
        for size in piece.sizes:
            sections.append(view[offset : offset + size])
            offset += size
        pieces.append((piece, sections))
    if offset != len(view):
        raise CorruptShard(f"{where}: sections do not add up to the shard's size")
    return pieces


class _Apply:
    """One version being applied: new tensors staged, deltas applied in place and undoable."""

    def __init__(self, state: WeightState, manifest: WeightManifest) -> None:
        self.state = state
        self.full = manifest.kind == "full"
        # New tensors are allocated as their first piece names them: no more than the
        # manifest says the whole state holds, whatever the pieces claim.
        self.room = manifest.state_bytes
        self.staged: dict[str, torch.Tensor] = {}
        self.covered: dict[str, int] = {}
        self.done: list[tuple[Piece, list[memoryview]]] = []
        self.lock = threading.Lock()

    def target(self, piece: Piece) -> np.ndarray:
        dtype = torch_dtype(piece.dtype)
        if piece.encoding == "raw":
            with self.lock:
                tensor = self.staged.get(piece.tensor)
                if tensor is None:
                    tensor = self.staged[piece.tensor] = self._allocate(piece, dtype)
                self.covered[piece.tensor] = self.covered.get(piece.tensor, 0) + piece.count
        else:
            tensor = self.state.tensors.get(piece.tensor)
            if tensor is None or tensor.dtype != dtype or tuple(tensor.shape) != piece.shape:
                raise CorruptShard(
                    f"{piece.tensor}: delta piece for a tensor of another shape or dtype"
                )
        if tensor.dtype != dtype or tuple(tensor.shape) != piece.shape:
            raise CorruptShard(f"{piece.tensor}: pieces disagree on shape or dtype")
        bits = as_bits(tensor)
        if piece.start < 0 or piece.start + piece.count > bits.size:
            raise CorruptShard(f"{piece.tensor}: piece range beyond the tensor")
        return bits[piece.start : piece.start + piece.count]

    def _allocate(self, piece: Piece, dtype: torch.dtype) -> torch.Tensor:
        size = math.prod(piece.shape) * dtype.itemsize
        if size > self.room:
            raise CorruptShard(
                f"{piece.tensor}: {size} bytes, beyond the {self.room} its manifest has left"
            )
        self.room -= size
        return torch.empty(piece.shape, dtype=dtype)

    def apply(self, item: tuple[Piece, list[memoryview]]) -> None:
        piece, sections = item
        codec.apply(piece, sections, self.target(piece))
        if piece.encoding != "raw":
            with self.lock:
                self.done.append(item)

    def undo(self) -> None:
        for piece, sections in self.done:
            codec.apply(piece, sections, self.target(piece), undo=True)


def apply_version(state: WeightState, manifest: WeightManifest, shards: list[bytes]) -> set[str]:
    """Bring `state` to `manifest.version`, all or nothing; returns the tensors that changed."""
    if manifest.kind == "delta" and (
        state.version is None or manifest.base_version != state.version
    ):
        raise UnknownBase(
            f"version {manifest.version} is a delta on {manifest.base_version}; "
            f"this receiver holds {state.version}"
        )
    if len(shards) != len(manifest.shards):
        raise CorruptShard(
            f"version {manifest.version}: {len(shards)} shards, "
            f"its manifest lists {len(manifest.shards)}"
        )
    items = [
        item
        for ref, data in zip(manifest.shards, shards, strict=True)
        for item in parse_shard(manifest, ref, data)
    ]
    run = _Apply(state, manifest)
    try:
        raw = sum(ref.raw_size for ref in manifest.shards)
        with executor_for(raw, len(items)) as pool:
            list(pool.map(run.apply, items))
        for name, tensor in run.staged.items():
            if run.covered[name] != tensor.numel():
                raise CorruptShard(
                    f"{name}: pieces cover {run.covered[name]} of {tensor.numel()} elements"
                )
        changed = {piece.tensor for piece, _ in items}
        if run.full:
            candidate = dict(run.staged)
        else:
            kept = {n: t for n, t in state.tensors.items() if n not in manifest.removed}
            candidate = kept | run.staged
        unchanged = {n: d for n, d in state.digests.items() if n in candidate and n not in changed}
        digests = tensor_digests(candidate, unchanged)
        digest = state_digest(candidate, digests)
        if digest != manifest.state_digest:
            raise DigestMismatch(
                f"version {manifest.version}: state digest {digest}, "
                f"its manifest says {manifest.state_digest}"
            )
    except BaseException:
        run.undo()
        raise
    state.commit(candidate, manifest.version, digests)
    return changed | set(manifest.removed)

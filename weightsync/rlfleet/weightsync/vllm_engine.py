"""Weightsync inside vLLM: a weight-transfer engine that runs in each worker process.

vLLM loads it through the `vllm.general_plugins` entry point (`register`), in every
process it starts. In the first worker of an engine (tensor-parallel rank 0, the
leader), the engine follows the run's versions on NATS from a background thread: shards
are fetched, decoded and verified against the state digest there, into a host copy of
the weights, while the model keeps generating. Only `update_weights` touches the model,
copying in the tensors changed since the last update, so generation pauses just for
that copy.

An engine over several devices keeps one host copy and fetches each version once: the
leader broadcasts the version, its digest and each changed tensor, one at a time, over
the engine's own tensor-parallel group (NVLink on a GPU node), and every worker loads
its own shard of it (vLLM's weight loaders slice the whole tensor). Followers hold no
copy, so host memory and the region's NATS traffic do not grow with the devices.

vLLM rebuilds a whole module from what it is given (fused QKV, all experts of a layer),
so every tensor of a decoder layer goes in when any of them changed.

Every worker proves what it loaded from, on its own (`LoadedTensors`): it keeps the
xxh3-128 digest of each checkpoint-named tensor it handed to vLLM's `load_weights`, and
reports the state digest of them all, which the client compares with the digest the
leader verified against the version's manifest.
"""

from __future__ import annotations

import asyncio
import logging
import re
import threading
from collections import deque
from collections.abc import Iterator, Mapping
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

import xxhash
from vllm.distributed.weight_transfer.base import (
    WeightTransferEngine,
    WeightTransferInitInfo,
    WeightTransferUpdateInfo,
)
from vllm.distributed.weight_transfer.factory import WeightTransferEngineFactory

from rlfleet.bus import connection
from rlfleet.launch.stopping import log_with_vllm
from rlfleet.weightsync.bits import as_bits, dtype_name
from rlfleet.weightsync.config import SyncConfig
from rlfleet.weightsync.receiver import Receiver
from rlfleet.weightsync.state import TensorEntry, entries_digest
from rlfleet.weightsync.transport import WeightStream
from rlfleet.weightsync.versions import wait_for_version
from rlfleet.weightsync.vllm_client import ENGINE_NAME

_LAYER = re.compile(r"^(.*?\.layers\.\d+)\.")

log = logging.getLogger(__name__)

# A follower hashes what it received on this many threads, while vLLM loads it; at most
# twice as many received tensors wait for their hash (host memory stays bounded).
HASHERS = 2


@dataclass
class InitInfo(WeightTransferInitInfo):
    nats_url: str = ""
    run: str = ""
    # The JetStream domain to read from: the region's own mirror in production.
    domain: str | None = None
    config: dict[str, Any] = field(default_factory=dict)


@dataclass
class UpdateInfo(WeightTransferUpdateInfo):
    # Wait until this version is held (verified) before writing; None: what is held now.
    version: int | None = None
    timeout_s: float = 300.0


def module_groups(names: set[str], all_names: list[str]) -> list[str]:
    """`names` widened to whole decoder layers, in the order of `all_names`."""
    layers = {m.group(1) for name in names if (m := _LAYER.match(name))}
    return [
        name
        for name in all_names
        if name in names or ((m := _LAYER.match(name)) is not None and m.group(1) in layers)
    ]


class LoadedTensors:
    """The checkpoint tensors one worker has handed to vLLM's `load_weights`, by digest.

    Each entry is the name, dtype, shape and xxh3-128 bits digest of the whole tensor the
    worker itself passed to `load_weights` (before vLLM's loaders slice it into this
    worker's shard or fuse it with others): a follower hashes the bytes it received from
    the broadcast, after receiving them; the leader takes the digests its receiver
    computed and verified for the very host tensors it sends. A load that sends every
    tensor of the state replaces the entries; one that sends only what changed updates
    those it sent, so a tensor the worker never got keeps its old digest.

    `digest()` is the state digest of the entries, computed the way the publisher
    computes the manifest's `state_digest`. Equal to the verified state's digest, it
    proves that this worker, since its last whole load, handed vLLM every tensor of that
    state, with exactly those bits, names, dtypes and shapes: a broadcast corrupted,
    truncated, mis-ordered or mislabelled on the way to this worker, a tensor it skipped,
    or one left at an older version is caught. It does not prove what vLLM made of them:
    the parameters are never read back (they are this worker's slices, fused, and may
    be repacked for a kernel), so a weight loader that writes a wrong slice, or memory
    corrupted after the load, is not caught. On the leader of several workers, the device
    copy it broadcasts is not hashed by the leader; the followers hash the bytes of that
    copy, so a bad copy shows as every follower disagreeing.
    """

    def __init__(self) -> None:
        self.entries: dict[str, TensorEntry] = {}

    def record(self, entries: Mapping[str, TensorEntry], whole: bool) -> None:
        if whole:
            self.entries = dict(entries)
        else:
            self.entries.update(entries)

    def digest(self) -> str | None:
        return entries_digest(self.entries.values()) if self.entries else None


def _entry(name: str, tensor: Any, digest: bytes) -> TensorEntry:
    return TensorEntry(name, dtype_name(tensor.dtype), tuple(tensor.shape), digest)


def _bits_digest(tensor: Any) -> bytes:
    return xxhash.xxh3_128(as_bits(tensor)).digest()


class WeightsyncEngine(WeightTransferEngine[InitInfo, UpdateInfo]):
    init_info_cls = InitInfo
    update_info_cls = UpdateInfo
    supports_draft_weight_update = False

    def init_transfer_engine(self, init_info: InitInfo) -> None:
        from vllm.distributed.parallel_state import get_tp_group

        log_with_vllm()
        self.loaded_version: int | None = None
        # The state digest of `loaded_version` as the leader verified it (sent to the
        # followers), and this worker's own digest of what it handed to vLLM.
        self.loaded_verified: str | None = None
        self.loaded_digest: str | None = None
        self.loaded_tensors = LoadedTensors()
        self._stashed_kernels: list[tuple[Any, Any]] = []
        self._group = get_tp_group()
        self.leads = self._group.rank_in_group == 0
        if not self.leads:
            return  # takes each version from the leader (`receive_weights`)
        self._loop = asyncio.new_event_loop()
        self._stop = asyncio.Event()
        self._thread = threading.Thread(
            target=self._loop.run_forever, name="weightsync", daemon=True
        )
        self._thread.start()
        self.receiver = self._call(self._follow(init_info))
        log.info(
            "weightsync engine following run %s on %s",
            init_info.run,
            init_info.domain or "the default domain",
        )

    def _call(self, coroutine):
        return asyncio.run_coroutine_threadsafe(coroutine, self._loop).result()

    async def _follow(self, info: InitInfo) -> Receiver:
        self._nc = await connection.connect(info.nats_url, max_reconnect_attempts=-1)
        stream = WeightStream(self._nc, info.run, SyncConfig(**info.config), domain=info.domain)
        receiver = Receiver(stream)
        self._following = asyncio.ensure_future(receiver.follow(self._stop))
        return receiver

    def start_weight_update(self) -> None:
        from vllm.model_executor.model_loader.reload import initialize_layerwise_reload

        # vLLM's CPU MoE kernel (the locked release) prepacks expert weights once and skips
        # it on reload, which would leave reloaded experts in the wrong layout: drop the
        # kernel so it is rebuilt from the new weights, and put back those of layers left
        # untouched.
        self._stashed_kernels = [
            (module.quant_method, module.quant_method.moe_kernel)
            for module in self.model.modules()
            if hasattr(module, "w13_weight")
            and getattr(getattr(module, "quant_method", None), "moe_kernel", None) is not None
        ]
        for method, _ in self._stashed_kernels:
            method.moe_kernel = None
        initialize_layerwise_reload(self.model)

    def receive_weights(self, update_info: UpdateInfo) -> None:
        if not self.leads:
            self._load({})
            return
        receiver = self.receiver
        if update_info.version is not None:
            wait_for_version(
                lambda: receiver.version,
                update_info.version,
                update_info.timeout_s,
                what="weightsync's receiver",
                poll_s=0.02,
            )
        with receiver.state_lock:
            tensors = receiver.state.tensors
            changed = {name for name in receiver.take_changed() if name in tensors}
            if self.loaded_version is None:
                changed = set(tensors)  # the first update replaces whatever vLLM loaded
            names = module_groups(changed, list(tensors))
            self._load(
                {name: tensors[name] for name in names},
                receiver.version,
                receiver.state.digest(),
                whole=len(names) == len(tensors),
                digests=receiver.state.digests,
            )

    def _load(
        self,
        tensors: dict[str, Any],
        version: int | None = None,
        digest: str | None = None,
        whole: bool = False,
        digests: Mapping[str, bytes] | None = None,
    ) -> None:
        """Write `tensors` (the leader's; empty on followers) into every worker's model:
        the leader sends what changed, tensor by tensor, and each worker loads its shard.
        `digest` is the leader's verified state digest of `version`, `whole` whether the
        tensors are the whole state, `digests` the leader's verified tensor digests."""
        shapes = [(name, t.shape, t.dtype) for name, t in tensors.items()]
        version, digest, whole, shapes = self._group.broadcast_object(
            (version, digest, whole, shapes)
        )
        handed: dict[str, TensorEntry] = {}
        try:
            if self.leads:
                self.model.load_weights(self._sent(tensors, shapes, digests or {}, handed))
            else:
                with ThreadPoolExecutor(HASHERS, thread_name_prefix="weightsync-hash") as pool:
                    self.model.load_weights(self._received(shapes, pool, handed))
        except BaseException:
            # What the model holds is unknown: reload it all.
            self.loaded_version = self.loaded_verified = self.loaded_digest = None
            raise
        self.loaded_tensors.record(handed, whole)
        self.loaded_version, self.loaded_verified = version, digest
        self.loaded_digest = self.loaded_tensors.digest()
        log.info("weightsync: wrote %d tensors of version %s", len(shapes), version)

    def _sent(
        self,
        tensors: dict[str, Any],
        shapes: list,
        digests: Mapping[str, bytes],
        handed: dict[str, TensorEntry],
    ) -> Iterator[tuple[str, Any]]:
        """The leader's tensors for `load_weights`, each broadcast to the followers first;
        each one handed is entered with its verified digest."""
        import torch

        for name, _, _ in shapes:
            host = tensor = tensors[name]
            if self._group.world_size > 1:
                tensor = tensor.to(self.device)  # NCCL sends from the device
                self._group.broadcast(tensor.view(-1).view(torch.uint8))
            yield name, tensor
            handed[name] = _entry(name, host, digests[name])

    def _received(
        self, shapes: list, pool: ThreadPoolExecutor, handed: dict[str, TensorEntry]
    ) -> Iterator[tuple[str, Any]]:
        """A follower's tensors for `load_weights`, received from the leader's broadcast;
        each one is hashed, from its host copy, while vLLM loads it."""
        import torch

        hashing: deque[tuple[str, Any, Future[bytes]]] = deque()

        def enter_oldest() -> None:
            name, tensor, digest = hashing.popleft()
            handed[name] = _entry(name, tensor, digest.result())

        for name, shape, dtype in shapes:
            size = shape.numel() * dtype.itemsize
            raw = torch.empty(size, dtype=torch.uint8, device=self.device)
            tensor = self._group.broadcast(raw).view(dtype).view(shape)
            host = tensor if tensor.device.type == "cpu" else tensor.to("cpu")
            hashing.append((name, host, pool.submit(_bits_digest, host)))
            if len(hashing) > 2 * HASHERS:
                enter_oldest()
            yield name, tensor
        while hashing:
            enter_oldest()

    def finish_weight_update(self) -> None:
        from vllm.model_executor.model_loader.reload import finalize_layerwise_reload

        finalize_layerwise_reload(self.model, self.model_config)
        for method, kernel in self._stashed_kernels:
            if method.moe_kernel is None:
                method.moe_kernel = kernel
        self._stashed_kernels = []

    def hold_at_most(self, version: int | None) -> None:
        """Let the host copy hold no newer version than `version` (None: the newest),
        going back to it if it holds a newer one; a no-op on followers."""
        if self.leads:
            self._loop.call_soon_threadsafe(setattr, self.receiver, "ceiling", version)

    def forget_loaded(self) -> None:
        """Take what the model holds as unknown, so the next update reloads every tensor
        (after workers were found to disagree)."""
        self.loaded_version = self.loaded_verified = self.loaded_digest = None

    def status(self) -> dict[str, Any]:
        """`held`: the version the leader holds verified (None on followers, which hold
        none); `loaded`: the version this worker's model was written to last; `verified`:
        that version's state digest, as the leader verified it against the manifest (on
        followers: as the leader sent it); `digest`: this worker's own digest of the
        tensors it handed vLLM (`LoadedTensors`), None before the first update."""
        loaded = {
            "loaded": self.loaded_version,
            "verified": self.loaded_verified,
            "digest": self.loaded_digest,
        }
        if not self.leads:
            return {"held": None, "leads": False, **loaded}
        receiver = self.receiver
        with receiver.state_lock:
            return {"held": receiver.version, "leads": True, **loaded}

    def shutdown(self) -> None:
        if getattr(self, "_loop", None) is None:
            return  # vLLM made the engine, but nobody started following weights with it

        async def close() -> None:
            self._stop.set()
            self._following.cancel()
            await asyncio.gather(self._following, return_exceptions=True)
            await self._nc.close()

        self._call(close())
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(timeout=10)


def register() -> None:
    """The `vllm.general_plugins` entry point: make the engine known in this process."""
    if ENGINE_NAME not in WeightTransferEngineFactory._registry:
        WeightTransferEngineFactory.register_engine(ENGINE_NAME, WeightsyncEngine)

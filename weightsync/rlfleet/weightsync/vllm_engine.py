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
"""

from __future__ import annotations

import asyncio
import logging
import re
import threading
from dataclasses import dataclass, field
from typing import Any

from vllm.distributed.weight_transfer.base import (
    WeightTransferEngine,
    WeightTransferInitInfo,
    WeightTransferUpdateInfo,
)
from vllm.distributed.weight_transfer.factory import WeightTransferEngineFactory

from rlfleet.bus import auth
from rlfleet.launch.stopping import log_with_vllm
from rlfleet.weightsync.config import SyncConfig
from rlfleet.weightsync.receiver import Receiver
from rlfleet.weightsync.transport import WeightStream
from rlfleet.weightsync.versions import wait_for_version
from rlfleet.weightsync.vllm_client import ENGINE_NAME

_LAYER = re.compile(r"^(.*?\.layers\.\d+)\.")

log = logging.getLogger(__name__)


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


class WeightsyncEngine(WeightTransferEngine[InitInfo, UpdateInfo]):
    init_info_cls = InitInfo
    update_info_cls = UpdateInfo
    supports_draft_weight_update = False

    def init_transfer_engine(self, init_info: InitInfo) -> None:
        from vllm.distributed.parallel_state import get_tp_group

        log_with_vllm()
        self.loaded_version: int | None = None
        self.loaded_digest: str | None = None
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
        self._nc = await auth.connect(info.nats_url, max_reconnect_attempts=-1)
        stream = WeightStream(self._nc, info.run, SyncConfig(**info.config), domain=info.domain)
        receiver = Receiver(stream)
        self._following = asyncio.ensure_future(receiver.follow(self._stop))
        return receiver

    def start_weight_update(self) -> None:
        from vllm.model_executor.model_loader.reload import initialize_layerwise_reload

        # vLLM 0.32's CPU MoE kernel prepacks expert weights once and skips it on reload,
        # which would leave reloaded experts in the wrong layout: drop the kernel so it
        # is rebuilt from the new weights, and put back those of layers left untouched.
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
            )

    def _load(
        self, tensors: dict[str, Any], version: int | None = None, digest: str | None = None
    ) -> None:
        """Write `tensors` (the leader's; empty on followers) into every worker's model:
        the leader sends what changed, tensor by tensor, and each worker loads its shard."""
        import torch

        shapes = [(name, t.shape, t.dtype) for name, t in tensors.items()]
        version, digest, shapes = self._group.broadcast_object((version, digest, shapes))

        def sent():
            for name, shape, dtype in shapes:
                if self.leads:
                    tensor = tensors[name]
                    if self._group.world_size > 1:
                        tensor = tensor.to(self.device)  # NCCL sends from the device
                        self._group.broadcast(tensor.view(-1).view(torch.uint8))
                else:
                    size = shape.numel() * dtype.itemsize
                    raw = torch.empty(size, dtype=torch.uint8, device=self.device)
                    tensor = self._group.broadcast(raw).view(dtype).view(shape)
                yield name, tensor

        try:
            self.model.load_weights(sent())
        except BaseException:
            self.loaded_version = None  # what the model holds is unknown: reload it all
            raise
        self.loaded_version, self.loaded_digest = version, digest
        log.info("weightsync: wrote %d tensors of version %s", len(shapes), version)

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

    def status(self) -> dict[str, Any]:
        """`held`: the version the leader holds verified (None on followers, which hold
        none); `loaded` and `digest`: what this worker's model runs."""
        loaded = {"loaded": self.loaded_version, "digest": self.loaded_digest}
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

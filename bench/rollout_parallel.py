"""Benchmark: host memory and update pause of a tensor-parallel vLLM engine (CPU backend).

Prints one JSON object. A Qwen3-MoE checkpoint of the tiny model's architecture, grown to
`model_mib`, is served by one engine of two workers that follow a real NATS hub through
weightsync; version 0 (a snapshot) and version 1 (a delta: one element in a hundred
moved by one unit in the last place) are published and loaded.

- `worker_extra_mib`: per worker (tensor-parallel rank), the growth of its resident
  memory from before the engine follows the weights until version 1 is loaded. The
  leader keeps the verified host copy; followers should hold none of it.
- `follower_vs_model`: the largest follower's growth over `model_mib` (0 is the aim: a
  copy per worker would make it about 1).
- `update_pause_ms`: generation paused for each version's load, snapshot and delta.

`--quick` serves the tiny MoE itself (still two workers), to check the script.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import tempfile
import uuid
from pathlib import Path

import psutil
import torch

from rlfleet.launch.caches import own_temporary_caches

MIB = 1 << 20
TENSOR_PARALLEL = 2
# 8 experts of 4 layers at these sizes: about 170 MiB of bf16.
SIZES = {
    "hidden_size": 1024,
    "moe_intermediate_size": 768,
    "num_hidden_layers": 4,
    "num_attention_heads": 8,
    "num_key_value_heads": 4,
    "head_dim": 128,
}
QUICK = {"SIZES": {}}


def _workers() -> list[psutil.Process]:
    """vLLM's worker processes under this one (titled `VLLM::Worker_TP<rank>`), by rank."""
    found = [p for p in psutil.Process().children(recursive=True) if "Worker" in _title(p)]
    return sorted(found, key=_title)


def _title(process: psutil.Process) -> str:
    return " ".join([process.name(), *process.cmdline()[:1]])


def _rss_mib(workers: list[psutil.Process]) -> list[float]:
    return [w.memory_info().rss / MIB for w in workers]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="smallest sizes: check the script")
    if parser.parse_args().quick:
        globals().update(QUICK)
    own_temporary_caches("rlfleet-bench-rollout-parallel-caches-")
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    os.environ.setdefault("VLLM_LOGGING_STREAM", "ext://sys.stderr")  # stdout: the JSON alone
    from vllm import LLM

    from rlfleet.bus.streams import ensure_run_streams
    from rlfleet.local.nats import HUB_DOMAIN, StandaloneNats
    from rlfleet.models.tiny import init_model, read_weights
    from rlfleet.rollout.worker.loop import parallel_options
    from rlfleet.weightsync import (
        Publisher,
        SyncConfig,
        WeightStream,
        vllm_options,
        vllm_start,
        vllm_update,
    )

    with tempfile.TemporaryDirectory(prefix="rlfleet-bench-rollout-parallel-") as root:
        model = init_model("tiny-moe", Path(root) / "v0", sizes=SIZES)
        weights = read_weights(model)
        model_mib = sum(t.numel() * t.element_size() for t in weights.values()) / MIB
        servers = StandaloneNats(Path(root) / "nats")
        try:
            hub = servers.bed.hub
            os.environ.update(hub.client_env())  # vLLM's workers log in as this process does
            run, config = f"tp{uuid.uuid4().hex[:6]}", SyncConfig()
            loop = asyncio.new_event_loop()
            nc = loop.run_until_complete(hub.connect())
            loop.run_until_complete(ensure_run_streams(nc, run, HUB_DOMAIN))
            llm = LLM(
                model=str(model),
                dtype="bfloat16",
                max_model_len=256,
                enforce_eager=True,
                **parallel_options(TENSOR_PARALLEL),
                **vllm_options(),
            )
            workers = _workers()
            before = _rss_mib(workers)
            publisher = Publisher(WeightStream(nc, run, config), config)
            vllm_start(llm, hub.url, run, None, config)
            pauses = []
            for version in (0, 1):
                if version:
                    generator = torch.Generator().manual_seed(version)
                    for tensor in weights.values():
                        moved = torch.rand(tensor.shape, generator=generator) < 0.01
                        bits = tensor.view(torch.int16)
                        bits[moved] += 1
                loop.run_until_complete(publisher.publish(weights, version))
                pauses.append(round(vllm_update(llm, version).pause_s * 1000, 1))
            extra = [round(a - b, 1) for a, b in zip(_rss_mib(workers), before, strict=True)]
            loop.run_until_complete(nc.close())
        finally:
            servers.stop()
    print(
        json.dumps(
            {
                "bench": "rollout_parallel",
                "tensor_parallel": TENSOR_PARALLEL,
                "model_mib": round(model_mib, 1),
                "worker_extra_mib": extra,
                "follower_vs_model": round(max(extra[1:]) / model_mib, 3),
                "update_pause_ms": {"snapshot": pauses[0], "delta": pauses[1]},
                "cpus": os.cpu_count(),
            }
        )
    )


if __name__ == "__main__":
    main()

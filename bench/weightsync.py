"""Benchmark: weightsync's delta sizes, codec speed, NATS transfer and vLLM apply pause.

Prints one JSON object. Every ratio compares two numbers measured in this same run.

- Realistic updates: real AdamW steps (fp32 master weights, cast to bf16) on the tiny
  MoE with real gradients, and on a synthetic model of >= 1 GB bf16 with Gaussian
  gradients, at RL learning rates. `ratio_vs_full` is the bf16 checkpoint's size over
  the delta's; `ratio_vs_zstd_full` the same against zstd of the checkpoint.
- Controlled: exactly 1% of elements moved by one unit in the last place.
- `size_vs_bound`: delta bytes over the order-0 entropy of what must be sent, worst over
  workloads. The bound is, per tensor, n*H(k/n) bits for the changed positions, plus
  k times the empirical entropy of the XOR symbols of the changed elements.
- Speeds are model bytes per second of one process (threads included), next to this
  machine's memcpy bandwidth; transfer is hub to leaf node next to raw loopback TCP.
"""

from __future__ import annotations

import asyncio
import json
import math
import os
import socket
import sys
import tempfile
import threading
import time
from pathlib import Path

import msgspec
import numpy as np
import torch
import zstandard

from rlfleet.weightsync.bits import as_bits
from rlfleet.weightsync.config import SyncConfig
from rlfleet.weightsync.shards import apply_version, encode_version
from rlfleet.weightsync.state import WeightState

CONFIG = SyncConfig()
SYNTHETIC_PARAMS = 512 << 20  # 1 GiB of bf16
SYNTHETIC_SHAPE = (4096, 4096)
LEARNING_RATES = (1e-6, 1e-5)
STEPS = 3
CHAIN = 1000
TRANSFER_BYTES = 256 << 20


def _entropy(p: float) -> float:
    return 0.0 if p <= 0 or p >= 1 else -(p * math.log2(p) + (1 - p) * math.log2(1 - p))


def _bound_bytes(old: dict[str, torch.Tensor], new: dict[str, torch.Tensor]) -> float:
    position_bits, symbols = 0.0, []
    for name, tensor in new.items():
        a, b = as_bits(old[name]), as_bits(tensor)
        changed = np.flatnonzero(a != b)
        position_bits += a.size * _entropy(changed.size / a.size)
        symbols.append(a[changed] ^ b[changed])
    flips = np.concatenate(symbols)
    if flips.size == 0:
        return position_bits / 8
    _, counts = np.unique(flips, return_counts=True)
    q = counts / counts.sum()
    return (position_bits + flips.size * float(-(q * np.log2(q)).sum())) / 8


def _changed_fraction(old: dict[str, torch.Tensor], new: dict[str, torch.Tensor]) -> float:
    changed = sum(int(np.count_nonzero(as_bits(old[n]) != as_bits(t))) for n, t in new.items())
    return changed / sum(t.numel() for t in new.values())


def _delta_stats(old: dict[str, torch.Tensor], new: dict[str, torch.Tensor]) -> dict:
    base = WeightState.copy_of(old, 0)
    started = time.perf_counter()
    encoded = encode_version("bench", 1, new, base, CONFIG)
    encode_s = time.perf_counter() - started
    size = sum(ref.size for ref in encoded.manifest.shards)
    model_bytes = encoded.manifest.state_bytes
    started = time.perf_counter()
    apply_version(base, encoded.manifest, encoded.shards)
    decode_s = time.perf_counter() - started
    assert base.digest() == encoded.manifest.state_digest
    return {
        "changed_fraction": _changed_fraction(old, new),
        "delta_bytes": size,
        "ratio_vs_full": model_bytes / size,
        "size_vs_bound": size / _bound_bytes(old, new),
        "encode_gbps": model_bytes / encode_s / 1e9,
        "decode_gbps": model_bytes / decode_s / 1e9,
    }


def _bf16(params: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    return {n: p.detach().to(torch.bfloat16) for n, p in params.items()}


def _zstd_full(tensors: dict[str, torch.Tensor]) -> int:
    compressor = zstandard.ZstdCompressor(level=CONFIG.zstd_level, threads=-1)
    return sum(len(compressor.compress(as_bits(t).tobytes())) for t in tensors.values())


def _mean(runs: list[dict]) -> dict:
    return {k: sum(r[k] for r in runs) / len(runs) for k in runs[0]}


def tiny_moe_workload(lr: float) -> dict:
    from transformers import AutoModelForCausalLM

    from rlfleet.models.tiny import init_model

    with tempfile.TemporaryDirectory() as directory:
        init_model("tiny-moe", Path(directory), seed=0)
        model = AutoModelForCausalLM.from_pretrained(directory, dtype=torch.float32)
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.01)
    generator = torch.Generator().manual_seed(0)
    params = dict(model.named_parameters())
    before = _bf16(params)
    runs = []
    for _ in range(STEPS):
        tokens = torch.randint(0, model.config.vocab_size, (8, 64), generator=generator)
        loss = model(input_ids=tokens, labels=tokens).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        after = _bf16(params)
        runs.append(_delta_stats(before, after))
        before = after
    return _mean(runs) | {"model_bytes": sum(t.numel() * 2 for t in before.values())}


def synthetic_workload(lr: float, params: list[torch.nn.Parameter]) -> dict:
    optimizer = torch.optim.AdamW(params, lr=lr, weight_decay=0.01)
    names = [f"layers.{i}.weight" for i in range(len(params))]
    before = _bf16(dict(zip(names, params, strict=True)))
    generator = torch.Generator().manual_seed(1)
    runs = []
    for _ in range(STEPS):
        for p in params:
            p.grad = torch.randn(p.shape, generator=generator)
        optimizer.step()
        after = _bf16(dict(zip(names, params, strict=True)))
        runs.append(_delta_stats(before, after))
        before = after
    for p in params:
        p.grad = None
    model_bytes = sum(t.numel() * 2 for t in before.values())
    stats = _mean(runs)
    stats["ratio_vs_zstd_full"] = _zstd_full(before) / stats["delta_bytes"]
    return stats | {"model_bytes": model_bytes}


def controlled_workload(tensors: dict[str, torch.Tensor], fraction: float) -> dict:
    """Exactly `fraction` of the elements moved by one unit in the last place."""
    rng = np.random.default_rng(2)
    new = {}
    for name, tensor in tensors.items():
        bits = as_bits(tensor).copy()
        where = rng.choice(bits.size, round(bits.size * fraction), replace=False)
        bits[where] += rng.choice(np.array([1, 0xFFFF], dtype=bits.dtype), where.size)
        new[name] = torch.from_numpy(bits.view(np.int16)).view(torch.bfloat16).reshape(tensor.shape)
    return _delta_stats(tensors, new)


def chain_is_bit_exact(length: int) -> bool:
    """Publisher and receiver states after `length` consecutive deltas and snapshots."""
    generator = torch.Generator().manual_seed(3)
    master = {f"w{i}": torch.randn(256, 256, generator=generator) * 0.02 for i in range(8)}
    sender, receiver = None, WeightState()
    for version in range(length):
        for tensor in master.values():
            tensor += 1e-4 * torch.randn(tensor.shape, generator=generator).sign()
        current = _bf16(master)
        encoded = encode_version("chain", version, current, sender, CONFIG)
        apply_version(receiver, encoded.manifest, encoded.shards)
        sender = WeightState.copy_of(current, version)
    return receiver.digest() == sender.digest() and all(
        np.array_equal(as_bits(receiver.tensors[n]), as_bits(t)) for n, t in sender.tensors.items()
    )


def memcpy_gbps(nbytes: int = 1 << 30) -> float:
    source = np.ones(nbytes, dtype=np.uint8)
    target = np.empty_like(source)
    best = math.inf
    for _ in range(3):
        started = time.perf_counter()
        np.copyto(target, source)
        best = min(best, time.perf_counter() - started)
    return nbytes / best / 1e9


def loopback_gbps(nbytes: int = 1 << 30) -> float:
    """Raw TCP over loopback, one connection, Python sockets on both ends."""
    server = socket.create_server(("127.0.0.1", 0))
    port = server.getsockname()[1]
    block = memoryview(bytearray(4 << 20))

    def send() -> None:
        with socket.create_connection(("127.0.0.1", port)) as client:
            for _ in range(nbytes // len(block)):
                client.sendall(block)

    sender = threading.Thread(target=send)
    started = time.perf_counter()
    sender.start()
    connection, _ = server.accept()
    received, buffer = 0, bytearray(4 << 20)
    with connection:
        while received < nbytes:
            got = connection.recv_into(buffer)
            if not got:
                break
            received += got
    elapsed = time.perf_counter() - started
    sender.join()
    server.close()
    return received / elapsed / 1e9


def transfer(nbytes: int) -> dict:
    """A full version of incompressible bits published at the hub, fetched at a leaf."""
    from rlfleet.bus.streams import ensure_run_streams
    from rlfleet.local.nats import HUB_DOMAIN, NatsServer, StandaloneNats
    from rlfleet.weightsync.receiver import Receiver
    from rlfleet.weightsync.transport import WeightStream

    generator = torch.Generator().manual_seed(4)
    tensors = {
        f"t{i}": torch.randint(
            -(2**15), 2**15, (nbytes // 2 // 16,), dtype=torch.int16, generator=generator
        )
        for i in range(16)
    }

    async def scenario(hub_server: NatsServer, leaf_server: NatsServer) -> dict:
        hub = await hub_server.connect()
        leaf = await leaf_server.connect()
        try:
            await ensure_run_streams(hub, "bench", HUB_DOMAIN)
            stream = WeightStream(hub, "bench", CONFIG)
            started = time.perf_counter()
            await stream.put_version(encode_version("bench", 0, tensors, None, CONFIG))
            put_s = time.perf_counter() - started
            receiver = Receiver(WeightStream(leaf, "bench", CONFIG, domain=HUB_DOMAIN))
            started = time.perf_counter()
            await receiver.sync()
            sync_s = time.perf_counter() - started
            (manifest,) = receiver.known.values()
            fetched = sum(ref.size for ref in manifest.shards)
            started = time.perf_counter()
            await receiver.fetch(manifest)
            fetch_s = time.perf_counter() - started
            return {
                "publish_gbps": fetched / put_s / 1e9,
                "transfer_gbps": fetched / fetch_s / 1e9,
                "receive_and_apply_gbps": fetched / sync_s / 1e9,
            }
        finally:
            await hub.close()
            await leaf.close()

    with tempfile.TemporaryDirectory(prefix="rlfleet-bench-ws-") as root:
        servers = StandaloneNats(Path(root))
        try:
            leaf = servers.bed.leaves[servers.region]
            return asyncio.run(scenario(servers.bed.hub, leaf))
        finally:
            servers.stop()


def vllm_apply_pause() -> dict:
    """Tiny MoE in vLLM (CPU): the pause to write a real AdamW step's delta in place."""
    from rlfleet.local.nats import HUB_DOMAIN, StandaloneNats
    from rlfleet.local.processes import run_in_session
    from rlfleet.models.tiny import init_model, train_step

    probe = Path(__file__).resolve().parent.parent / "tests" / "probes" / "vllm_weightsync.py"
    with tempfile.TemporaryDirectory(prefix="rlfleet-bench-vllm-") as root:
        root_path = Path(root)
        v0 = init_model("tiny-moe", root_path / "v0")
        versions = [v0]
        for step in range(1, 4):
            versions.append(train_step(versions[-1], root_path / f"v{step}", lr=1e-5, seed=step))
        servers = StandaloneNats(root_path / "nats")
        try:
            leaf = servers.bed.leaves[servers.region]
            args = {
                "checkpoint": str(v0),
                "rounds": [{"version": v, "publish": str(d)} for v, d in enumerate(versions)],
                "hub_url": servers.bed.hub.url,
                "leaf_url": leaf.url,
                "run": "bench",
                "domain": HUB_DOMAIN,
                "config": msgspec.to_builtins(CONFIG),
            }
            (root_path / "args.json").write_text(json.dumps(args))
            done = run_in_session(
                [
                    sys.executable,
                    str(probe),
                    str(root_path / "args.json"),
                    str(root_path / "out.json"),
                ],
                env={
                    **os.environ,
                    **leaf.client_env(),
                    "VLLM_CPU_KVCACHE_SPACE": "1",
                    "TOKENIZERS_PARALLELISM": "false",
                },
                timeout=900,
            )
        finally:
            servers.stop()
        if done.returncode != 0:
            raise RuntimeError(f"vLLM probe failed:\n{(done.stdout + done.stderr)[-4000:]}")
        rounds = json.loads((root_path / "out.json").read_text())["rounds"]
    deltas = rounds[1:]  # round 0 loads the first snapshot whole
    return {
        "apply_pause_ms": sum(r["pause_ms"] for r in deltas) / len(deltas),
        "first_load_pause_ms": rounds[0]["pause_ms"],
        "digest_verified": all(r["digest"] == r["published_digest"] for r in rounds),
    }


def main() -> None:
    torch.set_num_threads(2)
    result: dict = {"bench": "weightsync"}
    workloads: dict[str, dict] = {}
    for lr in LEARNING_RATES:
        workloads[f"tiny_moe_lr{lr:g}"] = tiny_moe_workload(lr)
    generator = torch.Generator().manual_seed(0)
    count = SYNTHETIC_PARAMS // math.prod(SYNTHETIC_SHAPE)
    params = [
        torch.nn.Parameter(torch.randn(SYNTHETIC_SHAPE, generator=generator) * 0.02)
        for _ in range(count)
    ]
    for lr in LEARNING_RATES:
        workloads[f"synthetic_1gib_lr{lr:g}"] = synthetic_workload(lr, params)
    subset = _bf16({f"layers.{i}.weight": p for i, p in enumerate(params[:8])})
    del params
    workloads["controlled_1pct"] = controlled_workload(subset, 0.01)
    headline = workloads["synthetic_1gib_lr1e-06"]
    result |= {
        "changed_fraction": headline["changed_fraction"],
        "ratio_vs_full": headline["ratio_vs_full"],
        "ratio_vs_zstd_full": headline["ratio_vs_zstd_full"],
        "ratio_at_1pct": workloads["controlled_1pct"]["ratio_vs_full"],
        "size_vs_bound": max(w["size_vs_bound"] for w in workloads.values()),
        "encode_gbps": headline["encode_gbps"],
        "decode_gbps": headline["decode_gbps"],
        "memcpy_gbps": memcpy_gbps(),
    }
    result |= transfer(TRANSFER_BYTES)
    result["loopback_gbps"] = loopback_gbps()
    result["transfer_vs_loopback"] = result["transfer_gbps"] / result["loopback_gbps"]
    result |= vllm_apply_pause()
    result["bit_exact"] = chain_is_bit_exact(CHAIN)
    result["chain_length"] = CHAIN
    result["workloads"] = workloads
    print(json.dumps(_rounded(result)))
    sys.stdout.flush()


def _rounded(value):
    if isinstance(value, float):
        return float(f"{value:.4g}")
    if isinstance(value, dict):
        return {k: _rounded(v) for k, v in value.items()}
    return value


if __name__ == "__main__":
    main()

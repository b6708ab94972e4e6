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
  machine's memcpy bandwidth; transfer (hub to a region's mirror at its leaf node) and
  fetch (a receiver from that mirror) next to raw loopback TCP.
  Encode and apply use every core; their `_per_core` figures are bytes per CPU second.
- `version_latency_s`: from a trainer step's 1 GiB bf16 state handed to the publisher to
  receivers in three regions, each on its own mirror, holding it verified; split into
  encode, publish, mirror, fetch and apply, beside a lower bound (`version_latency`).
- `publish_gbps`: encoded shards put on the hub's stream (encoding not included);
  `join_s`: a fresh receiver process at a leaf, from its start with nothing held to the
  newest version of a 1 GiB model (a snapshot and the deltas after it), verified.

`--quick` runs every part on models of a few MiB, one step and round each (vLLM and NATS
still start), to check the script: its figures then say nothing.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
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
import nats.js.errors
import numpy as np
import psutil
import torch
import zstandard

from rlfleet.launch.caches import own_temporary_caches
from rlfleet.weightsync.bits import as_bits
from rlfleet.weightsync.config import SyncConfig
from rlfleet.weightsync.shards import apply_version, encode_version
from rlfleet.weightsync.state import WORKERS, WeightState

CONFIG = SyncConfig()
SYNTHETIC_PARAMS = 512 << 20  # 1 GiB of bf16
SYNTHETIC_SHAPE = (4096, 4096)
LEARNING_RATES = (1e-6, 1e-5)
STEPS = 3
CHAIN = 1000
TRANSFER_BYTES = 256 << 20
TRANSFER_ROUNDS = 3
JOIN_BYTES = 1 << 30
LATENCY_BYTES = 1 << 30
JOIN_DELTAS = 3
SCALING_MEMORY = 64 << 30  # for the 4 GiB latency run
COPY_BYTES = 1 << 30  # memcpy and loopback TCP


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
    started, cpu = time.perf_counter(), time.process_time()
    encoded = encode_version("bench", 1, new, base, CONFIG)
    encode_s, encode_cpu_s = time.perf_counter() - started, time.process_time() - cpu
    size = sum(ref.size for ref in encoded.manifest.shards)
    model_bytes = encoded.manifest.state_bytes
    started, cpu = time.perf_counter(), time.process_time()
    apply_version(base, encoded.manifest, encoded.shards)
    apply_s, apply_cpu_s = time.perf_counter() - started, time.process_time() - cpu
    assert base.digest() == encoded.manifest.state_digest
    return {
        "changed_fraction": _changed_fraction(old, new),
        "delta_bytes": size,
        "ratio_vs_full": model_bytes / size,
        "size_vs_bound": size / _bound_bytes(old, new),
        "encode_gbps": model_bytes / encode_s / 1e9,
        "apply_gbps": model_bytes / apply_s / 1e9,
        # Encode and apply run on every core (`WORKERS` threads); per core is per CPU
        # second they used, so total over per core is how many cores they kept busy.
        "encode_gbps_per_core": model_bytes / encode_cpu_s / 1e9,
        "apply_gbps_per_core": model_bytes / apply_cpu_s / 1e9,
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


def memcpy_gbps(nbytes: int) -> float:
    source = np.ones(nbytes, dtype=np.uint8)
    target = np.empty_like(source)
    best = math.inf
    for _ in range(3):
        started = time.perf_counter()
        np.copyto(target, source)
        best = min(best, time.perf_counter() - started)
    return nbytes / best / 1e9


def loopback_gbps(nbytes: int) -> float:
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


def _cpu_s(process) -> float:
    times = process.cpu_times()
    return times.user + times.system


def transfer(nbytes: int, rounds: int) -> dict:
    """A full version of incompressible bits published at the hub, moved the way a version
    goes to a region (the median of `rounds` each):

    - `transfer_gbps`: the hop between clusters, hub to leaf node: a region's mirror made
      after the version is on the hub's stream, until it holds all of it;
    - `fetch_gbps`: a receiver at the leaf from that mirror (`parallel_fetches`
      connections) into the memory of the version before, as a receiver applying
      versions does (`fetch_cold_gbps`: the first, into new memory), and
      `fetch_via_leaf_gbps` from the hub's stream through the leaf link instead, as a
      region without a mirror would;
    - `transfer_cpu_s_per_gb` and `fetch_cpu_s_per_gb`: CPU seconds the hub server, the
      leaf node and the receiver each spend per GB of the mirror's catch-up and of the
      fetch from it. They share this machine's cores, so `transfer_cpu_bound_gbps` and
      `fetch_cpu_bound_gbps` (cores over their sum) are the fastest their work allows."""
    import statistics

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

    async def scenario(
        hub_server: NatsServer, leaf_server: NatsServer, region: str, processes
    ) -> dict:
        hub = await hub_server.connect()
        leaf = await leaf_server.connect()
        cpu = {step: dict.fromkeys(processes, 0.0) for step in ("transfer", "fetch")}

        async def timed(work, step: str | None = None) -> float:
            """Seconds `work` took, its CPU added to `step`'s when given."""
            before = {name: _cpu_s(p) for name, p in processes.items()}
            started = time.perf_counter()
            await work()
            elapsed = time.perf_counter() - started
            for name, p in processes.items():
                if step is not None:
                    cpu[step][name] += _cpu_s(p) - before[name]
            return elapsed

        try:
            await ensure_run_streams(hub, "bench", HUB_DOMAIN)
            stream = WeightStream(hub, "bench", CONFIG)
            # Encoding is timed on its own (`encode_gbps`): this is the stream's part.
            encoded = encode_version("bench", 0, tensors, None, CONFIG)
            started = time.perf_counter()
            await stream.put_version(encoded)
            put_s = time.perf_counter() - started
            stream_name = stream.subjects.stream
            last = (await stream.js.stream_info(stream_name)).state.last_seq
            mirror = leaf.jetstream(domain=region)

            async def catch_up() -> None:
                await ensure_run_streams(hub, "bench", HUB_DOMAIN, [region])
                deadline = time.monotonic() + 300
                while (await mirror.stream_info(stream_name)).state.last_seq < last:
                    assert time.monotonic() < deadline, "the region's mirror never caught up"
                    await asyncio.sleep(0.01)

            def fetch(receiver: Receiver):
                async def work() -> None:
                    # As after an applied version: the next fetch takes the memory it held.
                    receiver.buffers.give(await receiver.fetch(encoded.manifest))

                return work

            mirrors, fetches = [], []
            from_mirror = Receiver(WeightStream(leaf, "bench", CONFIG, domain=region))
            for _ in range(rounds):
                with contextlib.suppress(nats.js.errors.NotFoundError):
                    await mirror.delete_stream(stream_name)
                mirrors.append(await timed(catch_up, "transfer"))
                fetches.append(await timed(fetch(from_mirror), "fetch"))
            via_leaf_receiver = Receiver(WeightStream(leaf, "bench", CONFIG, domain=HUB_DOMAIN))
            started = time.perf_counter()
            await via_leaf_receiver.sync()
            sync_s = time.perf_counter() - started
            via_leaf = [await timed(fetch(via_leaf_receiver)) for _ in range(rounds)]
            fetched = sum(ref.size for ref in encoded.manifest.shards)
            per_gb = {
                step: {name: s / (rounds * fetched / 1e9) for name, s in spent.items()}
                for step, spent in cpu.items()
            }
            return {
                "publish_gbps": fetched / put_s / 1e9,
                "transfer_gbps": fetched / statistics.median(mirrors) / 1e9,
                "fetch_gbps": fetched / statistics.median(fetches[1:] or fetches) / 1e9,
                "fetch_cold_gbps": fetched / fetches[0] / 1e9,
                "fetch_via_leaf_gbps": fetched / statistics.median(via_leaf) / 1e9,
                "receive_and_apply_gbps": fetched / sync_s / 1e9,
                **{f"{step}_cpu_s_per_gb": spent for step, spent in per_gb.items()},
                **{
                    f"{step}_cpu_bound_gbps": psutil.cpu_count() / sum(spent.values())
                    for step, spent in per_gb.items()
                },
            }
        finally:
            await hub.close()
            await leaf.close()

    with tempfile.TemporaryDirectory(prefix="rlfleet-bench-ws-") as root:
        servers = StandaloneNats(Path(root))
        try:
            leaf = servers.bed.leaves[servers.region]
            pids = {m.name: m.process.pid for m in servers.supervisor.processes}
            processes = {
                "hub": psutil.Process(pids["nats-hub"]),
                "leaf": psutil.Process(pids[f"nats-{servers.region}"]),
                "receiver": psutil.Process(),
            }
            return asyncio.run(scenario(servers.bed.hub, leaf, servers.region, processes))
        finally:
            servers.stop()


def _join_receiver(url: str, credentials: str, run: str, started: float, out) -> None:
    """A rollout replica starting cold: from an empty host copy to the newest version."""
    from rlfleet.local.nats import HUB_DOMAIN, NatsServer
    from rlfleet.weightsync.receiver import Receiver
    from rlfleet.weightsync.transport import WeightStream

    split = {"fetch_s": 0.0, "apply_s": 0.0}

    async def scenario() -> dict:
        nc = await NatsServer("leaf", url, "", credentials).connect()
        try:
            receiver = Receiver(WeightStream(nc, run, CONFIG, domain=HUB_DOMAIN))
            fetch, apply = receiver.fetch, receiver._apply

            async def timed_fetch(manifest):
                begun = time.perf_counter()
                shards = await fetch(manifest)
                split["fetch_s"] += time.perf_counter() - begun
                return shards

            def timed_apply(manifest, shards):
                begun = time.perf_counter()
                changed = apply(manifest, shards)
                split["apply_s"] += time.perf_counter() - begun
                return changed

            receiver.fetch, receiver._apply = timed_fetch, timed_apply
            ready = time.time()
            version = await receiver.sync()
            return split | {
                "version": version,
                "digest": receiver.state.digest(),
                "start_s": ready - started,
            }
        finally:
            await nc.close()

    out.send(asyncio.run(scenario()) | {"join_s": time.time() - started})


def join(nbytes: int, deltas: int) -> dict:
    """`join_s`: a fresh receiver process, from its start with nothing held, to holding
    the newest of a snapshot and `deltas` deltas after it (each 1% of the elements moved
    by one unit in the last place) of a model of `nbytes` bf16, fetched at a leaf node."""
    import multiprocessing
    import multiprocessing.connection

    from rlfleet.bus.streams import ensure_run_streams
    from rlfleet.local.nats import HUB_DOMAIN, StandaloneNats
    from rlfleet.weightsync.publisher import Publisher
    from rlfleet.weightsync.transport import WeightStream

    generator = torch.Generator().manual_seed(5)
    count = nbytes // 2 // math.prod(SYNTHETIC_SHAPE)
    tensors = {
        f"layers.{i}.weight": (torch.randn(SYNTHETIC_SHAPE, generator=generator) * 0.02).bfloat16()
        for i in range(count)
    }

    async def publish(hub_server) -> tuple[str, int]:
        hub = await hub_server.connect()
        try:
            await ensure_run_streams(hub, "join", HUB_DOMAIN)
            publisher = Publisher(WeightStream(hub, "join", CONFIG), CONFIG)
            fetched = 0  # what a joining receiver fetches: the snapshot and the deltas
            for version in range(deltas + 1):
                if version:
                    for tensor in tensors.values():
                        bits = tensor.view(-1).view(torch.int16)
                        where = torch.randint(0, bits.numel(), (bits.numel() // 100,))
                        bits[where] += 1
                manifests = await publisher.publish(tensors, version)
                fetched += sum(ref.size for m in manifests for ref in m.shards)
            return manifests[0].state_digest, fetched
        finally:
            await hub.close()

    with tempfile.TemporaryDirectory(prefix="rlfleet-bench-join-") as root:
        servers = StandaloneNats(Path(root))
        try:
            digest, fetched = asyncio.run(publish(servers.bed.hub))
            leaf = servers.bed.leaves[servers.region]
            context = multiprocessing.get_context("spawn")
            theirs, ours = context.Pipe(duplex=False)
            started = time.time()
            child = context.Process(
                target=_join_receiver,
                args=(leaf.url, leaf.credentials, "join", started, ours),
            )
            child.start()
            if not multiprocessing.connection.wait([theirs, child.sentinel], 600) or (
                not theirs.poll()
            ):
                child.kill()
                raise RuntimeError(f"the joining receiver gave no answer ({child.exitcode})")
            joined = theirs.recv()
            child.join()
        finally:
            servers.stop()
    return {
        "join_s": joined["join_s"],
        "join_process_start_s": joined["start_s"],
        "join_fetch_s": joined["fetch_s"],
        "join_apply_s": joined["apply_s"],
        "join_model_bytes": count * math.prod(SYNTHETIC_SHAPE) * 2,
        "join_fetched_bytes": fetched,
        "join_deltas": deltas,
        "join_verified": joined["digest"] == digest and joined["version"] == deltas,
    }


LATENCY_REGIONS = ("region-a", "region-b", "region-c")


def _timed_receiver(receiver, times: dict[str, float]):
    """Records when `receiver` starts fetching a version (its region's mirror holds the
    manifest, so the version reached it) and when it starts and ends applying it."""
    fetch, apply = receiver.fetch, receiver._apply

    async def timed_fetch(manifest):
        times.setdefault("fetch_start", time.perf_counter())
        shards = await fetch(manifest)
        times["fetch_end"] = time.perf_counter()
        return shards

    def timed_apply(manifest, shards):
        times.setdefault("apply_start", time.perf_counter())
        changed = apply(manifest, shards)
        times["apply_end"] = time.perf_counter()
        return changed

    receiver.fetch, receiver._apply = timed_fetch, timed_apply


def version_latency(nbytes: int, lr: float, loopback: float, memcpy: float) -> dict:
    """`version_latency_s`: from the trainer handing the publisher a new bf16 state (a real
    AdamW step at `lr` on fp32 master weights of `nbytes` bf16, Gaussian gradients) until
    receivers at three regions' leaf nodes, each following its region's mirror of the
    hub's stream, hold that version verified. All on this machine, one process for the
    publisher and the receivers, sharing its cores.

    Its parts: `encode_s` (the same delta encoded alone, beforehand), `publish_s` (until
    the version's manifest is on the hub's stream: encode and put, pipelined), `mirror_s`
    (from then until the last region's receiver has the manifest from its mirror),
    `fetch_s` and `apply_s` (decode, apply and verify: the slowest region's each).
    `version_latency_bound_s`: the bytes that must move (the delta once onto the hub and
    once into each region) over loopback bandwidth, plus one memcpy pass of the model."""
    from rlfleet.bus.streams import ensure_run_streams
    from rlfleet.local.nats import HUB_DOMAIN, start_nats
    from rlfleet.local.processes import Supervisor
    from rlfleet.weightsync.publisher import Publisher
    from rlfleet.weightsync.receiver import Receiver
    from rlfleet.weightsync.transport import WeightStream

    generator = torch.Generator().manual_seed(6)
    count = nbytes // 2 // math.prod(SYNTHETIC_SHAPE)
    params = [
        torch.nn.Parameter(torch.randn(SYNTHETIC_SHAPE, generator=generator) * 0.02)
        for _ in range(count)
    ]
    names = [f"layers.{i}.weight" for i in range(count)]
    optimizer = torch.optim.AdamW(params, lr=lr, weight_decay=0.01)
    before = _bf16(dict(zip(names, params, strict=True)))
    for p in params:
        p.grad = torch.randn(p.shape, generator=generator)
    optimizer.step()
    after = _bf16(dict(zip(names, params, strict=True)))
    del optimizer, params
    expected = WeightState.copy_of(after, 1).digest()
    base = WeightState.copy_of(before, 0)
    started = time.perf_counter()
    delta = encode_version("latency", 1, after, base, CONFIG)
    encode_s = time.perf_counter() - started
    delta_bytes = sum(ref.size for ref in delta.manifest.shards)
    del delta, base

    async def scenario(bed) -> dict:
        hub = await bed.hub.connect()
        leaves = [await bed.leaves[r].connect() for r in LATENCY_REGIONS]
        stop = asyncio.Event()
        try:
            await ensure_run_streams(hub, "latency", HUB_DOMAIN, list(LATENCY_REGIONS))
            publisher = Publisher(WeightStream(hub, "latency", CONFIG), CONFIG)
            await publisher.publish(before, 0)
            held: dict[str, asyncio.Event] = {r: asyncio.Event() for r in LATENCY_REGIONS}
            times: dict[str, dict[str, float]] = {r: {} for r in LATENCY_REGIONS}
            receivers, following = [], []
            for region, leaf in zip(LATENCY_REGIONS, leaves, strict=True):

                async def reached(manifest, changed, region=region) -> None:
                    if manifest.version == 1:
                        held[region].set()

                receiver = Receiver(
                    WeightStream(leaf, "latency", CONFIG, domain=region), on_version=reached
                )
                # The region's mirror may not hold version 0 yet: a fast machine asks
                # before it arrives.
                deadline = time.monotonic() + 60
                while await receiver.sync() != 0:
                    assert time.monotonic() < deadline, f"{region} never mirrored version 0"
                    await asyncio.sleep(0.05)
                _timed_receiver(receiver, times[region])
                receivers.append(receiver)
                following.append(asyncio.create_task(receiver.follow(stop)))
            put_manifests, out = publisher._put_manifests, {}

            async def timed_put(*args):
                manifests = await put_manifests(*args)
                out["manifests"] = time.perf_counter()  # the version is on the hub's stream
                return manifests

            publisher._put_manifests = timed_put
            started = time.perf_counter()
            await publisher.publish(after, 1)
            published = out["manifests"]
            await asyncio.wait_for(asyncio.gather(*(e.wait() for e in held.values())), 600)
            done = time.perf_counter()
            verified = all(r.state.digest() == expected for r in receivers)
            slowest = {
                "mirror_s": max(t["fetch_start"] for t in times.values()) - published,
                "fetch_s": max(t["fetch_end"] - t["fetch_start"] for t in times.values()),
                "apply_s": max(t["apply_end"] - t["apply_start"] for t in times.values()),
            }
            return slowest | {
                "publish_s": published - started,
                "version_latency_s": done - started,
                "verified": verified,
            }
        finally:
            stop.set()
            for task in following:
                with contextlib.suppress(Exception):
                    await task
            for client in (hub, *leaves):
                await client.close()

    with tempfile.TemporaryDirectory(prefix="rlfleet-bench-latency-") as root:
        supervisor = Supervisor(Path(root) / "logs", attached=True)
        try:
            measured = asyncio.run(
                scenario(start_nats(list(LATENCY_REGIONS), supervisor, Path(root) / "nats"))
            )
        finally:
            supervisor.stop_all()
    moved = delta_bytes * (1 + len(LATENCY_REGIONS))
    bound = moved / (loopback * 1e9) + nbytes / (memcpy * 1e9)
    return measured | {
        "encode_s": encode_s,
        "delta_bytes": delta_bytes,
        "version_latency_bound_s": bound,
        "latency_over_bound": measured["version_latency_s"] / bound,
    }


# The deltas' rounds: None: no request runs; "drain": requests run and the update waits for
# them (the old way); "inflight": the update lands while they run.
VLLM_ROUNDS = (None, None, None, "drain", "inflight", "inflight")

# --quick: every part still runs, each kind of vLLM round once; a quarter of LATENCY_BYTES
# is still whole tensors of SYNTHETIC_SHAPE.
QUICK = {
    "SYNTHETIC_PARAMS": 8 * 256 * 256,
    "SYNTHETIC_SHAPE": (256, 256),
    "STEPS": 1,
    "CHAIN": 3,
    "TRANSFER_BYTES": 16 << 20,
    "TRANSFER_ROUNDS": 1,
    "JOIN_BYTES": 4 << 20,
    "LATENCY_BYTES": 4 << 20,
    "JOIN_DELTAS": 1,
    "COPY_BYTES": 16 << 20,
    "VLLM_ROUNDS": (None, "drain", "inflight"),
}


def vllm_apply_pause() -> dict:
    """Tiny MoE in vLLM (CPU): the pause to write a real AdamW step's delta in place, with
    no request running, and with requests running across it (`inflight_pause_ms`, and
    `drain_wait_ms`: how long a held version waited for them, against
    `drain_wait_ms_before`, when updates waited for running requests to finish)."""
    from rlfleet.bus.streams import ensure_run_streams
    from rlfleet.local.nats import HUB_DOMAIN, StandaloneNats
    from rlfleet.local.processes import run_in_session
    from rlfleet.models.tiny import init_model, train_step

    probe = Path(__file__).resolve().parent.parent / "tests" / "probes" / "vllm_weightsync.py"
    with tempfile.TemporaryDirectory(prefix="rlfleet-bench-vllm-") as root:
        root_path = Path(root)
        v0 = init_model("tiny-moe", root_path / "v0")
        versions = [v0]
        for step in range(1, 1 + len(VLLM_ROUNDS)):
            versions.append(train_step(versions[-1], root_path / f"v{step}", lr=1e-5, seed=step))
        servers = StandaloneNats(root_path / "nats")
        try:
            leaf = servers.bed.leaves[servers.region]

            async def streams() -> None:
                hub = await servers.bed.hub.connect()
                try:
                    await ensure_run_streams(hub, "bench", HUB_DOMAIN)
                finally:
                    await hub.close()

            asyncio.run(streams())
            args = {
                "checkpoint": str(v0),
                "rounds": [{"version": 0, "publish": str(v0)}]
                + [
                    {"version": v, "publish": str(versions[v]), "requests": requests}
                    for v, requests in enumerate(VLLM_ROUNDS, 1)
                ],
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
    # Round 0 loads the first snapshot whole; the others write deltas.
    by_kind: dict[str | None, list[dict]] = {kind: [] for kind in VLLM_ROUNDS}
    for r, kind in zip(rounds[1:], VLLM_ROUNDS, strict=True):
        by_kind[kind].append(r)

    def mean(kind: str | None, key: str) -> float:
        return sum(r[key] for r in by_kind[kind]) / len(by_kind[kind])

    return {
        "apply_pause_ms": mean(None, "pause_ms"),
        "first_load_pause_ms": rounds[0]["pause_ms"],
        "inflight_pause_ms": mean("inflight", "pause_ms"),
        "drain_wait_ms": mean("inflight", "drain_wait_ms"),
        "drain_wait_ms_before": mean("drain", "drain_wait_ms"),
        "inflight_versions_exact": all(
            [s[0] for s in long["spans"]] == [str(r["version"] - 1), str(r["version"])]
            for r in by_kind["inflight"]
            for long in r["long"]
        ),
        "digest_verified": all(r["digest"] == r["published_digest"] for r in rounds),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="smallest sizes: check the script")
    if parser.parse_args().quick:
        globals().update(QUICK)
    own_temporary_caches("rlfleet-bench-weightsync-caches-")  # this invocation's, removed after
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
        "apply_gbps": headline["apply_gbps"],
        "encode_gbps_per_core": headline["encode_gbps_per_core"],
        "apply_gbps_per_core": headline["apply_gbps_per_core"],
        "encode_gbps_at_lr1e-5": workloads["synthetic_1gib_lr1e-05"]["encode_gbps"],
        "apply_gbps_at_lr1e-5": workloads["synthetic_1gib_lr1e-05"]["apply_gbps"],
        "cores": WORKERS,
        "memcpy_gbps": memcpy_gbps(COPY_BYTES),
    }
    result |= transfer(TRANSFER_BYTES, TRANSFER_ROUNDS)
    result["loopback_gbps"] = loopback_gbps(COPY_BYTES)
    result["transfer_vs_loopback"] = result["transfer_gbps"] / result["loopback_gbps"]
    result["fetch_vs_loopback"] = result["fetch_gbps"] / result["loopback_gbps"]
    latency = {
        f"lr{lr:g}": version_latency(
            LATENCY_BYTES, lr, result["loopback_gbps"], result["memcpy_gbps"]
        )
        for lr in LEARNING_RATES
    }
    headline = latency[f"lr{LEARNING_RATES[0]:g}"]
    # How each part grows with the model: a quarter of it and the whole, and four times it
    # where memory allows (with its fp32 master and AdamW state, 4 GiB needs about 48 GiB).
    loopback, memcpy = result["loopback_gbps"], result["memcpy_gbps"]
    scaling = {
        "0.25gib": version_latency(LATENCY_BYTES // 4, LEARNING_RATES[0], loopback, memcpy),
        f"{LATENCY_BYTES >> 30}gib": headline,
    }
    if psutil.virtual_memory().total >= SCALING_MEMORY:
        scaling[f"{(4 * LATENCY_BYTES) >> 30}gib"] = version_latency(
            4 * LATENCY_BYTES, LEARNING_RATES[0], loopback, memcpy
        )
    result |= {
        "version_latency_s": headline["version_latency_s"],
        "version_latency_bound_s": headline["version_latency_bound_s"],
        "version_latency_s_at_lr1e-5": latency["lr1e-05"]["version_latency_s"],
        "version_latency": latency,
        "version_latency_scaling": scaling,
    }
    result |= join(JOIN_BYTES, JOIN_DELTAS)
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

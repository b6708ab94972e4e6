"""Benchmark: what bounds a shard fetch, path by path and connection by connection.

Prints one JSON object. One version of incompressible bits (`--mib`, 256 by default) is
put on the hub's stream and mirrored to a region; then its shards are fetched, with no
checksum or apply (the transport alone), over each path:

- `leaf->hub`: from a client at the leaf node, of the hub's stream, through the leaf link;
- `hub`: from a client at the hub, of its stream;
- `mirror`: from a client at the leaf node, of the region's mirror (what receivers do);

over 1 to 16 connections with as many requests in flight, and over one connection with
four (what receivers did before). Each variant's `gbps` is the median of `--rounds`
fetches into new memory; `cpu_s_per_gb` the hub server's, the leaf node's and this
process's CPU seconds per GB. On a 16-core host, `leaf->hub` stayed near 0.8 GB/s
however many connections, as the hub answers the leaf link's requests one at a time,
while `hub` and `mirror` reached 2.1-2.3 GB/s over eight or sixteen. `--quick`: every
variant once on a 16 MiB version, to check the script.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

import psutil
import torch

from rlfleet.bus.streams import ensure_run_streams
from rlfleet.local.nats import HUB_DOMAIN, StandaloneNats
from rlfleet.weightsync.config import SyncConfig
from rlfleet.weightsync.shards import encode_version
from rlfleet.weightsync.transport import WeightStream

CONFIG = SyncConfig()
PATHS = ("leaf->hub", "hub", "mirror")
# (connections, requests in flight); (1, 4) is one connection as receivers had it.
WINDOWS = ((1, 4), (1, 1), (4, 4), (8, 8), (16, 16))
QUICK = {"mib": 16, "rounds": 1}  # --quick's defaults: a few shards, every variant


def _cpu_s(process: psutil.Process) -> float:
    times = process.cpu_times()
    return times.user + times.system


async def _fetch(stream: WeightStream, manifest, connections: int, in_flight: int) -> None:
    window = asyncio.Semaphore(in_flight)
    async with stream.connections(connections) as opened:

        async def one(index: int) -> None:
            async with window:
                connection = opened[index % connections]
                await stream.fetch_shard(manifest, manifest.shards[index], connection)

        await asyncio.gather(*(one(i) for i in range(len(manifest.shards))))


async def _scenario(servers: StandaloneNats, nbytes: int, rounds: int, processes) -> dict:
    hub = await servers.bed.hub.connect()
    leaf = await servers.bed.leaves[servers.region].connect()
    try:
        generator = torch.Generator().manual_seed(4)
        tensors = {
            f"t{i}": torch.randint(
                -(2**15), 2**15, (nbytes // 32,), dtype=torch.int16, generator=generator
            )
            for i in range(16)
        }
        encoded = encode_version("bench", 0, tensors, None, CONFIG)
        size = sum(ref.size for ref in encoded.manifest.shards)
        await ensure_run_streams(hub, "bench", HUB_DOMAIN, [servers.region])
        published = WeightStream(hub, "bench", CONFIG)
        await published.put_version(encoded)
        name, mirror = published.subjects.stream, leaf.jetstream(domain=servers.region)
        last = (await published.js.stream_info(name)).state.last_seq
        deadline = time.monotonic() + 300
        while (await mirror.stream_info(name)).state.last_seq < last:
            assert time.monotonic() < deadline, "the region's mirror never caught up"
            await asyncio.sleep(0.01)
        streams = {
            "leaf->hub": WeightStream(leaf, "bench", CONFIG, domain=HUB_DOMAIN),
            "hub": published,
            "mirror": WeightStream(leaf, "bench", CONFIG, domain=servers.region),
        }
        variants = []
        for path in PATHS:
            for connections, in_flight in WINDOWS:
                seconds, cpu = [], dict.fromkeys(processes, 0.0)
                for _ in range(rounds):
                    before = {n: _cpu_s(p) for n, p in processes.items()}
                    started = time.perf_counter()
                    await _fetch(streams[path], encoded.manifest, connections, in_flight)
                    seconds.append(time.perf_counter() - started)
                    for n, p in processes.items():
                        cpu[n] += _cpu_s(p) - before[n]
                variants.append(
                    {
                        "path": path,
                        "connections": connections,
                        "in_flight": in_flight,
                        "gbps": size / statistics.median(seconds) / 1e9,
                        "cpu_s_per_gb": {n: s / (rounds * size / 1e9) for n, s in cpu.items()},
                    }
                )
        return {"bytes": size, "shards": len(encoded.manifest.shards), "variants": variants}
    finally:
        await leaf.close()
        await hub.close()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--mib", type=int, default=256, help="the version's size")
    parser.add_argument("--rounds", type=int, default=3, help="fetches per variant")
    parser.add_argument("--quick", action="store_true", help="smallest sizes: check the script")
    if parser.parse_known_args()[0].quick:
        parser.set_defaults(**QUICK)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="rlfleet-bench-paths-") as root:
        servers = StandaloneNats(Path(root))
        try:
            pids = {m.name: m.process.pid for m in servers.supervisor.processes}
            processes = {
                "hub": psutil.Process(pids["nats-hub"]),
                "leaf": psutil.Process(pids[f"nats-{servers.region}"]),
                "client": psutil.Process(),
            }
            result = asyncio.run(_scenario(servers, args.mib << 20, args.rounds, processes))
        finally:
            servers.stop()
    result = {"bench": "weightsync_paths", "cores": psutil.cpu_count()} | result
    print(json.dumps(result))
    sys.stdout.flush()


if __name__ == "__main__":
    main()

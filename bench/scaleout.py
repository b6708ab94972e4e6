"""Benchmark: publishing one model's versions from 1 and 2 trainer ranks.

Prints one JSON object. Each rank is its own process holding only the tensors
`owned_names` gives it (made there, never whole anywhere), gathering over gloo as trainer
ranks do, and publishing to a real NATS hub (`StandaloneNats`, as the tests start it).
Each configuration publishes a snapshot (version 0), then a delta (version 1: one
element in a hundred moved by one unit in the last place, as an RL step moves bf16).

- `publish_s_by_ranks`: seconds from the ranks' common start until the last rank
  returns, snapshot plus delta; `publish_snapshot_s_by_ranks` and `publish_delta_s_by_ranks`
  split it.
- `publish_extra_mib_by_ranks`: per rank count, the largest growth of any rank's resident
  memory over its size just before it publishes a version: the peak of samples of
  /proc/self/statm taken while it publishes, and of VmHWM (reset before each publish).
  `publish_extra_mib_max` is that of the largest rank count; the target is
  `publish_extra_mib_max <= 0.75 * model_mib` with two ranks (`extra_vs_model`).
- `step_s_by_ranks`: the real trainer's median step seconds per rank count, on the tiny
  MoE (`bench/trainer_ranks.py`, which this runs after the publishes).

`--quick` publishes a model of four 256 KiB tensors and takes `trainer_ranks.py`'s quick
steps, to check the script.
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import json
import os
import socket
import subprocess
import sys
import tempfile
import threading
import time
import zlib
from pathlib import Path

import torch
import trainer_ranks  # bench/ is this script's folder, so first on sys.path

from rlfleet.launch.caches import own_temporary_caches
from rlfleet.weightsync import SyncConfig, owned_names

MIB = 1 << 20
RANKS = (1, 2)
TENSORS = 64
SHAPE = (2048, 4096)  # bf16: 16 MiB each, 1 GiB in all
CHANGED_FRACTION = 0.01
CONFIG = SyncConfig()
SAMPLE_S = 0.002
RANK_FLAGS: list[str] = []  # what a rank's process is started with, besides its place
QUICK = {"TENSORS": 4, "SHAPE": (256, 512), "RANK_FLAGS": ["--quick"]}  # the ranks' too


def _sizes() -> dict[str, int]:
    return {f"layers.{i}.w": SHAPE[0] * SHAPE[1] * 2 for i in range(TENSORS)}


def _tensor(name: str) -> torch.Tensor:
    generator = torch.Generator().manual_seed(zlib.crc32(name.encode()))
    return (torch.randn(SHAPE, generator=generator) * 0.02).bfloat16()


def _step(tensor: torch.Tensor, seed: int) -> None:
    """One unit in the last place, up or down, at a hundredth of the elements, in place."""
    generator = torch.Generator().manual_seed(seed)
    bits = tensor.view(torch.int16).view(-1)
    where = torch.randint(
        0, bits.numel(), (int(bits.numel() * CHANGED_FRACTION),), generator=generator
    )
    bits[where] += torch.randint(0, 2, where.shape, generator=generator, dtype=torch.int16) * 2 - 1


PROC = Path("/proc/self")


def _rss() -> int:
    return int((PROC / "statm").read_text().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def _hwm() -> int:
    """The peak resident size since the last `_reset_hwm`."""
    for line in (PROC / "status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) * 1024
    raise RuntimeError("no VmHWM in /proc/self/status")


def _reset_hwm() -> None:
    (PROC / "clear_refs").write_text("5")


class _Sampler:
    """The peak of this process's resident size while it runs, sampled from /proc."""

    def __init__(self) -> None:
        self.peak = _rss()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        while not self._stop.wait(SAMPLE_S):
            self.peak = max(self.peak, _rss())

    def __enter__(self) -> _Sampler:
        self._thread.start()
        return self

    def __exit__(self, *exc_info: object) -> None:
        self._stop.set()
        self._thread.join()
        self.peak = max(self.peak, _rss())


async def _publish_as_rank(args: argparse.Namespace) -> dict:
    import torch.distributed as dist

    from rlfleet.bus import connection
    from rlfleet.weightsync import Part, Publisher, WeightStream

    def gather(obj: object) -> list[object]:
        gathered: list[object] = [None] * args.world
        dist.all_gather_object(gathered, obj)
        return gathered

    owned = sorted(owned_names(_sizes(), args.rank, args.world))
    tensors = {name: _tensor(name) for name in owned}
    nc = await connection.connect(args.url)
    part = Part(args.rank, args.world, gather) if args.world > 1 else None
    publisher = Publisher(WeightStream(nc, args.run, CONFIG), CONFIG, part=part)
    result: dict = {"rank": args.rank, "owned_mib": sum(_sizes()[n] for n in owned) / MIB}
    for version, kind in enumerate(("snapshot", "delta")):
        if version:
            for i, tensor in enumerate(tensors.values()):
                _step(tensor, 1000 * version + i)
        gc.collect()
        dist.barrier()
        before = _rss()
        _reset_hwm()
        started = time.time()
        with _Sampler() as sampler:
            await publisher.publish(tensors, version)
        result[kind] = {
            "started": started,
            "finished": time.time(),
            "extra_mib": (max(sampler.peak, _hwm()) - before) / MIB,
        }
    await nc.close()
    return result


def rank_main(args: argparse.Namespace) -> None:
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=args.init, rank=args.rank, world_size=args.world)
    try:
        result = asyncio.run(_publish_as_rank(args))
    finally:
        dist.destroy_process_group()
    print(json.dumps(result), flush=True)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _publish_with(ranks: int, hub, run: str) -> list[dict]:
    init = f"tcp://127.0.0.1:{_free_port()}"
    env = os.environ | hub.client_env()
    processes = [
        subprocess.Popen(
            [
                sys.executable,
                __file__,
                "--rank",
                str(rank),
                "--world",
                str(ranks),
                "--url",
                hub.url,
                "--run",
                run,
                "--init",
                init,
                *RANK_FLAGS,
            ],
            stdout=subprocess.PIPE,
            text=True,
            env=env,
        )
        for rank in range(ranks)
    ]
    results = []
    for process in processes:
        out, _ = process.communicate(timeout=1800)
        if process.returncode != 0:
            raise RuntimeError(f"a rank of {ranks} failed with {process.returncode}")
        results.append(json.loads(out.strip().splitlines()[-1]))
    return results


def main() -> None:
    own_temporary_caches("rlfleet-bench-scaleout-caches-")  # this invocation's, removed after
    from rlfleet.bus.streams import ensure_run_streams
    from rlfleet.local.nats import HUB_DOMAIN, StandaloneNats

    model_mib = sum(_sizes().values()) / MIB
    snapshot_s, delta_s, extra_mib = {}, {}, {}
    with tempfile.TemporaryDirectory(prefix="rlfleet-bench-scaleout-") as root:
        servers = StandaloneNats(Path(root))
        try:
            hub = servers.bed.hub
            for ranks in RANKS:
                run = f"scaleout{ranks}"

                async def streams(run: str = run) -> None:
                    async with await hub.connect() as nc:
                        await ensure_run_streams(nc, run, HUB_DOMAIN)

                asyncio.run(streams())
                results = _publish_with(ranks, hub, run)
                spans = {
                    kind: max(r[kind]["finished"] for r in results)
                    - min(r[kind]["started"] for r in results)
                    for kind in ("snapshot", "delta")
                }
                snapshot_s[str(ranks)] = round(spans["snapshot"], 3)
                delta_s[str(ranks)] = round(spans["delta"], 3)
                extra_mib[str(ranks)] = round(
                    max(r[kind]["extra_mib"] for r in results for kind in ("snapshot", "delta")),
                    1,
                )
        finally:
            servers.stop()
    largest = str(max(RANKS))
    print(
        json.dumps(
            {
                "bench": "scaleout",
                "ranks": list(RANKS),
                "model_mib": model_mib,
                "tensors": TENSORS,
                "publish_s_by_ranks": {r: round(snapshot_s[r] + delta_s[r], 3) for r in snapshot_s},
                "publish_snapshot_s_by_ranks": snapshot_s,
                "publish_delta_s_by_ranks": delta_s,
                "step_s_by_ranks": trainer_ranks.step_seconds_by_ranks(),
                "step_model": "tiny-moe",  # a step of the real trainer (bench/trainer_ranks.py)
                "publish_extra_mib_by_ranks": extra_mib,
                "publish_extra_mib_max": extra_mib[largest],
                "extra_vs_model": round(extra_mib[largest] / model_mib, 3),
                "cpus": os.cpu_count(),
            }
        )
    )


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rank", type=int)
    parser.add_argument("--world", type=int)
    parser.add_argument("--url")
    parser.add_argument("--run")
    parser.add_argument("--init")
    parser.add_argument("--quick", action="store_true", help="smallest sizes: check the script")
    arguments = parser.parse_args()
    if arguments.quick:
        globals().update(QUICK)
        vars(trainer_ranks).update(trainer_ranks.QUICK)
    if arguments.rank is None:
        main()
    else:
        rank_main(arguments)

"""Benchmark: a delta found and compacted on the device, and what then crosses to the host.

`measure(device, nbytes)` (or `device_encode_benchmark(nbytes, lr, device)`) makes a bf16
model of `nbytes` from fp32 master weights on `device`, takes one step of `lr` (a sign
step, what AdamW's first steps are) and compacts the new bf16 bits against the old piece
by piece, as the publisher does (`bits.compact_bits`, pieces the size `encode_shards` cuts
with the spec's default 8 MiB shards). It returns, as plain numbers:

- `compact_gbps`: model bytes per second of comparing and compacting on the device;
  `encode_gbps`: the same with the compacted arrays copied to the host (`Compacted.host`),
  which is all of the delta's encoding the device does;
- `d2h_bytes` (what crossed) beside `model_bytes`, and `full_copy_gbps`, the whole model
  copied to the host, which is what publishing cost before (None on the host). At lr
  1e-5 a quarter of bf16 elements change, dense steps are priced too, and more than the
  model crosses: the link is not what limits encoding (the host's zstd is);
- `bit_exact`: the compacted deltas, applied on the device to the old bits, give the new.

Needs torch and numpy only: weightsync's `bits` module is loaded from its file, without
the package (whose NATS, msgspec and zstd a GPU machine may lack). Runs on CPU too:
``python bench/codec_device.py --bytes 16777216`` prints one JSON object (`--quick`: 16 MiB,
to check the script).
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import sys
import time
from pathlib import Path

import torch

_BITS_FILE = Path(__file__).resolve().parents[1] / "weightsync/rlfleet/weightsync/bits.py"
PIECE_BYTES = (8 << 20) // 4  # encode_shards: a quarter of a shard, the spec's 8 MiB
LR = 1e-5
ROUNDS = 3
QUICK = {"bytes": 16 << 20}  # --quick's defaults: still several pieces


def _load_bits():
    name = "rlfleet_bench_weightsync_bits"
    if name not in sys.modules:
        spec = importlib.util.spec_from_file_location(name, _BITS_FILE)
        module = importlib.util.module_from_spec(spec)
        sys.modules[name] = module  # dataclasses look their module up while being made
        spec.loader.exec_module(module)
    return sys.modules[name]


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _apply(compacted, target: torch.Tensor) -> None:
    """The compacted delta into `target` (signed bit view, on the device): what a
    receiver does with any of its encodings, in torch."""
    top = target.element_size() * 8 - 1
    steps = compacted.steps if compacted.where is not None else compacted.dense
    differences = ((steps >> 1) & ((1 << top) - 1)) ^ -(steps & 1)  # >> is arithmetic
    if compacted.where is not None:
        target[compacted.where] += differences
    else:
        target += differences


def device_encode_benchmark(nbytes: int, lr: float = LR, device: str = "cuda") -> dict:
    bits = _load_bits()
    where = torch.device(device)
    count = max(1, nbytes // 2)
    generator = torch.Generator(device=where).manual_seed(0)
    master = torch.randn(count, generator=generator, device=where) * 0.02
    old = master.bfloat16()
    master += lr * torch.randn(count, generator=generator, device=where).sign()
    new = master.bfloat16()
    del master
    old_bits, new_bits = bits.device_bits(old), bits.device_bits(new)
    piece = PIECE_BYTES // new.element_size()
    ranges = [(start, min(piece, count - start)) for start in range(0, count, piece)]

    def compact():
        return [
            bits.compact_bits(new_bits[s : s + n], old_bits[s : s + n], 0.25) for s, n in ranges
        ]

    compact()  # kernels loaded, allocator warm
    compact_s = encode_s = copy_s = float("inf")
    for _ in range(ROUNDS):
        _sync(where)
        started = time.perf_counter()
        found = compact()
        _sync(where)
        middle = time.perf_counter()
        host = [c.host() for c in found if c is not None]
        ended = time.perf_counter()
        compact_s = min(compact_s, middle - started)
        encode_s = min(encode_s, ended - started)
        started = time.perf_counter()
        new.to("cpu")
        copy_s = min(copy_s, time.perf_counter() - started)
    target = old_bits.clone()
    for (start, size), compacted in zip(ranges, found, strict=True):
        if compacted is not None:
            _apply(compacted, target[start : start + size])
    _sync(where)
    model_bytes = count * new.element_size()
    changed = sum(c.changed for c in found if c is not None)
    return {
        "device": str(where),
        "model_bytes": model_bytes,
        "lr": lr,
        "changed_fraction": changed / count,
        "pieces": len(ranges),
        "compact_gbps": model_bytes / compact_s / 1e9,
        "encode_gbps": model_bytes / encode_s / 1e9,
        "d2h_bytes": sum(c.nbytes for c in host),
        # From the host to the host is no copy at all.
        "full_copy_gbps": model_bytes / copy_s / 1e9 if where.type != "cpu" else None,
        "bit_exact": bool(torch.equal(target, new_bits)),
    }


def measure(device: str, nbytes: int) -> dict:
    """What bench/gpu.py calls: the device compaction of an `nbytes` bf16 model at lr 1e-5."""
    return device_encode_benchmark(nbytes, LR, device)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--bytes", type=int, default=1 << 30)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--lr", type=float, default=LR)
    parser.add_argument("--quick", action="store_true", help="smallest sizes: check the script")
    if parser.parse_known_args()[0].quick:
        parser.set_defaults(**QUICK)
    args = parser.parse_args()
    result = device_encode_benchmark(args.bytes, args.lr, args.device)
    print(
        json.dumps({k: float(f"{v:.4g}") if isinstance(v, float) else v for k, v in result.items()})
    )


if __name__ == "__main__":
    main()

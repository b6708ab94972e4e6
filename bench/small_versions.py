"""Benchmark: a small model's versions encoded and applied in the caller's thread, or
through a pool of threads.

The demo's trainer publishes a version of the tiny MoE (1.2 MB) every step, and every
rollout engine and serving server applies each one in its own process, beside the model
it runs. Their pieces are a few KiB: handing each to a thread costs more than its work.
Here twenty real AdamW steps of the tiny MoE are encoded as deltas, then applied in a
chain, each way twice, alternating; `rlfleet.weightsync.state.executor_for` picks the
caller's thread for items under `POOLED_FROM_BYTES`. Prints one JSON object:
milliseconds of wall time and of CPU (every thread of the process) per version.
`--quick` runs the same on two versions, to check the script.
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import torch

import rlfleet.weightsync.state as state_module
from rlfleet.weightsync.config import SyncConfig
from rlfleet.weightsync.shards import EncodedVersion, apply_version, encode_version
from rlfleet.weightsync.state import WeightState

VERSIONS = 20
QUICK = {"VERSIONS": 2}  # --quick: a chain of deltas still
CONFIG = SyncConfig()


def tiny_moe_versions() -> list[dict[str, torch.Tensor]]:
    from transformers import AutoModelForCausalLM

    from rlfleet.models.tiny import init_model

    with tempfile.TemporaryDirectory() as directory:
        init_model("tiny-moe", Path(directory), seed=0)
        model = AutoModelForCausalLM.from_pretrained(directory, dtype=torch.float32)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-5, weight_decay=0.01)
    generator = torch.Generator().manual_seed(0)
    params = dict(model.named_parameters())
    versions = [{n: p.detach().bfloat16() for n, p in params.items()}]
    for _ in range(VERSIONS):
        tokens = torch.randint(0, model.config.vocab_size, (8, 64), generator=generator)
        model(input_ids=tokens, labels=tokens).loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        versions.append({n: p.detach().bfloat16() for n, p in params.items()})
    return versions


def per_version_ms(work: Callable[[], None]) -> dict[str, float]:
    wall, cpu = time.perf_counter(), time.process_time()
    work()
    return {
        "wall_ms": (time.perf_counter() - wall) * 1000 / VERSIONS,
        "cpu_ms": (time.process_time() - cpu) * 1000 / VERSIONS,
    }


def measure(versions: list[dict[str, torch.Tensor]]) -> dict[str, dict[str, float]]:
    bases = [WeightState.copy_of(tensors, v) for v, tensors in enumerate(versions)]
    encoded: list[EncodedVersion] = []

    def encode() -> None:
        encoded.clear()
        for v in range(1, VERSIONS + 1):
            encoded.append(encode_version("bench", v, versions[v], bases[v - 1], CONFIG))

    def apply() -> None:
        held = WeightState.copy_of(versions[0], 0)
        for version in encoded:
            apply_version(held, version.manifest, version.shards)
        assert held.digest() == bases[-1].digest()

    return {"encode": per_version_ms(encode), "apply": per_version_ms(apply)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="smallest sizes: check the script")
    if parser.parse_args().quick:
        globals().update(QUICK)
    versions = tiny_moe_versions()
    threshold = state_module.POOLED_FROM_BYTES
    runs: dict[str, list[dict]] = {"caller_thread": [], "pool": []}
    try:
        for _ in range(2):
            for mode in runs:
                state_module.POOLED_FROM_BYTES = threshold if mode == "caller_thread" else 0
                runs[mode].append(measure(versions))
    finally:
        state_module.POOLED_FROM_BYTES = threshold
    workers = state_module.WORKERS
    result: dict = {"bench": "small_versions", "versions": VERSIONS, "workers": workers}
    for mode, found in runs.items():
        for step in ("encode", "apply"):
            for key in ("wall_ms", "cpu_ms"):
                result[f"{step}_{key}_{mode}"] = round(min(r[step][key] for r in found), 2)
    for step in ("encode", "apply"):
        result[f"{step}_cpu_pool_over_caller_thread"] = round(
            result[f"{step}_cpu_ms_pool"] / result[f"{step}_cpu_ms_caller_thread"], 2
        )
    print(json.dumps(result))


if __name__ == "__main__":
    main()

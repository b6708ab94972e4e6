"""A version of a run's weights as a Hugging Face checkpoint: what a user serves (`vllm
serve DIR`), evaluates or hands on.

The version is rebuilt off the run's weight stream as a rollout worker rebuilds it (the
receiver, held at the version asked for), so its tensors are bit for bit those the rollout
engines served, in the dtype they served. The base model's folder gives everything else:
config, tokenizer, generation config, chat template. Once written, the files are read back
and their state digest checked against the version's manifest: a checkpoint that is not
exactly the version is never left looking like one.

    python -m rlfleet.weightsync.checkpoint --run KEY --nats-url URL --model BASE \\
        --version N --to DIR
"""

from __future__ import annotations

import argparse
import asyncio
import json
import shutil
import sys
from collections.abc import Mapping
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from rlfleet.bus import connection
from rlfleet.weightsync.config import SyncConfig
from rlfleet.weightsync.receiver import Receiver
from rlfleet.weightsync.state import WeightState, state_digest, tensor_digests
from rlfleet.weightsync.transport import WeightStream

WEIGHTS = "model.safetensors"
INDEX = "model.safetensors.index.json"
# Shards of at most this many bytes, as Hugging Face writes large checkpoints: a 1T-parameter
# model in one file would be beyond what most file systems and loaders take in one piece.
SHARD_BYTES = 5 << 30
# The base model's own weights, which the version's replace.
_WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".index.json")


class ExportError(Exception):
    """A version that cannot be exported as asked: the message says why."""


def shards(tensors: Mapping[str, torch.Tensor], max_bytes: int) -> list[dict[str, torch.Tensor]]:
    """The tensors in name order, cut into shards of at most `max_bytes` (a larger tensor
    alone in its own)."""
    cut: list[dict[str, torch.Tensor]] = [{}]
    size = 0
    for name in sorted(tensors):
        tensor = tensors[name].contiguous()
        if cut[-1] and size + tensor.nbytes > max_bytes:
            cut.append({})
            size = 0
        cut[-1][name] = tensor
        size += tensor.nbytes
    return cut


def write_checkpoint(
    tensors: Mapping[str, torch.Tensor], base: Path, out: Path, max_shard_bytes: int = SHARD_BYTES
) -> list[Path]:
    """`base`'s folder with `tensors` as its weights, written to `out`; the weight files.
    Published tensors carry the checkpoint's names (experts one by one), which loading
    converts as it does any checkpoint's."""
    out.mkdir(parents=True, exist_ok=True)
    for path in base.iterdir():
        if path.is_file() and not path.name.endswith(_WEIGHT_SUFFIXES):
            shutil.copy(path, out / path.name)
    cut = shards(tensors, max_shard_bytes)
    if len(cut) == 1:
        save_file(cut[0], out / WEIGHTS, metadata={"format": "pt"})
        return [out / WEIGHTS]
    files = [out / f"model-{i + 1:05d}-of-{len(cut):05d}.safetensors" for i in range(len(cut))]
    weight_map = {}
    for path, shard in zip(files, cut, strict=True):
        save_file(shard, path, metadata={"format": "pt"})
        weight_map |= dict.fromkeys(shard, path.name)
    total = sum(t.nbytes for t in tensors.values())
    index = {"metadata": {"total_size": total}, "weight_map": weight_map}
    (out / INDEX).write_text(json.dumps(index, indent=2, sort_keys=True) + "\n")
    return files


def written_digest(files: list[Path]) -> str:
    """The state digest of what the files hold, as a receiver proves a version."""
    loaded: dict[str, torch.Tensor] = {}
    for path in files:
        loaded |= load_file(path)
    return state_digest(loaded, tensor_digests(loaded))


async def version_of(
    url: str, run: str, version: int | None, credentials: Path | None, domain: str | None
) -> WeightState:
    """`version` of `run`'s weights (None: the newest), rebuilt off its stream, verified."""
    nc = await connection.connect(url, credentials)
    try:
        receiver = Receiver(WeightStream(nc, run, SyncConfig(), domain))
        receiver.ceiling = version
        await receiver.sync()
        known = sorted({v for v, _ in receiver.known})
        if receiver.version is None or (version is not None and receiver.version != version):
            raise ExportError(
                f"run {run}: version {version} cannot be rebuilt from its weight stream "
                f"(versions on it: {_span(known)})"
            )
        return receiver.state
    finally:
        await nc.close()


def _span(versions: list[int]) -> str:
    return f"{versions[0]} to {versions[-1]}" if versions else "none"


def export(state: WeightState, base: Path, out: Path) -> dict:
    """Writes the version held in `state` as a checkpoint, checks it, and says what it wrote."""
    if out.exists() and any(out.iterdir()):
        raise ExportError(f"{out} is not empty: export into a new folder")
    files = write_checkpoint(state.tensors, base, out)
    digest = written_digest(files)
    if digest != state.digest():
        shutil.rmtree(out)
        raise ExportError(f"version {state.version}: the written files do not hold it")
    return {
        "version": state.version,
        "state_digest": digest,
        "folder": str(out),
        "files": [p.name for p in files],
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m rlfleet.weightsync.checkpoint",
        description="Write a version of a run's weights as a Hugging Face checkpoint.",
    )
    parser.add_argument("--run", required=True, help="the run's key on NATS")
    parser.add_argument("--nats-url", required=True, help="where the run's weight stream is")
    parser.add_argument("--credentials", type=Path, help="a NATS user of the run (.creds)")
    parser.add_argument("--domain", help="the stream's JetStream domain")
    parser.add_argument("--model", type=Path, required=True, help="the run's base model folder")
    parser.add_argument("--version", type=int, help="the version (default: the newest)")
    parser.add_argument("--to", type=Path, required=True, help="a new folder for it")
    args = parser.parse_args(argv)
    try:
        state = asyncio.run(
            version_of(args.nats_url, args.run, args.version, args.credentials, args.domain)
        )
        done = export(state, args.model, args.to)
    except ExportError as error:
        print(f"export: {error}", file=sys.stderr)
        return 1
    print(json.dumps(done))
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""Benchmark: the trainer's numerics, a training step and the weight codec on a GPU.

Prints one JSON object. Where the GPU has no registry (the device machine), run
`scripts/gpu-wheels.sh` here and `scripts/gpu-bench.sh --out $OUT/gpu.json` there; keep the
result in `bench/results/`. Without a GPU it runs the same parts with small shapes
(`--quick` forces them), to check the script: its numbers then say nothing of a GPU.

Each part runs in a process of its own: cuBLAS reads its workspace settings once.

- `invariance`, under the trainer's numerics (`rlfleet.trainer.numerics` for the device,
  `trainer`) and under the GEMM library's defaults with the model's kernels (`default`):
  on the tiny MoE and a slice of a 30B-A3B-class Qwen3-MoE (hidden 2048, 8 layers, 64
  experts, top-8, 32k vocabulary: 2.7B parameters), 15 sequences of 16 to 1,500 tokens,
  each scored alone (a short one alone leaves most experts one token or none) and inside
  batches of 3 to 64 with others (fp32: up to 512 tokens and 16 a batch, as the tiled
  kernels are slow). `invariant_share_<dtype>`: the share of sequences whose log-probs
  are bitwise the same in every batch, over both models (the trainer's; `_default` the
  library's). `tokens_per_s_<dtype>`: forward and backward of 8 x 512 tokens on the
  slice; `invariant_overhead_bf16`: seconds a step under the trainer's numerics over the
  library's defaults.
- `train`: a real DeepSpeed step of the tiny MoE in bf16 on the device (the trainer's
  `Policy`, with a reference model), published by weightsync's `Publisher` (the delta
  found and compacted on the device) and applied by a receiver: `train_step_ok` when the
  receiver's state is the policy's weights bit for bit.
- `codec`: `bench/codec_device.py` on a 1 GiB bf16 model at lr 1e-6:
  `encode_gbps_device` (compared, compacted and copied to the host), `bit_exact`.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from datetime import UTC, datetime
from pathlib import Path

import torch

HERE = Path(__file__).resolve().parent
LENGTHS = (16, 24, 40, 64, 96, 128, 192, 256, 384, 512, 640, 768, 1024, 1280, 1500)
BATCHES = {"bf16": (3, 8, 16, 32, 64), "fp32": (3, 8, 16)}
FP32_LONGEST = 512
THROUGHPUT = (8, 512)  # sequences x tokens, forward and backward
SLICE = dict(  # a slice of a 30B-A3B-class MoE: its layer shapes, 8 of its layers
    hidden_size=2048,
    num_hidden_layers=8,
    num_attention_heads=32,
    num_key_value_heads=4,
    head_dim=128,
    intermediate_size=6144,
    moe_intermediate_size=768,
    num_experts=64,
    num_experts_per_tok=8,
    vocab_size=32768,
)
QUICK_SLICE = dict(SLICE, hidden_size=256, num_hidden_layers=2, num_experts=16)


def _device() -> torch.device:
    return torch.device("cuda" if torch.cuda.is_available() else "cpu")


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _model(shape: dict, dtype: torch.dtype, device: torch.device, tiled: bool):
    from transformers import AutoModelForCausalLM

    from rlfleet.models.tiny import model_config
    from rlfleet.trainer.scoring import prepare

    config = model_config("tiny-moe", eos_token_id=1, pad_token_id=0)
    config.update(shape)
    torch.manual_seed(0)
    with device:
        model = AutoModelForCausalLM.from_config(config, dtype=dtype)
    return prepare(model, tiled=tiled), config


def _logprobs(model, sequences, tiled: bool, device: torch.device) -> torch.Tensor:
    from rlfleet.trainer.scoring import Batch, token_logprobs

    batch = Batch.of(sequences).to(device)
    return token_logprobs(model, batch, tiled=tiled, replay=False)


def _invariant_share(model, vocab: int, dtype: str, tiled: bool, device, quick: bool):
    """How many of the probe sequences score bitwise alike alone and in every batch."""
    gen = torch.Generator().manual_seed(1)
    longest = FP32_LONGEST if dtype == "fp32" else max(LENGTHS)
    lengths = [n for n in LENGTHS if n <= (64 if quick else longest)]
    batches = BATCHES[dtype][:2] if quick else BATCHES[dtype]
    same, worst = 0, 0.0
    with torch.no_grad():
        for length in lengths:
            probe = torch.randint(0, vocab, (length,), generator=gen)
            alone = _logprobs(model, [probe], tiled, device)[0]
            equal = True
            for size in batches:
                others = [
                    torch.randint(0, vocab, (int(n),), generator=gen)
                    for n in torch.randint(8, max(lengths) + 1, (size - 1,), generator=gen)
                ]
                at = int(torch.randint(0, size, (1,), generator=gen))
                inside = _logprobs(model, [*others[:at], probe, *others[at:]], tiled, device)
                row = inside[at, : alone.shape[0]]
                if not torch.equal(row, alone):
                    equal = False
                    worst = max(worst, float((row - alone).abs().max()))
            same += equal
    return same, len(lengths), worst


def _step_seconds(model, vocab: int, tiled: bool, device, quick: bool) -> float:
    """Median seconds of a forward and backward pass over THROUGHPUT tokens."""
    gen = torch.Generator().manual_seed(2)
    count, length = (2, 64) if quick else THROUGHPUT
    sequences = [torch.randint(0, vocab, (length,), generator=gen) for _ in range(count)]
    model.train()
    times = []
    for _ in range(4):  # the first warms the kernels up
        _sync(device)
        started = time.perf_counter()
        _logprobs(model, sequences, tiled, device).sum().backward()
        model.zero_grad(set_to_none=True)
        _sync(device)
        times.append(time.perf_counter() - started)
    model.eval()
    return statistics.median(times[1:])


def invariance(config: str, quick: bool) -> dict:
    from rlfleet.trainer import numerics

    device = _device()
    tiled = {"bf16": False, "fp32": False}  # the library's defaults: the model's kernels
    if config == "trainer":
        for precision in ("fp32", "bf16"):  # on CUDA both set the GEMM library alike
            chosen = numerics.for_device(device, precision, batch_invariant=True)
            tiled[precision] = chosen.tiled
        numerics.apply(chosen)
    dtypes = {"bf16": torch.bfloat16, "fp32": torch.float32}
    shapes = {"tiny": {}, "slice": QUICK_SLICE if quick else SLICE}
    result: dict = {"kernels": {p: "tiled" if t else "model" for p, t in tiled.items()}}
    for precision, dtype in dtypes.items():
        same = total = 0
        worst = 0.0
        for name, shape in shapes.items():
            model, model_config = _model(shape, dtype, device, tiled[precision])
            s, n, w = _invariant_share(
                model, model_config.vocab_size, precision, tiled[precision], device, quick
            )
            same, total, worst = same + s, total + n, max(worst, w)
            if name == "slice":
                seconds = _step_seconds(
                    model, model_config.vocab_size, tiled[precision], device, quick
                )
                result[f"step_s_{precision}"] = seconds
                result[f"tokens_per_s_{precision}"] = (
                    2 * 64 if quick else THROUGHPUT[0] * THROUGHPUT[1]
                ) / seconds
                result["slice_parameters"] = sum(p.numel() for p in model.parameters())
            del model
            if device.type == "cuda":
                torch.cuda.empty_cache()
        result[f"invariant_share_{precision}"] = same / total
        result[f"max_abs_dlogp_{precision}"] = worst
    return result


class _MemoryStream:
    """Where the Publisher puts a version, kept in memory for the receiver to read."""

    run = "gpu-bench"

    def __init__(self) -> None:
        self.shards: dict[tuple[int, str, int], bytes] = {}

    @contextlib.asynccontextmanager
    async def connection(self):
        yield None

    async def put_shard(self, version, kind, ref, data, connection) -> None:
        self.shards[(version, kind, ref.index)] = bytes(data)

    async def put_manifest(self, manifest) -> None:
        pass

    async def retire_before(self, version: int) -> None:
        pass


def train(quick: bool) -> dict:
    from rlfleet.api.wire import Segment
    from rlfleet.launch.settings import TrainerConfig
    from rlfleet.models.tiny import init_model
    from rlfleet.trainer.policy import Policy
    from rlfleet.trainer.rows import make_rows
    from rlfleet.weightsync import Publisher, SyncConfig, WeightState
    from rlfleet.weightsync.shards import apply_version

    work = Path(tempfile.mkdtemp(prefix="rlfleet-gpu-"))
    config = TrainerConfig(
        run="gpu-bench",
        nats_url="nats://unused:4222",
        model=init_model("tiny-moe", work / "model"),
        checkpoint_dir=work / "checkpoints",
        precision="bf16",
        kl_coef=0.1,
        router_replay=False,
        learning_rate=1e-3,
        learning_rate_warmup_steps=0,
    )
    policy = Policy(config)
    gen = torch.Generator().manual_seed(3)

    def rows():
        segments = [
            Segment(
                tokens=torch.randint(0, 256, (48,), generator=gen).tolist(),
                prompt_len=8,
                generated=[1] * 40,
                logprobs=[-1.0] * 40,
                versions=[0] * 40,
            )
            for _ in range(2)
        ]
        return make_rows(segments, [1.0, -1.0], pad_id=0)

    stream = _MemoryStream()
    publisher = Publisher(stream, SyncConfig())
    before = policy.weights()
    manifests = asyncio.run(publisher.publish(before, 0))
    micro_batches = [rows(), rows()]
    result = policy.train_step(micro_batches, sum(r.tokens for r in micro_batches))
    after = policy.weights()
    manifests += asyncio.run(publisher.publish(after, 1))
    receiver = WeightState()
    for manifest in manifests:
        key = (manifest.version, manifest.kind)
        shards = [stream.shards[(*key, ref.index)] for ref in manifest.shards]
        apply_version(receiver, manifest, shards)
    same = receiver.tensors.keys() == after.keys() and all(
        torch.equal(receiver.tensors[n].view(torch.uint8), t.cpu().view(torch.uint8))
        for n, t in after.items()
    )
    changed = sum(not torch.equal(before[n].cpu(), t.cpu()) for n, t in after.items())
    delta = next(m for m in manifests if m.version == 1 and m.kind == "delta")
    return {
        "train_step_ok": bool(same and changed and torch.isfinite(torch.tensor(result.loss))),
        "train_loss": result.loss,
        "train_weights_device": next(iter(after.values())).device.type,
        "train_numerics": policy.numerics.reason,
        "train_tensors_changed": changed,
        "train_delta_bytes": sum(r.size for r in delta.shards),
        "train_state_bytes": delta.state_bytes,
    }


def codec(quick: bool) -> dict:
    sys.path.insert(0, str(HERE))
    import codec_device

    measured = codec_device.device_encode_benchmark(
        (16 << 20) if quick else (1 << 30), 1e-6, str(_device())
    )
    return {
        "encode_gbps_device": measured["encode_gbps"],
        "compact_gbps_device": measured["compact_gbps"],
        "encode_changed_fraction": measured["changed_fraction"],
        "encode_d2h_bytes": measured["d2h_bytes"],
        "encode_model_bytes": measured["model_bytes"],
        "bit_exact": measured["bit_exact"],
    }


def _part(name: str, quick: bool, config: str | None, timeout_s: float) -> dict:
    """One part, in a process of its own."""
    command = [sys.executable, __file__, "--part", name] + (["--quick"] if quick else [])
    command += ["--config", config] if config else []
    env = dict(os.environ)
    if not torch.cuda.is_available():
        env["DS_ACCELERATOR"] = "cpu"
    started = time.perf_counter()
    try:
        done = subprocess.run(
            command, env=env, capture_output=True, text=True, timeout=timeout_s, check=False
        )
    except subprocess.TimeoutExpired:
        return {"error": f"{name} {config or ''} ran past {timeout_s:.0f} s"}
    if done.returncode != 0:
        tail = done.stderr[-1500:]
        return {"error": f"{name} {config or ''} exited {done.returncode}: {tail}"}
    result = json.loads(done.stdout.strip().splitlines()[-1])
    return result | {"seconds": round(time.perf_counter() - started, 1)}


def _without_seconds(part: dict) -> dict:
    return {k: v for k, v in part.items() if k not in ("seconds", "error")}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="small shapes: check the script")
    parser.add_argument("--part", choices=["invariance", "train", "codec"])
    parser.add_argument("--config", choices=["trainer", "default"], default="trainer")
    parser.add_argument("--out", type=Path, help="also write the JSON object here")
    parser.add_argument("--part-timeout", type=float, default=300, help="seconds a part")
    args = parser.parse_args()
    args.quick = args.quick or not torch.cuda.is_available()  # a CPU: small shapes only
    if args.part:
        parts = {"invariance": lambda: invariance(args.config, args.quick)}
        parts |= {"train": lambda: train(args.quick), "codec": lambda: codec(args.quick)}
        print(json.dumps(parts[args.part]()))
        return
    device = _device()
    parts: dict[str, dict] = {}
    # The quick parts first, and the object written after each: a run cut short by its
    # machine's limit still returns what it measured.
    for key, name, config in (
        ("train", "train", None),
        ("codec", "codec", None),
        ("invariance", "invariance", "trainer"),
        ("invariance_default", "invariance", "default"),
    ):
        parts[key] = _part(name, args.quick, config, args.part_timeout)
        text = json.dumps(_summary(device, args.quick, parts), default=str)
        if args.out:
            args.out.write_text(text + "\n")
    print(text)


def _summary(device: torch.device, quick: bool, parts: dict[str, dict]) -> dict:
    trainer, default = parts.get("invariance", {}), parts.get("invariance_default", {})
    return {
        "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
        "date": datetime.now(UTC).strftime("%Y-%m-%d"),
        "quick": quick,
        "torch": torch.__version__,
        **_without_seconds(trainer),
        **{f"{k}_default": v for k, v in default.items() if k.startswith(("invariant", "tok"))},
        "invariant_overhead_bf16": (
            trainer["step_s_bf16"] / default["step_s_bf16"]
            if "step_s_bf16" in trainer and "step_s_bf16" in default
            else None
        ),
        **_without_seconds(parts.get("train", {})),
        **_without_seconds(parts.get("codec", {})),
        "part_seconds": {key: part.get("seconds") for key, part in parts.items()},
        "errors": [part["error"] for part in parts.values() if "error" in part],
    }


if __name__ == "__main__":
    main()

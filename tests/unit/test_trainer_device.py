"""The trainer on a device other than the host. CPUs cannot run CUDA; the `meta` device
holds no data, so a forward pass (whose MoE routing reads values) cannot run on it, but
it shows that rows reach the device whole. Which kernels and GEMM settings a device gets
(`numerics`) is a pure decision; `bench/gpu.py` runs a whole step on CUDA."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from transformers import PretrainedConfig

from rlfleet.api.wire import Segment
from rlfleet.models.tiny import model_config
from rlfleet.trainer import numerics
from rlfleet.trainer.rows import Rows, make_rows

META = torch.device("meta")


def rows_with_experts(shape: PretrainedConfig) -> Rows:
    """Two answers to one prompt and one to another, each with the experts it used."""
    gen = torch.Generator().manual_seed(0)
    layers, top_k = shape.num_hidden_layers, shape.num_experts_per_tok
    segments = []
    for prompt, answer in ((6, 5), (6, 9), (4, 7)):
        tokens = torch.randint(0, 200, (prompt + answer,), generator=gen).tolist()
        experts = torch.randint(0, shape.num_experts, (len(tokens) - 1, layers, top_k))
        segments.append(
            Segment(
                tokens=tokens,
                prompt_len=prompt,
                generated=[1] * answer,
                logprobs=[-1.5] * answer,
                versions=[0] * answer,
                routed_experts=experts.to(torch.uint16).numpy().tobytes(),
                moe_layers=layers,
                top_k=top_k,
            )
        )
    return make_rows(segments[:2], [1.0, -1.0], pad_id=0)


def tensors_of(value: object) -> list[tuple[str, torch.Tensor]]:
    """Every tensor a dataclass holds, through nested dataclasses: a field added later is
    checked without this test knowing of it."""
    found = []
    for field in dataclasses.fields(value):  # type: ignore[arg-type]
        item = getattr(value, field.name)
        if isinstance(item, torch.Tensor):
            found.append((field.name, item))
        elif dataclasses.is_dataclass(item):
            found += [(f"{field.name}.{n}", t) for n, t in tensors_of(item)]
    return found


def test_rows_move_every_tensor_they_hold() -> None:
    rows = rows_with_experts(model_config("tiny-moe", eos_token_id=1, pad_token_id=0))
    moved = rows.to(META)
    names = [name for name, _ in tensors_of(moved)]
    assert {"behaviour", "mask", "advantages", "batch.inputs", "batch.experts"} <= set(names)
    assert all(t.device == META for _, t in tensors_of(moved)), [
        (n, t.device) for n, t in tensors_of(moved)
    ]
    assert moved.batch.layouts == rows.batch.layouts


HOPPER = (9, 0)
AMPERE = (8, 0)


@pytest.mark.parametrize(
    ("device", "capability", "precision", "kernels", "split_k_off", "slow"),
    [
        ("cpu", None, "fp32", "tiled", False, False),
        ("cpu", None, "bf16", "tiled", False, False),
        ("cuda", HOPPER, "bf16", "model", True, False),
        ("cuda", (10, 0), "bf16", "model", True, False),
        ("cuda", HOPPER, "fp32", "tiled", True, True),
        ("cuda", AMPERE, "bf16", "tiled", True, True),
    ],
)
def test_each_device_gets_the_kernels_measured_invariant_on_it(
    device: str, capability, precision, kernels: str, split_k_off: bool, slow: bool
) -> None:
    chosen = numerics.numerics(device, capability, precision, batch_invariant=True)
    assert chosen.kernels == kernels and chosen.batch_invariant
    assert chosen.dtype == (torch.bfloat16 if precision == "bf16" else torch.float32)
    assert (chosen.env == numerics.NO_SPLIT_K_ENV) == split_k_off
    assert chosen.strict_gemm == split_k_off and chosen.slow_path == slow


def test_without_batch_invariance_the_library_keeps_its_defaults() -> None:
    chosen = numerics.numerics("cuda", HOPPER, "bf16", batch_invariant=False)
    assert chosen.kernels == "model" and not chosen.env and not chosen.strict_gemm

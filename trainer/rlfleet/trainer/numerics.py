"""How the trainer computes: the dtype, the kernels, and the GEMM library's settings that
make a sequence's log-probs independent of its batch on the rank's device. The one home
of that choice (`numerics`, pure), applied once before the first kernel runs (`apply`).

Measured on an NVIDIA H200 (`bench/gpu.py` measures it; its results are in `bench/results/`):

- The GEMM library picks its algorithm by shape. With its defaults it splits the
  reduction (split-K) for some shapes, such as an MoE expert that receives one tile of
  tokens or fewer, so the same row's sums run in another order: 0 of 15 sequences kept
  their log-probs bitwise inside batches, with either the model's kernels or the tiled
  ones below.
- With split-K made impossible (a cuBLAS workspace too small for it), cuBLASLt preferred
  and no reduced-precision reductions, as vLLM's batch-invariant mode sets them on
  Hopper and Blackwell, the model's own kernels in bf16 kept 15 of 15 bitwise (and 24 of
  24 sequences of up to 1,500 tokens in batches of up to 64), an order of magnitude
  faster than the tiled kernels. In fp32 the model's kernels stayed variant (0 of 15);
  the tiled kernels held, far slower than bf16.
- On CPUs the tiled kernels (`kernels`) are what holds; the GEMM settings do not apply.

Older GPUs (Ampere) cannot be made invariant through cuBLAS: vLLM replaces the GEMMs with
its own Triton kernels there. The trainer runs the tiled kernels on them, invariant but
slow, and says so at start.
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass, field
from typing import Literal

import torch

from rlfleet.api.rlrun import Precision

log = logging.getLogger(__name__)

# What a cuBLAS workspace too small to split K needs (vLLM's batch-invariant mode, Hopper).
NO_SPLIT_K_ENV = {"CUBLAS_WORKSPACE_CONFIG": ":16:8", "CUBLASLT_WORKSPACE_SIZE": "1"}
# The first architecture whose cuBLASLt GEMMs are batch-invariant once split-K is off.
HOPPER = (9, 0)

Kernels = Literal["tiled", "model"]


@dataclass(frozen=True)
class Numerics:
    """What a rank computes with: `dtype` for weights, activations and gradients (the
    optimiser's master copy is float32 either way), `kernels` (rlfleet's tiled kernels or
    the model's own), the environment and GEMM flags set before any kernel runs, and why."""

    dtype: torch.dtype
    kernels: Kernels
    batch_invariant: bool
    env: dict[str, str] = field(default_factory=dict)
    strict_gemm: bool = False  # cuBLASLt, no reduced-precision reductions, no TF32
    reason: str = ""
    slow_path: bool = False  # invariant, but at a fraction of the device's speed

    @property
    def tiled(self) -> bool:
        return self.kernels == "tiled"


def numerics(
    device_type: str,
    capability: tuple[int, int] | None,
    precision: Precision,
    batch_invariant: bool,
) -> Numerics:
    """The trainer's numerics on a device of `device_type` (and, for CUDA, its compute
    `capability`), for the spec's `precision` and `batchInvariant`. Pure."""
    dtype = torch.bfloat16 if precision == "bf16" else torch.float32
    if not batch_invariant:
        return Numerics(dtype, "model", False, reason="batchInvariant is off")
    if device_type != "cuda":
        return Numerics(dtype, "tiled", True, reason=f"{device_type}: the tiled kernels")
    env, strict = dict(NO_SPLIT_K_ENV), True
    if capability is not None and capability >= HOPPER and precision == "bf16":
        return Numerics(
            dtype,
            "model",
            True,
            env,
            strict,
            reason=f"sm_{capability[0]}{capability[1]} bf16: the model's kernels, split-K off",
        )
    why = (
        "fp32: the model's kernels are not invariant"
        if precision == "fp32"
        else f"sm_{''.join(map(str, capability or ()))} GEMMs are not invariant through cuBLAS"
    )
    return Numerics(
        dtype,
        "tiled",
        True,
        env,
        strict,
        reason=f"{why}: the tiled kernels, split-K off",
        slow_path=True,
    )


def for_device(device: torch.device, precision: Precision, batch_invariant: bool) -> Numerics:
    """`numerics` for the device this rank computes on."""
    capability = torch.cuda.get_device_capability(device) if device.type == "cuda" else None
    return numerics(device.type, capability, precision, batch_invariant)


def apply(chosen: Numerics) -> None:
    """Sets the GEMM library up as `chosen` says. Before the first kernel on the device:
    cuBLAS reads its workspace size when it makes its handle."""
    os.environ.update(chosen.env)
    if chosen.strict_gemm:
        torch.backends.cuda.matmul.allow_tf32 = False
        torch.backends.cudnn.allow_tf32 = False
        torch.backends.cuda.matmul.allow_fp16_reduced_precision_reduction = False
        torch.backends.cuda.matmul.allow_bf16_reduced_precision_reduction = False
        torch.backends.cuda.preferred_blas_library(backend="cublaslt")
    message = "numerics: %s, %s kernels, batch-invariant %s (%s)"
    args = (str(chosen.dtype).removeprefix("torch."), chosen.kernels, chosen.batch_invariant)
    if chosen.slow_path:
        log.warning(
            message + "; bf16 on Hopper or newer runs the model's kernels at full speed "
            "(spec.trainer.precision)",
            *args,
            chosen.reason,
        )
    else:
        log.info(message, *args, chosen.reason)

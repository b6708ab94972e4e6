"""How often the trainer's own router agrees with the experts an engine reported."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch
from transformers import AutoModelForCausalLM

from rlfleet.trainer.scoring import Batch, prepare, token_logprobs


def trainer_model(model_dir: Path) -> torch.nn.Module:
    """The checkpoint as the trainer scores with it, in fp32."""
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    return prepare(model, tiled=True).eval()


def agreement(model: torch.nn.Module, samples: list[tuple[list[int], np.ndarray]]) -> list[float]:
    """Per MoE layer, the share of tokens run whose reported experts (uint16 [tokens - 1,
    layers, k] for each sample's tokens) the trainer's router picks too. Rows shifted by
    a token or swapped between requests agree on a few percent; the right ones almost
    everywhere (bf16 against fp32 flips a near tie now and then)."""
    own: list[torch.Tensor] = []
    hooks = [
        module.register_forward_hook(lambda mod, args, out: own.append(out[2]))
        for name, module in model.named_modules()
        if name.endswith("mlp.gate")
    ]
    batch = Batch.of(
        [torch.tensor(tokens) for tokens, _ in samples],
        [torch.tensor(experts.astype(np.int64)) for _, experts in samples],
    )
    try:
        with torch.no_grad():
            token_logprobs(model, batch, tiled=True, replay=False)
    finally:
        for hook in hooks:
            hook.remove()
    real = batch.real.reshape(-1)
    top_k = batch.experts.shape[-1]
    return [
        float(
            (
                chosen.sort(-1).values
                == batch.experts[:, :, layer].reshape(-1, top_k).sort(-1).values
            )
            .all(-1)[real]
            .float()
            .mean()
        )
        for layer, chosen in enumerate(own)
    ]

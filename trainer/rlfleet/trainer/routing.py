"""MoE routing under the trainer's control: router replay (R3), and the experts actually used.

With replay on, each MoE layer routes every token to the experts the inference engine
used for it (from the trajectory) instead of re-routing; the gate weights still come
from the trainer's own router logits, so the router keeps learning. Without replay the
trainer routes by its own top-k, which on a large MoE picks other experts for a share of
tokens and is a main source of train/inference mismatch (seed 002).
"""

from __future__ import annotations

import contextlib
import contextvars
import types
from collections.abc import Iterator

import torch
import torch.nn.functional as F
from torch import nn

from rlfleet.trainer import kernels

# [batch * tokens, layers, top_k] expert ids, or None to route by the model's own top-k.
_replay: contextvars.ContextVar[torch.Tensor | None] = contextvars.ContextVar(
    "rlfleet_router_replay", default=None
)


def routers(model: nn.Module) -> list[nn.Module]:
    """The model's top-k routers in layer order (Qwen3-MoE / Qwen2-MoE / OLMoE style)."""
    return [
        module
        for module in model.modules()
        if hasattr(module, "top_k") and hasattr(module, "num_experts") and hasattr(module, "weight")
    ]


def _route(self, hidden_states: torch.Tensor):
    hidden_states = hidden_states.reshape(-1, self.hidden_dim)
    project = kernels.linear if self._rlfleet_tiled else F.linear
    logits = project(hidden_states, self.weight)
    probs = torch.softmax(logits, dim=-1, dtype=torch.float32)
    replay = _replay.get()
    if replay is None:
        weights, indices = torch.topk(probs, self.top_k, dim=-1)
    else:
        indices = replay[:, self._rlfleet_layer].to(torch.long)
        weights = probs.gather(-1, indices)
    if self.norm_topk_prob:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return logits, weights.to(logits.dtype), indices


def take_over_routers(model: nn.Module, *, tiled: bool) -> int:
    """Route `model`'s MoE layers through `_route`; returns the number of MoE layers."""
    found = routers(model)
    for layer, router in enumerate(found):
        router._rlfleet_layer = layer
        router._rlfleet_tiled = tiled
        router.forward = types.MethodType(_route, router)
    return len(found)


@contextlib.contextmanager
def replay(experts: torch.Tensor | None) -> Iterator[None]:
    """Route by `experts` ([batch, tokens, layers, top_k]) inside the block."""
    flat = None if experts is None else experts.reshape(-1, *experts.shape[-2:])
    token = _replay.set(flat)
    try:
        yield
    finally:
        _replay.reset(token)

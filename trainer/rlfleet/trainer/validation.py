"""Checks a trajectory must pass against the model before it can reach the optimiser.

Structure (lengths, finite numbers, schema) is checked when the wire message decodes;
what needs the model (vocabulary, experts, MoE shape) is checked here.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from rlfleet.api.wire import Trajectory


@dataclass(frozen=True)
class ModelShape:
    vocab_size: int
    moe_layers: int  # 0 for a dense model
    num_experts: int
    top_k: int


def problem(trajectory: Trajectory, shape: ModelShape, run: str, needs_experts: bool) -> str | None:
    """The first reason `trajectory` cannot be trained on, or None."""
    if trajectory.run != run:
        return "wrong_run"
    for segment in trajectory.segments:
        if min(segment.tokens) < 0 or max(segment.tokens) >= shape.vocab_size:
            return "token_out_of_range"
        if not needs_experts:
            continue
        # Replay needs every token's experts, in this model's shape (missing ones included).
        if (segment.moe_layers, segment.top_k) != (shape.moe_layers, shape.top_k):
            return "experts_shape"
        experts = np.frombuffer(segment.routed_experts, dtype="<u2")
        if experts.size and int(experts.max()) >= shape.num_experts:
            return "expert_out_of_range"
    return None

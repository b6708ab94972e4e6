"""Batch-invariant kernels: a sequence's log-probs do not depend on what else is in its batch.

Measured on CPU, three things make a forward pass depend on the batch:

- GEMM picks its kernel by the row count (one row runs a GEMV; fewer than 8 rows run
  another kernel than a full batch), and the rows of a linear are the batch's tokens, or
  for an MoE expert the tokens routed to it. Here every linear runs as one batched
  matmul over fixed tiles of `TILE` rows: each tile is the same GEMM whatever the batch.
- Attention over a padded batch reduces over the padded length. Here each sequence
  attends over exactly its own tokens.
- MoE combine: each token adds its experts' outputs in expert order.

Row-wise reductions over a fixed width (RMSNorm, the router's softmax, the log-softmax
over the vocabulary) run per row and are invariant already; tests check the whole model.
The weight gradient is a sum over the batch's tokens and so depends on the batch by
definition; it runs in a fixed order for a given batch.
"""

from __future__ import annotations

import contextlib
import contextvars
import types
from collections.abc import Iterator, Sequence

import torch
import torch.nn.functional as F
from torch import nn
from transformers import AttentionInterface
from transformers.integrations.moe import ALL_EXPERTS_FUNCTIONS
from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS

NAME = "rlfleet_batch_invariant"
# Rows per GEMM tile. Padding wastes at most TILE-1 rows per call (per expert in MoE).
TILE = 64

_lengths: contextvars.ContextVar[Sequence[int] | None] = contextvars.ContextVar(
    "rlfleet_sequence_lengths", default=None
)


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """`F.linear` whose every output row is computed by the same fixed-shape GEMM."""
    rows = x.reshape(-1, x.shape[-1])
    count = rows.shape[0]
    tiles = -(-count // TILE)
    padded = F.pad(rows, (0, 0, 0, tiles * TILE - count)).view(tiles, TILE, rows.shape[1])
    out = torch.bmm(padded, weight.t().expand(tiles, *weight.t().shape))
    out = out.view(tiles * TILE, weight.shape[0])[:count]
    if bias is not None:
        out = out + bias
    return out.view(*x.shape[:-1], weight.shape[0])


@contextlib.contextmanager
def sequence_lengths(lengths: Sequence[int]) -> Iterator[None]:
    """The true length of each row of a right-padded batch, for the attention below."""
    token = _lengths.set(list(lengths))
    try:
        yield
    finally:
        _lengths.reset(token)


def _attention(module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs):
    lengths = _lengths.get()
    if lengths is None:
        raise RuntimeError("batch-invariant attention needs sequence_lengths(...) around forward")
    batch, heads, tokens, head_dim = query.shape
    out = query.new_zeros(batch, tokens, heads, head_dim)
    for row, length in enumerate(lengths):
        attended = F.scaled_dot_product_attention(
            query[row : row + 1, :, :length],
            key[row : row + 1, :, :length],
            value[row : row + 1, :, :length],
            is_causal=True,
            scale=scaling,
            enable_gqa=True,
        )
        out[row, :length] = attended[0].transpose(0, 1)
    return out, None


def _no_mask(*args, **kwargs) -> None:
    # Each sequence is sliced to its own length and attends causally: no mask tensor.
    return None


def _experts(self, hidden_states, top_k_index, top_k_weights):
    out = torch.zeros_like(hidden_states)
    for expert in top_k_index.unique(sorted=True).tolist():
        token_idx, slot = torch.where(top_k_index == expert)
        gate_up = self.gate_up_proj[expert] if self.has_gate else self.up_proj[expert]
        down = self.down_proj[expert]
        if self.is_transposed:
            gate_up, down = gate_up.t(), down.t()
        hidden = linear(hidden_states[token_idx], gate_up)
        if self.has_bias:
            bias = self.gate_up_proj_bias if self.has_gate else self.up_proj_bias
            hidden = hidden + bias[expert]
        hidden = self._apply_gate(hidden) if self.has_gate else self.act_fn(hidden)
        hidden = linear(hidden, down)
        if self.has_bias:
            hidden = hidden + self.down_proj_bias[expert]
        out.index_add_(0, token_idx, hidden * top_k_weights[token_idx, slot, None])
    return out


def _linear_forward(self: nn.Linear, x: torch.Tensor) -> torch.Tensor:
    return linear(x, self.weight, self.bias)


AttentionInterface.register(NAME, _attention)
ALL_MASK_ATTENTION_FUNCTIONS.register(NAME, _no_mask)
ALL_EXPERTS_FUNCTIONS.register(NAME, _experts)


def make_batch_invariant(model: nn.Module) -> None:
    """Switch `model` (a Hugging Face causal LM) to the kernels above, for good."""
    config = model.config
    config._attn_implementation = NAME
    if hasattr(config, "_experts_implementation"):
        config._experts_implementation = NAME
    for module in model.modules():
        if isinstance(module, nn.Linear):
            module.forward = types.MethodType(_linear_forward, module)

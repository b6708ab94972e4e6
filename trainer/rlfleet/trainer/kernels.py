"""Batch-invariant kernels: a sequence's log-probs do not depend on what else is in its batch.

Measured on CPU, three things make a forward pass depend on the batch:

- GEMM picks its kernel by the row count (one row runs a GEMV; fewer than 8 rows run
  another kernel than a full batch), and the rows of a linear are the batch's tokens, or
  for an MoE expert the tokens routed to it. Here every linear runs as one batched
  matmul over fixed tiles of `TILE` rows: each tile is the same GEMM whatever the batch.
- Attention over a padded batch reduces over the padded length, and the kernel's sums
  over a window depend on the window's length. Here each sequence attends over exactly
  its own tokens: its prompt alone, then its continuation with the prompt in front,
  whichever other sequences share that prompt's row (`Layout`).
- MoE combine: each token adds its experts' outputs in expert order.

Row-wise reductions over a fixed width (the router's softmax, the log-softmax over the
vocabulary) run one row per block and are invariant already; tests check the whole model.
RMSNorm's mean is another matter on CUDA: a generic reduction there is laid out by how
many rows it reduces, so a row's sum of squares was summed in another order alone than
inside a batch (seen on an H200 in fp32: one sequence in ten off by 3e-6). Here it is
summed by elementwise halving (`sum_of_squares`), the same additions in the same order
for a row wherever it is. A demo-shaped training step costs the same with it as with a
plain sum or the tiled GEMM against columns of ones that it replaced.
The weight gradient is a sum over the batch's tokens and so depends on the batch by
definition; it runs in a fixed order for a given batch.
"""

from __future__ import annotations

import contextlib
import contextvars
import types
from collections.abc import Iterator, Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn
from transformers import AttentionInterface
from transformers.integrations.moe import ALL_EXPERTS_FUNCTIONS
from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS

NAME = "rlfleet_batch_invariant"
# Rows per GEMM tile. Padding wastes at most TILE-1 rows per call (per expert in MoE).
TILE = 64

_layouts: contextvars.ContextVar[Sequence[Layout] | None] = contextvars.ContextVar(
    "rlfleet_layouts", default=None
)


@dataclass(frozen=True)
class Layout:
    """One row of a batch: a prompt, then continuations laid end to end after it, each of
    which attends to the prompt and to itself only. A row without continuations is one
    sequence; the rest of the row past them is padding."""

    prompt: int
    continuations: tuple[int, ...] = ()  # lengths, in the order they are laid out

    def spans(self) -> list[tuple[int, int]]:
        """Where each non-empty continuation sits in the row."""
        spans, start = [], self.prompt
        for length in self.continuations:
            if length:
                spans.append((start, start + length))
            start += length
        return spans

    def allowed(self, width: int) -> torch.Tensor:
        """[width, width] True where a query (row) may attend to a key (column): the causal
        mask of each sequence the row holds. A padding query sees itself only."""
        owner = torch.full((width,), -2)
        owner[: self.prompt] = -1
        for index, (start, end) in enumerate(self.spans()):
            owner[start:end] = index
        position = torch.arange(width)
        causal = position[None, :] <= position[:, None]
        query, key = owner[:, None], owner[None, :]
        related = (key == query) | ((key == -1) & (query >= 0))  # itself, or the prompt
        return (causal & related & (query != -2)) | torch.eye(width, dtype=torch.bool)


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
def layouts(rows: Sequence[Layout]) -> Iterator[None]:
    """What each row of the batch holds, for the attention below."""
    token = _layouts.set(list(rows))
    try:
        yield
    finally:
        _layouts.reset(token)


def _causal(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, scaling) -> torch.Tensor:
    """Causal attention over one sequence, [heads, tokens, dim] in, [tokens, heads, dim] out."""
    attended = F.scaled_dot_product_attention(
        query[None], key[None], value[None], is_causal=True, scale=scaling, enable_gqa=True
    )
    return attended[0].transpose(0, 1)


def _attention(module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs):
    rows = _layouts.get()
    if rows is None:
        raise RuntimeError("batch-invariant attention needs layouts(...) around forward")
    width = query.shape[2]
    # The prompt is attended alone, then each continuation with the prompt in front: the
    # kernel's sums run over the whole window, so a prompt attended beside a continuation
    # would depend on that continuation's length; this way every sequence's numbers depend
    # on it alone, whoever shares its row. Rows are split with `unbind` and joined with one
    # `stack`: slicing rows out of the whole batch would make each row's backward write a
    # batch-sized gradient.
    out = []
    for q, k, v, layout in zip(query.unbind(0), key.unbind(0), value.unbind(0), rows, strict=True):
        p = layout.prompt
        parts = [_causal(q[:, :p], k[:, :p], v[:, :p], scaling)]
        for start, end in layout.spans():
            q_, k_, v_ = (torch.cat((x[:, :p], x[:, start:end]), dim=1) for x in (q, k, v))
            parts.append(_causal(q_, k_, v_, scaling)[p:])
        row = torch.cat(parts)
        out.append(F.pad(row, (0, 0, 0, 0, 0, width - row.shape[0])))
    return torch.stack(out), None


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


def sum_of_squares(x: torch.Tensor) -> torch.Tensor:
    """Each row's sum of squares over the last dimension, [..., 1], by halving: the row's
    upper half is added to its lower half, elementwise, until one column is left (padded
    with zeros to a power of two). Each row's sum is the same tree of float additions
    however many rows there are, on any device: no reduction kernel, whose order a
    device may choose by the row count, takes part."""
    squares = x * x
    width = squares.shape[-1]
    padded = 1 << (width - 1).bit_length()
    if padded != width:
        squares = F.pad(squares, (0, padded - width))
    while squares.shape[-1] > 1:
        half = squares.shape[-1] // 2
        squares = squares[..., :half] + squares[..., half:]
    return squares


def _rms_norm_forward(self: nn.Module, hidden_states: torch.Tensor) -> torch.Tensor:
    """Hugging Face's RMSNorm (float32 statistics, scaled in the input's dtype) with the
    sum of squares as a fixed tree of additions (`sum_of_squares`)."""
    dtype = hidden_states.dtype
    x = hidden_states.to(torch.float32)
    variance = sum_of_squares(x) / x.shape[-1]
    x = x * torch.rsqrt(variance + self.variance_epsilon)
    return self.weight * x.to(dtype)


def _is_rms_norm(module: nn.Module) -> bool:
    return type(module).__name__.endswith("RMSNorm") and hasattr(module, "variance_epsilon")


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
        elif _is_rms_norm(module):
            module.forward = types.MethodType(_rms_norm_forward, module)

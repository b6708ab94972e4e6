"""Per-token log-probs of whole sequences under the trainer's policy."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import nn

from rlfleet.trainer import kernels, routing


@dataclass(frozen=True)
class Batch:
    """Sequences right-padded into one tensor; position t of row b is real iff t < lengths[b]."""

    tokens: torch.Tensor  # [batch, width] int64
    lengths: list[int]
    experts: torch.Tensor | None  # [batch, width - 1, layers, top_k] experts each input token used

    @classmethod
    def of(
        cls,
        sequences: Sequence[torch.Tensor],
        experts: Sequence[torch.Tensor] | None = None,
        pad_id: int = 0,
    ) -> Batch:
        lengths = [len(s) for s in sequences]
        width = max(lengths)
        tokens = torch.full((len(sequences), width), pad_id, dtype=torch.long)
        for row, sequence in enumerate(sequences):
            tokens[row, : len(sequence)] = sequence
        routed = None
        if experts is not None:
            shape = experts[0].shape[1:]
            routed = torch.zeros((len(sequences), width - 1, *shape), dtype=torch.long)
            for row, ids in enumerate(experts):
                routed[row, : len(ids)] = ids
        return cls(tokens, lengths, routed)

    def mask(self) -> torch.Tensor:
        return torch.arange(self.tokens.shape[1])[None, :] < torch.tensor(self.lengths)[:, None]


def prepare(model: nn.Module, *, batch_invariant: bool) -> nn.Module:
    """Make `model` score with the chosen kernels and honour router replay."""
    if batch_invariant:
        kernels.make_batch_invariant(model)
    routing.take_over_routers(model, batch_invariant=batch_invariant)
    return model


def token_logprobs(
    model: nn.Module,
    batch: Batch,
    *,
    batch_invariant: bool,
    replay: bool,
    temperature: float = 1.0,
) -> torch.Tensor:
    """log p(token[t+1] | tokens[:t+1]) as [batch, width - 1] float32, 0 past each row's end.

    The model runs over every token but the last of each row (the last is only ever a
    target). With `replay`, MoE layers route each of those tokens by `batch.experts`.
    `temperature` scores under softmax(logits / temperature), as the engine samples.
    """
    if replay and batch.experts is None:
        raise ValueError("router replay needs the routed experts of every sequence")
    inputs = batch.tokens[:, :-1]
    lengths = [n - 1 for n in batch.lengths]
    targets_real = batch.mask()[:, 1:]
    # Batch-invariant attention slices each row to its length; the default kernels take a mask.
    attention_mask = None if batch_invariant else batch.mask()[:, :-1].long()
    with kernels.sequence_lengths(lengths), routing.replay(batch.experts if replay else None):
        logits = model(input_ids=inputs, attention_mask=attention_mask, use_cache=False).logits
    logprobs = torch.log_softmax(logits.float() / temperature, dim=-1)
    picked = logprobs.gather(-1, batch.tokens[:, 1:, None]).squeeze(-1)
    return picked * targets_real

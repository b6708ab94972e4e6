"""Per-token log-probs of whole sequences under the trainer's policy."""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import nn

from rlfleet.trainer import kernels, routing


@dataclass(frozen=True)
class Batch:
    """Sequences laid out for one forward pass, and where each one's targets are scored.

    Sequences that start with the same prompt share a row: the prompt runs through the
    model once, then each sequence's own continuation follows, attending to the prompt and
    to itself only, at the positions it has in its own sequence. A GRPO group scores its
    prompt once instead of once per attempt. Every token of a sequence but its last runs
    through the model; the last is only ever a target.
    """

    inputs: torch.Tensor  # [rows, width] int64: the tokens run through the model
    positions: torch.Tensor  # [rows, width]: each input's position in its own sequence
    layouts: list[kernels.Layout]  # per row: its prompt and continuations
    experts: torch.Tensor | None  # [rows, width, layers, top_k] experts each input used
    targets: torch.Tensor  # [sequences, longest - 1] int64: token t+1 of each sequence
    source: torch.Tensor  # [sequences, longest - 1]: the flat input index predicting it
    real: torch.Tensor  # [sequences, longest - 1] bool: target t exists

    @classmethod
    def of(
        cls,
        sequences: Sequence[torch.Tensor],
        experts: Sequence[torch.Tensor] | None = None,
        pad_id: int = 0,
        prompts: Sequence[int] | None = None,
    ) -> Batch:
        """`sequences` ([length] each), with `experts` ([length - 1, layers, top_k] each) and
        the length of each one's prompt, `prompts`: those sharing a prompt share a row.
        Without `prompts` each sequence is a row of its own."""
        if prompts is None:
            prompts = [len(s) - 1 for s in sequences]
            rows = [[index] for index in range(len(sequences))]
        else:
            sharing: dict[tuple[int, ...], list[int]] = {}
            for index, (sequence, prompt) in enumerate(zip(sequences, prompts, strict=True)):
                sharing.setdefault(tuple(sequence[:prompt].tolist()), []).append(index)
            rows = list(sharing.values())
        layouts, inputs, positions, routed = [], [], [], []
        placed: dict[int, tuple[int, int]] = {}  # sequence -> (row, where its continuation starts)
        for row, members in enumerate(rows):
            first, prompt = members[0], prompts[members[0]]
            continuations = [sequences[m][prompt:-1] for m in members]
            lengths = [len(c) for c in continuations]
            starts = torch.tensor([prompt, *lengths[:-1]]).cumsum(0).tolist()
            placed |= {m: (row, start) for m, start in zip(members, starts, strict=True)}
            layouts.append(kernels.Layout(prompt, tuple(lengths)))
            inputs.append(torch.cat([sequences[first][:prompt], *continuations]))
            positions.append(
                torch.cat(
                    [torch.arange(prompt), *(torch.arange(prompt, prompt + n) for n in lengths)]
                )
            )
            if experts is not None:
                routed.append(
                    torch.cat([experts[first][:prompt], *(experts[m][prompt:] for m in members)])
                )
        width = max(len(row) for row in inputs)
        longest = max(len(s) for s in sequences) - 1
        targets = torch.zeros((len(sequences), longest), dtype=torch.long)
        source = torch.zeros((len(sequences), longest), dtype=torch.long)
        for member, (row, start) in placed.items():
            n, prompt = len(sequences[member]) - 1, prompts[member]
            targets[member, :n] = sequences[member][1:]
            # Targets up to the prompt's end are predicted by the prompt's inputs; each later
            # one by the continuation's own input before it.
            at = torch.arange(n)
            source[member, :n] = row * width + torch.where(at < prompt, at, at - prompt + start)
        return cls(
            inputs=_padded(inputs, width, pad_id),
            positions=_padded(positions, width, 0),
            layouts=layouts,
            experts=_padded(routed, width, 0) if experts is not None else None,
            targets=targets,
            source=source,
            real=torch.arange(longest)[None, :]
            < torch.tensor([len(s) - 1 for s in sequences])[:, None],
        )

    def attention_mask(self) -> torch.Tensor:
        """[rows, 1, width, width] bool: each row's sequences, for the model's kernels."""
        width = self.inputs.shape[1]
        allowed = torch.stack([layout.allowed(width) for layout in self.layouts])[:, None]
        return allowed.to(self.inputs.device)

    def to(self, device: torch.device | str) -> Batch:
        """This batch with every tensor on `device` (the layouts are plain numbers)."""
        return dataclasses.replace(
            self,
            **{
                f.name: value.to(device)
                for f in dataclasses.fields(self)
                if isinstance(value := getattr(self, f.name), torch.Tensor)
            },
        )


def _padded(rows: Sequence[torch.Tensor], width: int, fill: int) -> torch.Tensor:
    out = torch.full((len(rows), width, *rows[0].shape[1:]), fill, dtype=rows[0].dtype)
    for index, row in enumerate(rows):
        out[index, : len(row)] = row
    return out


def prepare(model: nn.Module, *, tiled: bool) -> nn.Module:
    """Make `model` score with rlfleet's tiled kernels (`tiled`) or its own, and honour
    router replay. Which is batch-invariant where is `numerics`' decision."""
    if tiled:
        kernels.make_batch_invariant(model)
    routing.take_over_routers(model, tiled=tiled)
    return model


def token_logprobs(
    model: nn.Module,
    batch: Batch,
    *,
    tiled: bool,
    replay: bool,
    temperature: float = 1.0,
) -> torch.Tensor:
    """log p(token[t+1] | tokens[:t+1]) of each sequence as [sequences, longest - 1] float32,
    0 past each sequence's end, on `batch`'s device, which must be the model's.

    With `replay`, MoE layers route each input by `batch.experts`. `temperature` scores
    under softmax(logits / temperature), as the engine samples. `tiled`: the model was
    prepared with the tiled kernels.
    """
    if replay and batch.experts is None:
        raise ValueError("router replay needs the routed experts of every sequence")
    # The tiled attention attends to each sequence alone; the model's kernels take a mask.
    attention_mask = None if tiled else batch.attention_mask()
    with kernels.layouts(batch.layouts), routing.replay(batch.experts if replay else None):
        logits = model(
            input_ids=batch.inputs,
            position_ids=batch.positions,
            attention_mask=attention_mask,
            use_cache=False,
        ).logits
    logprobs = torch.log_softmax(logits.float() / temperature, dim=-1)
    vocab = logprobs.shape[-1]
    picked = logprobs.reshape(-1)[batch.source * vocab + batch.targets]
    return picked * batch.real

"""Batch-invariant scoring and router replay on the real tiny MoE (Hugging Face, CPU)."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import numpy as np
import pytest
import torch
from transformers import AutoModelForCausalLM

from rlfleet.api.wire import Segment
from rlfleet.launch.settings import TrainerConfig
from rlfleet.trainer import kernels
from rlfleet.trainer.objective import ObjectiveConfig, group_advantages, policy_loss
from rlfleet.trainer.rows import make_rows, routed_experts
from rlfleet.trainer.scoring import Batch, prepare, token_logprobs

# The objective a run with the spec's defaults trains with.
DEFAULTS = ObjectiveConfig.of(
    TrainerConfig(run="r", nats_url="", model=Path(), checkpoint_dir=Path())
)


def _model(path: Path, batch_invariant: bool) -> torch.nn.Module:
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    return prepare(model, tiled=batch_invariant).eval()


def _sequences(count: int, seed: int = 1) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    lengths = torch.randint(3, 150, (count,), generator=gen)
    return [torch.randint(0, 300, (int(n),), generator=gen) for n in lengths]


def _alone_vs_batched(model: torch.nn.Module, invariant: bool) -> list[bool]:
    """For batch sizes 1, 3 and 8: is each sequence's log-prob row bitwise its solo row?"""
    sequences = _sequences(8)
    with torch.no_grad():
        alone = [
            token_logprobs(model, Batch.of([s]), tiled=invariant, replay=False)[0]
            for s in sequences
        ]
        same = []
        for size in (1, 3, 8):
            for i in range(size):
                # Vary who shares the batch: sequence i sits among different neighbours.
                members = [sequences[(i + j) % 8] for j in range(size)]
                rows = token_logprobs(model, Batch.of(members), tiled=invariant, replay=False)
                n = len(sequences[i]) - 1
                same.append(torch.equal(rows[0, :n], alone[i][:n]))
    return same


def test_batch_invariant_logprobs_do_not_depend_on_the_batch(tiny_moe: Path) -> None:
    assert all(_alone_vs_batched(_model(tiny_moe, True), invariant=True))


def test_default_kernels_do_depend_on_the_batch(tiny_moe: Path) -> None:
    # What the invariant mode fixes is real: the same comparison fails with default kernels.
    assert not all(_alone_vs_batched(_model(tiny_moe, False), invariant=False))


def test_both_modes_compute_the_same_function(tiny_moe: Path) -> None:
    batch = Batch.of(_sequences(4))
    with torch.no_grad():
        invariant = token_logprobs(_model(tiny_moe, True), batch, tiled=True, replay=False)
        default = token_logprobs(_model(tiny_moe, False), batch, tiled=False, replay=False)
    torch.testing.assert_close(invariant, default, rtol=0, atol=1e-4)


def test_tiled_rms_norm_is_the_models_and_alike_at_any_row_count(tiny_moe: Path) -> None:
    # On CUDA a generic mean was laid out by row count (bench/results/gpu-*-fp32-*.json);
    # the tiled kernels sum its squares by elementwise halving instead.
    tiled, default = _model(tiny_moe, True), _model(tiny_moe, False)
    norms = [
        (a, b)
        for a, b in zip(tiled.modules(), default.modules(), strict=True)
        if type(a).__name__.endswith("RMSNorm")
    ]
    assert norms
    gen = torch.Generator().manual_seed(4)
    with torch.no_grad():
        for norm, reference in norms:
            x = torch.randn(300, norm.weight.shape[0], generator=gen)
            torch.testing.assert_close(norm(x), reference(x), rtol=0, atol=1e-6)
            assert all(torch.equal(norm(x[:n])[:1], norm(x[:1])) for n in (2, 65, 300))


def test_a_rows_sum_of_squares_is_one_fixed_tree_of_additions() -> None:
    """The same float32 additions in the same order for a row, whatever its neighbours and
    however its width pads to a power of two; and the sum it is meant to be."""
    gen = torch.Generator().manual_seed(5)
    for width in (1, 7, 64, 100):
        x = torch.randn(333, width, generator=gen)
        whole = kernels.sum_of_squares(x)
        assert whole.shape == (333, 1)
        assert all(torch.equal(kernels.sum_of_squares(x[i : i + n]), whole[i : i + n])
                   for i, n in ((0, 1), (5, 2), (17, 64), (100, 233)))  # fmt: skip
        torch.testing.assert_close(whole, (x.double() ** 2).sum(-1, keepdim=True).float())
        # The tree: pairs (j, j + half) first, at every level.
        row = [np.float32(v) for v in (x[0] * x[0]).tolist()]
        row += [np.float32(0)] * ((1 << (width - 1).bit_length()) - width)
        while len(row) > 1:
            half = len(row) // 2
            row = [a + b for a, b in zip(row[:half], row[half:], strict=True)]
        assert whole[0, 0].item() == row[0]


def _groups(seed: int = 2) -> tuple[list[torch.Tensor], list[torch.Tensor], list[int]]:
    """Three GRPO-like groups: five sequences each after one shared prompt, with experts that
    agree on the prompt (the engine ran it once) and differ after it."""
    gen = torch.Generator().manual_seed(seed)
    sequences, experts, prompts = [], [], []
    for _ in range(3):
        p = int(torch.randint(5, 60, (1,), generator=gen))
        prompt = torch.randint(0, 256, (p,), generator=gen)
        prompt_experts = torch.randint(0, 8, (p, 2, 2), generator=gen)
        for _ in range(5):
            c = int(torch.randint(1, 8, (1,), generator=gen))  # one-token answers too
            sequences.append(torch.cat([prompt, torch.randint(0, 256, (c,), generator=gen)]))
            answer_experts = torch.randint(0, 8, (c - 1, 2, 2), generator=gen)
            experts.append(torch.cat([prompt_experts, answer_experts]))
            prompts.append(p)
    return sequences, experts, prompts


def test_a_shared_prompt_runs_once_and_each_sequence_scores_as_it_would_alone(
    tiny_moe: Path,
) -> None:
    sequences, experts, prompts = _groups()
    model = _model(tiny_moe, True)
    shared = Batch.of(sequences, experts, prompts=prompts)
    # One row per group: the prompt once, then the five continuations' inputs.
    assert shared.inputs.shape[0] == 3
    assert shared.inputs.numel() < Batch.of(sequences, experts).inputs.numel() / 2
    order = torch.randperm(len(sequences), generator=torch.Generator().manual_seed(3)).tolist()
    with torch.no_grad():
        together = token_logprobs(model, shared, tiled=True, replay=True)
        shuffled = token_logprobs(
            model,
            Batch.of(
                [sequences[i] for i in order],
                [experts[i] for i in order],
                prompts=[prompts[i] for i in order],
            ),
            tiled=True,
            replay=True,
        )
        for index, (sequence, routed, prompt) in enumerate(
            zip(sequences, experts, prompts, strict=True)
        ):
            alone = token_logprobs(
                model,
                Batch.of([sequence], [routed], prompts=[prompt]),
                tiled=True,
                replay=True,
            )[0]
            n = len(sequence) - 1
            # Bitwise: whichever siblings share its row, and in whatever order.
            assert torch.equal(together[index, :n], alone[:n])
            assert torch.equal(shuffled[order.index(index), :n], alone[:n])
            assert not together[index, n:].any()


def test_sharing_a_prompt_computes_the_same_function_as_scoring_each_sequence_whole(
    tiny_moe: Path,
) -> None:
    sequences, experts, prompts = _groups()
    whole = Batch.of(sequences, experts)
    shared = Batch.of(sequences, experts, prompts=prompts)
    with torch.no_grad():
        for invariant in (True, False):
            model = _model(tiny_moe, invariant)
            expected = token_logprobs(model, whole, tiled=invariant, replay=True)
            found = token_logprobs(model, shared, tiled=invariant, replay=True)
            torch.testing.assert_close(found, expected, rtol=0, atol=1e-4)


def _segment(length: int, experts: np.ndarray) -> Segment:
    rng = np.random.default_rng(length)
    prompt = 5
    return Segment(
        tokens=rng.integers(0, 256, length).tolist(),
        prompt_len=prompt,
        generated=[1] * (length - prompt),
        logprobs=[-3.0] * (length - prompt),
        versions=[0] * (length - prompt),
        routed_experts=experts.astype("<u2").tobytes(),
        moe_layers=experts.shape[1],
        top_k=experts.shape[2],
    )


def _record_experts(model: torch.nn.Module) -> dict[int, list[torch.Tensor]]:
    seen: dict[int, list[torch.Tensor]] = {}
    experts = [m for name, m in model.named_modules() if name.endswith("mlp.experts")]
    for layer, module in enumerate(experts):
        module.register_forward_hook(
            lambda mod, args, out, layer=layer: seen.setdefault(layer, []).append(args[1].clone())
        )
    return seen


@pytest.mark.parametrize("batch_invariant", [True, False])
def test_router_replay_trains_with_exactly_the_trajectory_experts(
    tiny_moe: Path, batch_invariant: bool
) -> None:
    rng = np.random.default_rng(0)
    lengths = (40, 17, 29)
    # Experts the inference engine reported: distinct, sorted per token, unlike the model's own.
    chosen = [
        np.sort(np.stack([rng.permutation(8)[:2] for _ in range((n - 1) * 2)]), axis=-1)
        for n in lengths
    ]
    segments = [_segment(n, c.reshape(n - 1, 2, 2)) for n, c in zip(lengths, chosen, strict=True)]
    rows = make_rows(segments, [1.0, -0.5, 0.25], pad_id=0)
    model = _model(tiny_moe, batch_invariant)
    model.train()
    seen = _record_experts(model)
    logprobs = token_logprobs(model, rows.batch, tiled=batch_invariant, replay=True)
    loss = policy_loss(
        logprobs, logprobs.detach(), rows.behaviour, rows.advantages, rows.mask, DEFAULTS
    ).loss
    loss.backward()
    real = rows.batch.real.reshape(-1)
    for layer in (0, 1):
        used = seen[layer][0].view(len(lengths), -1, 2)
        for row, segment in enumerate(segments):
            n = len(segment.tokens) - 1
            expected = routed_experts(segment)[:, layer]
            assert torch.equal(used[row, :n].sort(-1).values, expected)
    assert real.sum() == sum(n - 1 for n in lengths)
    # R3: the gate weights come from the trainer's router, which keeps learning.
    routers = [p for n, p in model.named_parameters() if n.endswith("mlp.gate.weight")]
    assert all(p.grad is not None and p.grad.abs().sum() > 0 for p in routers)


def test_without_replay_the_trainer_routes_by_itself(tiny_moe: Path) -> None:
    # So the replay test above can fail: the model's own top-k is not the reported experts.
    n = 40
    rng = np.random.default_rng(0)
    reported = np.sort(np.stack([rng.permutation(8)[:2] for _ in range((n - 1) * 2)]), -1)
    segment = _segment(n, reported.reshape(n - 1, 2, 2))
    model = _model(tiny_moe, True)
    seen = _record_experts(model)
    with torch.no_grad():
        token_logprobs(model, make_rows([segment], [1.0], 0).batch, tiled=True, replay=False)
    own = seen[0][0].view(-1, 2)[: n - 1].sort(-1).values
    assert not torch.equal(own, routed_experts(segment)[:, 0])


def test_group_advantages_normalise_within_each_group() -> None:
    rewards = torch.tensor([1.0, 0.0, 1.0, 0.0, 0.5, 0.5, 0.5])
    groups = torch.tensor([0, 0, 0, 0, 1, 1, 1])
    advantages = group_advantages(rewards, groups)
    torch.testing.assert_close(
        advantages[:4], torch.tensor([1.0, -1.0, 1.0, -1.0]), atol=1e-4, rtol=0
    )
    # A group whose attempts all scored the same has nothing to teach.
    assert torch.equal(advantages[4:], torch.zeros(3))


def test_truncated_importance_weight_is_capped() -> None:
    logprobs = torch.tensor([[-0.1, -0.1]], requires_grad=True)
    behaviour = torch.tensor([[-5.0, -0.1]])  # first token: the engine thought it far less likely
    config = dataclasses.replace(DEFAULTS, importance_weight_cap=2.0)
    result = policy_loss(
        logprobs, logprobs.detach(), behaviour, torch.ones(1, 2), torch.ones(1, 2), config
    )
    result.loss.backward()
    # Weights min(exp(4.9), 2) = 2 and exp(0) = 1, averaged over the two tokens.
    torch.testing.assert_close(logprobs.grad, torch.tensor([[-1.0, -0.5]]))
    assert result.is_weight_mean == pytest.approx(1.5)


def test_kl_to_the_reference_is_zero_at_the_reference_and_positive_away_from_it() -> None:
    logprobs = torch.tensor([[-1.0, -2.0, -0.5]])
    ones = torch.ones(1, 3)
    config = dataclasses.replace(DEFAULTS, kl_coef=0.1)
    same = policy_loss(logprobs, logprobs, logprobs, ones, ones, config, reference=logprobs)
    assert same.kl_ref == 0.0
    moved = policy_loss(logprobs, logprobs, logprobs, ones, ones, config, reference=logprobs - 0.3)
    assert moved.kl_ref > 0
    assert float(moved.loss) == pytest.approx(float(same.loss) + 0.1 * moved.kl_ref)

"""The policy-gradient objective: pure functions of log-probs, rewards and masks."""

from __future__ import annotations

from dataclasses import dataclass, fields
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from rlfleet.launch.settings import TrainerConfig


@dataclass(frozen=True)
class ObjectiveConfig:
    """The objective's knobs, under the spec's names (`spec.trainer`); their defaults are the
    API model's alone, and reach here through the trainer's settings (`of`)."""

    clip_low: float
    clip_high: float  # asymmetric upper clip (DAPO) keeps low-probability tokens learning
    importance_weight_cap: float  # truncated importance sampling: weights capped here
    kl_coef: float  # KL to the reference policy (k3 estimator); 0 switches it off

    @classmethod
    def of(cls, settings: TrainerConfig) -> ObjectiveConfig:
        return cls(**{field.name: getattr(settings, field.name) for field in fields(cls)})


def group_advantages(
    rewards: torch.Tensor, groups: torch.Tensor, eps: float = 1e-6
) -> torch.Tensor:
    """GRPO: each reward minus its group's mean, over its group's standard deviation.

    A group whose rewards are all equal teaches nothing and gets advantage 0.
    """
    _, index = torch.unique(groups, return_inverse=True)
    count = torch.zeros(int(index.max()) + 1).index_add_(0, index, torch.ones_like(rewards))
    mean = torch.zeros_like(count).index_add_(0, index, rewards) / count
    centred = rewards - mean[index]
    var = torch.zeros_like(count).index_add_(0, index, centred**2) / count
    std = var.sqrt()[index]
    return torch.where(std > eps, centred / (std + eps), torch.zeros_like(centred))


@dataclass(frozen=True)
class Loss:
    loss: torch.Tensor
    clipped_fraction: float
    is_weight_mean: float
    kl_ref: float


def policy_loss(
    logprobs: torch.Tensor,
    proximal: torch.Tensor,
    behaviour: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    config: ObjectiveConfig,
    reference: torch.Tensor | None = None,
    tokens: float | None = None,
) -> Loss:
    """Token-level clipped policy gradient with truncated importance sampling (decoupled PPO).

    All tensors are [batch, tokens]; `advantages` is per token (a trajectory's advantage
    on each of its tokens). `proximal` is the trainer's log-prob before this update and
    `behaviour` the inference engine's: the clip bounds the step from the proximal policy
    and the capped weight proximal/behaviour corrects for the samples being off-policy
    (stale or numerically different). The mean is over every generated token of the batch,
    or over `tokens` when the step is split into micro-batches (the step's total).
    """
    mask = mask.float()
    tokens = tokens or mask.sum().clamp(min=1)
    ratio = torch.exp(logprobs - proximal)
    clipped_ratio = ratio.clamp(1 - config.clip_low, 1 + config.clip_high)
    surrogate = torch.minimum(ratio * advantages, clipped_ratio * advantages)
    is_weight = torch.exp(proximal - behaviour).clamp(max=config.importance_weight_cap).detach()
    loss = -(is_weight * surrogate * mask).sum() / tokens
    kl = torch.zeros((), device=logprobs.device)
    if reference is not None and config.kl_coef > 0:
        log_ratio = reference - logprobs
        kl = ((torch.exp(log_ratio) - 1 - log_ratio) * mask).sum() / tokens
        loss = loss + config.kl_coef * kl
    clipped = ((ratio != clipped_ratio).float() * mask).sum() / tokens
    return Loss(
        loss=loss,
        clipped_fraction=float(clipped),
        is_weight_mean=float((is_weight * mask).sum() / tokens),
        kl_ref=float(kl),
    )


@dataclass(frozen=True)
class Mismatch:
    """How far the trainer's log-probs are from the inference engine's on the same tokens."""

    mean_abs: float
    max_abs: float
    kl: float  # k3 estimate of KL(behaviour || trainer), from behaviour's samples

    @classmethod
    def of(cls, trainer: torch.Tensor, behaviour: torch.Tensor, mask: torch.Tensor) -> Mismatch:
        return cls.of_sums(mismatch_sums(trainer, behaviour, mask))

    @classmethod
    def of_sums(cls, sums: torch.Tensor) -> Mismatch:
        """From `mismatch_sums`, or their sum (max for the max) over parts of a batch."""
        count, sum_abs, max_abs, sum_k3 = sums.tolist()
        if not count:
            return cls(0.0, 0.0, 0.0)
        return cls(mean_abs=sum_abs / count, max_abs=max_abs, kl=sum_k3 / count)


def mismatch_sums(
    trainer: torch.Tensor, behaviour: torch.Tensor, mask: torch.Tensor
) -> torch.Tensor:
    """[tokens, sum |delta|, max |delta|, sum k3] over the masked tokens, in float64: what
    `Mismatch` is made of, summable over a batch split across ranks."""
    delta = (trainer - behaviour)[mask.bool()].double()
    if not delta.numel():
        return torch.zeros(4, dtype=torch.float64, device=delta.device)
    return torch.stack(
        [
            torch.tensor(float(delta.numel()), dtype=torch.float64, device=delta.device),
            delta.abs().sum(),
            delta.abs().max(),
            (torch.exp(delta) - 1 - delta).sum(),
        ]
    )

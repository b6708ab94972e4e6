"""The policy being trained: a DeepSpeed engine over a Hugging Face causal LM."""

from __future__ import annotations

import functools
import json
import logging
import math
from collections.abc import Collection
from dataclasses import dataclass
from typing import Any

import deepspeed
import torch
import torch.distributed as dist
from deepspeed.accelerator import get_accelerator
from transformers import AutoModelForCausalLM
from transformers.core_model_loading import revert_weight_conversion

from rlfleet.launch.settings import TrainerConfig
from rlfleet.trainer import checkpoints, distributed, numerics, routing
from rlfleet.trainer.checkpoints import tag
from rlfleet.trainer.deepspeed_config import deepspeed_config
from rlfleet.trainer.objective import Mismatch, ObjectiveConfig, mismatch_sums, policy_loss
from rlfleet.trainer.rows import Rows
from rlfleet.trainer.schedule import lr_factor
from rlfleet.trainer.scoring import prepare, token_logprobs
from rlfleet.trainer.validation import ModelShape
from rlfleet.weightsync import owned_names

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class StepResult:
    loss: float
    tokens: int
    mismatch: Mismatch
    clipped_fraction: float
    learning_rate: float  # the step's first update's, as the schedule had it
    # Micro-batches whose loss was not finite on some rank: left out of every update of
    # the step (all of them: no update at all), so a NaN never reaches the weights.
    nonfinite_micro_batches: int = 0
    # How the step moved the policy's preference on held-out trajectories (`preference`):
    # after minus before, per generated token; None without any, or when not finite.
    held_out_gain: float | None = None


class Policy:
    """The policy on this rank's device (its GPU, or the host): its weights, optimiser and
    reference model live there, and every micro-batch is moved there to be scored."""

    def __init__(self, config: TrainerConfig, local_rank: int = 0) -> None:
        self.config = config
        self.local_rank = local_rank
        deepspeed_config(config)  # a user's bad file fails before anything starts
        self.objective = ObjectiveConfig.of(config)
        accelerator = get_accelerator()
        self.device = torch.device(accelerator.device_name(local_rank))
        # Before the first kernel: cuBLAS reads its workspace settings once.
        self.numerics = numerics.for_device(self.device, config.precision, config.batch_invariant)
        numerics.apply(self.numerics)
        if self.device.type != "cpu":
            accelerator.set_device(local_rank)  # one rank per GPU; NCCL needs it set
        distributed.init_distributed(config.ranks, local_rank)
        self.shared_checkpoints = checkpoints.shared_across_nodes(config.checkpoint_dir, local_rank)
        engine_config = deepspeed_config(config, self.shared_checkpoints)
        torch.manual_seed(config.seed)
        model_config = json.loads((config.model / "config.json").read_text())
        # Published weights keep the checkpoint's dtype, the one the inference engine serves.
        self.serve_dtype = getattr(torch, model_config.get("dtype", "bfloat16"))
        model = self._load_model()
        self.shape = ModelShape(
            vocab_size=model.config.vocab_size,
            moe_layers=len(routing.routers(model)),
            num_experts=getattr(model.config, "num_experts", 0),
            top_k=getattr(model.config, "num_experts_per_tok", 0),
        )
        self.pad_id = model.config.pad_token_id or 0
        # Not DeepSpeed's to place: frozen, in the engine's dtype, on the rank's device.
        self.reference = (
            self._load_model().to(self.device, self.numerics.dtype).eval()
            if config.kl_coef > 0
            else None
        )
        optimizer = torch.optim.AdamW(
            model.parameters(), lr=config.learning_rate, weight_decay=config.weight_decay
        )
        schedule = torch.optim.lr_scheduler.LambdaLR(
            optimizer,
            functools.partial(
                lr_factor,
                warmup=config.learning_rate_warmup_steps,
                decay=config.learning_rate_decay_steps,
                floor=config.learning_rate_floor,
            ),
        )
        self.engine, *_ = deepspeed.initialize(
            model=model,
            optimizer=optimizer,
            lr_scheduler=schedule,  # stepped with the optimiser and kept in checkpoints
            config=engine_config,
        )

    def _load_model(self) -> torch.nn.Module:
        # float32: DeepSpeed's master weights are made from it; under bf16 it casts the
        # module itself.
        model = AutoModelForCausalLM.from_pretrained(self.config.model, dtype=torch.float32)
        prepare(model, tiled=self.numerics.tiled)
        return model

    @property
    def replay(self) -> bool:
        return self.config.router_replay and self.shape.moe_layers > 0

    def logprobs(self, rows: Rows, model: torch.nn.Module | None = None) -> torch.Tensor:
        """Log-probs of `rows` (on the rank's device) under the policy or `model`."""
        return token_logprobs(
            model or self.engine,
            rows.batch,
            tiled=self.numerics.tiled,
            replay=self.replay,
            temperature=self.config.temperature,
        )

    def placed(self, rows: list[Rows]) -> list[Rows]:
        """`rows` on the rank's device: they arrive in host memory (made by rank 0 from
        trajectories, scattered over the process group)."""
        return [r.to(self.device) for r in rows]

    def train_step(
        self, micro_batches: list[Rows], tokens: int, held_out: list[Rows] | None = None
    ) -> StepResult:
        """`updates_per_step` optimiser steps over the step's micro-batches, each a mean over
        all the step's `tokens`. Each rank passes its own share of the micro-batches (as many
        as every other rank); the result is the whole step's. The first pass's log-probs are
        the proximal policy: later passes are clipped against it (PPO epochs), which is what
        makes reusing a batch safe. `held_out`, this rank's share of trajectories not
        trained on, is scored before and after (`held_out_gain`)."""
        self.engine.train()
        learning_rate = self.engine.get_lr()[0]
        micro_batches, held_out = self.placed(micro_batches), self.placed(held_out or [])
        before = self.preference(held_out)
        references = [self._reference(rows) for rows in micro_batches]  # frozen: once
        first = last = self._update(micro_batches, references, tokens, None, kept=None)
        for _ in range(self.config.updates_per_step - 1):
            last = self._update(micro_batches, references, tokens, first.logprobs, first.kept)
        # Over the tokens trained on: a left-out micro-batch's log-probs may be NaN.
        masks = [rows.mask.flatten() * k for rows, k in zip(micro_batches, first.kept, strict=True)]
        mismatch = mismatch_sums(
            torch.cat([lp.flatten() for lp in first.logprobs]),
            torch.cat([rows.behaviour.flatten() for rows in micro_batches]),
            torch.cat(masks),
        ).cpu()
        totals = distributed.reduce(
            torch.cat([torch.tensor([first.loss, last.clipped], dtype=torch.float64), mismatch]),
            dist.ReduceOp.SUM,
        )
        totals[4] = distributed.reduce(mismatch[2:3].clone(), dist.ReduceOp.MAX)[0]
        left_out = first.kept.count(False)
        if left_out:
            log.warning(
                "%d of %d micro-batches had a non-finite loss and were left out of the step%s",
                left_out,
                len(micro_batches),
                "" if any(first.kept) else ": no update, the weights are as they were",
            )
        # The loss and mismatch are the first pass's: the batch as the engine sampled it. The
        # clipped fraction is the last pass's: how far the reuse pushed from the proximal.
        return StepResult(
            float(totals[0]),
            tokens,
            Mismatch.of_sums(totals[2:]),
            float(totals[1]),
            learning_rate,
            nonfinite_micro_batches=left_out,
            held_out_gain=self._gain(before, held_out),
        )

    def preference(self, rows: list[Rows]) -> torch.Tensor:
        """This rank's sum of advantage x log-prob over `rows`' generated tokens, and the
        tokens' count: how strongly the policy prefers what was rewarded over what was not.
        A forward pass each, collective under ZeRO-3 like training's (every rank has as
        many, `distributed.share`). `rows` are on the rank's device (`placed`)."""
        sums = torch.zeros(2, dtype=torch.float64)
        with torch.no_grad():
            for micro_batch in rows:
                sums[0] += float((self.logprobs(micro_batch) * micro_batch.advantages).sum())
                sums[1] += float(micro_batch.mask.sum())
        return sums

    def _gain(self, before: torch.Tensor, held_out: list[Rows]) -> float | None:
        if not held_out:  # on every rank alike: the shares of none are all empty
            return None
        after = self.preference(held_out)
        change = torch.stack([after[0] - before[0], before[1]])
        total, count = distributed.reduce(change, dist.ReduceOp.SUM).tolist()
        gain = total / max(count, 1.0)
        return gain if math.isfinite(gain) else None

    def _reference(self, rows: Rows) -> torch.Tensor | None:
        if self.reference is None:
            return None
        with torch.no_grad():
            return self.logprobs(rows, self.reference)

    def _update(
        self,
        micro_batches: list[Rows],
        references: list[torch.Tensor | None],
        tokens: int,
        proximal: list[torch.Tensor] | None,
        kept: list[bool] | None,
    ) -> _Pass:
        """One optimiser step over every micro-batch, clipped against `proximal` (on the
        first pass, the pass's own log-probs: ratio 1, clip idle; the truncated importance
        weight proximal/behaviour carries the off-policy correction). A micro-batch whose
        loss is not finite on any rank (the first pass decides; later passes keep `kept`)
        has no backward on any rank, since backward's hooks are collective; with none left,
        no optimiser step either, since AdamW moves weights even on zero gradients."""
        decide, kept = kept is None, kept or [True] * len(micro_batches)
        total_loss, clipped, logprobs_seen = 0.0, 0.0, []
        for index, (rows, reference) in enumerate(zip(micro_batches, references, strict=True)):
            logprobs = self.logprobs(rows)
            logprobs_seen.append(logprobs.detach())
            result = policy_loss(
                logprobs,
                logprobs_seen[-1] if proximal is None else proximal[index],
                rows.behaviour,
                rows.advantages,
                rows.mask,
                self.objective,
                reference,
                tokens=tokens,
            )
            if decide:
                kept[index] = _finite_everywhere(result.loss)
            if not kept[index]:
                continue
            # DeepSpeed averages gradients over the ranks; each rank's loss is its share of
            # the step's mean, so scaling it by the ranks makes the average their sum.
            self.engine.backward(result.loss * distributed.world(), scale_wrt_gas=False)
            total_loss += float(result.loss.detach())
            clipped += result.clipped_fraction  # already a share of the step's `tokens`
        if any(kept):
            self.engine.step()
        return _Pass(total_loss, clipped, logprobs_seen, kept)

    def weights(self) -> dict[str, torch.Tensor]:
        """This rank's part of the policy under the checkpoint's names, in the serving dtype:
        the module's tensors weightsync's `owned_names` gives this rank (by the module's
        names, so that a fused tensor's owner alone converts it). Every rank calls it: under
        ZeRO-3 parameters are gathered one at a time, collectively, and each rank keeps only
        its own, so no rank ever holds the whole model."""
        module = self.engine.module
        tensors = module.state_dict(keep_vars=True)
        sizes = {name: getattr(t, "ds_numel", t.numel()) for name, t in tensors.items()}
        owned = owned_names(sizes, distributed.rank(), distributed.world())
        state = {}
        for name, tensor in tensors.items():
            partitioned = hasattr(tensor, "ds_id")  # a ZeRO-3 parameter: gather it
            with deepspeed.zero.GatheredParameters([tensor], enabled=partitioned):
                if name in owned:
                    # A copy: the gathered storage goes back to its partitions on exit.
                    state[name] = tensor.detach().to(self.serve_dtype, copy=partitioned)
        return revert_weight_conversion(module, state)

    def save(self, step: int, client_state: dict[str, Any], pinned: Collection[int] = ()) -> None:
        """Collective: every rank saves its part, into its node's `checkpoint_dir` (a volume
        per pod, or one every node shares: `checkpoints`); rank 0's `client_state` is the
        one resumed from. The newest few are kept, and the `pinned` steps' too (a
        production run's serving version and the one before it, to go back to)."""
        directory = self.config.checkpoint_dir
        self.engine.save_checkpoint(str(directory), tag=tag(step), client_state=client_state)
        # Once every rank has written (the save ends in a barrier), one process per folder.
        if checkpoints.prunes(self.shared_checkpoints, self.local_rank):
            checkpoints.prune(directory, self.config.keep_checkpoints, pinned)

    def restore(self, step: int) -> bool:
        """Collective: the weights and optimiser state back to step `step`'s checkpoint,
        if this node still has it. The caller keeps counting versions from where it is:
        a version number is never used twice."""
        if not (self.config.checkpoint_dir / tag(step)).is_dir():
            return False
        self.engine.load_checkpoint(str(self.config.checkpoint_dir), tag=tag(step))
        return True

    def load(self) -> dict[str, Any] | None:
        """Collective: restores on every rank the step rank 0's newest checkpoint holds and
        returns its client state, or None to start fresh."""
        latest = self.config.checkpoint_dir / "latest"
        tag = [latest.read_text().strip() if latest.exists() else None]
        if distributed.world() > 1:
            dist.broadcast_object_list(tag, src=0)  # all ranks resume from one step
        if tag[0] is None:
            return None
        path, client_state = self.engine.load_checkpoint(
            str(self.config.checkpoint_dir), tag=tag[0]
        )
        log.info("resumed from %s", path)
        return client_state


@dataclass(frozen=True)
class _Pass:
    """One optimiser step's pass over the micro-batches."""

    loss: float
    clipped: float
    logprobs: list[torch.Tensor]  # each micro-batch's, before the step
    kept: list[bool]  # whose loss was finite everywhere, and so trained on


def _finite_everywhere(loss: torch.Tensor) -> bool:
    """Whether every rank's `loss` is finite: they all skip a micro-batch, or none does."""
    bad = torch.tensor([0.0 if torch.isfinite(loss.detach()).item() else 1.0])
    return not distributed.reduce(bad, dist.ReduceOp.MAX)[0].item()

"""The policy being trained: a DeepSpeed engine over a Hugging Face causal LM."""

from __future__ import annotations

import json
import logging
import os
import shutil
import socket
from dataclasses import dataclass
from typing import Any

import deepspeed
import torch
from deepspeed.accelerator import get_accelerator
from transformers import AutoModelForCausalLM
from transformers.core_model_loading import revert_weight_conversion

from rlfleet.launch.settings import TrainerConfig
from rlfleet.trainer import routing
from rlfleet.trainer.deepspeed_config import deepspeed_config
from rlfleet.trainer.objective import Mismatch, ObjectiveConfig, policy_loss
from rlfleet.trainer.rows import Rows
from rlfleet.trainer.scoring import prepare, token_logprobs
from rlfleet.trainer.validation import ModelShape

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class StepResult:
    loss: float
    tokens: int
    mismatch: Mismatch
    clipped_fraction: float


def _init_distributed() -> None:
    if not os.environ.get("MASTER_PORT"):
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            os.environ["MASTER_PORT"] = str(s.getsockname()[1])
    for key, value in (("MASTER_ADDR", "127.0.0.1"), ("RANK", "0"), ("LOCAL_RANK", "0")):
        os.environ.setdefault(key, value)
    os.environ.setdefault("WORLD_SIZE", "1")
    # The CPU accelerator defaults to oneCCL; gloo needs nothing installed.
    backend = "gloo" if get_accelerator().device_name() == "cpu" else None
    deepspeed.init_distributed(dist_backend=backend)


class Policy:
    def __init__(self, config: TrainerConfig) -> None:
        self.config = config
        engine_config = deepspeed_config(config)  # a user's bad file fails before any load
        self.objective = ObjectiveConfig(
            clip_low=config.clip_low,
            clip_high=config.clip_high,
            is_cap=config.is_cap,
            kl_coef=config.kl_coef,
        )
        _init_distributed()
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
        self.reference = self._load_model().eval() if config.kl_coef > 0 else None
        optimizer = torch.optim.AdamW(
            model.parameters(), lr=config.lr, weight_decay=config.weight_decay
        )
        # Adam's first updates move every weight by about lr whatever the gradient's size;
        # ramping lr up keeps a policy's first noisy RL steps from undoing its warm start.
        warmup = max(config.lr_warmup_steps, 1)
        schedule = torch.optim.lr_scheduler.LambdaLR(
            optimizer, lambda step: min(1.0, (step + 1) / warmup)
        )
        self.engine, *_ = deepspeed.initialize(
            model=model,
            optimizer=optimizer,
            lr_scheduler=schedule,  # stepped with the optimiser and kept in checkpoints
            config=engine_config,
        )

    def _load_model(self) -> torch.nn.Module:
        model = AutoModelForCausalLM.from_pretrained(self.config.model, dtype=torch.float32)
        prepare(model, batch_invariant=self.config.batch_invariant)
        return model

    @property
    def replay(self) -> bool:
        return self.config.router_replay and self.shape.moe_layers > 0

    def logprobs(self, rows: Rows, model: torch.nn.Module | None = None) -> torch.Tensor:
        return token_logprobs(
            model or self.engine,
            rows.batch,
            batch_invariant=self.config.batch_invariant,
            replay=self.replay,
            temperature=self.config.temperature,
        )

    def train_step(self, micro_batches: list[Rows]) -> StepResult:
        """`updates_per_step` optimiser steps over all `micro_batches`, each a mean over all
        their tokens. The first pass's log-probs are the proximal policy: later passes are
        clipped against it (PPO epochs), which is what makes reusing a batch safe."""
        self.engine.train()
        tokens = sum(rows.tokens for rows in micro_batches)
        references = [self._reference(rows) for rows in micro_batches]  # frozen: once
        loss, clipped, proximal = self._update(micro_batches, references, tokens, None)
        for _ in range(self.config.updates_per_step - 1):
            _, clipped, _ = self._update(micro_batches, references, tokens, proximal)
        mismatch = Mismatch.of(
            torch.cat([lp.flatten() for lp in proximal]),
            torch.cat([rows.behaviour.flatten() for rows in micro_batches]),
            torch.cat([rows.mask.flatten() for rows in micro_batches]),
        )
        # The loss and mismatch are the first pass's: the batch as the engine sampled it. The
        # clipped fraction is the last pass's: how far the reuse pushed from the proximal.
        return StepResult(loss, tokens, mismatch, clipped)

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
    ) -> tuple[float, float, list[torch.Tensor]]:
        """One optimiser step over every micro-batch, clipped against `proximal` (on the
        first pass, the pass's own log-probs: ratio 1, clip idle; the truncated importance
        weight proximal/behaviour carries the off-policy correction). Returns the loss, the
        clipped fraction and this pass's log-probs before the step."""
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
            self.engine.backward(result.loss, scale_wrt_gas=False)
            total_loss += float(result.loss.detach())
            clipped += result.clipped_fraction * rows.tokens / tokens
        self.engine.step()
        return total_loss, clipped, logprobs_seen

    def weights(self) -> dict[str, torch.Tensor]:
        """The policy's tensors under the checkpoint's names, in the serving dtype."""
        module = self.engine.module
        with deepspeed.zero.GatheredParameters(
            list(module.parameters()), enabled=self.config.zero_stage == 3
        ):
            state = {k: v.detach().to(self.serve_dtype) for k, v in module.state_dict().items()}
        return revert_weight_conversion(module, state)

    def save(self, step: int, client_state: dict[str, Any]) -> None:
        directory = self.config.checkpoint_dir
        tag = f"step-{step:08d}"
        self.engine.save_checkpoint(str(directory), tag=tag, client_state=client_state)
        tags = sorted(p for p in directory.glob("step-*") if p.is_dir())
        for old in tags[: -self.config.keep_checkpoints]:
            shutil.rmtree(old)

    def load(self) -> dict[str, Any] | None:
        """The client state of the newest checkpoint after restoring it, or None to start fresh."""
        if not (self.config.checkpoint_dir / "latest").exists():
            return None
        path, client_state = self.engine.load_checkpoint(str(self.config.checkpoint_dir))
        log.info("resumed from %s", path)
        return client_state

"""The trainer's settings: a JSON file `rlfleet run` writes, or a pod's mounted run spec."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import msgspec

from rlfleet import launch
from rlfleet.api.rlrun import RLRunSpec
from rlfleet.weightsync import SyncConfig

Positive = Annotated[int, msgspec.Meta(ge=1)]


class TrainerConfig(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    run: str
    nats_url: str
    model: Path  # the base Hugging Face checkpoint: policy version 0
    checkpoint_dir: Path  # DeepSpeed checkpoints and the step log; resume from here
    jetstream_domain: str | None = None  # the hub's domain, when connected through a leaf
    # Regions' domains whose mirrors of the weights the trainer retires old versions from
    # (a purge does not travel down a mirror).
    weight_mirrors: list[str] = msgspec.field(default_factory=list)
    zero_stage: Annotated[int, msgspec.Meta(ge=0, le=3)] = 1
    batch_invariant: bool = True
    router_replay: bool = True
    max_staleness: Annotated[int, msgspec.Meta(ge=0)] = 4
    step_tokens: Positive = 4096  # each optimiser step trains on at least this many tokens
    max_step_tokens: Positive | None = None  # and on more when ready, up to this (2x by default)
    # Or on exactly this many groups (tasks), ignoring the token budget: a batch the task
    # feed's staleness-aware admission can issue exactly, so nothing goes stale unused.
    step_groups: Positive | None = None
    micro_batch_tokens: Positive = 8192  # padded tokens per forward/backward
    lr: float = 1e-5
    lr_warmup_steps: Annotated[int, msgspec.Meta(ge=0)] = 0  # lr ramps up over these updates
    updates_per_step: Positive = 1  # optimiser passes over each batch (PPO epochs)
    weight_decay: float = 0.0
    grad_clip: float = 1.0
    clip_low: float = 0.2
    clip_high: float = 0.28
    is_cap: float = 2.0
    kl_coef: float = 0.0
    # The rollouts' sampling temperature: tokens are scored under logits / temperature, the
    # distribution they were sampled from, else importance ratios compare two different
    # distributions. The KL to the reference is taken at it too.
    temperature: Annotated[float, msgspec.Meta(gt=0)] = 1.0
    group_timeout_s: float = 600.0
    ack_wait_s: float = 600.0  # JetStream redelivers what a dead trainer never acknowledged
    keep_checkpoints: Positive = 2
    max_steps: int | None = None  # stop after this step (tests, fixed-budget runs)
    seed: int = 0
    metrics_port: int | None = None  # serve Prometheus metrics here
    weightsync: dict = msgspec.field(default_factory=dict)  # SyncConfig fields

    def sync_config(self) -> SyncConfig:
        return SyncConfig(**self.weightsync)


def load(path: Path) -> TrainerConfig:
    return msgspec.json.decode(path.read_bytes(), type=TrainerConfig, dec_hook=_paths)


def from_spec(name: str, spec: RLRunSpec, at: launch.Placement) -> TrainerConfig:
    """A trainer pod's settings: its run's mounted spec, placed by the operator."""
    checkpoints = f"{at.state_dir}/checkpoints"
    settings = launch.trainer_settings(name, spec, launch.model_dir(spec), checkpoints, at)
    return msgspec.convert(settings, TrainerConfig, dec_hook=_paths)


def _paths(kind: type, value: object) -> object:
    if kind is Path and isinstance(value, str):
        return Path(value)
    raise NotImplementedError

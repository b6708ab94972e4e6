"""The rollout worker's settings: a JSON file `rlfleet run` writes, or a pod's mounted run spec."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import msgspec

from rlfleet import launch
from rlfleet.api.rlrun import RLRunSpec
from rlfleet.rollout.sandbox import Limits
from rlfleet.rollout.session import SessionConfig
from rlfleet.weightsync import SyncConfig

Positive = Annotated[int, msgspec.Meta(ge=1)]
Weight = Annotated[float, msgspec.Meta(ge=0)]


class JudgeConfig(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """An LLM-as-judge over any OpenAI-compatible endpoint (a vLLM server included)."""

    base_url: str
    model: str
    api_key: str | None = None
    timeout_s: float = 60.0
    extra_body: dict = msgspec.field(default_factory=dict)  # e.g. a vLLM guided regex


class RewardConfig(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """Weights of the parts that apply to a task (an answer, hidden tests, a rubric)."""

    exact: Weight = 1.0
    tests: Weight = 1.0
    judge: Weight = 0.0
    judge_endpoint: JudgeConfig | None = None


class WorkerConfig(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    run: str
    nats_url: str
    model: str  # the base Hugging Face checkpoint: policy version 0
    name: str = "rollout-0"  # names the worker in trajectories and logs
    jetstream_domain: str | None = None  # the hub's domain, when connected through a leaf
    # The region's own domain, whose mirror of the hub's weights the worker reads: a
    # version then crosses the WAN once per region, not once per worker.
    weights_domain: str | None = None
    max_sessions: Positive = 64  # sessions running at once, across groups
    group_size: Positive = 4  # attempts per task, unless the task message says
    max_model_len: Positive = 4096
    dtype: str = "bfloat16"
    prefix_caching: bool = True
    follow_weights: bool = True  # apply the trainer's versions as they arrive
    start_version: int | None = 0  # take no task before this version is loaded
    session: SessionConfig = SessionConfig()
    limits: Limits = Limits()
    rewards: RewardConfig = RewardConfig()
    ack_wait_s: float = 600.0  # a task whose worker died is redelivered after this
    seed: int = 0
    metrics_port: int | None = None
    weightsync: dict = msgspec.field(default_factory=dict)  # SyncConfig fields

    def sync_config(self) -> SyncConfig:
        return SyncConfig(**self.weightsync)


def load(path: Path) -> WorkerConfig:
    return msgspec.json.decode(path.read_bytes(), type=WorkerConfig)


def from_spec(name: str, spec: RLRunSpec, at: launch.Placement) -> WorkerConfig:
    """A rollout pod's settings: its run's mounted spec, placed by the operator."""
    settings = launch.rollout_settings(name, spec, launch.model_dir(spec), at)
    return msgspec.convert(settings, WorkerConfig)

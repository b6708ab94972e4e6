"""Driving weightsync in a vLLM `LLM` from the process that owns it (a rollout worker)."""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any

import msgspec

from rlfleet.weightsync.config import SyncConfig
from rlfleet.weightsync.versions import wait_for_version

ENGINE_NAME = "rlfleet-weightsync"
_STATUS = "rlfleet_weightsync_status"


def llm_options(
    worker_extension: str = "rlfleet.weightsync.vllm_worker.WeightsyncWorker",
) -> dict[str, Any]:
    """Keyword arguments for `vllm.LLM` (or engine args) that enable the engine.

    `worker_extension` names a subclass of `WeightsyncWorker`, for callers that add methods.
    """
    return {
        "weight_transfer_config": {"backend": ENGINE_NAME},
        "worker_extension_cls": worker_extension,
    }


def start(llm, nats_url: str, run: str, domain: str | None, config: SyncConfig) -> None:
    """Connect every worker's engine to the run's weights and start following them."""
    info = {
        "nats_url": nats_url,
        "run": run,
        "domain": domain,
        "config": msgspec.to_builtins(config),
    }
    llm.init_weight_transfer_engine({"init_info": info})


@dataclass(frozen=True)
class Update:
    version: int | None
    digest: str | None
    pause_s: float  # generation was stopped this long


def status(llm) -> list[dict[str, Any]]:
    return llm.collective_rpc(_STATUS)


def _held_by_all(llm) -> int | None:
    """The newest version every worker holds; None while one holds none."""
    held = [s["held"] for s in status(llm)]
    return None if None in held else min(held)


def update(llm, version: int | None = None, timeout_s: float = 300.0) -> Update:
    """Switch the model to `version` (or the newest held) once every worker holds it.

    Waiting happens between generation steps; only the write into the model pauses it.
    Samples generated afterwards carry the version in `CompletionOutput.weight_versions`.
    """
    if version is not None:
        wait_for_version(lambda: _held_by_all(llm), version, timeout_s, what="vLLM's workers")
    started = time.perf_counter()
    llm.start_weight_update()
    llm.update_weights({"update_info": {"version": version, "timeout_s": timeout_s}})
    loaded = status(llm)
    tag = str(loaded[0]["loaded"])
    llm.finish_weight_update(weight_version=tag)
    llm.reset_prefix_cache()
    pause_s = time.perf_counter() - started
    versions = {s["loaded"] for s in loaded}
    if len(versions) != 1:
        raise RuntimeError(f"workers disagree on the loaded version: {sorted(map(str, versions))}")
    return Update(loaded[0]["loaded"], loaded[0]["digest"], pause_s)

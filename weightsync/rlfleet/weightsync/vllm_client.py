"""Driving weightsync in vLLM from the process that owns the engine: a `vllm.LLM` (a
rollout worker), or the `AsyncLLM` of vLLM's OpenAI-compatible server (a production
pool's server, `*_async`)."""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass
from typing import Any

import msgspec

from rlfleet.weightsync.config import SyncConfig
from rlfleet.weightsync.versions import wait_for_version

ENGINE_NAME = "rlfleet-weightsync"
_STATUS = "rlfleet_weightsync_status"
_UPDATE = "rlfleet_weightsync_update"
_HOLD_AT_MOST = "rlfleet_weightsync_hold_at_most"
_FORGET_LOADED = "rlfleet_weightsync_forget_loaded"


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


def _init_info(nats_url: str, run: str, domain: str | None, config: SyncConfig) -> dict:
    return {
        "nats_url": nats_url,
        "run": run,
        "domain": domain,
        "config": msgspec.to_builtins(config),
    }


def start(llm, nats_url: str, run: str, domain: str | None, config: SyncConfig) -> None:
    """Connect every worker's engine to the run's weights and start following them."""
    llm.init_weight_transfer_engine({"init_info": _init_info(nats_url, run, domain, config)})


async def start_async(
    engine, nats_url: str, run: str, domain: str | None, config: SyncConfig
) -> None:
    """`start` for an `AsyncLLM`."""
    from vllm.distributed.weight_transfer.base import WeightTransferInitRequest

    info = _init_info(nats_url, run, domain, config)
    await engine.init_weight_transfer_engine(WeightTransferInitRequest(init_info=info))


@dataclass(frozen=True)
class Update:
    version: int | None
    digest: str | None
    pause_s: float  # generation was stopped this long
    write_s: float  # of which the workers wrote the weights into the model


def status(llm) -> list[dict[str, Any]]:
    return llm.collective_rpc(_STATUS)


def _held(workers: list[dict[str, Any]]) -> int | None:
    versions = [s["held"] for s in workers if s["leads"]]
    return None if None in versions else min(versions)


def held(llm) -> int | None:
    """The newest version the engine can load: what its leading worker holds verified
    (the others take each version from it); None while it holds none."""
    return _held(status(llm))


async def hold_at_most_async(engine, version: int | None) -> None:
    """Let the engine's workers hold no newer version than `version` (None: the newest),
    going back to it from a snapshot if they hold a newer one: a server that is to serve
    `version`, or to serve it again after a newer one."""
    await engine.collective_rpc(_HOLD_AT_MOST, kwargs={"version": version})


async def held_async(engine) -> int | None:
    """`held` for an `AsyncLLM`."""
    return _held(await engine.collective_rpc(_STATUS))


def disagree(workers: list[dict[str, Any]]) -> None:
    """Raise unless every worker (one per device of a parallel engine) loaded the same
    version, and the digest each one computed of the tensors it handed vLLM is that
    version's state digest as the leader verified it against the manifest (`verified`;
    the followers report it as the leader sent it, so all must agree on it too). What a
    worker's digest proves, and what not: `vllm_engine.LoadedTensors`. A worker left
    behind, or fed other bits, would compute with shards of another state."""
    verified = {(s["loaded"], s["verified"]) for s in workers}
    computed = {(s["loaded"], s["digest"]) for s in workers}
    if len(verified) != 1 or computed != verified:
        found = ", ".join(f"worker {i}: {s['loaded']} {s['digest']}" for i, s in enumerate(workers))
        expected = ", ".join(f"{version} {digest}" for version, digest in sorted(verified, key=str))
        raise RuntimeError(
            f"workers disagree on the loaded version and digest: {found} (verified: {expected})"
        )


def update(llm, version: int | None = None, timeout_s: float = 300.0) -> Update:
    """Switch the model to `version` (or the newest held) once the engine holds it.

    Requests may be running: vLLM's engine core steps them on its own between our calls,
    and a step while a layer is being reloaded (meta tensors) kills the engine, so the
    scheduler is paused around the write, keeping every request where it is. Tokens
    sampled before the pause carry the old version in `CompletionOutput.weight_versions`,
    those after it the new one. Running requests then recompute their context under the
    new weights, so what they sample next is the new policy's alone, as a fresh engine
    on that version would sample it. Waiting for the version happens before the pause.
    If the write fails, or the workers disagree on what they loaded (`disagree`), the
    engine stays paused (the model's weights are unknown) and a later `update` reloads
    every tensor and resumes it.
    """
    if version is not None:
        wait_for_version(lambda: held(llm), version, timeout_s, what="vLLM's workers")
    started = time.perf_counter()
    llm.sleep(level=0, mode="keep")
    info = {"version": version, "timeout_s": timeout_s}
    writing = time.perf_counter()
    loaded = llm.collective_rpc(_UPDATE, kwargs={"update_info": info})
    written = time.perf_counter() - writing
    try:
        disagree(loaded)
    except RuntimeError:
        llm.collective_rpc(_FORGET_LOADED)  # the next update reloads every tensor
        raise
    llm.update_weight_version(str(loaded[0]["loaded"]))
    # Drops the KV the old weights computed: the prefix cache, and the running requests'
    # (they go back to the queue and recompute it).
    llm.reset_prefix_cache(reset_running_requests=True)
    llm.wake_up(tags=["scheduling"])
    return Update(loaded[0]["loaded"], loaded[0]["digest"], time.perf_counter() - started, written)


async def update_async(engine, version: int, timeout_s: float = 300.0) -> Update:
    """`update` for an `AsyncLLM` serving requests, to a version its workers hold: the
    scheduler is paused keeping every request where it is (none fails; each waits out
    the write), and resumed with the new weights. A failed write leaves it paused, as
    `update` does: a model in an unknown state serves nobody."""
    started = time.perf_counter()
    # `AsyncLLM.pause_generation` is this call and then a 20 ms sleep, for outputs in
    # flight to reach their callers first; they reach them all the same.
    await engine.engine_core.pause_scheduler_async(mode="keep", clear_cache=False)
    info = {"version": version, "timeout_s": timeout_s}
    writing = time.perf_counter()
    loaded = await engine.collective_rpc(_UPDATE, kwargs={"update_info": info})
    written = time.perf_counter() - writing
    try:
        disagree(loaded)
    except RuntimeError:
        await engine.collective_rpc(_FORGET_LOADED)
        raise
    # Neither depends on the other, and both are done before the scheduler resumes.
    await asyncio.gather(
        engine.update_weight_version(str(loaded[0]["loaded"])),
        engine.reset_prefix_cache(reset_running_requests=True),
    )
    await engine.resume_generation()
    return Update(loaded[0]["loaded"], loaded[0]["digest"], time.perf_counter() - started, written)

"""The experts vLLM routed each token to, per request, for router replay in the trainer.

vLLM returns routed experts itself only from its V2 model runner, which needs Triton,
so not on CPU. This records them in the worker: every MoE router reports its top-k ids
through vLLM's capture hook, and after each model step the rows are split among the
step's requests in the order the runner laid their tokens out. A request's record
covers every token the engine ran through the model: the prompt (which must not come
from the prefix cache, or its rows are missing) and every generated token but the last.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from typing import Any

import numpy as np

from rlfleet.weightsync import WeightsyncWorker

EXTENSION = "rlfleet.rollout.vllm_experts.RolloutWorker"


class _Recorder:
    def __init__(self, layers: int) -> None:
        self.layers = layers
        self.step: list[Any] = [None] * layers
        self.requests: dict[str, list[np.ndarray]] = {}

    def capture(self, layer: int, topk_ids) -> None:
        self.step[layer] = topk_ids

    def split(self, order: Sequence[tuple[str, int]]) -> None:
        rows = sum(count for _, count in order)
        if not rows or any(ids is None for ids in self.step):
            return
        # [tokens, layers, top_k] for this step, then each request's slice of tokens.
        step = np.stack([ids[:rows].to("cpu").numpy() for ids in self.step], axis=1)
        start = 0
        for request, count in order:
            self.requests.setdefault(request, []).append(step[start : start + count])
            start += count
        self.step = [None] * self.layers


def _external_id(internal: str) -> str:
    # The engine appends "-<8 random hex>" to the id the caller knows.
    return internal.rsplit("-", 1)[0]


class RolloutWorker(WeightsyncWorker):
    def rlfleet_experts_start(self) -> int:
        """Start recording; returns the number of MoE layers found."""
        from vllm.model_executor.layers.fused_moe.router.base_router import BaseRouter

        runner = self.model_runner
        routers: dict[int, Any] = {}
        for module in runner.model.modules():
            router = getattr(module, "router", None)
            if isinstance(router, BaseRouter) and hasattr(module, "layer_id"):
                routers.setdefault(module.layer_id, router)
        recorder = _Recorder(len(routers))
        for index, layer_id in enumerate(sorted(routers)):
            routers[layer_id].set_capture_fn(functools.partial(recorder.capture, index))
        execute = runner.execute_model

        @functools.wraps(execute)
        def execute_and_record(scheduler_output, *args, **kwargs):
            result = execute(scheduler_output, *args, **kwargs)
            counts = scheduler_output.num_scheduled_tokens
            order = [(r, counts[r]) for r in runner.input_batch.req_ids if r in counts]
            recorder.split(order)
            return result

        runner.execute_model = execute_and_record
        self._rlfleet_experts = recorder
        return recorder.layers

    def rlfleet_experts_take(self, request_ids: list[str]) -> dict[str, tuple[bytes, list[int]]]:
        """Each finished request's experts as (uint16 bytes, [tokens run, layers, k])."""
        recorder: _Recorder = self._rlfleet_experts
        wanted = set(request_ids)
        taken: dict[str, list[np.ndarray]] = {}
        for internal in list(recorder.requests):
            external = _external_id(internal)
            if external in wanted:
                taken[external] = recorder.requests.pop(internal)
        # RPC results travel as msgpack: bytes keep their size, arrays would become lists.
        joined = {key: np.concatenate(chunks).astype("<u2") for key, chunks in taken.items()}
        return {key: (ids.tobytes(), list(ids.shape)) for key, ids in joined.items()}

    def rlfleet_experts_forget(self) -> None:
        """Drop every record (requests that were aborted are never taken)."""
        self._rlfleet_experts.requests.clear()


def start(llm) -> int:
    """Record routed experts in `llm`, made with `vllm_options(worker_extension=EXTENSION)`."""
    return llm.collective_rpc("rlfleet_experts_start")[0]


def take(llm, outputs) -> list[list[np.ndarray]]:
    """Experts of each completion of each `RequestOutput`, as `uint16` [tokens - 1, layers, k]."""
    keys = [
        [r.request_id if len(r.outputs) == 1 else f"{c.index}_{r.request_id}" for c in r.outputs]
        for r in outputs
    ]
    found = llm.collective_rpc("rlfleet_experts_take", args=([k for ks in keys for k in ks],))[0]
    return [
        [np.frombuffer(found[k][0], dtype="<u2").reshape(found[k][1]) for k in ks] for ks in keys
    ]

"""The experts vLLM routed each token to, per request, for router replay in the trainer.

vLLM returns routed experts itself only from its V2 model runner, which needs Triton,
so not on CPU. This records them in the worker: every MoE router reports its top-k ids
through vLLM's capture hook, and after each model step the rows are split among the
step's requests in the order the runner laid their tokens out, by token position.

Prefix caching stays on: a request that reuses cached KV blocks never runs those
tokens, so the recorder keeps a mirror of the KV cache (experts per physical block
slot, written whenever a block is computed) and copies a new request's cached prefix
from it. A request's record covers every token it would run: the prompt and every
generated token but the last.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from typing import Any

import numpy as np

from rlfleet.weightsync import WeightsyncWorker

EXTENSION = "rlfleet.rollout.vllm_experts.RolloutWorker"


class _Record:
    """One request's experts by token position, and the KV blocks holding its tokens."""

    def __init__(self, blocks: list[int]) -> None:
        self.blocks = blocks
        self.rows: np.ndarray | None = None
        self.length = 0

    def put(self, first: int, rows: np.ndarray) -> None:
        end = first + len(rows)
        if self.rows is None or end > len(self.rows):
            grown = np.zeros((max(end, 2 * self.length, 64), *rows.shape[1:]), rows.dtype)
            if self.rows is not None:
                grown[: self.length] = self.rows[: self.length]
            self.rows = grown
        self.rows[first:end] = rows
        self.length = max(self.length, end)


class _Recorder:
    def __init__(self, layers: int, block_size: int) -> None:
        self.layers = layers
        self.block_size = block_size
        self.step: list[Any] = [None] * layers
        self.requests: dict[str, _Record] = {}
        self.kv: dict[int, np.ndarray] = {}  # physical block -> [block_size, layers, k]
        # New requests' cached prefixes, read after the step: another request of the same
        # step may be computing those very blocks (siblings of one prompt).
        self.prefixes: list[tuple[_Record, int]] = []

    def capture(self, layer: int, topk_ids) -> None:
        self.step[layer] = topk_ids

    def _spans(self, blocks: list[int], first: int, count: int):
        """(block, first slot, offset into the rows, length) covering positions first.. +count."""
        done = 0
        while done < count:
            position = first + done
            slot = position % self.block_size
            length = min(self.block_size - slot, count - done)
            yield blocks[position // self.block_size], slot, done, length
            done += length

    def _write_kv(self, blocks: list[int], first: int, rows: np.ndarray) -> None:
        for block, slot, offset, length in self._spans(blocks, first, len(rows)):
            mirror = self.kv.get(block)
            if mirror is None:
                mirror = self.kv[block] = np.zeros((self.block_size, *rows.shape[1:]), rows.dtype)
            mirror[slot : slot + length] = rows[offset : offset + length]

    def _read_kv(self, blocks: list[int], count: int) -> np.ndarray:
        return np.concatenate(
            [self.kv[b][s : s + n] for b, s, _, n in self._spans(blocks, 0, count)]
        )

    def track(self, scheduler_output) -> dict[str, int]:
        """Follow new and resumed requests' KV blocks; each request's first position this step."""
        first: dict[str, int] = {}
        for new in scheduler_output.scheduled_new_reqs:
            record = self.requests[new.req_id] = _Record(list(new.block_ids[0]))
            first[new.req_id] = new.num_computed_tokens
            if new.num_computed_tokens:  # prefix cache hit: those tokens are not run
                self.prefixes.append((record, new.num_computed_tokens))
        cached = scheduler_output.scheduled_cached_reqs
        for index, request in enumerate(cached.req_ids):
            record = self.requests.get(request)
            if record is None:
                continue
            new_blocks = cached.new_block_ids[index]
            if new_blocks is not None:
                if request in cached.resumed_req_ids:
                    record.blocks = list(new_blocks[0])
                else:
                    record.blocks.extend(new_blocks[0])
            first[request] = cached.num_computed_tokens[index]
        return first

    def split(self, order: Sequence[tuple[str, int]], first: dict[str, int]) -> None:
        rows = sum(count for _, count in order)
        if not rows or any(ids is None for ids in self.step):
            return
        # [tokens, layers, top_k] for this step, then each request's slice of tokens.
        step = np.stack([ids[:rows].to("cpu").numpy() for ids in self.step], axis=1)
        step = step.astype("<u2")
        start = 0
        for request, count in order:
            record = self.requests[request]
            chunk = step[start : start + count]
            record.put(first[request], chunk)
            self._write_kv(record.blocks, first[request], chunk)
            start += count
        self.step = [None] * self.layers
        for record, count in self.prefixes:
            record.put(0, self._read_kv(record.blocks, count))
        self.prefixes = []


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
        recorder = _Recorder(len(routers), runner.cache_config.block_size)
        for index, layer_id in enumerate(sorted(routers)):
            routers[layer_id].set_capture_fn(functools.partial(recorder.capture, index))
        execute = runner.execute_model

        @functools.wraps(execute)
        def execute_and_record(scheduler_output, *args, **kwargs):
            first = recorder.track(scheduler_output)
            result = execute(scheduler_output, *args, **kwargs)
            counts = scheduler_output.num_scheduled_tokens
            order = [(r, counts[r]) for r in runner.input_batch.req_ids if r in counts]
            recorder.split(order, first)
            return result

        runner.execute_model = execute_and_record
        self._rlfleet_experts = recorder
        return recorder.layers

    def rlfleet_experts_take(self, request_ids: list[str]) -> dict[str, tuple[bytes, list[int]]]:
        """Each finished request's experts as (uint16 bytes, [tokens run, layers, k])."""
        recorder: _Recorder = self._rlfleet_experts
        wanted = set(request_ids)
        taken: dict[str, np.ndarray] = {}
        for internal in list(recorder.requests):
            external = _external_id(internal)
            if external in wanted:
                record = recorder.requests.pop(internal)
                if record.rows is not None:
                    taken[external] = record.rows[: record.length]
        # RPC results travel as msgpack: bytes keep their size, arrays would become lists.
        return {key: (ids.tobytes(), list(ids.shape)) for key, ids in taken.items()}

    def rlfleet_experts_forget(self, request_ids: list[str]) -> None:
        """Drop the records of requests that were aborted, so never taken."""
        recorder: _Recorder = self._rlfleet_experts
        wanted = set(request_ids)
        for internal in [r for r in recorder.requests if _external_id(r) in wanted]:
            del recorder.requests[internal]


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

    def rows(key: str, prompt: int, completion) -> np.ndarray:
        ids = np.frombuffer(found[key][0], dtype="<u2").reshape(found[key][1])
        # A stop string is found after the engine has already run the next step: rows past
        # the last kept token belong to tokens that were thrown away.
        return ids[: prompt + len(completion.token_ids) - 1]

    return [
        [rows(k, len(r.prompt_token_ids), c) for k, c in zip(ks, r.outputs, strict=True)]
        for ks, r in zip(keys, outputs, strict=True)
    ]

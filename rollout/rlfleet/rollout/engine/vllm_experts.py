"""The experts vLLM routed each token to, per request, for router replay in the trainer.

vLLM returns routed experts itself only from its V2 model runner, which needs Triton,
so not on CPU. This records them in the worker: every MoE router reports its top-k ids
through vLLM's capture hook, and after each model step the rows are split among the
step's requests in the order the runner laid their tokens out, by token position.

Prefix caching stays on: a request that reuses cached KV blocks never runs those
tokens, so the recorder keeps a mirror of the KV cache (experts per physical block
slot, written whenever a block is computed) and copies a new request's cached prefix
from it. A request's record covers every token it would run: the prompt and every
generated token but the last. Records are taken by the id the caller knows: by a
rollout engine as its requests finish, by a production server's middleware (`Taker`)
for the completions it captures. A finished record nobody takes (a request another
endpoint served, one aborted, another tensor-parallel rank's copy) waits among the
last `KEEP_FINISHED` and is then dropped.
"""

from __future__ import annotations

import asyncio
import functools
import logging
from collections import OrderedDict
from collections.abc import Sequence
from typing import Any

import numpy as np

from rlfleet.weightsync import WeightsyncWorker

log = logging.getLogger(__name__)

EXTENSION = "rlfleet.rollout.engine.vllm_experts.RolloutWorker"
# Finished records kept for a take: more than one step's finished requests (a rollout
# engine takes them as they finish), and a production server's recent answers.
KEEP_FINISHED = 4096


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
        self.requests: dict[str, _Record] = {}  # running, and finished not yet told
        self.finished: OrderedDict[str, _Record] = OrderedDict()  # oldest first
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
        for request in scheduler_output.finished_req_ids:
            record = self.requests.pop(request, None)
            if record is not None:
                self.finished[request] = record
        while len(self.finished) > KEEP_FINISHED:
            self.finished.popitem(last=False)
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
        from vllm.config import CompilationMode, CUDAGraphMode
        from vllm.model_executor.layers.fused_moe.router.base_router import BaseRouter

        runner = self.model_runner
        compiled = self.vllm_config.compilation_config
        if compiled.mode != CompilationMode.NONE or compiled.cudagraph_mode != CUDAGraphMode.NONE:
            # The routers' capture hook was traced out of the graphs before it was set.
            raise RuntimeError(
                "routed experts are recorded only by an eager engine: --enforce-eager"
            )
        routers: dict[int, Any] = {}
        for module in runner.model.modules():
            router = getattr(module, "router", None)
            if isinstance(router, BaseRouter) and hasattr(module, "layer_id"):
                routers.setdefault(module.layer_id, router)
        if not routers:
            return 0  # a dense model: nothing to record
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
        """Experts of the named requests as (uint16 bytes, [tokens run, layers, k]); none for
        an id two requests share (a client may choose its request's id)."""
        recorder: _Recorder = self._rlfleet_experts
        wanted = set(request_ids)
        matches: dict[str, list[tuple[dict, str]]] = {}
        for records in (recorder.requests, recorder.finished):
            for internal in records:
                external = _external_id(internal)
                if external in wanted:
                    matches.setdefault(external, []).append((records, internal))
        taken: dict[str, np.ndarray] = {}
        for external, found in matches.items():
            records = [store.pop(internal) for store, internal in found]
            if len(records) == 1 and records[0].rows is not None:
                taken[external] = records[0].rows[: records[0].length]
        # RPC results travel as msgpack: bytes keep their size, arrays would become lists.
        return {key: (ids.tobytes(), list(ids.shape)) for key, ids in taken.items()}


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


class Taker:
    """A production server's side: its completions' experts, taken from the workers of its
    engine (vLLM's async engine client) in one call for all the completions that want
    them at once, so many answers finishing together cost the engine one call."""

    def __init__(self, engine) -> None:
        self.engine = engine
        self.layers = 0
        self._wanted: dict[str, asyncio.Future] = {}
        self._taking: asyncio.Task | None = None

    async def start(self) -> int:
        """Record in the engine's workers; the number of MoE layers (0: a dense model)."""
        self.layers = (await self.engine.collective_rpc("rlfleet_experts_start"))[0]
        return self.layers

    async def take(self, request_id: str, tokens: int) -> np.ndarray | None:
        """The experts of the finished request `request_id` that ran `tokens` tokens, as
        uint16 [tokens, layers, k]; None if the workers kept none for it."""
        if request_id in self._wanted:
            return None  # two answers with one id: neither is whose
        future = self._wanted[request_id] = asyncio.get_running_loop().create_future()
        if self._taking is None or self._taking.done():
            self._taking = asyncio.create_task(self._take_wanted())
        rows = await future
        # A stop string is found after the engine has already run the next step: rows past
        # the last kept token belong to tokens that were thrown away.
        return rows[:tokens] if rows is not None and len(rows) >= tokens else None

    async def _take_wanted(self) -> None:
        while self._wanted:  # those that came while the last call was out go in the next
            wanted, self._wanted = self._wanted, {}
            try:
                called = self.engine.collective_rpc("rlfleet_experts_take", args=(list(wanted),))
                found = (await called)[0]
            except Exception:
                log.exception("taking routed experts of %d completions", len(wanted))
                found = {}
            for request_id, future in wanted.items():
                rows = found.get(request_id)
                if not future.done():
                    future.set_result(
                        None if rows is None else np.frombuffer(rows[0], "<u2").reshape(rows[1])
                    )

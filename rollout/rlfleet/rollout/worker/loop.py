"""The rollout worker: tasks from a JetStream work queue in, trajectories out.

Each task becomes a group of attempts (GRPO), each attempt a session in a fresh sandbox
holding its own copy of the task's starting state, claimed from the worker's environment
pool (`envclient.pool`), all driven through one vLLM engine.
A task message is acknowledged only once its whole group is published, so a worker
that dies loses nothing: the task is redelivered and run again; the trajectories'
message ids (group and attempt) let JetStream drop copies published twice.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import time
import zlib
from pathlib import Path

import msgspec
import nats.errors

from rlfleet.api.wire import (
    Task,
    TaskMessage,
    Trajectory,
    decode_task_message,
    encode_trajectory,
    task_stream,
    trajectory_id,
    trajectory_stream,
    trajectory_subject,
)
from rlfleet.bus import connection
from rlfleet.bus.patience import TRANSIENT
from rlfleet.bus.streams import (
    TASK_MAX_DELIVER,
    WORKER_ACK_WAIT_S,
    WORKER_CONSUMER,
    bind_consumer,
    bind_stream,
)
from rlfleet.launch.settings import WorkerConfig
from rlfleet.rollout.engine import metrics
from rlfleet.rollout.engine.driver import Engine
from rlfleet.rollout.environment import envclient, plugins
from rlfleet.rollout.environment.endpoint import Endpoint
from rlfleet.rollout.environment.envclient import EnvClient
from rlfleet.rollout.environment.plugins import Attempt, EpisodeFailed
from rlfleet.rollout.worker import layout
from rlfleet.rollout.worker.layout import Layout
from rlfleet.weightsync import WeightStream, vllm_options, vllm_start

log = logging.getLogger(__name__)

# A task waits this long for the policy version it needs (a trainer restarting from its
# checkpoint takes minutes); then it goes back to the queue, to be tried again.
VERSION_WAIT_S = 1800.0


def engine_options() -> dict:
    """What a rollout engine needs besides its sizes: weights that follow the trainer, the
    experts each token was routed to, and each sampled token's log-prob under the
    temperature it was sampled at (vLLM's default, raw log-probs, ignores temperature,
    and the trainer's off-policy correction divides by that log-prob). The processed
    log-prob also takes in every other sampling change (min_tokens, penalties, top-p),
    which the trainer does not make: sessions set the temperature and nothing else."""
    from rlfleet.rollout.engine.vllm_experts import EXTENSION

    return {"logprobs_mode": "processed_logprobs", **vllm_options(worker_extension=EXTENSION)}


def engine_layout(config: WorkerConfig) -> Layout:
    """The layout for this worker's model on the devices this process sees."""
    from vllm.platforms import current_platform

    model = Path(config.model)
    weight_bytes = sum(f.stat().st_size for f in model.glob("*.safetensors"))
    heads = json.loads((model / "config.json").read_text())["num_attention_heads"]
    gpus = current_platform.device_count() if current_platform.is_cuda_alike() else 0
    gpu_bytes = current_platform.get_device_total_memory(0) if gpus else 0
    return layout.choose(weight_bytes, gpus, gpu_bytes, heads, config.tensor_parallel)


def parallel_options(tensor_parallel: int) -> dict:
    """`vllm.LLM` arguments for an engine over `tensor_parallel` workers. On the CPU backend
    each worker is bound to its own share of this process's cores (vLLM would want a NUMA
    node per worker), unless VLLM_CPU_OMP_THREADS_BIND already says where."""
    from vllm.platforms import current_platform

    if tensor_parallel == 1:
        return {}
    if current_platform.is_cpu() and "VLLM_CPU_OMP_THREADS_BIND" not in os.environ:
        binds = layout.cpu_binds(sorted(os.sched_getaffinity(0)), tensor_parallel)
        os.environ["VLLM_CPU_OMP_THREADS_BIND"] = binds  # read by the engine's processes
    return {"tensor_parallel_size": tensor_parallel, "distributed_executor_backend": "mp"}


# vLLM's own step budget on CPU, in tokens; a step must hold a whole prompt (below).
CPU_STEP_TOKENS = 4096


def prefill_options(max_model_len: int) -> dict:
    """On the CPU backend, a prompt is never split across steps. After a step that ran
    part of a seeded request's prompt, vLLM rewinds that request's generator, which
    torch's CPU generator cannot do: the engine dies ("CPU Generator does not use
    offset"). Sessions seed every request; it struck when a weight update sent 42
    running requests back to recompute their context at once, beyond a step's budget."""
    from vllm.platforms import current_platform

    if not current_platform.is_cpu():
        return {}
    return {
        "enable_chunked_prefill": False,
        "max_num_batched_tokens": max(max_model_len, CPU_STEP_TOKENS),
    }


def make_llm(config: WorkerConfig, tensor_parallel: int = 1):
    from vllm import LLM

    return LLM(
        model=config.model,
        dtype=config.dtype,
        max_model_len=config.max_model_len,
        enforce_eager=True,
        seed=config.seed,
        enable_prefix_caching=config.prefix_caching,
        **parallel_options(tensor_parallel),
        **prefill_options(config.max_model_len),
        **engine_options(),
    )


def start_failure(error: BaseException) -> str:
    """Why an engine did not start, in one line: a compiler's `error:` line anywhere in the
    exception's chain (torch inductor's C++ build), else the innermost cause's message."""
    chain = [error]
    while (inner := chain[-1].__cause__ or chain[-1].__context__) and inner not in chain:
        chain.append(inner)
    for found in chain:
        for line in str(found).splitlines():
            if "error:" in line:
                return f"{type(found).__name__}: {line.strip()}"
    innermost = chain[-1]
    first = next((line.strip() for line in str(innermost).splitlines() if line.strip()), "")
    return f"{type(innermost).__name__}: {first}"


def groups_to_take(running: int, max_sessions: int, group_size: int) -> int:
    """How many groups to fetch with `running` sessions under way. A group is never split,
    so one larger than `max_sessions` runs alone rather than never."""
    if group_size > max_sessions:
        return 0 if running else 1
    return max(0, max_sessions - running) // group_size


def read_task(data: bytes, run: str) -> TaskMessage:
    """A task message of this run; msgspec.DecodeError or ValueError, saying why, if not."""
    task = decode_task_message(data)
    if task.run != run:
        raise ValueError(f"task for run {task.run!r}, not {run!r}")
    return task


class Worker:
    def __init__(self, config: WorkerConfig, layout: Layout) -> None:
        self.config = config
        self.layout = layout  # of this worker's one engine (`layout.engines` is 1)
        self.stopping = asyncio.Event()
        # Made first, so that a setting it refuses stops the worker before its engine.
        self.environment = plugins.load(config.environment)
        self.environment.start(config)
        self.engine: Engine | None = None
        self.endpoint: Endpoint | None = None  # where harnesses reach the engine
        self.pool: EnvClient | None = None  # where attempts claim sandboxes
        self._failures_logged: set[str] = set()  # each reason is logged once
        self.sessions = 0  # running now
        self._groups: set[asyncio.Task] = set()
        self.ack_wait_s = WORKER_ACK_WAIT_S  # its consumer's, once bound

    async def run(self) -> None:
        config = self.config
        tensor_parallel = self.layout.tensor_parallel
        log.info("vLLM engine over %d workers: %s", tensor_parallel, self.layout.reason)
        metrics.engine_workers.set(tensor_parallel)
        try:
            llm = await asyncio.to_thread(make_llm, config, tensor_parallel)
        except Exception as error:
            log.exception("the vLLM engine failed to start")
            # vLLM's own last words only point above; the log's last line says why.
            log.error("vLLM engine did not start: %s", start_failure(error))
            raise SystemExit(1) from None
        self.engine = Engine(llm, follow_weights=config.follow_weights)
        environment = config.environment
        self.endpoint = Endpoint(
            self.engine, config.session, environment.tool_call_parser, config.model
        )
        await self.endpoint.start()
        try:
            async with envclient.pool(config.envpool, config.limits, config.max_sessions) as pool:
                self.pool = pool
                await self._serve(llm, self.engine)
        finally:
            await self.endpoint.close()

    async def _serve(self, llm, engine: Engine) -> None:
        config = self.config
        nc = await connection.connect(config.nats_url, max_reconnect_attempts=-1)
        try:
            js = nc.jetstream(domain=config.jetstream_domain)
            for stream in (task_stream(config.run), trajectory_stream(config.run)):
                await bind_stream(js, stream)
            if config.follow_weights:  # before the engine starts polling what this starts
                weights = WeightStream(nc, config.run, config.weightsync, self._weights_domain())
                await weights.bind()
                await engine.call(
                    vllm_start, llm, config.nats_url, config.run, weights.domain, weights.config
                )
            await engine.start()
            if config.follow_weights and config.start_version is not None:
                log.info("waiting for policy version %d", config.start_version)
                await engine.wait_for_version(config.start_version, timeout_s=3600)
            # The run's owner made the queue's consumer: its ack wait is the one kept to.
            stream = task_stream(config.run)
            consumer = await bind_consumer(js, stream, WORKER_CONSUMER)
            self.ack_wait_s = consumer.config.ack_wait or self.ack_wait_s
            queue = await js.pull_subscribe_bind(durable=WORKER_CONSUMER, stream=stream)
            log.info("worker %s taking tasks of run %s", config.name, config.run)
            while not self.stopping.is_set() and engine.failed is None:
                await self._take(queue, js)
            if engine.failed is not None:
                await self._give_back(engine.failed)
            # Finish what was taken: it is acknowledged only when published.
            log.info("stopping: finishing %d groups under way", len(self._groups))
            await asyncio.gather(*self._groups, return_exceptions=True)
        finally:
            await engine.close()
            await nc.close()

    async def _give_back(self, failure: BaseException) -> None:
        """The engine is gone: the groups under way fail and are handed back (nak) for
        another worker, and the worker exits, so that its pod starts a fresh engine."""
        log.error(
            "vLLM engine failed (%s): giving back %d groups and exiting", failure, len(self._groups)
        )
        await asyncio.gather(*self._groups, return_exceptions=True)
        raise SystemExit(1)

    def _weights_domain(self) -> str | None:
        """Where this worker reads weights: its region's mirror of the hub's stream."""
        hub, region = self.config.jetstream_domain, self.config.weights_domain
        return hub if hub is None or region is None else region

    async def _take(self, queue, js) -> None:
        wanted = groups_to_take(self.sessions, self.config.max_sessions, self.config.group_size)
        if not wanted:
            await asyncio.sleep(0.05)
            return
        try:
            messages = await queue.fetch(wanted, timeout=1)
        except (TimeoutError, nats.errors.TimeoutError):  # nothing yet
            return
        except TRANSIENT as error:  # NATS restarting: the loop comes round again
            log.warning("fetching: %r", error)
            await asyncio.sleep(1)
            return
        for message in messages:
            group = asyncio.create_task(self._group(message, js))
            self._groups.add(group)
            group.add_done_callback(self._groups.discard)
        # Each group counts its sessions before its first await: let them, so the next
        # fetch sees them (it once took a second group into a full worker).
        await asyncio.sleep(0)

    async def _group(self, message, js) -> None:
        try:
            task = read_task(message.data, self.config.run)
            self.environment.check(task.task, self.config)
        except (msgspec.DecodeError, ValueError) as error:
            log.warning("rejected task message %s: %s", message.metadata.sequence.stream, error)
            metrics.tasks_rejected.inc()
            await message.term()
            return
        size = task.group_size or self.config.group_size
        self.sessions += size
        heartbeat = asyncio.create_task(self._keep_alive(message))
        try:
            await self._await_version(task.min_policy_version)
            group_id = f"{task.task.id}@{message.metadata.sequence.stream}"
            trajectories = await self._attempts(task.task, group_id, size)
            for trajectory in trajectories:
                await js.publish(
                    trajectory_subject(self.config.run),
                    encode_trajectory(trajectory),
                    headers={"Nats-Msg-Id": trajectory_id(trajectory)},
                )
                metrics.trajectories.inc()
            await message.ack()
        except Exception as error:  # an ExceptionGroup from the attempts included
            tries = message.metadata.num_delivered
            failed = "task %s failed (try %d of %d)"
            if _episodes_failed(error):  # each reason was logged once, as it was counted
                log.debug(failed, task.task.id, tries, TASK_MAX_DELIVER, exc_info=True)
            else:
                log.exception(failed, task.task.id, tries, TASK_MAX_DELIVER)
            await message.nak(delay=5)
        finally:
            heartbeat.cancel()
            self.sessions -= size

    async def _await_version(self, version: int) -> None:
        """Hold the task (and its sessions' places) until the engine runs `version`: the
        trainer would drop as stale what an older version made of it."""
        assert self.engine is not None
        if not self.config.follow_weights or self.engine.version >= version:
            return  # an engine that follows no weights has only the version it loaded
        started = time.perf_counter()
        with metrics.awaiting_version.track_inprogress():
            await self.engine.wait_for_version(version, timeout_s=VERSION_WAIT_S)
        metrics.version_wait.inc(time.perf_counter() - started)

    async def _keep_alive(self, message) -> None:
        while True:
            await asyncio.sleep(self.ack_wait_s / 3)
            await message.in_progress()

    async def _attempts(self, task: Task, group_id: str, size: int) -> list[Trajectory]:
        # One attempt failing cancels the others: the group is retried as a whole.
        async with asyncio.TaskGroup() as attempts:
            running = [
                attempts.create_task(self._attempt(task, group_id, size, i)) for i in range(size)
            ]
        return [attempt.result() for attempt in running]

    async def _attempt(self, task: Task, group_id: str, size: int, index: int) -> Trajectory:
        assert self.engine is not None and self.endpoint is not None
        seed = zlib.crc32(f"{self.config.seed}/{group_id}/{index}".encode())
        attempt = Attempt(
            task, group_id, index, seed, self.config, self.engine, self.endpoint, self.pool
        )
        try:
            result = await self.environment.attempt(attempt)
        except EpisodeFailed as failed:
            metrics.episodes_failed.labels(failed.reason).inc()
            if failed.reason not in self._failures_logged:
                self._failures_logged.add(failed.reason)
                log.warning(
                    "%s #%d: episode failed (logged once per reason): %s", group_id, index, failed
                )
            raise
        reward = result.reward
        metrics.sessions.labels(result.ended).inc()
        if reward.reason:
            log.info("%s #%d: reward %.2f, %s", group_id, index, reward.value, reward.reason)
        return Trajectory(
            run=self.config.run,
            task_id=task.id,
            group_id=group_id,
            group_size=size,
            attempt=index,
            reward=reward.value,
            reward_breakdown=reward.breakdown,
            segments=result.segments,
            worker=self.config.name,
            created_at=time.time(),
        )


def _episodes_failed(error: BaseException) -> bool:
    """Whether every failure in `error` (a group's attempts') is an EpisodeFailed."""
    if isinstance(error, BaseExceptionGroup):
        return all(_episodes_failed(inner) for inner in error.exceptions)
    return isinstance(error, EpisodeFailed)

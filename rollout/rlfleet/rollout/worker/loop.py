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
import contextlib
import json
import logging
import os
import time
import zlib
from dataclasses import dataclass
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
from rlfleet.rollout.environment import envclient, rewards
from rlfleet.rollout.environment.envclient import ClaimTimeout, EnvClient, RemoteSandbox
from rlfleet.rollout.environment.sandbox import Sandbox, SandboxClosed
from rlfleet.rollout.environment.session import Episode, Session
from rlfleet.rollout.environment.tasks import start_files
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


@dataclass(frozen=True)
class _Group:
    task: Task
    scorer: rewards.Scorer
    start: dict[str, bytes]  # the task's starting tree, copied into each attempt's sandbox
    id: str
    size: int


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
        self.engine: Engine | None = None
        self.pool: EnvClient | None = None  # where attempts claim sandboxes
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
        async with envclient.pool(config.envpool, config.limits, config.max_sessions) as pool:
            self.pool = pool
            await self._serve(llm, self.engine)

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
            grading = rewards.Grading(
                self.pool, self.config.limits, self.config.rewards.judge_endpoint
            )
            scorer = rewards.scorer_for(task.task, self.config.rewards.weights, grading)
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
            trajectories = await self._attempts(task.task, scorer, group_id, size)
            for trajectory in trajectories:
                await js.publish(
                    trajectory_subject(self.config.run),
                    encode_trajectory(trajectory),
                    headers={"Nats-Msg-Id": trajectory_id(trajectory)},
                )
                metrics.trajectories.inc()
            await message.ack()
        except Exception:  # an ExceptionGroup from the attempts included
            tries = message.metadata.num_delivered
            log.exception("task %s failed (try %d of %d)", task.task.id, tries, TASK_MAX_DELIVER)
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

    async def _attempts(
        self, task: Task, scorer: rewards.Scorer, group_id: str, size: int
    ) -> list[Trajectory]:
        group = _Group(task, scorer, start_files(task), group_id, size)
        # One attempt failing cancels the others: the group is retried as a whole.
        async with asyncio.TaskGroup() as attempts:
            running = [attempts.create_task(self._attempt(group, i)) for i in range(size)]
        return [attempt.result() for attempt in running]

    async def _attempt(self, group: _Group, attempt: int) -> Trajectory:
        task, group_id = group.task, group.id
        assert self.engine is not None
        # A bare question has no tools, so nothing for a sandbox to run.
        sandbox = await self._claim(task, group.start) if task.tools else None
        async with sandbox or contextlib.nullcontext():
            seed = zlib.crc32(f"{self.config.seed}/{group_id}/{attempt}".encode())
            episode = await Session(self.engine, task, sandbox, self.config.session, seed).run()
            reward = await self._grade(task, group.scorer, episode, sandbox)
        metrics.sessions.labels(episode.ended).inc()
        if "cheat" in reward.reason:
            metrics.cheats.inc()
        if reward.reason:
            log.info("%s #%d: reward %.2f, %s", group_id, attempt, reward.value, reward.reason)
        return Trajectory(
            run=self.config.run,
            task_id=task.id,
            group_id=group_id,
            group_size=group.size,
            attempt=attempt,
            reward=reward.value,
            reward_breakdown=reward.breakdown,
            segments=episode.segments,
            worker=self.config.name,
            created_at=time.time(),
        )

    async def _claim(self, task: Task, start: dict[str, bytes]) -> RemoteSandbox:
        """A sandbox from the pool holding a copy of `start` over a fork of the task's
        environment. Raises if there is no pool, the environment's set-up fails, or no
        sandbox comes free in time: the attempt fails, and its group goes back to the queue."""
        if self.pool is None:
            raise envclient.NoPool("a task uses tools, and this worker has no environment pool")
        environment = await self.pool.environment(task.environment)
        started = time.perf_counter()
        try:
            sandbox = await self.pool.create(start, self.config.limits, snapshot=environment)
        except ClaimTimeout:
            metrics.claim_timeouts.inc()
            raise
        metrics.sandbox_claim.observe(time.perf_counter() - started)
        return sandbox

    async def _grade(
        self, task: Task, scorer: rewards.Scorer, episode: Episode, sandbox: Sandbox | None
    ) -> rewards.Reward:
        if episode.ended == "sandbox":
            return rewards.Reward(0.0, {"sandbox_stopped": 1.0}, f"sandbox: {episode.error}")
        try:
            files = {} if sandbox is None else await rewards.archive(sandbox)
        except (rewards.ArchiveError, SandboxClosed) as error:  # the agent can cause both
            return rewards.Reward(0.0, {"archive_failed": 1.0}, f"archive: {error}")
        outcome = rewards.Outcome(episode.answer, files, episode.transcript)
        return await rewards.grade(task, outcome, scorer)

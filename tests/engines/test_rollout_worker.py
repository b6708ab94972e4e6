"""The rollout worker process: real vLLM, real sandboxes, tasks and trajectories over
real NATS JetStream (through a region's leaf node), weights through weightsync."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
import time
import urllib.request
import uuid
from collections.abc import Iterator
from pathlib import Path

import msgspec
import nats
import nats.js.errors
import psutil
import pytest
import rollout_scripts
import torch
from conftest import wait_for
from rollout_scripts import ABUSE, HAPPY, SUMMARY, SUMMARY_TASK
from transformers import AutoTokenizer

from rlfleet.api.wire import (
    TaskMessage,
    Trajectory,
    decode_trajectory,
    encode,
    task_stream,
    task_subject,
    trajectory_stream,
    trajectory_subject,
)
from rlfleet.bus.streams import WORKER_CONSUMER, ensure_run_streams
from rlfleet.local.nats import HUB_DOMAIN, StandaloneNats
from rlfleet.local.processes import free_port
from rlfleet.models.tiny import init_model, read_weights
from rlfleet.rollout.environment.session import SUMMARY_HEADER, window_text
from rlfleet.rollout.environment.tasks import SUITES, load_suite
from rlfleet.trainer.validation import ModelShape, problem
from rlfleet.weightsync import Publisher, SyncConfig, WeightStream

SYNC = SyncConfig(snapshot_every=4)
SHAPE = ModelShape(vocab_size=320, moe_layers=2, num_experts=8, top_k=2)


class WorkerUnderTest:
    def __init__(self, root: Path, servers: StandaloneNats) -> None:
        self.run = f"r{uuid.uuid4().hex[:8]}"
        self.hub = servers.bed.hub
        self.model = init_model("tiny-moe", root / "model")
        self.tokenizer = AutoTokenizer.from_pretrained(self.model)
        self.session = rollout_scripts.teach(self.model, self.tokenizer)
        self.metrics_port = free_port()
        self.config = root / "worker.json"
        self.config.write_text(
            json.dumps(
                {
                    "run": self.run,
                    "nats_url": servers.bed.leaves[servers.region].url,
                    "jetstream_domain": HUB_DOMAIN,
                    "model": str(self.model),
                    "max_sessions": 16,
                    "group_size": 2,
                    "max_model_len": 2048,
                    "session": {
                        "max_turns": self.session.max_turns,
                        "turn_tokens": self.session.turn_tokens,
                        "context_tokens": self.session.context_tokens,
                        "summary_tokens": self.session.summary_tokens,
                        "temperature": 0.0,
                    },
                    "limits": msgspec.to_builtins(rollout_scripts.LIMITS),
                    "metrics_port": self.metrics_port,
                    "weightsync": {"snapshot_every": SYNC.snapshot_every},
                }
            )
        )
        self.log = root / "worker.log"
        self.loop = asyncio.new_event_loop()
        self.nc = self.loop.run_until_complete(self.hub.connect())
        self.js = self.nc.jetstream(domain=HUB_DOMAIN)
        self.loop.run_until_complete(ensure_run_streams(self.nc, self.run, HUB_DOMAIN))
        # Durable: the server deletes an ephemeral consumer idle for 5 s (no fetch pending,
        # as while a test publishes weights on a busy machine), and every later fetch in
        # the module would then fail with ServiceUnavailable.
        self.trajectories = self.loop.run_until_complete(
            self.js.pull_subscribe(
                trajectory_subject(self.run), durable="tests", stream=trajectory_stream(self.run)
            )
        )
        self.publisher = Publisher(WeightStream(self.nc, self.run, SYNC, domain=HUB_DOMAIN), SYNC)
        # The groups of the test running: `collect` passes over the rest, which a test that
        # failed may have left running, so that one failure stays one.
        self.groups: set[str] = set()
        self.publish_weights(read_weights(self.model), 0)
        env = os.environ | servers.bed.leaves[servers.region].client_env()
        env |= {"VLLM_CPU_KVCACHE_SPACE": "1", "TOKENIZERS_PARALLELISM": "false"}
        with self.log.open("w") as log:
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "rlfleet.rollout", str(self.config)],
                env=env,
                stdout=log,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )

    def publish_weights(self, tensors: dict[str, torch.Tensor], version: int) -> None:
        self.loop.run_until_complete(self.publisher.publish(tensors, version))

    def publish_tasks(self, *tasks, group_size: int = 2, min_policy_version: int = 0) -> list[int]:
        """Publishes the tasks; their messages' stream sequences."""

        async def publish() -> list[int]:
            sequences = []
            for task in tasks:
                message = TaskMessage(
                    run=self.run,
                    task=task,
                    group_size=group_size,
                    min_policy_version=min_policy_version,
                )
                ack = await self.js.publish(task_subject(self.run), encode(message))
                self.groups.add(f"{task.id}@{ack.seq}")
                sequences.append(ack.seq)
            return sequences

        return self.loop.run_until_complete(publish())

    def publish_raw(self, payload: bytes) -> None:
        self.loop.run_until_complete(self.js.publish(task_subject(self.run), payload))

    def collect(self, count: int, timeout_s: float = 600) -> list[Trajectory]:
        async def fetch() -> list[Trajectory]:
            found: list[Trajectory] = []
            deadline = time.monotonic() + timeout_s
            while len(found) < count:
                assert self.proc.poll() is None, self.log.read_text()[-5000:]
                assert time.monotonic() < deadline, self.log.read_text()[-5000:]
                try:
                    messages = await self.trajectories.fetch(count - len(found), timeout=2)
                except (TimeoutError, nats.errors.TimeoutError):
                    continue
                for message in messages:
                    trajectory = decode_trajectory(message.data)
                    if trajectory.group_id in self.groups:
                        found.append(trajectory)
                    await message.ack()
            return found

        return self.loop.run_until_complete(fetch())

    def metric(self, name: str) -> float:
        url = f"http://127.0.0.1:{self.metrics_port}/metrics"
        with urllib.request.urlopen(url, timeout=5) as response:
            for line in response.read().decode().splitlines():
                if line.startswith(name + " "):
                    return float(line.split()[1])
        raise AssertionError(f"no metric {name}")

    def text(self, tokens: list[int]) -> str:
        return self.tokenizer.decode(tokens)

    def stop(self) -> None:
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(60)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait()
        self.loop.run_until_complete(self.nc.close())
        self.loop.close()


@pytest.fixture(scope="module")
def worker(
    tmp_path_factory: pytest.TempPathFactory, nats_servers: StandaloneNats
) -> Iterator[WorkerUnderTest]:
    under_test = WorkerUnderTest(tmp_path_factory.mktemp("rollout-worker"), nats_servers)
    try:
        yield under_test
    finally:
        under_test.stop()


@pytest.fixture(autouse=True)
def own_groups(request: pytest.FixtureRequest) -> None:
    if "worker" in request.fixturenames:
        request.getfixturevalue("worker").groups.clear()


def by_task(trajectories: list[Trajectory]) -> dict[str, list[Trajectory]]:
    found: dict[str, list[Trajectory]] = {}
    for trajectory in trajectories:
        found.setdefault(trajectory.task_id, []).append(trajectory)
    return found


def observations(worker: WorkerUnderTest, trajectory: Trajectory) -> str:
    """Every token the harness inserted, decoded."""
    return "".join(
        worker.text(
            [t for t, g in zip(s.tokens[s.prompt_len :], s.generated, strict=True) if not g]
        )
        for s in trajectory.segments
    )


def transcript(worker: WorkerUnderTest, trajectory: Trajectory) -> str:
    """The whole session as the model saw it, to show when an assertion fails."""
    return "\n---\n".join(worker.text(s.tokens) for s in trajectory.segments)


def test_scripted_sessions_write_run_submit_survive_abuse_and_summarise(
    worker: WorkerUnderTest,
) -> None:
    worker.publish_tasks(HAPPY, ABUSE, SUMMARY_TASK)
    found = by_task(worker.collect(6))
    assert {len(v) for v in found.values()} == {2}
    for trajectory in [t for ts in found.values() for t in ts]:
        assert trajectory.worker == "rollout-0" and trajectory.group_size == 2
        assert problem(trajectory, SHAPE, worker.run, needs_experts=True) is None
        for segment in trajectory.segments:
            assert segment.moe_layers == 2 and segment.top_k == 2
            assert set(segment.versions) == {0}
            assert len(segment.tokens) <= worker.session.context_tokens

    # A malformed call is an error observation; then a file written, a command run, a submit.
    for happy in found[HAPPY.id]:
        assert happy.reward == 1.0, happy.reward_breakdown
        assert happy.reward_breakdown == {"cheat": 0.0, "exactAnswer": 1.0, "hiddenTests": 1.0}
        shown = observations(worker, happy)
        assert "error: invalid tool call" in shown, transcript(worker, happy)
        assert "wrote 6 bytes to a.txt" in shown and "exit code 0\nhello" in shown
        assert len(happy.segments) == 1

    # The network is unreachable, the fork bomb and the endless command are stopped at the
    # call's deadline, the file size limit kills the disk filler; the session goes on.
    for abuse in found[ABUSE.id]:
        shown, whole = observations(worker, abuse), transcript(worker, abuse)
        assert "Network is unreachable" in shown, whole
        limit = rollout_scripts.LIMITS.call_seconds
        assert shown.count(f"error: timed out after {limit:.1f}s") == 2, whole
        assert "File size limit exceeded\n153" in shown, whole  # 128 + SIGXFSZ
        assert abuse.reward == 1.0, (abuse.reward_breakdown, whole)

    # The summary script overflows its context after two turns: it summarises, goes on in a
    # fresh window that starts from the summary, and finishes; both windows get the reward.
    for summarised in found[SUMMARY_TASK.id]:
        first, second = summarised.segments
        assert worker.text(first.tokens).endswith(SUMMARY + "<|im_end|>")
        assert SUMMARY_HEADER + SUMMARY in worker.text(second.tokens[: second.prompt_len])
        assert summarised.reward == 1.0, summarised.reward_breakdown
    assert worker.proc.poll() is None


def test_a_weight_update_mid_run_is_recorded_per_token(worker: WorkerUnderTest) -> None:
    toy = load_suite(SUITES / "toy.jsonl")[:8]
    worker.publish_tasks(*toy)
    early = worker.collect(1)
    worker.publish_weights(nudged(worker), 1)
    # Tasks that need the new version: the first batch may all finish before it lands
    # (sandboxes come warm from the pool, so attempts are quick).
    worker.publish_tasks(*toy[:2], min_policy_version=1)
    rest = worker.collect(2 * len(toy) + 3)
    versions = []
    for trajectory in early + rest:
        assert problem(trajectory, SHAPE, worker.run, needs_experts=True) is None
        for segment in trajectory.segments:
            generated = [v for v, g in zip(segment.versions, segment.generated, strict=True) if g]
            assert generated == sorted(generated)  # a version never goes back
            versions += generated
    assert set(versions) == {0, 1}
    assert early[0].policy_version == 0
    assert worker.metric("rlfleet_rollout_policy_version") == 1.0


def nudged(worker: WorkerUnderTest) -> dict[str, torch.Tensor]:
    """A trainer's next version: every weight moved a little."""
    return {
        name: (t.float() + 1e-3 * torch.randn_like(t.float())).to(t.dtype)
        for name, t in read_weights(worker.model).items()
    }


def test_a_task_for_a_newer_policy_waits_for_it(worker: WorkerUnderTest) -> None:
    held = worker.metric("rlfleet_rollout_policy_version")
    wanted = int(held) + 1
    task = load_suite(SUITES / "toy.jsonl")[0]
    worker.publish_tasks(task, min_policy_version=wanted)
    wait_for(
        "the worker to hold the task for the next version",
        lambda: worker.metric("rlfleet_rollout_tasks_awaiting_version") == 1.0,
    )
    worker.publish_weights(nudged(worker), wanted)
    group = worker.collect(2)
    for trajectory in group:
        assert trajectory.policy_version == wanted  # nothing of the older policy in it
    assert worker.metric("rlfleet_rollout_tasks_awaiting_version") == 0.0
    assert worker.metric("rlfleet_rollout_version_wait_seconds_total") > 0


def test_a_bare_question_is_asked_without_the_tool_protocol_or_a_sandbox(
    worker: WorkerUnderTest,
) -> None:
    [question] = load_suite(SUITES / "rules.jsonl")[:1]
    sandboxes = worker.metric("rlfleet_rollout_sandbox_claim_seconds_count")
    worker.publish_tasks(question)
    for trajectory in worker.collect(2):
        [segment] = trajectory.segments  # one turn: its text is the answer
        prompt = worker.text(segment.tokens[: segment.prompt_len])
        assert prompt == window_text(question.prompt, tools=False)
        assert "<|im_start|>system" not in prompt and "<tool>" not in prompt
        assert "exactAnswer" in trajectory.reward_breakdown  # graded against the task's answer
    assert worker.metric("rlfleet_rollout_sandbox_claim_seconds_count") == sandboxes


def test_a_malformed_task_is_rejected_and_counted(worker: WorkerUnderTest) -> None:
    before = worker.metric("rlfleet_rollout_tasks_rejected_total")
    worker.publish_raw(b'{"schema": "rlfleet.io/rollout-task/v1", "run": 7}')
    worker.publish_tasks(HAPPY)
    assert {t.task_id for t in worker.collect(2)} == {HAPPY.id}
    assert worker.metric("rlfleet_rollout_tasks_rejected_total") == before + 1


# Last: it ends the module's worker.
def test_a_worker_whose_engine_core_dies_gives_its_task_back_and_exits(
    worker: WorkerUnderTest,
) -> None:
    """vLLM's engine core can die under a worker (a GPU fault, the OOM killer), and vLLM's
    client then answers nothing ever again. The worker must not sit on its tasks looking
    alive: it gives back what it holds and exits with the cause, so that its pod starts a
    fresh engine and another worker takes the task."""
    # The task waits for a version that never comes: it is held when the core dies.
    [sequence] = worker.publish_tasks(HAPPY, min_policy_version=99)

    async def consumer():
        return await worker.js.consumer_info(task_stream(worker.run), WORKER_CONSUMER)

    def held() -> bool:
        try:
            info = worker.loop.run_until_complete(consumer())
        except nats.js.errors.NotFoundError:  # the worker is still starting
            return False
        # Delivered and not acknowledged (what an earlier test left may be held beside it).
        return info.delivered.stream_seq >= sequence > info.ack_floor.stream_seq

    wait_for("the task held", held, timeout=300)
    (core,) = [
        p
        for p in psutil.Process(worker.proc.pid).children(recursive=True)
        if "EngineCore" in " ".join(p.cmdline()) or "EngineCore" in p.name()
    ]
    # Stopped first, so that the worker's next call into vLLM is under way when it dies:
    # vLLM's client never answers that one.
    core.suspend()
    time.sleep(2)
    core.kill()
    assert worker.proc.wait(timeout=120) == 1
    log = worker.log.read_text()
    said = "vLLM engine failed (vLLM's engine core exited): giving back"
    assert said in log and "task happy failed (try 1 of 5)" in log, log[-3000:]
    # Given back, not acknowledged: still the run's to do.
    info = worker.loop.run_until_complete(consumer())
    assert info.ack_floor.stream_seq < info.delivered.stream_seq

"""A user's environment through the rollout worker: a harness written against the OpenAI
SDK drives real vLLM through the worker's episode endpoint, with the model's own chat
template and vLLM's tool-call parser, and its episodes reach NATS as trajectories of
exactly the tokens sampled. Each way a harness can go wrong fails its episode, counted."""

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

import nats.errors
import pytest
from conftest import wait_for
from harness_cases import case
from rlfleet_lookup import LOOKUP
from transformers import AutoTokenizer

from rlfleet.api.wire import (
    TaskMessage,
    Trajectory,
    decode_trajectory,
    encode,
    task_subject,
    trajectory_stream,
    trajectory_subject,
)
from rlfleet.bus.streams import ensure_run_streams
from rlfleet.local.nats import HUB_DOMAIN, StandaloneNats
from rlfleet.local.processes import free_port
from rlfleet.models.tiny import fine_tune, init_model
from rlfleet.trainer.validation import ModelShape, problem

SHAPE = ModelShape(vocab_size=320, moe_layers=2, num_experts=8, top_k=2)
HERE = Path(__file__).parent
CALL = '<tool_call>\n{"name": "lookup", "arguments": {"word": "apple"}}\n</tool_call>'
MAX_CALLS = 4  # the session's turn cap
EPISODE_S = 20.0


def conversation(tokenizer) -> tuple[str, str]:
    """The lookup of apple as the template renders it: up to the model's first turn, and
    the whole exchange up to its answer."""
    question = [{"role": "user", "content": "What is the secret number of apple?"}]
    call = {"id": "c", "type": "function", "function": {"name": "lookup", "arguments": ""}}
    call["function"]["arguments"] = json.dumps({"word": "apple"})
    answered = [
        *question,
        {"role": "assistant", "content": None, "tool_calls": [call]},
        {"role": "tool", "tool_call_id": "c", "content": "7"},
    ]

    def render(messages: list[dict]) -> str:
        return tokenizer.apply_chat_template(
            messages, tools=[LOOKUP], add_generation_prompt=True, tokenize=False
        )

    return render(question), render(answered)


def teach(model: Path, tokenizer) -> str:
    """Teaches the tiny model to look apple up and answer 7; the whole episode's text."""
    opening, answered = conversation(tokenizer)
    called = opening + CALL + "<|im_end|>"
    assert answered.startswith(called)
    example = [(opening, False), (CALL + "<|im_end|>", True)]
    example += [(answered[len(called) :], False), ("7<|im_end|>", True)]
    fine_tune(model, [example], steps=150)
    return answered + "7<|im_end|>"


class HarnessWorker:
    def __init__(self, root: Path, servers: StandaloneNats) -> None:
        self.run = f"h{uuid.uuid4().hex[:8]}"
        model = init_model("tiny-moe", root / "model")
        self.tokenizer = AutoTokenizer.from_pretrained(model)
        self.episode = teach(model, self.tokenizer)
        self.metrics_port = free_port()
        config = root / "worker.json"
        environment = {
            "name": "harness_cases:load_environment",
            "settings": {"maxCalls": 3},
            "episode_s": EPISODE_S,
        }
        session = {"max_turns": MAX_CALLS, "turn_tokens": 96, "temperature": 0.0}
        settings = {
            "run": self.run,
            "nats_url": servers.bed.leaves[servers.region].url,
            "jetstream_domain": HUB_DOMAIN,
            "model": str(model),
            "max_sessions": 16,
            "group_size": 2,
            "max_model_len": 2048,
            "session": session | {"context_tokens": 2048, "summary_tokens": 64},
            "environment": environment,
            "follow_weights": False,
            "start_version": None,
            "metrics_port": self.metrics_port,
        }
        config.write_text(json.dumps(settings))
        self.loop = asyncio.new_event_loop()
        self.nc = self.loop.run_until_complete(servers.bed.hub.connect())
        self.js = self.nc.jetstream(domain=HUB_DOMAIN)
        self.loop.run_until_complete(ensure_run_streams(self.nc, self.run, HUB_DOMAIN))
        self.trajectories = self.loop.run_until_complete(
            self.js.pull_subscribe(
                trajectory_subject(self.run), durable="tests", stream=trajectory_stream(self.run)
            )
        )
        env = os.environ | servers.bed.leaves[servers.region].client_env()
        env |= {"VLLM_CPU_KVCACHE_SPACE": "1", "TOKENIZERS_PARALLELISM": "false"}
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(HERE), env.get("PYTHONPATH")]))
        self.log = root / "worker.log"
        with self.log.open("w") as log:
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "rlfleet.rollout", str(config)],
                env=env,
                stdout=log,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )

    def publish(self, *tasks) -> None:
        async def publish() -> None:
            for task in tasks:
                message = TaskMessage(run=self.run, task=task, group_size=2)
                await self.js.publish(task_subject(self.run), encode(message))

        self.loop.run_until_complete(publish())

    def collect(self, task_ids: set[str], timeout_s: float = 600) -> dict[str, list[Trajectory]]:
        """Two trajectories of each task in `task_ids`."""

        async def fetch() -> dict[str, list[Trajectory]]:
            found: dict[str, list[Trajectory]] = {}
            deadline = time.monotonic() + timeout_s
            while any(len(found.get(task, [])) < 2 for task in task_ids):
                assert self.proc.poll() is None, self.log.read_text()[-5000:]
                assert time.monotonic() < deadline, self.log.read_text()[-5000:]
                try:
                    messages = await self.trajectories.fetch(8, timeout=2)
                except (TimeoutError, nats.errors.TimeoutError):
                    continue
                for message in messages:
                    trajectory = decode_trajectory(message.data)
                    found.setdefault(trajectory.task_id, []).append(trajectory)
                    await message.ack()
            return found

        return self.loop.run_until_complete(fetch())

    def metric(self, name: str, **labels: str) -> float:
        selector = ",".join(f'{key}="{value}"' for key, value in labels.items())
        wanted = f"{name}{{{selector}}}" if labels else name
        url = f"http://127.0.0.1:{self.metrics_port}/metrics"
        with urllib.request.urlopen(url, timeout=5) as response:
            for line in response.read().decode().splitlines():
                if line.startswith(wanted + " "):
                    return float(line.split()[1])
        return 0.0

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
) -> Iterator[HarnessWorker]:
    under_test = HarnessWorker(tmp_path_factory.mktemp("harness-worker"), nats_servers)
    try:
        yield under_test
    finally:
        under_test.stop()


def test_a_tool_using_harness_trains_exactly_the_tokens_it_sampled(
    worker: HarnessWorker,
) -> None:
    """The example environment, unchanged: its tasks, its OpenAI-SDK loop, its reward. The
    model's native tool call is parsed by vLLM's hermes parser, the tool's answer goes
    back through the chat template, and the trajectory is one segment whose text is the
    whole exchange as the template renders it, model turns marked as sampled."""
    task = next(t for t in _lookup_tasks() if t.id == "lookup-apple")
    worker.publish(task)
    for trajectory in worker.collect({task.id})[task.id]:
        assert problem(trajectory, SHAPE, worker.run, needs_experts=True) is None
        assert trajectory.reward_breakdown == {"correct": 1.0, "lookedUp": 1.0}
        assert trajectory.reward == 1.0
        (segment,) = trajectory.segments
        assert worker.tokenizer.decode(segment.tokens) == worker.episode
        completion = segment.tokens[segment.prompt_len :]
        sampled = [t for t, g in zip(completion, segment.generated, strict=True) if g]
        shown = [t for t, g in zip(completion, segment.generated, strict=True) if not g]
        assert worker.tokenizer.decode(sampled) == CALL + "<|im_end|>7<|im_end|>"
        assert "<tool_response>\n7\n</tool_response>" in worker.tokenizer.decode(shown)


def _lookup_tasks():
    from rlfleet_lookup import load_environment

    return list(load_environment({}).tasks())


def test_a_call_that_extends_the_episode_continues_its_segment_and_one_that_does_not_starts_one(
    worker: HarnessWorker,
) -> None:
    before = worker.metric("rlfleet_rollout_resegmented_calls_total")
    worker.publish(case("twice"), case("rewrite"))
    found = worker.collect({"case-twice", "case-rewrite"})
    for twice in found["case-twice"]:
        (segment,) = twice.segments
        runs = [
            g for i, g in enumerate(segment.generated) if i == 0 or g != segment.generated[i - 1]
        ]
        assert runs == [1, 0, 1]  # sampled, the new user turn shown, sampled
    for rewritten in found["case-rewrite"]:
        assert len(rewritten.segments) == 2
        assert all(any(s.generated) for s in rewritten.segments)
    assert worker.metric("rlfleet_rollout_resegmented_calls_total") >= before + 2


FAILURES = {
    "raise": "harness",
    "hang": "deadline",
    "nan": "reward",
    "range": "reward",
    "text": "reward",
    "caps": "turns",
    "biased": "harness",
    "arguments": "harness",
}


def test_each_way_a_harness_goes_wrong_fails_its_episode_counted_and_the_worker_stays_up(
    worker: HarnessWorker,
) -> None:
    """Nothing of a failed episode is published; each failure is counted by reason, the
    refused requests by theirs, and a call made with a key after its episode ended is
    refused. A good task published after them is still trained."""
    names = sorted(FAILURES)
    worker.publish(*(case(name) for name in names), case("late"))
    reasons = set(FAILURES.values())
    wait_for(
        "every failure counted",
        lambda: all(
            worker.metric("rlfleet_rollout_episodes_failed_total", reason=r) > 0 for r in reasons
        ),
        timeout=600,
    )
    refused = {
        reason: worker.metric("rlfleet_rollout_endpoint_refused_total", reason=reason)
        for reason in ("request", "caps", "key")
    }
    assert refused["request"] >= 2 and refused["caps"] >= 1, refused
    wait_for(
        "the late call refused",
        lambda: worker.metric("rlfleet_rollout_endpoint_refused_total", reason="key") > 0,
    )
    found = worker.collect({"case-late"})
    assert not {f"case-{name}" for name in names} & set(found), sorted(found)
    assert all(t.reward == 0.5 for t in found["case-late"])
    assert worker.proc.poll() is None


def test_a_verifiers_taskset_plays_through_its_own_harness_and_is_scored_by_its_rubric(
    worker: HarnessWorker,
) -> None:
    """verifiers' null chat loop, run by verifiers in its own program, reaches the engine
    through verifiers' relay; the episode is captured as sampled and its reward is the
    rubric's weighted sum, each reward function a part."""
    from rlfleet.rollout.environment.verifiers_env import load_environment

    (task,) = load_environment({"taskset": {"id": "vf_questions"}}).tasks()
    worker.publish(task)
    question = [{"role": "user", "content": task.prompt}]
    opening = worker.tokenizer.apply_chat_template(
        question, add_generation_prompt=True, tokenize=False
    )
    for trajectory in worker.collect({task.id})[task.id]:
        assert problem(trajectory, SHAPE, worker.run, needs_experts=True) is None
        (segment,) = trajectory.segments
        assert worker.tokenizer.decode(segment.tokens[: segment.prompt_len]) == opening
        sampled = segment.tokens[segment.prompt_len :]
        reply = worker.tokenizer.decode(sampled, skip_special_tokens=True).strip()
        parts = {"replied": float(bool(reply)), "correct": float("7" in reply)}
        assert trajectory.reward_breakdown == parts
        assert trajectory.reward == 0.5 * parts["replied"] + 0.5 * parts["correct"]

"""Environments as plug-ins: the registry, the settings an environment refuses by name,
the endpoint's request checks and segments, and a harness's reward, without an engine."""

from __future__ import annotations

import json
import math
import subprocess
import sys

import pytest
from rlfleet_lookup import LOOKUP
from transformers import PreTrainedTokenizerFast

from rlfleet.launch.settings import EnvironmentConfig, RewardConfig, WorkerConfig
from rlfleet.models.tiny import build_tokenizer
from rlfleet.rollout.environment import endpoint, plugins
from rlfleet.rollout.environment.agent import AgentEnvironment
from rlfleet.rollout.environment.endpoint import EpisodeCapture, Refused
from rlfleet.rollout.environment.plugins import EpisodeFailed, SettingsError
from rlfleet.rollout.environment.rewards import scored


def test_environments_are_found_by_entry_point_or_by_module_path() -> None:
    assert {"agent", "lookup"} <= set(plugins.installed())
    assert isinstance(plugins.load(EnvironmentConfig()), AgentEnvironment)
    lookup = plugins.load(EnvironmentConfig(name="rlfleet_lookup:load_environment"))
    assert [t.id for t in lookup.tasks()][:1] == ["lookup-apple"]
    with pytest.raises(LookupError, match=r"no environment 'nope'.*installed: agent"):
        plugins.load(EnvironmentConfig(name="nope"))
    with pytest.raises(LookupError, match=r"spec\.rollout\.environment\.name: nowhere:x"):
        plugins.load(EnvironmentConfig(name="nowhere:x"))


@pytest.mark.parametrize(
    ("name", "settings", "field"),
    [
        ("agent", {"turns": 3}, "turns"),
        ("lookup", {"maxCalls": 0}, "maxCalls"),
        ("lookup", {"words": {"apple": "seven"}}, "words.apple"),
        ("lookup", {"colour": "red"}, "colour"),
    ],
)
def test_a_setting_an_environment_refuses_is_named_as_the_spec_spells_it(
    name: str, settings: dict, field: str
) -> None:
    with pytest.raises(SettingsError) as refused:
        plugins.load(EnvironmentConfig(name=name, settings=settings))
    assert str(refused.value).startswith(f"spec.rollout.environment.settings.{field}: ")


def test_rewards_are_finite_numbers_in_range_or_named_parts_of_them() -> None:
    assert scored(0.25, (0, 1), "reward").value == 0.25
    parts = scored({"correct": 1.0, "style": 0.5}, (0, 1), "reward")
    assert parts.value == 0.75 and parts.breakdown == {"correct": 1.0, "style": 0.5}
    for bad in (math.nan, math.inf, 2.0, "1", True, None, {}, {"a": math.nan}):
        with pytest.raises(EpisodeFailed) as failed:
            scored(bad, (0, 1), "reward")
        assert failed.value.reason == "reward"


def _body(**extra) -> dict:
    return {"model": "m", "messages": [{"role": "user", "content": "hi"}], **extra}


def test_the_endpoint_refuses_what_would_change_the_sampled_distribution() -> None:
    endpoint._parse(_body(temperature=0.3, top_p=1.0, stream=True))  # overridden, neutral
    for control in (
        {"top_p": 0.05},
        {"top_k": 1},
        {"logit_bias": {"7": 100}},
        {"presence_penalty": 1.0},
        {"min_tokens": 4},
        {"response_format": {"type": "json_object"}},
        {"n": 2},
    ):
        with pytest.raises(Refused) as refused:
            endpoint._parse(_body(**control))
        assert refused.value.status == 400 and next(iter(control)) in str(refused.value)


def test_the_endpoint_refuses_malformed_requests_naming_the_field() -> None:
    call = {"id": "c1", "type": "function", "function": {"name": "f", "arguments": "{"}}
    history = [{"role": "assistant", "content": None, "tool_calls": [call]}]
    with pytest.raises(Refused, match="arguments of 'c1' are not JSON"):
        endpoint._parse(_body(messages=history))
    with pytest.raises(Refused, match="messages"):
        endpoint._parse({"model": "m"})


def test_a_prompt_extending_the_episode_continues_its_window_else_starts_a_segment() -> None:
    def encode(text: str) -> list[int]:
        return [ord(c) for c in text]

    capture = EpisodeCapture("key", seed=0)
    window = endpoint._extend(capture, "abc", encode)
    assert window.tokens == [97, 98, 99] and window.prompt_len == 3
    # What was sampled stays as sampled (here an id no encoding gives), and only the new
    # turns are encoded.
    window.tokens, window.generated, window.logprobs, window.versions = (
        [97, 98, 99, 7],
        [1],
        [-0.1],
        [0],
    )
    capture.text += "X"
    assert endpoint._extend(capture, "abcXde", encode) is window
    assert window.tokens == [97, 98, 99, 7, 100, 101] and window.generated == [1, 0, 0]
    assert capture.resegmented == 0
    fresh = endpoint._extend(capture, "abz", encode)
    assert fresh is not window and capture.resegmented == 1
    assert [s.tokens for s in capture.segments] == [[97, 98, 99, 7, 100, 101]]
    # A window nothing was sampled in (its call failed) is replaced, not kept.
    assert endpoint._extend(capture, "q", encode) is not fresh and capture.resegmented == 1
    assert len(capture.all_segments()) == 1


def test_a_reply_sent_back_as_given_extends_the_window_whatever_was_sampled() -> None:
    """A policy samples special tokens mid-turn and stops partway through a character; the
    reply a harness is given keeps both, so that sending it back renders the text the
    capture holds and the episode goes on in one window. (Given vLLM's own text, which
    drops both, 147 of 320 calls of bench/rollout.py started a new segment.)"""
    tokenizer: PreTrainedTokenizerFast = build_tokenizer()
    ids = tokenizer.encode("ab", add_special_tokens=False)
    ids += [tokenizer.convert_tokens_to_ids("<|endoftext|>")]
    ids += tokenizer.encode("cé", add_special_tokens=False)[:-1]  # half of é
    question = [{"role": "user", "content": "Say something."}]
    prompt = tokenizer.apply_chat_template(question, add_generation_prompt=True, tokenize=False)

    def extends(reply: str) -> bool:
        turns = [*question, {"role": "assistant", "content": reply}, question[0]]
        rendered = tokenizer.apply_chat_template(turns, add_generation_prompt=True, tokenize=False)
        return rendered.startswith(prompt + sampled)

    for end in ([tokenizer.convert_tokens_to_ids("<|im_end|>")], []):  # stopped, cut short
        sampled = tokenizer.decode(ids + end, skip_special_tokens=False)
        turn_end = tokenizer.decode(end, skip_special_tokens=False)
        assert extends(endpoint.reply_text(sampled, turn_end, cut_at_stop=None))
        assert not extends(tokenizer.decode(ids, skip_special_tokens=True).rstrip("\ufffd"))
    assert endpoint.reply_text("ab</s>", "", cut_at_stop="ab") == "ab"  # vLLM cut it there


def test_the_tiny_template_renders_tool_calls_as_the_hermes_parser_reads_them() -> None:
    from vllm.entrypoints.openai.chat_completion.protocol import ChatCompletionRequest
    from vllm.tool_parsers.abstract_tool_parser import ToolParserManager

    tokenizer: PreTrainedTokenizerFast = build_tokenizer()
    request = ChatCompletionRequest.model_validate(_body(tools=[LOOKUP]))
    call = '<tool_call>\n{"name": "lookup", "arguments": {"word": "apple"}}\n</tool_call>'
    parser = ToolParserManager.get_tool_parser("hermes")(tokenizer, request.tools)
    parsed = parser.extract_tool_calls(call, request)
    assert parsed.tools_called and not parsed.content
    (tool_call,) = parsed.tool_calls
    assert json.loads(tool_call.function.arguments) == {"word": "apple"}
    message = {"role": "assistant", "content": None, "tool_calls": [tool_call.model_dump()]}
    rendered = tokenizer.apply_chat_template(
        [*request.messages, message], tools=[LOOKUP], tokenize=False
    )
    assert rendered.endswith("<|im_start|>assistant\n" + call + "<|im_end|>\n")


def test_a_python_grader_that_does_not_import_stops_the_worker_as_it_starts() -> None:
    rewards = RewardConfig(weights={"python": 1.0}, python_function="nowhere:score")
    config = WorkerConfig(run="r", nats_url="nats://n", model="m", rewards=rewards)
    with pytest.raises(ValueError, match="python function nowhere:score"):
        AgentEnvironment().start(config)


# The feed loads the run's environment for its tasks alone: importing vLLM (and torch)
# there cost it about 9 s at each start and the engine's libraries in memory.
FEED_TASKS = """
import itertools, json, sys
from rlfleet.launch.settings import EnvironmentConfig, FeedConfig
from rlfleet.rollout.taskfeed.feed import task_source
heavy = {}
for name in sys.argv[1:]:
    config = FeedConfig(
        run="r", nats_url="nats://x", suite="toy", environment=EnvironmentConfig(name=name)
    )
    assert list(itertools.islice(task_source(config), 2))
    heavy[name] = sorted({"vllm", "torch", "transformers"} & set(sys.modules))
print(json.dumps(heavy))
"""


def test_the_feed_takes_an_environments_tasks_without_loading_an_engine() -> None:
    names = ["agent", "lookup"]  # the built-in loop's, and a harness's (the example)
    done = subprocess.run(
        [sys.executable, "-c", FEED_TASKS, *names],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    assert json.loads(done.stdout) == {name: [] for name in names}

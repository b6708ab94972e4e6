"""One agent session: the model and a sandbox taking turns until it answers.

Each turn the model writes until it closes a tool call (or stops); the harness parses
the call strictly, runs it in the sandbox and appends the observation as a user turn.
The context is kept as token ids, never re-tokenised, so the next request's prompt is
exactly the previous one plus the new tokens (the engine serves it from its prefix
cache) and the trainer scores exactly the tokens that were sampled.

When the next turn would not fit the context budget, the model is asked to summarise
its progress; the window is closed as a segment and a new one starts from the system
prompt, the task and the summary. Every segment is kept, so the summary is credited
with the session's final reward. The conversation is in the one chat format
(`rlfleet.models.chat`).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import numpy as np

from rlfleet.api.wire import Segment, Task
from rlfleet.launch.settings import SessionConfig
from rlfleet.models.chat import END_TURN, chat_text
from rlfleet.rollout.environment import tools
from rlfleet.rollout.environment.sandbox import Sandbox, SandboxClosed

if TYPE_CHECKING:  # vLLM only where a request is sent (`sampling`)
    from vllm import SamplingParams

    from rlfleet.rollout.engine.driver import Completion, Engine

SYSTEM = (
    "You are an agent working in a sandboxed directory with no network. "
    f"{tools.PROTOCOL} A turn with no tool call is your final answer."
)
SUMMARY_REQUEST = (
    "Your context is full. Summarise your progress so far: what you know, what you "
    "changed, and what is left to do. Your summary replaces the conversation."
)
SUMMARY_HEADER = "Summary of your progress so far:\n"


def window_text(
    task_prompt: str,
    summary: str | None = None,
    observation: str | None = None,
    *,
    tools: bool = True,
) -> str:
    """A fresh window's prompt: system, task, and after a summary the summary and the last
    observation, ending where the model's turn begins. A task without tools is asked bare:
    the protocol would only be noise to it (and, for a small model, most of its context)."""
    turns = [("system", SYSTEM)] if tools else []
    turns.append(("user", task_prompt))
    if summary is not None:
        turns.append(("user", SUMMARY_HEADER + summary))
    if observation is not None:
        turns.append(("user", observation))
    return chat_text(turns)


def request_seed(episode_seed: int, request: int) -> int:
    """The sampling seed of an episode's `request`-th call: every call its own, and an
    episode replayed with its seed samples alike."""
    return episode_seed * 1_000_003 + request


def sampling(
    max_tokens: int, temperature: float, stop: list[str], seed: int, *, keep_stop: bool = False
) -> SamplingParams:
    """A request's sampling settings. vLLM is imported here, not at the top: the feed
    imports environments for their tasks alone, and a worker's engine has loaded it."""
    from vllm import SamplingParams

    return SamplingParams(
        max_tokens=max_tokens,
        temperature=temperature,
        stop=stop,
        include_stop_str_in_output=keep_stop,
        seed=seed,
    )


def user_turn_text(text: str) -> str:
    """A user turn (an observation, the summary request) after the model's closed turn."""
    return chat_text([("user", text)])


@dataclass
class Window:
    """One context window being built into a `Segment`."""

    tokens: list[int]
    prompt_len: int
    generated: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    versions: list[int] = field(default_factory=list)
    experts: np.ndarray | None = None

    def add_completion(self, completion: Completion) -> None:
        self.tokens += completion.token_ids
        self.generated += [1] * len(completion.token_ids)
        self.logprobs += completion.logprobs
        self.versions += completion.versions
        self.experts = completion.experts  # covers the whole window so far

    def add_observation(self, ids: list[int]) -> None:
        self.tokens += ids
        self.generated += [0] * len(ids)
        self.logprobs += [0.0] * len(ids)
        self.versions += [self.versions[-1]] * len(ids)

    def segment(self) -> Segment:
        experts = self.experts
        return Segment(
            tokens=self.tokens,
            prompt_len=self.prompt_len,
            generated=self.generated,
            logprobs=self.logprobs,
            versions=self.versions,
            routed_experts=b"" if experts is None else experts.astype("<u2").tobytes(),
            moe_layers=0 if experts is None else experts.shape[1],
            top_k=0 if experts is None else experts.shape[2],
        )


@dataclass
class Episode:
    segments: list[Segment]
    answer: str | None  # the submitted answer, or the final turn's text
    transcript: str
    ended: str  # answered | submitted | turns | sandbox | context
    error: str = ""


class Session:
    def __init__(
        self,
        engine: Engine,
        task: Task,
        sandbox: Sandbox | None,  # None for a task without tools
        config: SessionConfig,
        seed: int,
    ) -> None:
        self.engine = engine
        self.task = task
        self.sandbox = sandbox
        self.config = config
        self.seed = seed
        self.segments: list[Segment] = []
        self.transcript: list[str] = []
        self._requests = 0
        self._end = self._encode(END_TURN)
        self._summary_request = self._user_turn(SUMMARY_REQUEST)

    def _encode(self, text: str) -> list[int]:
        return self.engine.encode(text)

    def _user_turn(self, text: str) -> list[int]:
        return self._encode(user_turn_text(text))

    def _open(self, summary: str | None = None, observation: str | None = None) -> Window:
        text = window_text(self.task.prompt, summary, observation, tools=self.task.tools)
        tokens = self._encode(text)
        return Window(tokens=tokens, prompt_len=len(tokens))

    def _fits(self, window: Window, extra: int) -> bool:
        # Room is always kept to ask for a summary and receive it.
        reserve = len(self._end) + 1 + len(self._summary_request) + self.config.summary_tokens
        return len(window.tokens) + extra + reserve <= self.config.context_tokens

    def _close(self, completion: Completion) -> list[int]:
        """End the model's turn, unless it ended it itself with its end-of-turn token."""
        closed = completion.token_ids[-len(self._end) :] == self._end
        return self._encode("\n") if closed else self._end + self._encode("\n")

    async def _complete(self, window: Window, max_tokens: int, stop: list[str]) -> Completion:
        seed = request_seed(self.seed, self._requests)
        params = sampling(max_tokens, self.config.temperature, stop, seed, keep_stop=True)
        self._requests += 1
        completion = await self.engine.generate(list(window.tokens), params)
        window.add_completion(completion)
        return completion

    async def _execute(self, call: tools.ToolCall | tools.ToolError) -> str:
        if isinstance(call, tools.ToolError):
            return f"error: {call.message}"
        assert self.sandbox is not None, "only a task with tools makes tool calls"
        reply = await self.sandbox.call(tools.request(call))
        return tools.observation(reply, self.config.observation_chars)

    async def run(self) -> Episode:
        window: Window | None = self._open()
        if not self._fits(window, self.config.turn_tokens):
            raise ValueError(
                f"the task's prompt ({len(window.tokens)} tokens) leaves no room for a turn "
                f"in a context of {self.config.context_tokens}"
            )
        answer, ended, error = None, "turns", ""
        for turn in range(self.config.max_turns):
            completion = await self._complete(window, self.config.turn_tokens, [tools.CLOSE])
            self.transcript.append(f"[assistant] {completion.text}")
            call = tools.parse(completion.text) if self.task.tools else None
            if call is None:
                answer, ended = completion.text.removesuffix(END_TURN).strip(), "answered"
                break
            if isinstance(call, tools.Submit):
                answer, ended = call.answer, "submitted"
                break
            try:
                observation = await self._execute(call)
            except SandboxClosed as closed:
                ended, error = "sandbox", str(closed)
                break
            self.transcript.append(f"[tool] {observation}")
            if turn + 1 == self.config.max_turns:
                break
            reply = self._close(completion) + self._user_turn(observation)
            if self._fits(window, len(reply) + self.config.turn_tokens):
                window.add_observation(reply)
                continue
            window.add_observation(self._close(completion) + self._summary_request)
            summary = await self._complete(window, self.config.summary_tokens, [])
            self.transcript.append(f"[summary] {summary.text}")
            self.segments.append(window.segment())
            window = self._open(summary.text.removesuffix(END_TURN).strip(), observation)
            if not self._fits(window, self.config.turn_tokens):
                ended, error, window = "context", "no room for a turn after the summary", None
                break
        if window is not None:
            self.segments.append(window.segment())
        return Episode(self.segments, answer, "\n".join(self.transcript), ended, error)

"""Rewards: composable scorers over a finished attempt, behind a check for cheating.

An attempt is graded from what it leaves behind (`Outcome`): its submitted answer and its
final working tree, fetched with the sandbox's `archive` tool. Code is run for grading
only in a fresh sandbox built from that tree, the hidden tests and the original protected
files, so nothing the agent left running can touch its grade. `grade` checks for cheating
first, because a reward that tampering with the checker can raise teaches tampering.
"""

from __future__ import annotations

import asyncio
import base64
import importlib
import inspect
import math
import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any, Protocol

import httpx
import msgspec

from rlfleet.api.rlrun import RewardKind
from rlfleet.api.wire import Task, check_relative_path
from rlfleet.launch.settings import JudgeConfig, RemoteRewardConfig
from rlfleet.rollout.environment.cheats import changed, detect_cheats, is_bytecode, overlaps
from rlfleet.rollout.environment.envclient import EnvClient, NoPool
from rlfleet.rollout.environment.plugins import EpisodeFailed
from rlfleet.rollout.environment.sandbox import Limits, Sandbox, SandboxClosed


@dataclass(frozen=True)
class Outcome:
    answer: str | None  # the submitted answer; None if the agent never submitted
    files: dict[str, bytes]  # the agent's final working tree
    transcript: str


class Reward(msgspec.Struct, frozen=True):
    value: float
    breakdown: dict[str, float]
    reason: str = ""


class Scorer(Protocol):
    name: str  # its key in a breakdown

    async def score(self, task: Task, outcome: Outcome) -> Reward: ...


class ArchiveError(RuntimeError):
    """The sandbox could not hand over its working tree."""


async def archive(sandbox: Sandbox) -> dict[str, bytes]:
    """The sandbox's working tree: every regular file by its relative path."""
    reply = await sandbox.call({"tool": "archive"})
    if not reply["ok"]:
        raise ArchiveError(reply["error"])
    files = {}
    for path, content in reply["files"].items():
        check_relative_path(path)  # the server runs beside the agent's code: trust nothing
        files[path] = base64.b64decode(content, validate=True)
    return files


def matches(answer: str, expected: str) -> bool:
    """The exact-answer rule: equal, whitespace aside."""
    return answer.split() == expected.split()


@dataclass(frozen=True)
class ExactAnswer:
    """1 if the submitted answer is the task's answer, whitespace aside."""

    name: str = "exactAnswer"

    async def score(self, task: Task, outcome: Outcome) -> Reward:
        if task.answer is None:
            raise ValueError(f"task {task.id} has no answer to compare with")
        if outcome.answer is None:
            return Reward(0.0, {self.name: 0.0}, "no answer submitted")
        if matches(outcome.answer, task.answer):
            return Reward(1.0, {self.name: 1.0})
        return Reward(0.0, {self.name: 0.0}, f"answer {outcome.answer[:80]!r} is wrong")


def _grading_tree(task: Task, files: dict[str, bytes]) -> dict[str, bytes]:
    """The agent's final tree with the hidden tests and the original protected files laid
    over it. Bytecode is dropped: an unchecked `.pyc` would run in place of its source."""
    overrides = {path: task.files[path].encode() for path in task.protected}
    overrides |= {path: content.encode() for path, content in task.hidden_tests.items()}
    kept = {
        path: content
        for path, content in files.items()
        if not is_bytecode(path) and not any(overlaps(path, other) for other in overrides)
    }
    return kept | overrides


@dataclass(frozen=True)
class HiddenTests:
    """1 if the task's test command passes in a fresh sandbox holding the grading tree,
    claimed from the pool the attempt's came from."""

    pool: EnvClient | None  # None: no pool to grade in, so grading fails, saying so
    limits: Limits = field(default_factory=Limits)
    seconds: float = 60.0  # for the test command
    name: str = "hiddenTests"

    def _failed(self, reason: str) -> Reward:
        return Reward(0.0, {self.name: 0.0}, reason)

    async def score(self, task: Task, outcome: Outcome) -> Reward:
        if task.test_command is None:
            raise ValueError(f"task {task.id} has no test_command")
        if self.pool is None:
            raise NoPool(f"task {task.id} is graded by hidden tests, and there is no pool")
        tree = _grading_tree(task, outcome.files)
        try:
            environment = await self.pool.environment(task.environment)
            async with await self.pool.create(tree, self.limits, snapshot=environment) as sandbox:
                command = {"tool": "run", "command": task.test_command}
                reply = await sandbox.call(command, self.seconds)
        except SandboxClosed as error:
            return self._failed(f"the grading sandbox stopped: {error}")
        if not reply["ok"]:
            return self._failed(f"hidden tests did not finish: {reply['error']}")
        if reply["exit_code"] != 0:
            tail = reply["output"].strip()[-300:]
            return self._failed(f"hidden tests failed (exit {reply['exit_code']}): {tail}")
        return Reward(1.0, {self.name: 1.0})


_JUDGE_SYSTEM = (
    "You grade one attempt at a task on one dimension. Reply with a single integer from "
    "0 (worst) to 10 (best) and nothing else."
)
_FIRST_INTEGER = re.compile(r"\d+")


@dataclass(frozen=True)
class Judge:
    """An LLM scores the attempt 0-10 on each of the task's rubric dimensions, through
    any OpenAI-compatible chat-completions endpoint; the value is the mean score / 10.
    A failed call or an unusable reply scores its dimension 0 with a reason: it never
    raises, so a flaky judge costs reward, not a worker."""

    base_url: str  # up to and including the API version, e.g. http://judge:8000/v1
    model: str
    api_key: str | None = field(default=None, repr=False)
    # Merged into every request body, e.g. a vLLM guided-decoding regex.
    extra_body: dict[str, Any] = field(default_factory=dict)
    name: str = "judge"
    timeout: float = 60.0
    max_tokens: int = 8
    submission_chars: int = 8000
    transcript_chars: int = 4000  # the transcript's last characters

    def _prompt(self, task: Task, outcome: Outcome, dimension: str, meaning: str) -> str:
        parts = [] if outcome.answer is None else [f"Submitted answer:\n{outcome.answer}"]
        parts += [
            f"--- {path}\n{content.decode(errors='replace')}"
            for path, content in sorted(changed(task, outcome.files).items())
        ]
        submission = "\n\n".join(parts)[: self.submission_chars] or "(nothing submitted)"
        excerpt = outcome.transcript[-self.transcript_chars :]
        return (
            f"Dimension: {dimension}: {meaning}\n\nTask:\n{task.prompt}\n\n"
            f"Submission:\n{submission}\n\nTranscript (its end):\n{excerpt}\n\n"
            f"Score the attempt on {dimension} from 0 to 10."
        )

    async def _ask(self, client: httpx.AsyncClient, prompt: str) -> tuple[int | None, str]:
        body = {
            "model": self.model,
            "messages": [
                {"role": "system", "content": _JUDGE_SYSTEM},
                {"role": "user", "content": prompt},
            ],
            "temperature": 0.0,
            "max_tokens": self.max_tokens,
        } | self.extra_body
        try:
            response = await client.post("chat/completions", json=body)
            response.raise_for_status()
            content = response.json()["choices"][0]["message"]["content"]
            match = _FIRST_INTEGER.search(content)
        except (httpx.HTTPError, ValueError, LookupError, TypeError) as error:
            return None, f"{type(error).__name__}: {error}"[:200]
        if match is None or int(match[0]) > 10:
            return None, f"no score from 0 to 10 in {content[:80]!r}"
        return int(match[0]), ""

    async def score(self, task: Task, outcome: Outcome) -> Reward:
        if not task.rubric:
            raise ValueError(f"task {task.id} has no rubric to judge by")
        headers = {"Authorization": f"Bearer {self.api_key}"} if self.api_key else {}
        base = self.base_url.rstrip("/") + "/"
        async with httpx.AsyncClient(
            base_url=base, headers=headers, timeout=self.timeout
        ) as client:
            replies = await asyncio.gather(
                *(
                    self._ask(client, self._prompt(task, outcome, dimension, meaning))
                    for dimension, meaning in task.rubric.items()
                )
            )
        breakdown: dict[str, float] = {}
        reasons = []
        for dimension, (points, reason) in zip(task.rubric, replies, strict=True):
            breakdown[f"{self.name}.{dimension}"] = (points or 0) / 10
            if points is None:
                reasons.append(f"{self.name}.{dimension}: {reason}")
        value = sum(breakdown.values()) / len(breakdown)
        return Reward(value, {self.name: value} | breakdown, "; ".join(reasons))


@dataclass(frozen=True)
class Combined:
    """The weighted mean of several scorers; the breakdown keeps every part's values."""

    parts: list[tuple[float, Scorer]]
    name: str = "combined"

    def __post_init__(self) -> None:
        if not self.parts or any(weight <= 0 for weight, _ in self.parts):
            raise ValueError("Combined needs at least one part, each with a positive weight")
        names = [scorer.name for _, scorer in self.parts]
        if len(set(names)) != len(names):
            raise ValueError(f"scorer names must differ to keep their breakdowns apart: {names}")

    async def score(self, task: Task, outcome: Outcome) -> Reward:
        rewards = await asyncio.gather(*(scorer.score(task, outcome) for _, scorer in self.parts))
        total = sum(weight for weight, _ in self.parts)
        value = sum(w * r.value for (w, _), r in zip(self.parts, rewards, strict=True)) / total
        breakdown = {key: v for reward in rewards for key, v in reward.breakdown.items()}
        return Reward(value, breakdown, "; ".join(r.reason for r in rewards if r.reason))


def scored(value: object, bounds: tuple[float, float], name: str) -> Reward:
    """A grader's answer as a reward: a number, or parts by name whose mean it is, each
    finite and within `bounds`; EpisodeFailed (reason `reward`) for anything else."""
    parts = dict(value) if isinstance(value, Mapping) else {name: value}
    if not parts:
        raise EpisodeFailed("reward", f"{name} returned no parts")
    low, high = bounds
    for part, number in parts.items():
        if isinstance(number, bool) or not isinstance(number, int | float):
            number = None
        if number is None or not math.isfinite(number) or not low <= number <= high:
            raise EpisodeFailed(
                "reward",
                f"{name}: {part} is {parts[part]!r}, not a finite number in [{low:g}, {high:g}]",
            )
    breakdown = {str(part): float(number) for part, number in parts.items()}
    return Reward(sum(breakdown.values()) / len(breakdown), breakdown)


def _named(reward: Reward, name: str) -> Reward:
    """A reward under `name` in a combined breakdown, its parts as `name.part`."""
    if list(reward.breakdown) == [name]:
        return reward
    parts = {f"{name}.{part}": value for part, value in reward.breakdown.items()}
    return Reward(reward.value, {name: reward.value} | parts)


@dataclass(frozen=True)
class PythonGrader:
    """The user's function, sync (run in a thread, so the worker's loop goes on) or
    async, called as `function(task, outcome)`."""

    function: Callable[[Task, Outcome], Any]
    name: str = "python"

    @classmethod
    def load(cls, path: str) -> PythonGrader:
        module, _, attribute = path.partition(":")
        try:
            return cls(getattr(importlib.import_module(module), attribute))
        except (ImportError, AttributeError) as error:
            raise ValueError(f"spec.rewards: python function {path}: {error}") from error

    async def score(self, task: Task, outcome: Outcome) -> Reward:
        try:
            if inspect.iscoroutinefunction(self.function):
                value = await self.function(task, outcome)
            else:
                value = await asyncio.to_thread(self.function, task, outcome)
        except Exception as error:
            raise EpisodeFailed("reward", f"{self.name} raised {error!r}") from error
        return _named(scored(value, (0.0, 1.0), self.name), self.name)


_RETRIED = {429, 500, 502, 503, 504}


@dataclass
class Remote:
    """A reward service: each attempt POSTed as JSON (the task, its answer, transcript and
    files in base64), answered with `{"reward": x}` or `{"parts": {...}}`. At most
    `concurrency` requests are open at once; a timeout, refused connection, 429 or 5xx is
    tried again `retries` times, backing off; then the attempt fails."""

    config: RemoteRewardConfig
    name: str = "remote"
    _open: asyncio.Semaphore = field(init=False)

    def __post_init__(self) -> None:
        self._open = asyncio.Semaphore(self.config.concurrency)

    def _body(self, task: Task, outcome: Outcome) -> dict:
        files = {path: base64.b64encode(data).decode() for path, data in outcome.files.items()}
        return {
            "task": msgspec.to_builtins(task),
            "answer": outcome.answer,
            "transcript": outcome.transcript,
            "files": files,
        }

    async def score(self, task: Task, outcome: Outcome) -> Reward:
        body, config, problem = self._body(task, outcome), self.config, ""
        async with self._open, httpx.AsyncClient(timeout=config.timeout_s) as client:
            for attempt in range(config.retries + 1):
                if attempt:
                    await asyncio.sleep(0.5 * 2 ** (attempt - 1))
                try:
                    response = await client.post(config.url, json=body)
                except httpx.HTTPError as error:  # timeouts and refused connections
                    problem = f"{type(error).__name__}: {error}"
                    continue
                if response.status_code in _RETRIED:
                    problem = f"HTTP {response.status_code}"
                    continue
                return self._reward(response)
        raise EpisodeFailed("reward", f"{self.name}: {problem} after {config.retries + 1} tries")

    def _reward(self, response: httpx.Response) -> Reward:
        try:
            response.raise_for_status()
            answer = response.json()
            value = answer["parts"] if "parts" in answer else answer["reward"]
        except (httpx.HTTPError, ValueError, LookupError, TypeError) as error:
            raise EpisodeFailed("reward", f"{self.name}: {error!r}"[:300]) from error
        return _named(scored(value, (0.0, 1.0), self.name), self.name)


@dataclass(frozen=True)
class Grading:
    """What an attempt's scorers are made with."""

    pool: EnvClient | None  # where hidden tests run
    limits: Limits  # of the sandbox they run in
    judge: JudgeConfig | None  # the judge's endpoint, where the run weighs one
    python: PythonGrader | None = None  # where the run weighs one
    remote: Remote | None = None  # where the run weighs one


def _exact_answer(task: Task, grading: Grading) -> Scorer | None:
    return ExactAnswer() if task.answer is not None else None


def _hidden_tests(task: Task, grading: Grading) -> Scorer | None:
    return HiddenTests(grading.pool, grading.limits) if task.test_command is not None else None


def _judge(task: Task, grading: Grading) -> Scorer | None:
    if not task.rubric or (judge := grading.judge) is None:
        return None
    return Judge(
        judge.base_url,
        judge.model,
        api_key=judge.api_key,
        extra_body=judge.extra_body,
        timeout=judge.timeout_s,
    )


def _python(task: Task, grading: Grading) -> Scorer | None:
    return grading.python


def _remote(task: Task, grading: Grading) -> Scorer | None:
    return grading.remote


# Each reward kind a run may name (`RewardKind`), and the scorer it is on the tasks it
# applies to (None where it does not: a task without an answer has no exact answer).
SCORERS: dict[RewardKind, Callable[[Task, Grading], Scorer | None]] = {
    "exactAnswer": _exact_answer,
    "hiddenTests": _hidden_tests,
    "judge": _judge,
    "python": _python,
    "remote": _remote,
}


def scorer_for(task: Task, weights: Mapping[RewardKind, float], grading: Grading) -> Scorer:
    """The weighted parts of the reward that apply to `task`; ValueError if none does."""
    parts = [
        (weight, scorer)
        for kind, weight in weights.items()
        if weight > 0 and (scorer := SCORERS[kind](task, grading)) is not None
    ]
    if not parts:
        raise ValueError(f"task {task.id} has nothing the configured rewards can grade")
    return Combined(parts)


async def grade(task: Task, outcome: Outcome, scorer: Scorer) -> Reward:
    """The scorer's reward, or zero with the reason if the attempt cheated."""
    if cheat := detect_cheats(task, outcome.files):
        return Reward(0.0, {"cheat": 1.0}, f"cheat: {cheat}")
    reward = await scorer.score(task, outcome)
    return msgspec.structs.replace(reward, breakdown={"cheat": 0.0} | reward.breakdown)

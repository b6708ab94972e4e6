"""The environment the harness tests' worker runs (`harness_cases:load_environment`): the
example `lookup` environment as it ships, tasks whose harness misbehaves or makes the
calls a test needs, chosen by task id, and the verifiers taskset `vf_questions` through
the built-in `verifiers` environment."""

from __future__ import annotations

import asyncio
import math
from collections.abc import Mapping
from typing import Any

import httpx
from rlfleet_lookup import LOOKUP, Lookup
from rlfleet_lookup import load_environment as load_lookup

from rlfleet.api.wire import Task
from rlfleet.rollout.environment.harness import Model
from rlfleet.rollout.environment.plugins import Attempt, Result
from rlfleet.rollout.environment.verifiers_env import SUITE as VERIFIERS
from rlfleet.rollout.environment.verifiers_env import VerifiersEnvironment
from rlfleet.rollout.environment.verifiers_env import load_environment as load_verifiers

QUESTION = [{"role": "user", "content": "Say something."}]


async def _ask(model: Model, messages: list[dict], **extra: Any) -> dict:
    reply = await model.client.chat.completions.create(model=model.name, messages=messages, **extra)
    return reply.choices[0].message.model_dump(exclude_none=True)


async def _twice(model: Model) -> list[dict]:
    """Two calls, the second's conversation extending the first's (after asking which
    models there are, as some agents do first)."""
    assert [served.id async for served in model.client.models.list()] == [model.name]
    first = await _ask(model, QUESTION)
    return await _ask(model, [*QUESTION, first, {"role": "user", "content": "Again?"}])


async def _rewrite(model: Model) -> list[dict]:
    """Two calls, the second dropping the first's answer."""
    await _ask(model, QUESTION)
    return await _ask(model, [{"role": "user", "content": "Something else."}])


async def _calls_on(model: Model) -> list[dict]:
    """Calls on past the episode's turn cap."""
    while True:
        await _ask(model, QUESTION)


async def _stale_call(model: Model) -> None:
    await asyncio.sleep(1)  # the episode is over by then
    async with httpx.AsyncClient() as client:
        await client.post(
            f"{model.base_url}/chat/completions",
            json={"model": model.name, "messages": QUESTION},
            headers={"Authorization": f"Bearer {model.api_key}"},
        )


_KEPT: set[asyncio.Task] = set()


async def _leaves_a_call(model: Model) -> list[dict]:
    """Answers, and leaves a call behind that comes after the episode ended."""
    late = asyncio.create_task(_stale_call(model))
    _KEPT.add(late)
    late.add_done_callback(_KEPT.discard)
    return [await _ask(model, QUESTION)]


async def _raises(model: Model) -> list[dict]:
    await _ask(model, QUESTION)
    raise RuntimeError("the harness broke")


async def _hangs(model: Model) -> list[dict]:
    await _ask(model, QUESTION)
    await asyncio.sleep(3600)
    return []


async def _biased(model: Model) -> list[dict]:
    return [await _ask(model, QUESTION, logit_bias={"7": 100})]


async def _bad_arguments(model: Model) -> list[dict]:
    call = {"id": "c1", "type": "function", "function": {"name": "lookup", "arguments": "{"}}
    history = [*QUESTION, {"role": "assistant", "content": None, "tool_calls": [call]}]
    return [await _ask(model, history, tools=[LOOKUP])]


HARNESSES = {
    "twice": _twice,
    "rewrite": _rewrite,
    "caps": _calls_on,
    "late": _leaves_a_call,
    "raise": _raises,
    "hang": _hangs,
    "biased": _biased,
    "arguments": _bad_arguments,
}
SCORES: dict[str, Any] = {"nan": math.nan, "range": 5.0, "text": "1"}


def case(name: str) -> Task:
    return Task(id=f"case-{name}", suite="cases", prompt=name)


class Cases(Lookup):
    # A verifiers taskset's tasks go to the verifiers environment, so one worker (one
    # engine) serves both ecosystems' tests.
    verifiers: VerifiersEnvironment

    async def attempt(self, attempt: Attempt) -> Result:
        if attempt.task.suite == VERIFIERS:
            return await self.verifiers.attempt(attempt)
        return await super().attempt(attempt)

    async def rollout(self, task: Task, model: Model) -> Any:
        harness = HARNESSES.get(task.prompt)
        if harness is not None:
            return await harness(model)
        if task.prompt in SCORES:
            return [await _ask(model, QUESTION)]
        return await super().rollout(task, model)

    async def score(self, task: Task, state: Any) -> float | Mapping[str, float]:
        if task.prompt in SCORES:
            return SCORES[task.prompt]
        if task.id.startswith("case-"):
            return 0.5
        return await super().score(task, state)


def load_environment(settings: Mapping[str, Any]) -> Cases:
    lookup = load_lookup(settings)
    cases = Cases(lookup.words, lookup.max_calls)
    cases.verifiers = load_verifiers({"taskset": {"id": "vf_questions"}})
    return cases

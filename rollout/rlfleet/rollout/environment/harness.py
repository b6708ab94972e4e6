"""`Harness`: a user's environment, which drives the model through the OpenAI API.

A harness is the agent code of the user's product, as it is: each episode it is handed
the task and a `Model` (an `openai.AsyncOpenAI` client on the episode's own endpoint,
with its address and key for code run out of process) and it plays the episode however
it likes; then `score` grades what it returned. rlfleet captures every token the model
sampled in between (`rlfleet.rollout.environment.endpoint`), so the harness never sees
a token id and the trainer trains on exactly what was sampled.

An episode fails, counted by reason, and its group is tried again, when the harness
raises (`harness`), outlives the run's episode deadline (`deadline`), breaks the turn or
context caps (`turns`, `context`), never calls the model (`empty`), or its score is not
a finite number in `reward_range` (`reward`): the trainer never sees half an episode.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

import openai

from rlfleet.api.wire import Task
from rlfleet.launch.settings import WorkerConfig
from rlfleet.rollout.environment.endpoint import EpisodeCapture
from rlfleet.rollout.environment.plugins import Attempt, EpisodeFailed, Result, episode_deadline
from rlfleet.rollout.environment.rewards import scored


@dataclass(frozen=True)
class Model:
    """The policy, as an episode's harness reaches it."""

    client: openai.AsyncOpenAI  # on the episode's endpoint, with its key
    base_url: str  # for a program run out of process: its OPENAI_BASE_URL
    api_key: str  # its OPENAI_API_KEY; refused once the episode is over
    name: str  # the model name requests carry (any is served)


class Harness:
    """Base of a user's environment. Override `rollout` and `score`; `tasks` to bring the
    environment's own tasks, `check` to refuse tasks it cannot play."""

    reward_range: tuple[float, float] = (0.0, 1.0)

    def start(self, config: WorkerConfig) -> None:
        return None

    def tasks(self) -> Iterable[Task] | None:
        return None

    def check(self, task: Task, config: WorkerConfig) -> None:
        return None

    def demonstrations(self) -> Iterable[tuple[list[dict], list[dict] | None]] | None:
        """Conversations (messages, tools) as the harness would have them go, for a
        supervised warm-up before RL (`rlfleet run`'s tiny models): None for none."""
        return None

    async def rollout(self, task: Task, model: Model) -> Any:
        """Plays one episode; what it returns is handed to `score`."""
        raise NotImplementedError

    async def score(self, task: Task, state: Any) -> float | Mapping[str, float]:
        """The episode's reward, or its parts by name (the reward is their mean)."""
        raise NotImplementedError

    async def attempt(self, attempt: Attempt) -> Result:
        endpoint = attempt.endpoint
        capture = endpoint.open(attempt.seed)
        try:
            async with episode_deadline(attempt.config):
                state = await self._play(attempt, capture)
                reward = scored(await self._score(attempt.task, state), self.reward_range, "reward")
        finally:
            endpoint.close_episode(capture)
        segments = capture.all_segments()
        if not segments:
            raise EpisodeFailed("empty", "the harness never called the model")
        return Result(segments, reward, "answered")

    async def _play(self, attempt: Attempt, capture: EpisodeCapture) -> Any:
        endpoint = attempt.endpoint
        client = openai.AsyncOpenAI(base_url=endpoint.base_url, api_key=capture.key, max_retries=0)
        model = Model(client, endpoint.base_url, capture.key, endpoint.model)
        try:
            state = await self.rollout(attempt.task, model)
        except Exception as error:
            # A cap the endpoint refused surfaces in the harness as an API error.
            raise capture.failure or EpisodeFailed("harness", repr(error)) from error
        finally:
            await client.close()
        if capture.failure is not None:  # the harness went on past a refused call
            raise capture.failure
        return state

    async def _score(self, task: Task, state: Any) -> float | Mapping[str, float]:
        try:
            return await self.score(task, state)
        except Exception as error:
            raise EpisodeFailed("reward", f"score raised {error!r}") from error

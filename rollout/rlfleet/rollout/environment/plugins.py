"""Environments as plug-ins: the contract between the rollout worker and a run's harness.

An environment is what a run's rollouts act in: the harness that drives the model, the
tasks it is asked (its own, or the run's suite) and the reward. The worker knows it only
through `Environment`: for each attempt of a task it hands over an `Attempt` (the task,
a seed, and the worker's engine, episode endpoint and sandbox pool) and gets back the
attempt's captured segments and its reward. rlfleet's own agent loop is the environment
`agent` (`rlfleet.rollout.environment.agent`); a user's is usually a
`rlfleet.rollout.environment.harness.Harness`, which drives the model through the
OpenAI API and never sees a token.

Environments are found in one registry, the entry-point group `rlfleet.environments`:
each entry names a factory that takes the run's settings (a mapping, from
`spec.rollout.environment.settings`) and returns the environment, raising
`SettingsError` naming the setting it refuses. The worker and the feed load it when
they start, so a bad setting stops them before they take any work.
"""

from __future__ import annotations

import asyncio
import contextlib
import importlib
import importlib.metadata
from collections.abc import AsyncIterator, Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol

from rlfleet.api.environment import ENTRY_POINT_GROUP
from rlfleet.api.wire import Segment, Task
from rlfleet.launch.settings import EnvironmentConfig, WorkerConfig

if TYPE_CHECKING:
    from rlfleet.rollout.engine.driver import Engine
    from rlfleet.rollout.environment.endpoint import Endpoint
    from rlfleet.rollout.environment.envclient import EnvClient
    from rlfleet.rollout.environment.rewards import Reward


class SettingsError(ValueError):
    """An environment refuses one of its settings: says which, as the spec spells it."""

    def __init__(self, setting: str, message: str) -> None:
        self.setting = setting
        super().__init__(f"spec.rollout.environment.settings.{setting}: {message}")


class EpisodeFailed(RuntimeError):
    """An attempt that yields nothing to train on; `reason` is one word, counted and
    logged (`rlfleet_rollout_episodes_failed_total`). Its group is tried again."""

    def __init__(self, reason: str, detail: str) -> None:
        self.reason = reason
        super().__init__(f"{reason}: {detail}")


@contextlib.asynccontextmanager
async def episode_deadline(config: WorkerConfig) -> AsyncIterator[None]:
    """The run's episode deadline around an episode: past it, EpisodeFailed (`deadline`)."""
    seconds = config.environment.episode_s
    try:
        async with asyncio.timeout(seconds):
            yield
    except TimeoutError:
        raise EpisodeFailed("deadline", f"past the episode's {seconds:g} s") from None


@dataclass(frozen=True)
class Attempt:
    """One attempt at a task, and what the worker lends it to run."""

    task: Task
    group_id: str
    index: int  # within its group
    seed: int
    config: WorkerConfig
    engine: Engine
    endpoint: Endpoint  # where a harness's OpenAI client talks to the engine
    pool: EnvClient | None  # where sandboxes are claimed; None if the worker has none


@dataclass(frozen=True)
class Result:
    """A finished attempt: every token as sampled, in its context windows, and its grade."""

    segments: list[Segment]
    reward: Reward
    ended: str  # how the episode ended, one word (answered, submitted, turns, ...)


class Environment(Protocol):
    def start(self, config: WorkerConfig) -> None:
        """Once, as a worker of `config` starts: ValueError if the environment cannot run
        in it (the worker stops, saying why)."""
        ...

    def tasks(self) -> Iterable[Task] | None:
        """The environment's own tasks, passed over again and again by the feed (a
        generator may be endless); None: the run's task suite."""
        ...

    def check(self, task: Task, config: WorkerConfig) -> None:
        """ValueError if the environment cannot attempt or score `task` in a worker of
        `config`: the task is refused once, never retried."""
        ...

    async def attempt(self, attempt: Attempt) -> Result:
        """Runs one episode and scores it; EpisodeFailed when there is nothing to train."""
        ...


Factory = Callable[[Mapping[str, Any]], Environment]


def installed() -> list[str]:
    """The names registered in the entry-point group."""
    return sorted(ep.name for ep in importlib.metadata.entry_points(group=ENTRY_POINT_GROUP))


def factory(name: str) -> Factory:
    """The factory `name` registers, or the one `module:attribute` names."""
    found = importlib.metadata.entry_points(group=ENTRY_POINT_GROUP, name=name)
    if found:
        return next(iter(found)).load()
    module, _, attribute = name.partition(":")
    if not attribute:
        raise LookupError(
            f"spec.rollout.environment.name: no environment {name!r} in the entry-point group"
            f" {ENTRY_POINT_GROUP} (installed: {', '.join(installed()) or 'none'})"
        )
    try:
        return getattr(importlib.import_module(module), attribute)
    except (ImportError, AttributeError) as error:
        raise LookupError(f"spec.rollout.environment.name: {name}: {error}") from error


def load(config: EnvironmentConfig) -> Environment:
    """The run's environment, made with its settings: LookupError if it is not installed,
    SettingsError if it refuses a setting."""
    return factory(config.name)(dict(config.settings))

"""The built-in environment `verifiers`: a `verifiers` environment, as its users write it.

A verifiers user writes a taskset module (a `vf.Taskset` of `vf.Task`s, their
`@vf.reward` functions the rubric) and runs it with a verifiers harness (its `null` chat
loop, `bash`, or a coding agent's CLI) in a verifiers runtime. This adapter runs that
module unchanged: the feed iterates its taskset, and each attempt is one
`Env.run_episode` whose model is the worker's episode endpoint, reached through verifiers'
own interception server. That server multiplexes every episode over one client, so it
presents the endpoint's relay key and names each call's episode by the trace id it sends;
the adapter binds the trace to its episode the moment verifiers mints it, before any call.
The trace's rewards, weighted as the rubric weighs them, are the attempt's reward, each
reward function a part of its breakdown.

Settings are verifiers' own environment config, as `vf eval` reads it: `taskset` (its
`id`, the module, and its own fields), `harness` (default `{"id": "null"}`), `runtime`
(default `{"type": "subprocess"}`), and `rewardRange`, the bounds a reward must fall in
(default `[0, 1]`). verifiers' whole-rollout retries are left off: a failed attempt's
group is tried again by the worker, as every environment's is.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
from collections.abc import Iterable, Mapping
from typing import Any

from rlfleet.api.wire import Task
from rlfleet.launch.settings import WorkerConfig
from rlfleet.rollout.environment.plugins import (
    Attempt,
    EpisodeFailed,
    Result,
    SettingsError,
    episode_deadline,
)
from rlfleet.rollout.environment.rewards import Reward, scored

SUITE = "verifiers"
DATA = "verifiersData"  # the task's verifiers data, in the wire task's metadata
# verifiers reads the provider key from a variable; one with API_KEY in its name is kept
# out of the programs it runs, so no harness ever sees the relay key.
RELAY_KEY_VARIABLE = "RLFLEET_RELAY_API_KEY"
SETTINGS = ("taskset", "harness", "runtime", "rewardRange")


def load_environment(settings: Mapping[str, Any]) -> VerifiersEnvironment:
    """The entry point: verifiers' environment for the settings, or SettingsError."""
    try:
        import verifiers.v1 as vf
    except ImportError as error:
        raise SettingsError(
            "taskset", f"verifiers is not installed in the image: {error}"
        ) from error
    for setting in settings:
        if setting not in SETTINGS:
            raise SettingsError(setting, f"not a setting (settings: {', '.join(SETTINGS)})")
    taskset = settings.get("taskset")
    if not isinstance(taskset, Mapping) or not taskset.get("id"):
        raise SettingsError("taskset", "the taskset's config, with its id (its module)")
    config = {
        "taskset": dict(taskset),
        "agent": {
            "harness": dict(settings.get("harness") or {"id": "null"}),
            "runtime": dict(settings.get("runtime") or {"type": "subprocess"}),
        },
    }
    try:
        env = vf.load_environment(vf.resolve_env_config(config))
    except Exception as error:  # a module that does not import, a field it refuses
        raise SettingsError(_setting_of(error), str(error)) from error
    return VerifiersEnvironment(env, _reward_range(settings.get("rewardRange", [0.0, 1.0])))


def _setting_of(error: Exception) -> str:
    """The setting a verifiers config error is about: its first location, if it names one."""
    errors = getattr(error, "errors", None)
    if callable(errors):
        location = errors()[0].get("loc", ())
        if location and location[0] == "agent" and len(location) > 1:
            location = location[1:]
        if location:
            return ".".join(str(part) for part in location)
    return "taskset"


def _reward_range(value: object) -> tuple[float, float]:
    numbers = value if isinstance(value, list | tuple) else []
    if len(numbers) != 2 or not all(isinstance(n, int | float) for n in numbers):
        raise SettingsError("rewardRange", f"[low, high], not {value!r}")
    low, high = float(numbers[0]), float(numbers[1])
    if not low < high:
        raise SettingsError("rewardRange", f"low must be under high, not {value!r}")
    return low, high


class VerifiersEnvironment:
    def __init__(self, env: Any, reward_range: tuple[float, float]) -> None:
        self.env = env
        self.reward_range = reward_range
        self._serving: contextlib.AsyncExitStack | None = None
        self._starting = asyncio.Lock()

    def start(self, config: WorkerConfig) -> None:
        return None

    def tasks(self) -> Iterable[Task]:
        return (_wire(task) for task in self.env.taskset)

    def check(self, task: Task, config: WorkerConfig) -> None:
        self._task(task)

    def _task(self, task: Task) -> Any:
        """The verifiers task a wire task carries, rebuilt from its data as verifiers'
        replay does (its taskset's Task type over its data)."""
        data = task.metadata.get(DATA)
        if not isinstance(data, Mapping):
            raise ValueError(f"task {task.id} is not a verifiers task (no {DATA})")
        task_type = type(self.env.taskset).task_type()
        return task_type(task_type.data_type().model_validate(data))

    async def attempt(self, attempt: Attempt) -> Result:
        await self._serve(attempt)
        endpoint = attempt.endpoint
        capture = endpoint.open(attempt.seed)
        try:
            async with episode_deadline(attempt.config):
                trace = await self._episode(attempt, lambda t: endpoint.bind(capture, t.id))
        finally:
            endpoint.close_episode(capture)
        if capture.failure is not None:
            raise capture.failure
        if not trace.ok:
            raise EpisodeFailed("harness", str(trace.last_error))
        segments = capture.all_segments()
        if not segments:
            raise EpisodeFailed("empty", "the harness never called the model")
        return Result(segments, self._reward(trace), "answered")

    async def _serve(self, attempt: Attempt) -> None:
        """verifiers' servers, started once for the worker's life on its first attempt."""
        async with self._starting:
            if self._serving is None:
                os.environ[RELAY_KEY_VARIABLE] = attempt.endpoint.relay_key
                stack = contextlib.AsyncExitStack()
                await stack.enter_async_context(self.env.serving())
                self._serving = stack

    async def _episode(self, attempt: Attempt, bind) -> Any:
        import verifiers.v1 as vf

        endpoint, session = attempt.endpoint, attempt.config.session
        context = vf.ModelContext(
            model=endpoint.model,
            client=vf.EvalClientConfig(base_url=endpoint.base_url, api_key_var=RELAY_KEY_VARIABLE),
            sampling=vf.SamplingConfig(
                temperature=session.temperature, max_tokens=session.turn_tokens
            ),
        )
        episode = await self.env.run_episode(self._task(attempt.task), context, on_trace=bind)
        if len(episode.traces) != 1:
            raise EpisodeFailed("harness", f"{len(episode.traces)} traces, not one agent's")
        return episode.traces[0]

    def _reward(self, trace: Any) -> Reward:
        """The rubric's weighted sum, checked against the range; its functions the parts."""
        total = scored(trace.reward, self.reward_range, "reward").value
        parts = {name: r.score for name, r in trace.rewards.items() if r is not None}
        return Reward(total, parts or {"reward": total})


def _wire(task: Any) -> Task:
    data = task.data
    identity = data.id if data.id is not None else task.key[:16]
    return Task(
        id=f"{SUITE}-{identity}",
        suite=SUITE,
        prompt=data.prompt_text,
        tools=False,
        metadata={DATA: data.model_dump(mode="json", exclude_none=True)},
    )

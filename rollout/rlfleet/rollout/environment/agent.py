"""The built-in environment `agent`: rlfleet's own agent loop (`session`), its tools in a
sandbox claimed from the run's EnvPool, its task suites, and the run's reward kinds
(`rewards`), behind the cheat checks. It drives the engine on token ids directly."""

from __future__ import annotations

import contextlib
import time
from collections.abc import Iterable, Mapping
from typing import Any

from rlfleet.api.wire import Task
from rlfleet.launch.settings import WorkerConfig
from rlfleet.rollout.engine import metrics
from rlfleet.rollout.environment import envclient, rewards
from rlfleet.rollout.environment.envclient import ClaimTimeout, EnvClient, RemoteSandbox
from rlfleet.rollout.environment.plugins import Attempt, Result, SettingsError
from rlfleet.rollout.environment.sandbox import Sandbox, SandboxClosed
from rlfleet.rollout.environment.session import Episode, Session
from rlfleet.rollout.environment.tasks import start_files


def load_environment(settings: Mapping[str, Any]) -> AgentEnvironment:
    """The entry point: the agent takes its settings from the run's spec, none of its own."""
    for setting in settings:
        raise SettingsError(setting, "the agent environment takes no settings")
    return AgentEnvironment()


class AgentEnvironment:
    def __init__(self) -> None:
        self._python: rewards.PythonGrader | None = None
        self._remote: rewards.Remote | None = None

    def start(self, config: WorkerConfig) -> None:
        # Made once per worker: a python grader imported (a wrong path stops the worker
        # here, not each task), a remote service's bound on open requests held across
        # every attempt.
        function, remote = config.rewards.python_function, config.rewards.remote
        self._python = rewards.PythonGrader.load(function) if function is not None else None
        self._remote = rewards.Remote(remote) if remote is not None else None

    def tasks(self) -> Iterable[Task] | None:
        return None  # the run's suite

    def check(self, task: Task, config: WorkerConfig) -> None:
        self._scorer(task, config, None)  # whether any reward kind the run weighs applies

    def _scorer(self, task: Task, config: WorkerConfig, pool: EnvClient | None) -> rewards.Scorer:
        """The weighted parts of the run's reward that apply to `task`; ValueError if none."""
        judge = config.rewards.judge_endpoint
        grading = rewards.Grading(
            pool, config.limits, judge, python=self._python, remote=self._remote
        )
        return rewards.scorer_for(task, config.rewards.weights, grading)

    async def attempt(self, attempt: Attempt) -> Result:
        task, config = attempt.task, attempt.config
        scorer = self._scorer(task, config, attempt.pool)
        # A bare question has no tools, so nothing for a sandbox to run.
        sandbox = await _claim(attempt.pool, attempt) if task.tools else None
        async with sandbox or contextlib.nullcontext():
            session = Session(attempt.engine, task, sandbox, config.session, attempt.seed)
            episode = await session.run()
            reward = await _grade(task, scorer, episode, sandbox)
        if "cheat" in reward.reason:
            metrics.cheats.inc()
        return Result(episode.segments, reward, episode.ended)


async def _claim(pool: EnvClient | None, attempt: Attempt) -> RemoteSandbox:
    """A sandbox from the pool holding a copy of the task's files over a fork of its
    environment. Raises if there is no pool, the environment's set-up fails, or no sandbox
    comes free in time: the attempt fails, and its group goes back to the queue."""
    if pool is None:
        raise envclient.NoPool("a task uses tools, and this worker has no environment pool")
    task = attempt.task
    environment = await pool.environment(task.environment)
    started = time.perf_counter()
    try:
        sandbox = await pool.create(start_files(task), attempt.config.limits, snapshot=environment)
    except ClaimTimeout:
        metrics.claim_timeouts.inc()
        raise
    metrics.sandbox_claim.observe(time.perf_counter() - started)
    return sandbox


async def _grade(
    task: Task, scorer: rewards.Scorer, episode: Episode, sandbox: Sandbox | None
) -> rewards.Reward:
    if episode.ended == "sandbox":
        return rewards.Reward(0.0, {"sandbox_stopped": 1.0}, f"sandbox: {episode.error}")
    try:
        files = {} if sandbox is None else await rewards.archive(sandbox)
    except (rewards.ArchiveError, SandboxClosed) as error:  # the agent can cause both
        return rewards.Reward(0.0, {"archive_failed": 1.0}, f"archive: {error}")
    outcome = rewards.Outcome(episode.answer, files, episode.transcript)
    return await rewards.grade(task, outcome, scorer)

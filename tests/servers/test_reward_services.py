"""A run's own graders: a Python function and a remote reward service (a real HTTP server
of the test's own), as the agent environment scores attempts with them: parts reported
by name, bad answers and an unreachable or failing service failing the attempt with the
reason `reward`, retries and the bound on open requests kept."""

from __future__ import annotations

import asyncio
import math
import threading
from collections.abc import AsyncIterator

import pytest
from aiohttp import web

from rlfleet.api.wire import Task
from rlfleet.launch.settings import RemoteRewardConfig
from rlfleet.rollout.environment import rewards
from rlfleet.rollout.environment.plugins import EpisodeFailed

TASK = Task(id="t", suite="s", prompt="Say hello.", answer="hello")
OUTCOME = rewards.Outcome("hello", {"notes.txt": b"hi\n"}, "[assistant] hello")


def style(task: Task, outcome: rewards.Outcome) -> dict[str, float]:
    assert threading.current_thread() is not threading.main_thread()  # off the loop
    return {"correct": float(outcome.answer == task.answer), "short": 0.5}


async def judged(task: Task, outcome: rewards.Outcome) -> float:
    return 0.25


def broken(task: Task, outcome: rewards.Outcome) -> float:
    raise KeyError("rubric")


def test_a_python_grader_sync_or_async_reports_its_parts_by_name() -> None:
    reward = asyncio.run(rewards.PythonGrader.load(f"{__name__}:style").score(TASK, OUTCOME))
    assert reward.value == 0.75
    assert reward.breakdown == {"python": 0.75, "python.correct": 1.0, "python.short": 0.5}
    assert asyncio.run(rewards.PythonGrader(judged).score(TASK, OUTCOME)).breakdown == {
        "python": 0.25
    }
    with pytest.raises(ValueError, match="python function nowhere:score"):
        rewards.PythonGrader.load("nowhere:score")


@pytest.mark.parametrize("grader", [broken, lambda task, outcome: math.nan, lambda t, o: 3])
def test_a_python_grader_that_raises_or_answers_no_reward_fails_the_attempt(grader) -> None:
    with pytest.raises(EpisodeFailed) as failed:
        asyncio.run(rewards.PythonGrader(grader).score(TASK, OUTCOME))
    assert failed.value.reason == "reward"


class Verifier:
    """A reward service that answers as each test asks: `plan` lists the statuses of the
    requests to come (200 scores), `delay_s` holds each; it counts what it saw."""

    def __init__(self) -> None:
        self.plan: list[int] = []
        self.delay_s = 0.0
        self.seen: list[dict] = []
        self.open = self.most_open = 0

    async def score(self, request: web.Request) -> web.Response:
        self.seen.append(await request.json())
        self.open += 1
        self.most_open = max(self.most_open, self.open)
        try:
            await asyncio.sleep(self.delay_s)
            status = self.plan.pop(0) if self.plan else 200
            if status != 200:
                return web.json_response({"error": "no"}, status=status)
            return web.json_response({"parts": {"tests": 1.0, "lint": 0.5}})
        finally:
            self.open -= 1


async def _served(verifier: Verifier) -> AsyncIterator[str]:
    app = web.Application()
    app.router.add_post("/score", verifier.score)
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
    try:
        yield f"http://127.0.0.1:{port}/score"
    finally:
        await runner.cleanup()


def _scenario(test) -> None:
    async def run() -> None:
        verifier = Verifier()
        async for url in _served(verifier):
            await test(verifier, url)

    asyncio.run(run())


def test_a_remote_reward_posts_the_attempt_and_reports_its_parts() -> None:
    async def test(verifier: Verifier, url: str) -> None:
        reward = await rewards.Remote(RemoteRewardConfig(url=url)).score(TASK, OUTCOME)
        assert reward.breakdown == {"remote": 0.75, "remote.tests": 1.0, "remote.lint": 0.5}
        (body,) = verifier.seen
        assert body["task"]["id"] == "t" and body["answer"] == "hello"
        assert body["files"] == {"notes.txt": "aGkK"}  # base64 of "hi\n"

    _scenario(test)


def test_a_remote_reward_retries_what_may_pass_and_fails_what_will_not() -> None:
    async def test(verifier: Verifier, url: str) -> None:
        remote = rewards.Remote(RemoteRewardConfig(url=url, retries=2))
        verifier.plan = [503, 429]
        assert (await remote.score(TASK, OUTCOME)).value == 0.75
        assert len(verifier.seen) == 3
        verifier.plan, verifier.seen = [500, 500, 500], []
        with pytest.raises(EpisodeFailed, match="HTTP 500 after 3 tries"):
            await remote.score(TASK, OUTCOME)
        verifier.plan, verifier.seen = [400], []
        with pytest.raises(EpisodeFailed) as failed:
            await remote.score(TASK, OUTCOME)
        assert failed.value.reason == "reward" and len(verifier.seen) == 1  # not retried

    _scenario(test)


def test_a_remote_reward_times_out_and_keeps_its_bound_on_open_requests() -> None:
    async def test(verifier: Verifier, url: str) -> None:
        verifier.delay_s = 2.0
        slow = rewards.Remote(RemoteRewardConfig(url=url, timeout_s=0.5, retries=0))
        with pytest.raises(EpisodeFailed, match="ReadTimeout"):
            await slow.score(TASK, OUTCOME)
        await asyncio.sleep(2.0)  # the server finishes the request given up on
        verifier.delay_s, verifier.most_open = 0.2, 0
        bounded = rewards.Remote(RemoteRewardConfig(url=url, concurrency=2))
        await asyncio.gather(*(bounded.score(TASK, OUTCOME) for _ in range(8)))
        assert verifier.most_open <= 2

    _scenario(test)


def test_an_unreachable_service_fails_the_attempt_after_its_retries() -> None:
    remote = rewards.Remote(RemoteRewardConfig(url="http://127.0.0.1:9/score", retries=1))
    with pytest.raises(EpisodeFailed, match=r"ConnectError.*after 2 tries"):
        asyncio.run(remote.score(TASK, OUTCOME))

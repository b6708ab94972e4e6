"""Staleness-aware admission: the feed publishes what the trainer can use within its
staleness bound, each task naming the oldest policy that may attempt it; and its
curriculum, which mostly skips tasks whose last group taught nothing. The decisions
alone, then the feed process's loop against real NATS JetStream, driven by step reports."""

from __future__ import annotations

import asyncio
import contextlib
import uuid
from collections import Counter
from collections.abc import AsyncIterator
from pathlib import Path

import msgspec
import nats
import nats.errors
import pytest
from conftest import step_report
from nats.js import JetStreamContext
from nats.js.api import AckPolicy, ConsumerConfig

from rlfleet.api.wire import (
    GroupOutcome,
    StepReport,
    Task,
    TaskMessage,
    decode_task_message,
    encode,
    step_subject,
    task_stream,
    task_subject,
)
from rlfleet.bus import connection, streams
from rlfleet.bus.connection import CREDENTIALS_ENV
from rlfleet.bus.streams import StreamMissing, ensure_run_streams
from rlfleet.local.nats import StandaloneNats
from rlfleet.pipeline.admission import Admission
from rlfleet.rollout.environment.tasks import write_suite
from rlfleet.rollout.taskfeed.curriculum import Curriculum
from rlfleet.rollout.taskfeed.feed import FeedConfig, feed, passes, publish_task
from rlfleet.rollout.worker.loop import groups_to_take


def min_versions(admission: Admission, room: int) -> list[int]:
    return [admission.min_version(target) for target in admission.admit(room)]


def test_synchronous_admission_publishes_one_batch_per_version() -> None:
    admission = Admission(max_staleness=0, groups_per_step=3)
    # This version's batch, and the next one's, which waits for version 1 in the workers.
    assert min_versions(admission, 8) == [0, 0, 0, 1, 1, 1]
    assert admission.admit(8) == []  # the trainer has not used them yet
    admission.observe(version=1, groups=3)
    assert min_versions(admission, 8) == [2, 2, 2]


def test_asynchronous_admission_runs_ahead_by_the_bound_and_no_further() -> None:
    admission = Admission(max_staleness=2, groups_per_step=2)
    # Batches for the steps from versions 0 to 3; the last must come from version 1 or
    # newer to be at most 2 behind when it is trained.
    assert min_versions(admission, 6) == [0, 0, 0, 0, 0, 0]
    assert min_versions(admission, 6) == [1, 1]
    admission.observe(version=1, groups=2)
    assert min_versions(admission, 6) == [2, 2]
    assert admission.admit(6) == []


def test_a_batch_short_of_a_group_gets_one_more_and_the_next_follows_the_reports() -> None:
    admission = Admission(max_staleness=0, groups_per_step=2)
    for seq, target in enumerate(admission.admit(8), start=1):
        admission.published(target, seq)
    assert not admission.batch_done(first_unfinished_seq=2)
    assert admission.batch_done(first_unfinished_seq=3)
    admission.starved()  # a group was lost and the trainer waits for its batch
    assert admission.admit(8) == [0]
    admission.observe(version=1, groups=3)
    assert admission.admit(8) == [1, 2, 2, 2]
    admission.observe(version=1, groups=9)  # a report seen twice changes nothing
    assert admission.admit(8) == []


def test_the_feed_follows_the_trainer_through_its_step_reports(
    nats_servers: StandaloneNats, monkeypatch: pytest.MonkeyPatch
) -> None:
    run = f"r{uuid.uuid4().hex[:8]}"
    # The feed connects as a pod's would: with the user its environment names.
    monkeypatch.setenv(CREDENTIALS_ENV, nats_servers.bed.hub.credentials)
    config = FeedConfig(
        run=run,
        nats_url=nats_servers.bed.hub.url,
        suite="toy",
        max_staleness=0,
        groups_per_step=2,
    )

    async def scenario() -> None:
        async with _feeding(config) as (js, worker):

            async def take(count: int) -> list[int]:
                return [m.min_policy_version for m in await _take(worker, count)]

            # This version's batch, then the next one's, to be held until version 1.
            assert await take(4) == [0, 0, 1, 1]
            # The first batch is done and the trainer has not stepped: one more for it.
            assert await take(1) == [0]
            await js.publish(step_subject(run), encode(step_report(run, 1, 0.0, 0)))
            # The report says one group made version 1: one task for the step after.
            assert await take(1) == [2]

    asyncio.run(asyncio.wait_for(scenario(), 120))


def test_the_curriculum_mostly_skips_tasks_whose_last_group_taught_nothing() -> None:
    tasks = [Task(id=name, suite="s", prompt=name, answer="x", tools=False) for name in "abc"]
    curriculum = Curriculum(revisit=0.25, seed=0)
    curriculum.observe(
        [
            GroupOutcome("a", [1.0, 1.0, 1.0]),  # all right
            GroupOutcome("b", [0.0, 0.0, 0.0]),  # all wrong
            GroupOutcome("c", [0.0, 1.0, 0.0]),  # something to learn
        ]
    )
    order = passes(tasks, seed=0)
    asked = Counter(curriculum.select(order).id for _ in range(3000))
    # c every time it comes round; a and b about a quarter of the times they do.
    assert 0.15 < asked["a"] / asked["c"] < 0.35 and 0.15 < asked["b"] / asked["c"] < 0.35
    # A task that teaches again is asked again every time.
    curriculum.observe([GroupOutcome("a", [0.0, 1.0, 1.0])])
    asked = Counter(curriculum.select(order).id for _ in range(3000))
    assert 0.9 < asked["a"] / asked["c"] < 1.1
    with pytest.raises(ValueError, match="never ask again"):
        Curriculum(revisit=0.0, seed=0)


def test_the_feed_stops_asking_what_the_trainer_reports_as_settled(
    nats_servers: StandaloneNats, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    config = three_task_feed(nats_servers, tmp_path, monkeypatch)
    run = config.run

    async def scenario() -> None:
        async with _feeding(config) as (js, worker):
            await _take(worker, 2)  # before any report: whatever comes first
            asked = []
            for version in range(1, 7):
                await js.publish(step_subject(run), encode(settling(run, version)))
                asked += [m.task.id for m in await _take(worker, 1)]
            assert asked == ["c"] * 6

    asyncio.run(asyncio.wait_for(scenario(), 120))


def test_a_restarted_feed_remembers_what_the_step_stream_shows_settled(
    nats_servers: StandaloneNats, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    config = three_task_feed(nats_servers, tmp_path, monkeypatch)

    async def scenario() -> None:
        await _make_streams(config)
        nc = await connection.connect(config.nats_url)
        try:
            js = nc.jetstream()
            # What the trainer reported before this feed (re)started.
            for version in range(1, 4):
                await js.publish(step_subject(config.run), encode(settling(config.run, version)))
            await js.publish(step_subject(config.run), b"not a step report")
        finally:
            await nc.close()
        async with _feeding(config) as (js, worker):
            asked = [m.task.id for m in await _take(worker, 1)]
            for version in range(4, 9):  # steps that say nothing of a or b
                report = step_report(config.run, version, 0.0, 0)
                await js.publish(step_subject(config.run), encode(report))
                asked += [m.task.id for m in await _take(worker, 1)]
            assert asked == ["c"] * 6

    asyncio.run(asyncio.wait_for(scenario(), 120))


def three_task_feed(
    nats_servers: StandaloneNats, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> FeedConfig:
    """A feed of tasks a, b and c, one a step, that all but never asks a settled task; it
    connects as a pod's would, with the user its environment names."""
    monkeypatch.setenv(CREDENTIALS_ENV, nats_servers.bed.hub.credentials)
    suite = tmp_path / "three.jsonl"
    write_suite(
        [Task(id=name, suite="three", prompt=name, answer="x", tools=False) for name in "abc"],
        suite,
    )
    return FeedConfig(
        run=f"r{uuid.uuid4().hex[:8]}",
        nats_url=nats_servers.bed.hub.url,
        suite=str(suite),
        max_staleness=0,
        groups_per_step=1,
        revisit_uniform=1e-9,
    )


def settling(run: str, version: int) -> StepReport:
    """A step whose groups at a (all right) and b (all wrong) taught nothing."""
    settled = [GroupOutcome("a", [1.0] * 4), GroupOutcome("b", [0.0] * 4)]
    return msgspec.structs.replace(step_report(run, version, 0.0, 0), outcomes=settled)


@contextlib.asynccontextmanager
async def _feeding(
    config: FeedConfig,
) -> AsyncIterator[tuple[JetStreamContext, JetStreamContext.PullSubscription]]:
    """The feed running, and a rollout worker's pull consumer on the run's task queue."""
    await _make_streams(config)
    stop = asyncio.Event()
    feeding = asyncio.create_task(feed(config, stop))
    nc = await connection.connect(config.nats_url)
    try:
        js = nc.jetstream()
        worker = await js.pull_subscribe(
            task_subject(config.run),
            durable="rollout",
            stream=task_stream(config.run),
            config=ConsumerConfig(ack_policy=AckPolicy.EXPLICIT),
        )
        yield js, worker
    finally:
        stop.set()
        await feeding
        await nc.close()


async def _take(worker: JetStreamContext.PullSubscription, count: int) -> list[TaskMessage]:
    """The next `count` tasks a worker gets, acknowledged."""
    found: list[TaskMessage] = []
    while len(found) < count:
        with contextlib.suppress(TimeoutError, nats.errors.TimeoutError):
            for msg in await worker.fetch(count - len(found), timeout=5):
                found.append(decode_task_message(msg.data))
                await msg.ack()
    return found


async def _make_streams(config: FeedConfig) -> None:
    """The run's streams, as whoever starts a run makes them."""
    nc = await connection.connect(config.nats_url)
    try:
        await ensure_run_streams(nc, config.run, None)
    finally:
        await nc.close()


def test_a_feed_whose_run_has_no_streams_fails_naming_the_stream_and_makes_none(
    nats_servers: StandaloneNats, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    config = three_task_feed(nats_servers, tmp_path, monkeypatch)
    monkeypatch.setattr(streams, "BIND_WAIT_S", 0.5)  # not the half minute a pod waits

    async def scenario() -> None:
        with pytest.raises(StreamMissing, match=f"stream {task_stream(config.run)} does not"):
            await feed(config, asyncio.Event())
        nc = await connection.connect(config.nats_url)
        try:
            with pytest.raises(nats.js.errors.NotFoundError):
                await nc.jetstream().stream_info(task_stream(config.run))
        finally:
            await nc.close()

    asyncio.run(asyncio.wait_for(scenario(), 60))


def test_a_worker_takes_whole_groups_and_a_group_larger_than_its_sessions_alone() -> None:
    assert groups_to_take(running=0, max_sessions=64, group_size=16) == 4
    assert groups_to_take(running=40, max_sessions=64, group_size=16) == 1
    assert groups_to_take(running=50, max_sessions=64, group_size=16) == 0
    assert groups_to_take(running=80, max_sessions=64, group_size=16) == 0
    # groupSize may be up to 1024 while a worker runs 64 sessions: such a group once took
    # no task ever; now it runs when the worker is idle.
    assert groups_to_take(running=0, max_sessions=16, group_size=32) == 1
    assert groups_to_take(running=32, max_sessions=16, group_size=32) == 0


def test_a_task_whose_answer_was_lost_is_published_once(
    nats_servers: StandaloneNats, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # NATS restarting as the stream stored the task: its answer lost, the feed tries again.
    config = three_task_feed(nats_servers, tmp_path, monkeypatch)

    class AnswerLost:
        def __init__(self, js: JetStreamContext) -> None:
            self.js, self.tries = js, 0

        async def publish(self, *args, **kwargs):
            self.tries += 1
            ack = await self.js.publish(*args, **kwargs)
            if self.tries == 1:
                raise nats.errors.TimeoutError
            return ack

    async def scenario() -> tuple[int, int]:
        await _make_streams(config)
        nc = await connection.connect(config.nats_url)
        try:
            js = AnswerLost(nc.jetstream())
            task = Task(id="a", suite="three", prompt="a", answer="x", tools=False)
            message = TaskMessage(run=config.run, task=task, group_size=2, min_policy_version=0)
            await publish_task(js, message, "feed-0")  # type: ignore[arg-type]
            info = await nc.jetstream().stream_info(task_stream(config.run))
            return js.tries, info.state.messages
        finally:
            await nc.close()

    assert asyncio.run(scenario()) == (2, 1)

"""`python -m rlfleet.rollout.taskfeed.feed CONFIG.json | --rlrun [SPEC]`: keeps a run's task
queue stocked.

Tasks come from a suite (a shipped name such as `toy`, or a path), shuffled afresh each
pass, less those the curriculum skips because their last group taught nothing
(`Curriculum`, from the groups each step report lists; a restarted feed first reads every
report the step stream keeps). What is published follows the trainer (its step reports)
through `Admission`: no more tasks than it can train within the staleness bound, each
naming the oldest policy version allowed to attempt it. The queue also never holds more
than `depth` tasks waiting or under way, so workers share the work as it comes.
"""

from __future__ import annotations

import asyncio
import logging
import random
import secrets
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import msgspec
import prometheus_client
from nats.js import JetStreamContext
from nats.js.api import PubAck, StreamState

from rlfleet.api.taskdata import TaskSource
from rlfleet.api.wire import (
    Task,
    TaskMessage,
    decode_step_report,
    encode,
    step_subject,
    task_stream,
    task_subject,
)
from rlfleet.bus import connection
from rlfleet.bus.patience import TRANSIENT, patiently
from rlfleet.bus.reading import messages
from rlfleet.bus.streams import bind_stream, step_stream
from rlfleet.launch import components
from rlfleet.launch.settings import FeedConfig
from rlfleet.launch.stopping import run_until_signalled, wait_set
from rlfleet.pipeline.admission import Admission
from rlfleet.rollout.environment import plugins, taskdata
from rlfleet.rollout.environment.plugins import Environment
from rlfleet.rollout.environment.tasks import load_suite, suite_path
from rlfleet.rollout.taskfeed.curriculum import Curriculum

log = logging.getLogger(__name__)

STEP_POLL_S = 1.0  # how often the feed looks for step reports it was not woken for


def passes(tasks: list[Task], seed: int) -> Iterator[Task]:
    """The suite over and over, each pass in a new order."""
    rng = random.Random(seed)
    while True:
        order = list(tasks)
        rng.shuffle(order)
        yield from order


def environment_passes(environment: Environment) -> Iterator[Task]:
    """An environment's own tasks over and over, in the order it gives them: read as they
    are published, so a large dataset or an endless generator never sits in memory."""
    while True:
        source = environment.tasks()
        if source is None:
            raise ValueError("the environment has no tasks of its own")
        empty = True
        for task in source:
            empty = False
            yield task
        if empty:
            raise ValueError("the environment's tasks() gave no task")


def task_source(config: FeedConfig) -> Iterator[Task]:
    """The run's own data, if it names some; else the environment's own tasks, if it brings
    them; else the run's suite. A source that cannot be read fails here, at the start."""
    environment = plugins.load(config.environment)
    if config.tasks is not None:
        source = TaskSource.model_validate(config.tasks)
        root = taskdata.source_root(source, Path(config.tasks_dir))
        taskdata.check(source, root)
        return taskdata.data_passes(source, root, config.seed)
    if environment.tasks() is not None:
        return environment_passes(environment)
    return passes(load_suite(suite_path(config.suite)), config.seed)


class _Trainer:
    """What the feed knows of the trainer: its step reports, as they arrive."""

    def __init__(self, admission: Admission, curriculum: Curriculum) -> None:
        self.admission = admission
        self.curriculum = curriculum
        self.changed = time.monotonic()  # when the version last moved
        # The last step's training and publishing time; the first step, a trainer still
        # warming up, takes seconds.
        self.step_s = 5.0

    async def report(self, msg) -> None:
        try:
            report = decode_step_report(msg.data)
        except msgspec.DecodeError as error:
            log.warning("a message on the step subject is not a step report: %s", error)
            return
        self.curriculum.observe(report.outcomes)
        if self.admission.observe(report.policy_version, report.groups):
            self.changed = time.monotonic()
            self.step_s = report.step_seconds + report.weight_seconds

    def stuck(self, since: float) -> bool:
        """No new version for longer than a step takes, counted from `since`."""
        return time.monotonic() - max(since, self.changed) > 1.0 + 2 * self.step_s


async def publish_task(js: JetStreamContext, message: TaskMessage, message_id: str) -> PubAck:
    """Publishes a task, again while NATS restarts, under one message id: the stream drops
    a try whose answer was lost as a duplicate, so a retry never adds a task."""
    return await patiently(
        lambda: js.publish(
            task_subject(message.run), encode(message), headers={"Nats-Msg-Id": message_id}
        ),
        "publishing a task",
    )


async def feed(config: FeedConfig, stop: asyncio.Event) -> None:
    tasks = task_source(config)
    admission = Admission(config.max_staleness, config.groups_per_step)
    curriculum = Curriculum(config.revisit_uniform, config.seed)
    trainer = _Trainer(admission, curriculum)
    feed_id = secrets.token_hex(8)  # names this feed's publishes apart from an earlier one's
    nc = await connection.connect(config.nats_url, max_reconnect_attempts=-1)
    following: list[asyncio.Task] = []
    stopping = asyncio.Event()  # a follower stops on it, should nats-py swallow its cancel
    try:
        js = nc.jetstream(domain=config.jetstream_domain)
        for stream in (task_stream(config.run), step_stream(config.run)):
            await bind_stream(js, stream)
        replayed, newest = await _replay_outcomes(js, config.run, curriculum)
        if replayed:
            log.info("the curriculum learnt from %d earlier step reports", replayed)
        following.append(
            asyncio.create_task(_follow_steps(nc, js, config.run, trainer, newest, stopping))
        )
        # Tasks an earlier feed left count against the quotas, as published last.
        state = await _queue_state(js, config.run)
        for target in admission.admit(state.messages):
            admission.published(target, state.last_seq)
        published, done_since = 0, time.monotonic()
        while not stop.is_set():
            state = await _queue_state(js, config.run)
            if not admission.batch_done(state.first_seq):
                done_since = time.monotonic()
            elif trainer.stuck(done_since):
                log.info(
                    "version %d's batch is done and the trainer still waits: one more task",
                    admission.version,
                )
                admission.starved()
                done_since = time.monotonic()
            for target in admission.admit(config.depth - state.messages):
                message = TaskMessage(
                    run=config.run,
                    task=curriculum.select(tasks),
                    group_size=config.group_size,
                    min_policy_version=admission.min_version(target),
                )
                ack = await publish_task(js, message, f"{feed_id}-{published}")
                admission.published(target, ack.seq)
                published += 1
            await wait_set(stop, config.poll_s)
        log.info(
            "published %d tasks of %s; skipped %d that last taught nothing",
            *(published, (config.tasks or {}).get("path", config.suite), curriculum.skipped),
        )
    finally:
        stopping.set()
        for task in following:
            task.cancel()
        await asyncio.gather(*following, return_exceptions=True)  # before its connection
        await nc.close()


async def _follow_steps(
    nc, js: JetStreamContext, run: str, trainer: _Trainer, newest: int, stopping: asyncio.Event
) -> None:
    """Hands the trainer's step reports to `trainer`: the newest report there was at the
    start (sequence `newest`, 0 for none: the trainer's version now; not merely the
    newest message, which may be no report), then each after it, read by direct gets
    (the feed makes no consumer); a report published wakes it, else it looks every
    `STEP_POLL_S`, until `stopping` is set."""
    stream, subject = step_stream(run), step_subject(run)
    published = asyncio.Event()

    async def wake(_message) -> None:
        published.set()

    subscription = await nc.subscribe(subject, cb=wake)
    try:
        seen = max(0, newest - 1)
        while not stopping.is_set():
            try:
                async for message in messages(js, stream, subject, after=seen):
                    await trainer.report(message)
                    seen = message.seq or seen
            except TRANSIENT as error:  # NATS restarting: the next look reads on
                log.warning("reading step reports: %r", error)
            await wait_set(published, STEP_POLL_S)
            published.clear()
    finally:
        await subscription.unsubscribe()


async def _replay_outcomes(js, run: str, curriculum: Curriculum) -> tuple[int, int]:
    """Teaches the curriculum what every step report the stream keeps says of its tasks,
    so a restarted feed does not ask again what a group already showed settled. Returns
    how many reports it read and the newest one's sequence (0: none)."""
    state = (await js.stream_info(step_stream(run))).state
    if not state.messages:
        return 0, 0
    read = newest = 0
    async for message in messages(js, step_stream(run), step_subject(run)):
        try:
            curriculum.observe(decode_step_report(message.data).outcomes)
            read, newest = read + 1, message.seq or newest
        except msgspec.DecodeError as error:
            log.warning("step report %d skipped: %s", message.seq, error)
        if (message.seq or 0) >= state.last_seq:
            break
    return read, newest


async def _queue_state(js, run: str) -> StreamState:
    """The work queue keeps each task, waiting or under way, until it is acknowledged
    (read again while NATS restarts: the feed asks every `poll_s`)."""
    info = await patiently(lambda: js.stream_info(task_stream(run)), "reading the task queue")
    return info.state


def main() -> None:
    config = components.component_settings(sys.argv[1:], components.FEED)
    if config.metrics_port is not None:
        prometheus_client.start_http_server(config.metrics_port)

    run_until_signalled(lambda stop: feed(config, stop))


if __name__ == "__main__":
    main()

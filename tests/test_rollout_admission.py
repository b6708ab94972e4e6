"""Staleness-aware admission: the feed publishes what the trainer can use within its
staleness bound, each task naming the oldest policy that may attempt it. The decision
alone, then the feed process's loop against real NATS JetStream, driven by step reports."""

from __future__ import annotations

import asyncio
import contextlib
import uuid

import nats
import pytest
from conftest import step_report
from nats.js.api import AckPolicy, ConsumerConfig

from rlfleet.api.streams import ensure_stream, step_stream_config
from rlfleet.api.wire import (
    decode_task_message,
    encode,
    step_subject,
    task_stream,
    task_subject,
)
from rlfleet.rollout.admission import Admission
from rlfleet.rollout.feed import FeedConfig, feed
from rlfleet.testbed.nats import StandaloneNats


def test_synchronous_admission_publishes_one_batch_per_version() -> None:
    admission = Admission(max_staleness=0, groups_per_step=3)
    assert admission.admit(8) == [0, 0, 0]
    assert admission.admit(8) == []  # the trainer has not used them yet
    admission.observe(version=1, groups=3)
    assert admission.admit(8) == [1, 1, 1]  # and only the new version may attempt them


def test_asynchronous_admission_runs_ahead_by_the_bound_and_no_further() -> None:
    admission = Admission(max_staleness=2, groups_per_step=2)
    # Batches for versions 0, 1 and 2 of the trainer, all from the base policy.
    assert admission.admit(4) == [0, 0, 0, 0]
    assert admission.admit(4) == [0, 0]
    assert admission.admit(4) == []
    admission.observe(version=1, groups=2)
    # The batch for version 3 must come from version 1 or newer to be trained at 3.
    assert admission.admit(4) == [1, 1]


def test_the_batch_follows_what_the_trainer_steps_on() -> None:
    admission = Admission(max_staleness=0, groups_per_step=3)
    admission.admit(8)
    admission.starved()  # three groups were short of the step's tokens
    assert admission.admit(8) == [0]
    admission.observe(version=1, groups=4)
    assert admission.admit(8) == [1, 1, 1, 1]
    admission.observe(version=1, groups=9)  # a report seen twice changes nothing
    assert admission.admit(8) == []


@pytest.mark.nats
def test_the_feed_follows_the_trainer_through_its_step_reports(
    nats_servers: StandaloneNats,
) -> None:
    run = f"r{uuid.uuid4().hex[:8]}"
    config = FeedConfig(
        run=run,
        nats_url=nats_servers.bed.hub.authenticated_url,
        suite="toy",
        max_staleness=0,
        groups_per_step=2,
    )

    async def scenario() -> None:
        stop = asyncio.Event()
        feeding = asyncio.create_task(feed(config, stop))
        nc = await nats.connect(config.nats_url)
        try:
            js = nc.jetstream()
            await ensure_stream(js, step_stream_config(run))
            await _wait_for_stream(js, task_stream(run))
            worker = await js.pull_subscribe(
                task_subject(run),
                durable="rollout",
                stream=task_stream(run),
                config=ConsumerConfig(ack_policy=AckPolicy.EXPLICIT),
            )

            async def take(count: int) -> list[int]:
                found = []
                while len(found) < count:
                    with contextlib.suppress(TimeoutError, nats.errors.TimeoutError):
                        for msg in await worker.fetch(count - len(found), timeout=5):
                            found.append(decode_task_message(msg.data).min_policy_version)
                            await msg.ack()
                return found

            assert await take(2) == [0, 0]
            # Both groups were done and the trainer did not step: it needs a third.
            assert await take(1) == [0]
            await js.publish(step_subject(run), encode(step_report(run, 1, 0.0, 0)))
            # The report says one group made version 1: one task, for version 1 or newer.
            assert await take(1) == [1]
        finally:
            stop.set()
            await feeding
            await nc.close()

    asyncio.run(asyncio.wait_for(scenario(), 120))


async def _wait_for_stream(js, name: str) -> None:
    while True:
        try:
            await js.stream_info(name)
            return
        except nats.js.errors.NotFoundError:
            await asyncio.sleep(0.1)

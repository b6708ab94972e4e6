"""`python -m rlfleet.rollout.feed CONFIG.json`: keeps a run's task queue stocked.

Tasks come from a suite (a shipped name such as `toy`, or a path), shuffled afresh each
pass. The queue is topped up to `depth` tasks waiting or under way, never more: a task
published long before a worker takes it would be attempted by an older policy than
needed, and the staleness bound would drop its trajectories.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import random
import signal
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Annotated

import msgspec
import nats

from rlfleet.api.streams import ensure_stream, task_stream_config
from rlfleet.api.wire import Task, TaskMessage, encode, task_stream, task_subject
from rlfleet.rollout.tasks import load_suite, suite_path

log = logging.getLogger(__name__)


class FeedConfig(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    run: str
    nats_url: str
    suite: str  # a shipped suite's name, or a path to a JSON Lines file
    jetstream_domain: str | None = None
    depth: Annotated[int, msgspec.Meta(ge=1)] = 8
    group_size: Annotated[int, msgspec.Meta(ge=2)] | None = None  # the workers' default
    seed: int = 0
    poll_s: float = 0.5


def passes(tasks: list[Task], seed: int) -> Iterator[Task]:
    """The suite over and over, each pass in a new order."""
    rng = random.Random(seed)
    while True:
        order = list(tasks)
        rng.shuffle(order)
        yield from order


async def feed(config: FeedConfig, stop: asyncio.Event) -> None:
    tasks = passes(load_suite(suite_path(config.suite)), config.seed)
    nc = await nats.connect(config.nats_url, max_reconnect_attempts=-1)
    try:
        js = nc.jetstream(domain=config.jetstream_domain)
        await ensure_stream(js, task_stream_config(config.run))
        published = 0
        while not stop.is_set():
            queued = (await js.stream_info(task_stream(config.run))).state.messages
            for _ in range(config.depth - queued):
                message = TaskMessage(
                    run=config.run, task=next(tasks), group_size=config.group_size
                )
                await js.publish(task_subject(config.run), encode(message))
                published += 1
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(stop.wait(), config.poll_s)
        log.info("published %d tasks of %s", published, config.suite)
    finally:
        await nc.close()


def main() -> None:
    logging.basicConfig(
        level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    if len(sys.argv) != 2:
        sys.exit("usage: python -m rlfleet.rollout.feed CONFIG.json")
    config = msgspec.json.decode(Path(sys.argv[1]).read_bytes(), type=FeedConfig)

    async def run() -> None:
        stop = asyncio.Event()
        for signum in (signal.SIGTERM, signal.SIGINT):
            asyncio.get_running_loop().add_signal_handler(signum, stop.set)
        await feed(config, stop)

    asyncio.run(run())


if __name__ == "__main__":
    main()

"""A run's queues on the hub are bounded, so that no worker or feed, however wrong, can
fill the hub's store: its trajectories by the spec's backlog (the oldest go first), its
tasks by a count past which a publish is refused. Against a real NATS server."""

from __future__ import annotations

import asyncio
import uuid

import nats.js.errors
import pytest

from rlfleet.api.wire import task_stream, task_subject, trajectory_stream, trajectory_subject
from rlfleet.bus.streams import TASKS_WAITING, ensure_run_streams
from rlfleet.local.nats import HUB_DOMAIN, StandaloneNats

pytestmark = pytest.mark.nats


def test_trajectories_past_the_backlog_push_out_the_oldest(nats_servers: StandaloneNats) -> None:
    run, backlog, size = f"bound-{uuid.uuid4().hex[:6]}", 64 << 20, 512 << 10

    async def flood() -> tuple[int, int]:
        nc = await nats_servers.bed.hub.connect()
        try:
            await ensure_run_streams(nc, run, HUB_DOMAIN, trajectory_backlog=backlog)
            js = nc.jetstream(domain=HUB_DOMAIN)
            for i in range(192):  # half as much again as the bound
                await js.publish(trajectory_subject(run), bytes(size), headers={"n": str(i)})
            state = (await js.stream_info(trajectory_stream(run))).state
            return state.bytes, state.first_seq
        finally:
            await nc.close()

    kept, first = asyncio.run(flood())
    assert kept <= backlog
    assert first > 192 - backlog // size  # the newest stay; the oldest went


def test_tasks_past_the_bound_are_refused(nats_servers: StandaloneNats) -> None:
    run = f"bound-{uuid.uuid4().hex[:6]}"

    async def flood() -> tuple[int, str]:
        nc = await nats_servers.bed.hub.connect()
        try:
            await ensure_run_streams(nc, run, HUB_DOMAIN)
            js = nc.jetstream(domain=HUB_DOMAIN)
            for _ in range(TASKS_WAITING):  # no acknowledgement awaited: the server's pace
                await nc.publish(task_subject(run), b"t")
            await nc.flush()
            try:
                await js.publish(task_subject(run), b"one too many")
            except nats.js.errors.APIError as error:
                refusal = str(error)
            else:
                refusal = ""
            return (await js.stream_info(task_stream(run))).state.messages, refusal
        finally:
            await nc.close()

    waiting, refusal = asyncio.run(flood())
    assert waiting == TASKS_WAITING
    assert "maximum messages" in refusal

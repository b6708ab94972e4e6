"""A run's queues on the hub are bounded, so that no worker or feed, however wrong, can
fill the hub's store: its trajectories by the spec's backlog (the oldest go first), its
tasks by a count past which a publish is refused. Against a real NATS server."""

from __future__ import annotations

import asyncio
import uuid

import nats.js.errors

from rlfleet.api.wire import (
    BusRole,
    task_stream,
    task_subject,
    trajectory_stream,
    trajectory_subject,
)
from rlfleet.bus import connection
from rlfleet.bus.streams import (
    MAX_TRAJECTORY_BYTES,
    TASKS_WAITING,
    delete_run_streams,
    ensure_run_streams,
    largest_message,
    run_stream_configs,
    weights_mirror_config,
)
from rlfleet.local.nats import HUB_DOMAIN, StandaloneNats


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


def test_every_stream_bounds_its_messages_and_every_server_takes_the_largest(
    nats_servers: StandaloneNats,
) -> None:
    """No stream takes a message of any size, and none takes one a server would refuse at
    publish (a worker would redo its whole group for nothing)."""
    run = "sizes"
    configs = [*run_stream_configs(run), weights_mirror_config(run, HUB_DOMAIN)]
    assert all(config.max_msg_size and config.max_msg_size > 0 for config in configs)

    async def payloads() -> list[int]:
        found = []
        for server in (nats_servers.bed.hub, *nats_servers.bed.leaves.values()):
            nc = await server.connect()
            found.append(nc.max_payload)
            await nc.close()
        return found

    assert set(asyncio.run(payloads())) == {largest_message()}
    assert largest_message() == MAX_TRAJECTORY_BYTES


def test_a_trajectory_of_several_mebibytes_is_taken_from_a_region(
    nats_servers: StandaloneNats,
) -> None:
    run = f"large-{uuid.uuid4().hex[:6]}"
    bed = nats_servers.bed

    async def publish() -> int:
        admin = await bed.hub.connect()
        worker = await connection.connect(
            bed.leaves[nats_servers.region].url, bed.run_user(run, BusRole.ROLLOUT)
        )
        try:
            await ensure_run_streams(admin, run, HUB_DOMAIN)
            js = worker.jetstream(domain=HUB_DOMAIN)
            await js.publish(trajectory_subject(run), bytes(8 << 20), timeout=30)
            return (await admin.jetstream().stream_info(trajectory_stream(run))).state.bytes
        finally:
            await worker.close()
            await delete_run_streams(admin, run, HUB_DOMAIN)
            await admin.close()

    assert asyncio.run(publish()) > 8 << 20

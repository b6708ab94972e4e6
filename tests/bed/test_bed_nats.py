"""NATS: the hub's JetStream reached through each region's own leaf node; nobody anonymous,
and each of a run's users does what its component needs, and nothing of another run's."""

from __future__ import annotations

import asyncio
import json
import uuid
from pathlib import Path

import nats
import pytest
from nats.errors import NoServersError

from rlfleet.api.wire import BusRole, trajectory_subject
from rlfleet.bus import connection
from rlfleet.bus.credentials import ACCOUNT, USER, NKey, Permissions, creds, user_jwt
from rlfleet.bus.streams import (
    TRAINER_ACK_WAIT_S,
    TRAINER_CONSUMER,
    run_stream_configs,
    trainer_consumer_config,
)
from rlfleet.local.nats import HUB_DOMAIN, NatsServer, StandaloneNats
from rlfleet.testbed.bed import BedInfo
from rlfleet.testbed.permissions import NEEDS, nats_matrix


async def _connect(server: NatsServer, credentials: str | None = None, **options):
    return await connection.connect(
        server.url,
        credentials if credentials is not None else Path(server.credentials),
        allow_reconnect=False,
        connect_timeout=5,
        max_reconnect_attempts=0,
        **options,
    )


def test_publish_on_each_region_leaf_is_consumed_at_the_hub(bed: BedInfo) -> None:
    # What crosses a leaf is what a region's run users need (`permissions.leaf_permissions`): a
    # rollout worker at each leaf publishes its run's trajectories into the hub's stream.
    run = f"leaf-{uuid.uuid4().hex[:6]}"

    async def scenario() -> None:
        hub = await _connect(bed.nats.hub)
        try:
            hub_js = hub.jetstream()
            for config in run_stream_configs(run):
                await hub_js.add_stream(config)
            for region, leaf in bed.nats.leaves.items():
                client = await _connect(leaf, bed.nats.run_user(run, BusRole.ROLLOUT))
                try:
                    # The leaf's own domain is the region; the hub's streams are one domain away.
                    ack = await client.jetstream(domain=HUB_DOMAIN).publish(
                        trajectory_subject(run), region.encode()
                    )
                    assert ack.stream == f"TRAJ-{run}"
                finally:
                    await client.close()
            consumer = await hub_js.pull_subscribe(trajectory_subject(run), durable="hub-reader")
            messages = await consumer.fetch(len(bed.nats.leaves), timeout=10)
            assert sorted(m.data.decode() for m in messages) == sorted(bed.nats.leaves)
            for message in messages:
                await message.ack()
        finally:
            for config in run_stream_configs(run):
                await hub.jetstream().delete_stream(config.name)
            await hub.close()

    asyncio.run(scenario())


def _stranger() -> str:
    """A user signed by an account key the servers were never told of."""
    account, user = NKey.generate(ACCOUNT), NKey.generate(USER)
    jwt = user_jwt(account, account.public, user, "stranger", Permissions())
    return creds(jwt, user.seed)


@pytest.mark.parametrize("who", ["anonymous", "a user of an account no server trusts"])
def test_unauthenticated_clients_are_refused(bed: BedInfo, who: str) -> None:
    servers = [bed.nats.hub, *bed.nats.leaves.values()]

    async def attempt(server: NatsServer) -> None:
        errors: list[Exception] = []

        async def record(error: Exception) -> None:
            errors.append(error)

        with pytest.raises((NoServersError, nats.errors.Error, OSError)):
            if who == "anonymous":
                await nats.connect(
                    server.url, allow_reconnect=False, connect_timeout=5, error_cb=record
                )
            else:
                await _connect(server, _stranger(), error_cb=record)
        assert any("authorization" in str(e).lower() for e in errors), errors

    for server in servers:
        asyncio.run(attempt(server))


def test_a_runs_users_reach_its_streams_from_a_region_and_nothing_of_another_run(
    bed: BedInfo,
) -> None:
    mine, theirs = (f"perm-{uuid.uuid4().hex[:6]}" for _ in range(2))
    region = next(iter(bed.nats.leaves.values()))

    async def scenario() -> None:
        admin = await _connect(bed.nats.hub)
        denied: list[str] = []

        async def record(error: Exception) -> None:
            denied.append(str(error).lower())

        worker = await _connect(region, bed.nats.run_user(mine, BusRole.ROLLOUT), error_cb=record)
        trainer = await _connect(bed.nats.hub, bed.nats.run_user(mine, BusRole.TRAINER))
        try:
            for run in (mine, theirs):
                for config in run_stream_configs(run):
                    await admin.jetstream().add_stream(config)
            # The operator makes the trainer's consumer; the trainer binds to it.
            await admin.jetstream().add_consumer(
                f"TRAJ-{mine}", trainer_consumer_config(mine, TRAINER_ACK_WAIT_S)
            )
            js = worker.jetstream(domain=HUB_DOMAIN, timeout=2)
            ack = await js.publish(trajectory_subject(mine), b"trajectory")
            assert ack.stream == f"TRAJ-{mine}"
            reader = await trainer.jetstream(timeout=2).pull_subscribe_bind(
                durable=TRAINER_CONSUMER, stream=f"TRAJ-{mine}"
            )
            [message] = await reader.fetch(1, timeout=10)
            await message.ack()
            assert message.data == b"trajectory"
            # Another run's subjects and streams: the server refuses, and says so.
            with pytest.raises(nats.errors.TimeoutError):
                await js.publish(trajectory_subject(theirs), b"forged", timeout=2)
            with pytest.raises(nats.errors.TimeoutError):
                await js.stream_info(f"TRAJ-{theirs}")
            await worker.subscribe(trajectory_subject(theirs))
            await worker.flush()
            await asyncio.sleep(0.5)
            theirs_stream = (await admin.jetstream().stream_info(f"TRAJ-{theirs}")).state
            assert theirs_stream.messages == 0
        finally:
            await worker.close()
            await trainer.close()
            for run in (mine, theirs):
                for config in run_stream_configs(run):
                    await admin.jetstream().delete_stream(config.name)
            await admin.close()
        assert any(f'publish to "{trajectory_subject(theirs)}"' in d for d in denied), denied
        assert any(f'subscription to "{trajectory_subject(theirs)}"' in d for d in denied), denied
        assert any(f"traj-{theirs}" in d for d in denied), denied

    asyncio.run(scenario())


def test_each_component_may_do_what_it_needs_on_nats_and_nothing_more(
    nats_servers: StandaloneNats,
) -> None:
    """The least-privilege matrix: every role against every kind of operation, on its own
    run and another's (`rlfleet.testbed.permissions`)."""
    mine, theirs = (f"matrix-{uuid.uuid4().hex[:6]}" for _ in range(2))
    tried = asyncio.run(nats_matrix(nats_servers.bed, mine, theirs))
    wrong = [
        f"{c.role} {c.operation}: {'allowed' if c.allowed else 'refused'}"
        for c in tried
        if c.violation
    ]
    print(json.dumps({"permission_checks": len(tried), "permission_violations": len(wrong)}))
    assert wrong == []
    assert sum(c.allowed for c in tried) == sum(len(needs) + 1 for needs in NEEDS.values())

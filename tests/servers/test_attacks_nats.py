"""Attacks on the NATS boundary, each tried against the real hub and a region's
leaf node (`rlfleet.local.nats.StandaloneNats`) with the users the hub operator mints.

The attacker holds one credential a run's pod or a region holds (a rollout worker's, the
read-only observer's, a region leaf node's login) or one that should no longer work (an
expired one, a deleted run's), and tries what that credential must not do. Each test is
one attack, and passes when the servers refuse it: an attack that gets through leaves its
mark on the servers' state (a consumer made, a message taken or stored, a stream gone),
which is what each test reads back as the hub's own admin."""

from __future__ import annotations

import asyncio
import json
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import nats
import nats.errors
import nats.js.errors
import pytest
from nats.js.api import AckPolicy, ConsumerConfig, DeliverPolicy

from rlfleet.api.wire import (
    BusRole,
    serving_stream,
    serving_subject,
    step_subject,
    task_stream,
    trajectory_stream,
    trajectory_subject,
    weights_stream,
)
from rlfleet.bus import connection
from rlfleet.bus.streams import (
    TRAINER_CONSUMER,
    delete_run_streams,
    ensure_run_streams,
    step_stream,
)
from rlfleet.local.nats import HUB_DOMAIN, NatsServer, StandaloneNats

REFUSED = (TimeoutError, nats.errors.Error, nats.js.errors.Error)  # how a refusal shows
WAIT_S = 2.0  # for an answer the servers will not give


@dataclass
class Victim:
    """A run with its streams, and the servers; what every attack is tried on."""

    servers: StandaloneNats
    run: str

    @property
    def hub(self) -> NatsServer:
        return self.servers.bed.hub

    @property
    def leaf(self) -> NatsServer:
        return self.servers.bed.leaves[self.servers.region]

    def user(self, role: BusRole, **minting) -> str:
        return self.servers.bed.run_user(self.run, role, **minting)


def _run(name: str) -> str:
    return f"{name}-{uuid.uuid4().hex[:6]}"


async def _client(server: NatsServer | str, credentials: str | Path, **options) -> nats.NATS:
    url = server if isinstance(server, str) else server.url
    return await connection.connect(
        url, credentials, allow_reconnect=False, connect_timeout=5, **options
    )


async def _logs_in(server: NatsServer | str, credentials: str | Path) -> bool:
    """Whether the server lets a client in with `credentials`."""
    try:
        nc = await _client(server, credentials)
    except REFUSED:
        return False
    await nc.close()
    return True


async def _admin(victim: Victim) -> nats.NATS:
    return await victim.hub.connect()


async def _made(servers: StandaloneNats, run: str) -> None:
    """The run's streams, and the trainer's consumer of its trajectories, as the hub
    makes them (a release that let the trainer make its own: as the trainer did)."""
    admin = await servers.bed.hub.connect()
    try:
        await ensure_run_streams(admin, run, HUB_DOMAIN, [servers.region])
        js = admin.jetstream()
        try:
            await js.consumer_info(trajectory_stream(run), TRAINER_CONSUMER)
        except nats.js.errors.NotFoundError:
            trainer = ConsumerConfig(durable_name=TRAINER_CONSUMER, ack_policy=AckPolicy.EXPLICIT)
            await js.add_consumer(trajectory_stream(run), trainer)
    finally:
        await admin.close()


@pytest.fixture(scope="module")
def victim(nats_servers: StandaloneNats) -> Iterator[Victim]:
    run = _run("victim")
    asyncio.run(_made(nats_servers, run))
    yield Victim(nats_servers, run)

    async def remove() -> None:
        admin = await nats_servers.bed.hub.connect()
        await delete_run_streams(admin, run, HUB_DOMAIN, [nats_servers.region])
        await admin.close()

    asyncio.run(remove())


@pytest.mark.attack("nats")
def test_a_worker_lists_every_runs_streams(victim: Victim) -> None:
    """A rollout worker's credential asks the hub for the names of every stream (every
    run's), as nats-py does to find a stream by subject."""

    async def attack() -> list[str] | None:
        worker = await _client(victim.leaf, victim.user(BusRole.ROLLOUT))
        try:
            answer = await worker.request(
                f"$JS.{HUB_DOMAIN}.API.STREAM.NAMES", b"{}", timeout=WAIT_S
            )
            return json.loads(answer.data).get("streams")
        except REFUSED:
            return None
        finally:
            await worker.close()

    assert asyncio.run(attack()) is None


@pytest.mark.attack("nats")
def test_an_observer_makes_a_consumer_on_the_trajectories(victim: Victim) -> None:
    """The read-only observer makes itself a consumer of the trainer's trajectories."""

    async def attack() -> set[str]:
        observer = await _client(victim.hub, victim.user(BusRole.OBSERVER))
        admin = await _admin(victim)
        try:
            with pytest.raises(REFUSED):
                await observer.jetstream(timeout=WAIT_S).add_consumer(
                    trajectory_stream(victim.run),
                    ConsumerConfig(deliver_policy=DeliverPolicy.ALL),
                )
            consumers = await admin.jetstream().consumers_info(trajectory_stream(victim.run))
            return {c.name for c in consumers}
        finally:
            await observer.close()
            await admin.close()

    assert asyncio.run(attack()) == {TRAINER_CONSUMER}


@pytest.mark.attack("nats")
def test_an_observer_pulls_from_the_trainers_consumer(victim: Victim) -> None:
    """The observer pulls from the trainer's durable consumer: what it takes, the trainer
    does not get until it is redelivered."""
    stream = trajectory_stream(victim.run)

    async def attack() -> tuple[int, int]:
        admin = await _admin(victim)
        observer = await _client(victim.hub, victim.user(BusRole.OBSERVER))
        try:
            await admin.jetstream().publish(trajectory_subject(victim.run), b"trajectory")
            before = await admin.jetstream().consumer_info(stream, TRAINER_CONSUMER)
            with pytest.raises(REFUSED):
                pulled = await observer.jetstream(timeout=WAIT_S).pull_subscribe_bind(
                    durable=TRAINER_CONSUMER, stream=stream
                )
                await pulled.fetch(1, timeout=WAIT_S)
            after = await admin.jetstream().consumer_info(stream, TRAINER_CONSUMER)
            return before.delivered.stream_seq, after.delivered.stream_seq
        finally:
            await observer.close()
            await admin.close()

    before, after = asyncio.run(attack())
    assert after == before  # nothing taken from under the trainer


@pytest.mark.attack("nats")
def test_a_worker_leaves_a_durable_consumer_on_the_weights(victim: Victim) -> None:
    """A rollout worker's credential makes a durable consumer of the weights, which stays
    on the hub after it (made in a loop: the hub's memory and disk)."""
    stream = weights_stream(victim.run)

    async def attack() -> set[str]:
        worker = await _client(victim.leaf, victim.user(BusRole.ROLLOUT))
        admin = await _admin(victim)
        try:
            with pytest.raises(REFUSED):
                await worker.jetstream(domain=HUB_DOMAIN, timeout=WAIT_S).add_consumer(
                    stream, ConsumerConfig(durable_name="squatter")
                )
            return {c.name for c in await admin.jetstream().consumers_info(stream)}
        finally:
            await worker.close()
            await admin.close()

    assert "squatter" not in asyncio.run(attack())


@pytest.mark.attack("nats")
def test_a_conductor_stores_a_message_past_its_streams_bound(victim: Victim) -> None:
    """The conductor's credential stores a half-mebibyte message where a serving set's
    order (a few hundred bytes) goes: a few thousand fill the hub's store."""
    subject = serving_subject(victim.run, "stable")

    async def attack() -> int:
        conductor = await _client(victim.hub, victim.user(BusRole.CONDUCTOR))
        admin = await _admin(victim)
        try:
            with pytest.raises(REFUSED):
                await conductor.jetstream(timeout=WAIT_S).publish(subject, bytes(512 << 10))
            return (await admin.jetstream().stream_info(serving_stream(victim.run))).state.bytes
        finally:
            await conductor.close()
            await admin.close()

    assert asyncio.run(attack()) == 0


@pytest.mark.attack("nats")
def test_an_expired_credential_logs_in(victim: Victim) -> None:
    """A trainer's credential, leaked and tried after its lifetime."""
    leaked = victim.user(BusRole.TRAINER, ttl_s=1)

    async def attack() -> bool:
        await asyncio.sleep(2.5)  # the JWT's `exp` is in whole seconds
        return await _logs_in(victim.hub, leaked)

    assert not asyncio.run(attack())


@pytest.mark.attack("nats")
def test_a_connection_outlives_its_credential(victim: Victim) -> None:
    """A client logs in with a credential about to expire and keeps publishing on that
    connection after it has."""

    async def attack() -> int:
        nc = await _client(victim.hub, victim.user(BusRole.TRAINER, ttl_s=2))
        admin = await _admin(victim)
        try:
            await asyncio.sleep(3.5)
            with pytest.raises(REFUSED):
                await nc.jetstream(timeout=WAIT_S).publish(step_subject(victim.run), b"late")
            state = (await admin.jetstream().stream_info(step_stream(victim.run))).state
            return state.messages
        finally:
            await nc.close()
            await admin.close()

    assert asyncio.run(attack()) == 0


def _revoke(servers: StandaloneNats, incarnation: str) -> list[str]:
    """What the hub operator does when an RLRun is deleted: its users revoked."""

    async def revoke() -> list[str]:
        admin = await servers.bed.hub.connect()
        try:
            return await connection.revoke_run_users(
                admin,
                servers.bed.hub.url,
                HUB_DOMAIN,
                servers.bed.owner(),
                incarnation,
                3600,
                servers=2,
                wait_s=5,
            )
        finally:
            await admin.close()

    return asyncio.run(revoke())


@pytest.mark.attack("nats")
def test_a_deleted_runs_credential_logs_in(nats_servers: StandaloneNats) -> None:
    """A rollout worker's credential, leaked, tried at its region after its run was
    deleted."""
    run, uid = _run("deleted"), f"uid-{uuid.uuid4().hex[:8]}"
    leaked = nats_servers.bed.run_user(run, BusRole.ROLLOUT, incarnation=uid)
    assert len(_revoke(nats_servers, uid)) == 2  # the hub and the leaf node took it

    assert not asyncio.run(_logs_in(nats_servers.bed.leaves[nats_servers.region], leaked))


@pytest.mark.attack("nats")
def test_a_recreated_runs_old_credential_feeds_the_new_run(nats_servers: StandaloneNats) -> None:
    """A run is deleted and made again under the same name; a rollout worker credential
    leaked from the first publishes a trajectory into the second's stream."""
    run, first, second = _run("again"), "uid-first", f"uid-{uuid.uuid4().hex[:8]}"
    leaked = nats_servers.bed.run_user(run, BusRole.ROLLOUT, incarnation=first)
    _revoke(nats_servers, first)
    asyncio.run(_made(nats_servers, run))
    nats_servers.bed.run_user(run, BusRole.ROLLOUT, incarnation=second)  # the new run's

    async def attack() -> int:
        admin = await nats_servers.bed.hub.connect()
        try:
            with pytest.raises(REFUSED):
                worker = await _client(nats_servers.bed.leaves[nats_servers.region], leaked)
                try:
                    js = worker.jetstream(domain=HUB_DOMAIN, timeout=WAIT_S)
                    await js.publish(trajectory_subject(run), b"forged")
                finally:
                    await worker.close()
            return (await admin.jetstream().stream_info(trajectory_stream(run))).state.messages
        finally:
            await delete_run_streams(admin, run, HUB_DOMAIN, [nats_servers.region])
            await admin.close()

    assert asyncio.run(attack()) == 0


@pytest.mark.attack("nats")
def test_a_region_publishes_a_step_report_to_the_hub(victim: Victim) -> None:
    """Anyone at a region's leaf node (its own admin, a process there with no run's user)
    sends the hub a forged step report, which the hub operator folds into the run's
    status: the leaf's login to the hub must not carry it."""

    async def attack() -> int:
        region = await victim.leaf.connect()
        admin = await _admin(victim)
        try:
            with pytest.raises(REFUSED):
                await region.jetstream(domain=HUB_DOMAIN, timeout=WAIT_S).publish(
                    step_subject(victim.run), b"forged step"
                )
            state = (await admin.jetstream().stream_info(step_stream(victim.run))).state
            return state.messages
        finally:
            await region.close()
            await admin.close()

    assert asyncio.run(attack()) == 0


@pytest.mark.attack("nats")
def test_a_region_deletes_a_stream_at_the_hub(nats_servers: StandaloneNats) -> None:
    """Anyone at a region's leaf node deletes a run's task queue at the hub."""
    run = _run("doomed")
    asyncio.run(_made(nats_servers, run))

    async def attack() -> bool:
        region = await nats_servers.bed.leaves[nats_servers.region].connect()
        admin = await nats_servers.bed.hub.connect()
        try:
            with pytest.raises(REFUSED):
                await region.jetstream(domain=HUB_DOMAIN, timeout=WAIT_S).delete_stream(
                    task_stream(run)
                )
            try:
                await admin.jetstream().stream_info(task_stream(run))
            except nats.js.errors.NotFoundError:
                return False
            return True
        finally:
            await delete_run_streams(admin, run, HUB_DOMAIN, [nats_servers.region])
            await region.close()
            await admin.close()

    assert asyncio.run(attack())


@pytest.mark.attack("nats")
def test_a_region_pulls_the_trainers_trajectories(victim: Victim) -> None:
    """Anyone at a region's leaf node pulls from the trainer's durable consumer at the
    hub, through the leaf's login."""
    stream = trajectory_stream(victim.run)

    async def attack() -> tuple[int, int]:
        region = await victim.leaf.connect()
        admin = await _admin(victim)
        try:
            await admin.jetstream().publish(trajectory_subject(victim.run), b"trajectory")
            before = await admin.jetstream().consumer_info(stream, TRAINER_CONSUMER)
            with pytest.raises(REFUSED):
                js = region.jetstream(domain=HUB_DOMAIN, timeout=WAIT_S)
                pulled = await js.pull_subscribe_bind(durable=TRAINER_CONSUMER, stream=stream)
                await pulled.fetch(1, timeout=WAIT_S)
            after = await admin.jetstream().consumer_info(stream, TRAINER_CONSUMER)
            return before.delivered.stream_seq, after.delivered.stream_seq
        finally:
            await region.close()
            await admin.close()

    before, after = asyncio.run(attack())
    assert after == before


@pytest.mark.attack("nats")
def test_a_leaf_nodes_login_connects_as_a_client(victim: Victim) -> None:
    """A region leaf node's credential, leaked, used by a client at the hub, which would
    then be whatever that login may be."""
    login = Path(victim.hub.credentials).parent / f"leaf-{victim.servers.region}.creds"

    assert not asyncio.run(_logs_in(victim.hub, login.read_text()))

"""A run's NATS users end: each JWT expires, its owner signs it again before then and its
processes reconnect with the new one unasked; a deleted run's users are revoked on every
server, its live connections closed. Against the real hub and leaf node
(`rlfleet.local.nats.StandaloneNats`); the attacks on them are in test_attacks_nats.py."""

from __future__ import annotations

import asyncio
import time
import uuid
from pathlib import Path

import nats.errors

from rlfleet.api.wire import BusRole
from rlfleet.bus import connection
from rlfleet.bus.credentials import ACCOUNT, NKey, claims_of, expires_at, parse_creds
from rlfleet.bus.permissions import mint_run_user, renewal_due
from rlfleet.local.files import write_secret
from rlfleet.local.nats import HUB_DOMAIN, NatsBed, StandaloneNats
from rlfleet.operator.dataplane import DataPlane, NatsLogin


def test_a_user_is_due_for_renewal_with_a_third_of_its_life_left() -> None:
    seed = NKey.generate(ACCOUNT).seed
    account = NKey.generate(ACCOUNT).public
    user = mint_run_user(seed, account, "r", BusRole.TRAINER, "uid-1", ttl_s=3000)
    expires = expires_at(user)
    assert expires is not None and abs(expires - (time.time() + 3000)) < 5
    assert not renewal_due(user, expires - 1001, 3000)
    assert renewal_due(user, expires - 999, 3000)
    # The same key through the run's life, another for a run made again under its name.
    again = mint_run_user(seed, account, "r", BusRole.TRAINER, "uid-1", ttl_s=3000)
    other = mint_run_user(seed, account, "r", BusRole.TRAINER, "uid-2", ttl_s=3000)
    key = claims_of(parse_creds(user)[0])["sub"]
    assert claims_of(parse_creds(again)[0])["sub"] == key
    assert claims_of(parse_creds(other)[0])["sub"] != key


def test_a_renewed_user_is_picked_up_before_the_old_one_expires(
    nats_servers: StandaloneNats, tmp_path: Path
) -> None:
    """The owner rewrites the .creds file (a Secret's mounted file follows it); the client
    reconnects with it by itself and outlives its first JWT. One left alone is closed by
    the server when its JWT expires."""
    # JWT expiries are whole seconds, rounded down: the renewal comes half a TTL after
    # the first user, so the check, a second past the first's expiry, is a second or
    # more before the renewed one's.
    bed, run, ttl = nats_servers.bed, f"renew-{uuid.uuid4().hex[:6]}", 6.0
    renewed, stale = tmp_path / "renewed.creds", tmp_path / "stale.creds"
    write_secret(renewed, bed.run_user(run, BusRole.TRAINER, ttl_s=ttl))
    write_secret(stale, bed.run_user(run, BusRole.FEED, ttl_s=ttl))

    async def scenario() -> tuple[bool, bool, int]:
        reconnects = 0

        async def reconnected() -> None:
            nonlocal reconnects
            reconnects += 1

        kept = await connection.connect(bed.hub.url, renewed, reconnected_cb=reconnected)
        left = await connection.connect(bed.hub.url, stale, max_reconnect_attempts=-1)
        await asyncio.sleep(ttl / 2)
        write_secret(renewed, bed.run_user(run, BusRole.TRAINER, ttl_s=ttl))
        await asyncio.sleep(ttl / 2 + 1)  # past the first JWT's expiry
        await kept.flush(timeout=5)  # the server still answers it
        try:
            return kept.is_connected, left.is_connected, reconnects
        finally:
            await kept.close()
            await left.close()

    kept, left, reconnects = asyncio.run(scenario())
    assert kept and reconnects == 1
    assert not left


def _dataplane(bed: NatsBed, with_owner: bool = True) -> DataPlane:
    def login() -> NatsLogin:
        owner = bed.owner()
        return NatsLogin(
            Path(bed.hub.credentials).read_text(),
            owner.signer_seed,
            owner.operator_seed if with_owner else None,
            owner.system_credentials if with_owner else None,
        )

    return DataPlane(bed.hub.url, login, HUB_DOMAIN, timeout_s=10.0)


def test_the_hub_revokes_a_deleted_runs_users_on_every_server(
    nats_servers: StandaloneNats,
) -> None:
    """As the hub operator does when an RLRun is deleted: its users' connections at the hub
    and at a region's leaf node close, and their credentials are refused from then on; a
    run made again under the same name (another uid) gets users that work."""
    bed, run = nats_servers.bed, f"revoke-{uuid.uuid4().hex[:6]}"
    leaf = bed.leaves[nats_servers.region]
    dataplane = _dataplane(bed)
    old = dataplane.run_users(run, "uid-old", 3600)
    new = dataplane.run_users(run, "uid-new", 3600)

    async def scenario() -> tuple[list[bool], list[str]]:
        clients = [
            await connection.connect(bed.hub.url, old[BusRole.TRAINER], allow_reconnect=False),
            await connection.connect(leaf.url, old[BusRole.ROLLOUT], allow_reconnect=False),
        ]
        await asyncio.to_thread(dataplane.revoke_users, run, "uid-old", 3600, 2)
        await asyncio.sleep(0.5)
        closed = [c.is_closed for c in clients]
        refused = []
        for url, user in ((bed.hub.url, old[BusRole.TRAINER]), (leaf.url, old[BusRole.ROLLOUT])):
            try:
                nc = await connection.connect(url, user, allow_reconnect=False, connect_timeout=5)
            except nats.errors.Error as error:
                refused.append(str(error))
            else:
                await nc.close()
        fresh = await connection.connect(leaf.url, new[BusRole.ROLLOUT], allow_reconnect=False)
        await fresh.close()
        return closed, refused

    closed, refused = asyncio.run(scenario())
    assert closed == [True, True]
    assert len(refused) == 2 and all("Authorization Violation" in r for r in refused)

"""NATS: the hub's JetStream reached through each region's own leaf node; nobody anonymous."""

from __future__ import annotations

import asyncio
import uuid

import nats
import pytest
from nats.errors import NoServersError
from nats.js.api import StreamConfig

from rlfleet.testbed.bed import BedInfo
from rlfleet.testbed.nats import HUB_DOMAIN

pytestmark = pytest.mark.nats


async def _connect(url: str, **options):
    return await nats.connect(
        url, allow_reconnect=False, connect_timeout=5, max_reconnect_attempts=0, **options
    )


def test_publish_on_each_region_leaf_is_consumed_at_the_hub(bed: BedInfo) -> None:
    async def scenario() -> None:
        stream = f"T{uuid.uuid4().hex[:8]}"
        hub = await _connect(bed.nats.hub.authenticated_url)
        try:
            hub_js = hub.jetstream()
            await hub_js.add_stream(StreamConfig(name=stream, subjects=[f"{stream}.>"]))
            for region, leaf in bed.nats.leaves.items():
                client = await _connect(leaf.authenticated_url)
                try:
                    # The leaf's own domain is the region; the hub's streams are one domain away.
                    ack = await client.jetstream(domain=HUB_DOMAIN).publish(
                        f"{stream}.{region}", region.encode()
                    )
                    assert ack.stream == stream
                finally:
                    await client.close()
            consumer = await hub_js.pull_subscribe(f"{stream}.>", durable="hub-reader")
            messages = await consumer.fetch(len(bed.nats.leaves), timeout=10)
            assert sorted(m.data.decode() for m in messages) == sorted(bed.nats.leaves)
            for message in messages:
                await message.ack()
        finally:
            await hub.close()

    asyncio.run(scenario())


@pytest.mark.parametrize("who", ["anonymous", "wrong password"])
def test_unauthenticated_clients_are_refused(bed: BedInfo, who: str) -> None:
    servers = [bed.nats.hub, *bed.nats.leaves.values()]

    async def attempt(url: str) -> None:
        errors: list[Exception] = []

        async def record(error: Exception) -> None:
            errors.append(error)

        with pytest.raises((NoServersError, nats.errors.Error, OSError)):
            await _connect(url, error_cb=record)
        assert any("authorization" in str(e).lower() for e in errors), errors

    for server in servers:
        host = server.url.removeprefix("nats://")
        url = server.url if who == "anonymous" else f"nats://{server.user}:wrong@{host}"
        asyncio.run(attempt(url))

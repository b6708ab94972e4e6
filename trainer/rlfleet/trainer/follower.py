"""What every rank of the trainer's job runs besides rank 0's `Trainer`: its publisher of
the run's version stream and the publishing collective all ranks take part in, and the
loop of a rank other than 0 (`follow`), which does what rank 0 orders.

Apart from `rlfleet.trainer.loop` because none of it reads the trajectory stream: a
follower holds no consumer, buffer or client state (`rlfleet.trainer.distributed` says
why one reader feeds them all), only its share of the policy.
"""

from __future__ import annotations

import asyncio
import logging

from rlfleet.api.wire import WeightManifest
from rlfleet.bus import connection
from rlfleet.bus.patience import TRANSIENT, patiently
from rlfleet.launch.settings import TrainerConfig
from rlfleet.trainer import distributed
from rlfleet.trainer.distributed import Kind
from rlfleet.trainer.policy import Policy
from rlfleet.weightsync import Part, Publisher, PublishFailed, WeightStream

log = logging.getLogger(__name__)


async def rank_publisher(nc, config: TrainerConfig) -> Publisher:
    """This rank's publisher of the run's one version stream: each rank puts the shards
    of the tensors it owns (`Policy.weights`), rank 0 the manifest."""
    weights = WeightStream(nc, config.run, config.weightsync, config.jetstream_domain)
    await weights.bind()
    mirrors = [
        WeightStream(nc, config.run, config.weightsync, domain) for domain in config.weight_mirrors
    ]
    part = Part(distributed.rank(), distributed.world(), distributed.gather)
    return Publisher(weights, config.weightsync, mirrors, part=part)


async def publish(policy: Policy, publisher: Publisher, version: int) -> list[WeightManifest]:
    """Collective: every rank gathers its part of the policy and publishes it as `version`,
    again while NATS restarts (every rank fails the same try: the publisher gathers each
    rank's outcome, and another rank's failure is its `PublishFailed`)."""
    weights = await asyncio.to_thread(policy.weights)
    return await patiently(
        lambda: publisher.publish(weights, version),
        f"publishing version {version}",
        transient=(*TRANSIENT, PublishFailed),
    )


async def follow(config: TrainerConfig, local_rank: int) -> None:
    """A rank other than 0: takes its part in every collective rank 0 starts (restoring,
    training its share of each step, saving, publishing) until told to stop."""
    policy = await asyncio.to_thread(Policy, config, local_rank)
    state = await asyncio.to_thread(policy.load)
    if state is None and config.production:  # with rank 0's save of version 0
        await asyncio.to_thread(policy.save, 0, {"step": 0})
    nc = await connection.connect(config.nats_url, max_reconnect_attempts=-1)
    try:
        publisher = await rank_publisher(nc, config)
        await publish(policy, publisher, state["step"] if state is not None else 0)
        while (order := await asyncio.to_thread(distributed.receive)).kind is not Kind.STOP:
            if order.kind is Kind.STEP:
                await asyncio.to_thread(
                    policy.train_step, order.micro_batches, order.tokens, order.held_out
                )
                # Rank 0's client state is the one resumed from; this node's own checkpoint
                # says which version it holds.
                step = order.step
                await asyncio.to_thread(policy.save, step, {"step": step}, order.pinned)
                await publish(policy, publisher, step)
            elif order.kind is Kind.RESTORE:
                await asyncio.to_thread(policy.restore, order.step)
    finally:
        await nc.close()
    log.info("rank %d: stopped with rank 0", distributed.rank())

"""The JetStream streams of one run, declared once, and the one function that makes them.

Whoever starts a run makes its streams (`ensure_run_streams`): the hub operator, or
`rlfleet run` on one machine. Components only bind to them (`bind_stream`) and fail,
naming the stream, when it is not there; none creates or rewrites a stream, so no
component's idea of a stream's config can drift from what is declared here.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Sequence
from dataclasses import dataclass

import nats.errors
from nats.aio.client import Client
from nats.js import JetStreamContext
from nats.js.api import (
    AckPolicy,
    ConsumerConfig,
    ConsumerInfo,
    DiscardPolicy,
    ExternalStream,
    RetentionPolicy,
    StorageType,
    StreamConfig,
    StreamInfo,
    StreamSource,
)
from nats.js.errors import BadRequestError, NotFoundError

from rlfleet.api.rlrun import RLRunSpec
from rlfleet.api.wire import (
    WEIGHT_CHUNK_BYTES,
    capture_stream,
    capture_subject,
    conductor_subjects,
    cycle_subject,
    evaluation_subject,
    feedback_stream,
    feedback_subject,
    live_subject,
    serving_stream,
    serving_subject,
    step_subject,
    task_stream,
    task_subject,
    trajectory_stream,
    trajectory_subject,
    weights_prefix,
    weights_stream,
)

log = logging.getLogger(__name__)

# Step reports kept per run: enough history to read a run's recent progress after a
# restart, bounded so a run of a million steps does not grow the stream without end.
STEP_REPORTS_KEPT = 10_000
EVALUATIONS_KEPT = 1_000  # one every `everyVersions` versions: a long run's whole history
CYCLES_KEPT = 1_000  # a production run's cycles, a few a day: months of them
# What a production pool's servers capture and the feedback on it, kept this long (a
# cycle collects for hours) and bounded in count so a busy pool cannot fill the store.
PRODUCTION_KEPT_S = 7 * 24 * 3600.0
CAPTURES_KEPT = 1_000_000
FEEDBACK_KEPT = 4_000_000
# One completion's tokens, log-probs and versions, in one message: a NATS server's default
# max_payload. A longer one (some 70k tokens) is dropped by the server that made it.
MAX_CAPTURE_BYTES = 1 << 20
# Tasks waiting for a worker: the feed keeps a few steps' worth there (its admission), so
# only a feed gone wrong meets this bound.
TASKS_WAITING = 100_000
# The spec's default, in bytes.
TRAJECTORY_BACKLOG = RLRunSpec.model_fields["trajectory_backlog_mib"].default << 20
MAX_TRAJECTORY_BYTES = 32 << 20  # one trajectory, its routed experts included
# One task: its prompt, starting tree, hidden tests and environment's files.
MAX_TASK_BYTES = 8 << 20
# One report (a step's, an evaluation's, a cycle's or the conductor's state, whose history
# is bounded) or order: small, and bounded so that no writer can fill a stream with a few.
MAX_REPORT_BYTES = 1 << 20
MAX_FEEDBACK_BYTES = 64 << 10  # one client event on one response
MAX_SERVING_BYTES = 64 << 10  # which version one set of servers serves
MAX_WEIGHTS_BYTES = WEIGHT_CHUNK_BYTES + 4096  # a chunk of a shard and its headers
# How long a component waits for a stream its run's owner has not made yet: the hub
# operator starts a run's pods and makes its streams in the same reconcile.
BIND_WAIT_S = 30.0


class StreamMissing(LookupError):
    """A stream or consumer a component needs is not there: whoever starts the run makes
    it."""


# The run's durable consumers, made with its streams by whoever starts it: a component
# only binds to its own (`bind_consumer`), with no right to make, change or delete one,
# nor to take messages from another's. The trainer's, of the trajectory stream: its
# acknowledgements say which trajectories are done with (an audit reads its ack floor).
TRAINER_CONSUMER = "trainer"
WORKER_CONSUMER = "rollout"  # the task queue's, shared by every rollout worker of the run
# JetStream redelivers what a dead trainer never acknowledged after this; a live one
# keeps what it holds by saying so a third of it apart.
TRAINER_ACK_WAIT_S = 60.0
WORKER_ACK_WAIT_S = 600.0  # a task whose worker died is redelivered after this
TASK_MAX_DELIVER = 5  # a task that keeps failing is not a loop


@dataclass(frozen=True)
class ConsumerWaits:
    """How long the run's durable consumers wait for an acknowledgement."""

    trainer_s: float = TRAINER_ACK_WAIT_S
    worker_s: float = WORKER_ACK_WAIT_S


def trainer_consumer_config(run: str, ack_wait_s: float) -> ConsumerConfig:
    return ConsumerConfig(
        durable_name=TRAINER_CONSUMER,
        filter_subject=trajectory_subject(run),
        ack_policy=AckPolicy.EXPLICIT,
        ack_wait=ack_wait_s,
        max_ack_pending=-1,
    )


def worker_consumer_config(run: str, ack_wait_s: float) -> ConsumerConfig:
    return ConsumerConfig(
        durable_name=WORKER_CONSUMER,
        filter_subject=task_subject(run),
        ack_policy=AckPolicy.EXPLICIT,
        ack_wait=ack_wait_s,
        max_ack_pending=-1,
        max_deliver=TASK_MAX_DELIVER,
    )


def run_consumer_configs(run: str, waits: ConsumerWaits) -> list[tuple[str, ConsumerConfig]]:
    """Every durable consumer of the run, with the stream it reads."""
    return [
        (trajectory_stream(run), trainer_consumer_config(run, waits.trainer_s)),
        (task_stream(run), worker_consumer_config(run, waits.worker_s)),
    ]


def step_stream(run: str) -> str:
    return f"STEPS-{run}"


def task_stream_config(run: str) -> StreamConfig:
    """The run's task queue: each task goes to exactly one worker. The feed's admission
    keeps a few steps' tasks waiting; past `TASKS_WAITING` a publish is refused."""
    return StreamConfig(
        name=task_stream(run),
        subjects=[task_subject(run)],
        retention=RetentionPolicy.WORK_QUEUE,
        storage=StorageType.FILE,
        discard=DiscardPolicy.NEW,
        max_msgs=TASKS_WAITING,
        max_msg_size=MAX_TASK_BYTES,
    )


def trajectory_stream_config(run: str, backlog_bytes: int = TRAJECTORY_BACKLOG) -> StreamConfig:
    """Trajectories for the trainer (work-queue semantics come from acknowledgement), at
    most `backlog_bytes` of them (`spec.trajectoryBacklogMib`), the oldest first
    to go: they stay after training, so that an audit can read what was published."""
    return StreamConfig(
        name=trajectory_stream(run),
        subjects=[trajectory_subject(run)],
        storage=StorageType.FILE,
        discard=DiscardPolicy.OLD,
        max_msg_size=MAX_TRAJECTORY_BYTES,
        max_bytes=backlog_bytes,
    )


def _reports(name: str, subject: str, kept: int) -> StreamConfig:
    """Reports read by their newest (direct get), the last `kept` of them retained."""
    return StreamConfig(
        name=name,
        subjects=[subject],
        storage=StorageType.FILE,
        discard=DiscardPolicy.OLD,
        max_msgs=kept,
        max_msg_size=MAX_REPORT_BYTES,
        allow_direct=True,
    )


def step_stream_config(run: str) -> StreamConfig:
    """The trainer's step reports, which the hub operator folds into the run's status."""
    return _reports(step_stream(run), step_subject(run), STEP_REPORTS_KEPT)


def evaluation_stream(run: str) -> str:
    return f"EVALS-{run}"


def evaluation_stream_config(run: str) -> StreamConfig:
    """The evaluator's reports, which the hub operator holds to the evaluation gate."""
    return _reports(evaluation_stream(run), evaluation_subject(run), EVALUATIONS_KEPT)


def capture_stream_config(run: str) -> StreamConfig:
    """Completions a production pool served, one subject per response id, so feedback
    can be checked against it (direct get by subject) on any of the pool's servers."""
    return StreamConfig(
        name=capture_stream(run),
        subjects=[capture_subject(run)],
        storage=StorageType.FILE,
        discard=DiscardPolicy.OLD,
        max_age=PRODUCTION_KEPT_S,
        max_msgs=CAPTURES_KEPT,
        max_msg_size=MAX_CAPTURE_BYTES,
        allow_direct=True,
    )


def feedback_stream_config(run: str) -> StreamConfig:
    """Client feedback, one subject per (response, client event): the stream takes each
    subject's first message and refuses the rest, so a client's retry is recorded once
    however late it comes; when full it refuses new events rather than drop old ones."""
    return StreamConfig(
        name=feedback_stream(run),
        subjects=[feedback_subject(run)],
        storage=StorageType.FILE,
        discard=DiscardPolicy.NEW,
        discard_new_per_subject=True,
        max_msgs_per_subject=1,
        max_age=PRODUCTION_KEPT_S,
        max_msgs=FEEDBACK_KEPT,
        max_msg_size=MAX_FEEDBACK_BYTES,
        allow_direct=True,  # the collector reads a completion's events by subject
    )


def serving_stream_config(run: str) -> StreamConfig:
    """Which version each set of the pool's servers serves: the newest per set is the
    order, the few before it its history."""
    return StreamConfig(
        name=serving_stream(run),
        subjects=[serving_subject(run)],
        storage=StorageType.FILE,
        discard=DiscardPolicy.OLD,
        max_msgs_per_subject=16,
        max_msg_size=MAX_SERVING_BYTES,
        allow_direct=True,
    )


def cycle_stream(run: str) -> str:
    return f"CYCLES-{run}"


def cycle_stream_config(run: str) -> StreamConfig:
    """A production run's cycles: the collector's reports (its progress, read back when
    it restarts) and live reward tallies, and the conductor's state, evaluation requests
    and trainer resets. Each read by its subject's newest; each subject keeps its own
    history, so frequent tallies never push out a cycle's report."""
    return StreamConfig(
        name=cycle_stream(run),
        subjects=[cycle_subject(run), live_subject(run), conductor_subjects(run)],
        storage=StorageType.FILE,
        discard=DiscardPolicy.OLD,
        max_msgs_per_subject=CYCLES_KEPT,
        max_msg_size=MAX_REPORT_BYTES,
        allow_direct=True,
    )


def weights_stream_config(run: str) -> StreamConfig:
    """The run's weight versions on the hub (`rlfleet.weightsync`): shards in chunks read
    by batched direct get, and a publisher's retries dropped as duplicates."""
    return StreamConfig(
        name=weights_stream(run),
        subjects=[f"{weights_prefix(run)}.>"],
        storage=StorageType.FILE,
        allow_direct=True,
        discard=DiscardPolicy.OLD,
        max_msg_size=MAX_WEIGHTS_BYTES,
        duplicate_window=120.0,
    )


def weights_mirror_config(run: str, hub_domain: str) -> StreamConfig:
    """A region's copy of the run's weights, read there so a version crosses the WAN once
    per region; the publisher retires old versions from it as from the hub's."""
    name = weights_stream(run)
    return StreamConfig(
        name=name,
        storage=StorageType.FILE,
        allow_direct=True,
        max_msg_size=MAX_WEIGHTS_BYTES,
        mirror=StreamSource(name=name, external=ExternalStream(api=f"$JS.{hub_domain}.API")),
    )


def run_stream_configs(
    run: str, trajectory_backlog: int = TRAJECTORY_BACKLOG
) -> list[StreamConfig]:
    """Every stream the run has on the hub; the trajectories' first, whose bound is
    reserved: a new run the hub's store has no room for gets no stream at all."""
    return [
        trajectory_stream_config(run, trajectory_backlog),
        task_stream_config(run),
        step_stream_config(run),
        evaluation_stream_config(run),
        weights_stream_config(run),
        capture_stream_config(run),
        feedback_stream_config(run),
        cycle_stream_config(run),
        serving_stream_config(run),
    ]


# Users revoked with their runs (`rlfleet.bus.connection.revoke_run_users`): the owner of the
# runs' account reads them back each time it signs the account again.
REVOCATIONS = "RLFLEET-REVOKED"


def revocation_subject(incarnation: str = "*") -> str:
    return f"rlfleet.revoked.{incarnation}"


def revocation_stream_config(kept_s: float) -> StreamConfig:
    """One record per deleted run (its users' keys), kept `kept_s`: as long as a JWT of
    theirs may still be valid; past that, expiry refuses them without a revocation."""
    return StreamConfig(
        name=REVOCATIONS,
        subjects=[revocation_subject()],
        storage=StorageType.FILE,
        discard=DiscardPolicy.OLD,
        max_age=kept_s,
        max_msgs_per_subject=1,
        max_msg_size=MAX_REPORT_BYTES,
        allow_direct=True,
    )


def largest_message() -> int:
    """The largest message any stream of a run takes: a server's (and every leaf node's)
    `max_payload` must allow it, else a message the stream would take is refused at
    publish (a rollout worker whose trajectory it is redoes the whole group), and a leaf
    node drops its link on one."""
    return max(config.max_msg_size for config in run_stream_configs("any"))


async def _ensure(js: JetStreamContext, config: StreamConfig) -> None:
    """Creates the stream, or brings an existing one to `config`."""
    try:
        await js.add_stream(config)
    except BadRequestError:
        await js.update_stream(config)


async def ensure_run_streams(
    nc: Client,
    run: str,
    hub_domain: str | None,
    regions: Sequence[str] = (),
    trajectory_backlog: int = TRAJECTORY_BACKLOG,
    waits: ConsumerWaits = ConsumerWaits(),
) -> list[str]:
    """Makes the run's streams and durable consumers on the hub and a mirror of its
    weights in each region's JetStream domain, or brings them back to their declared
    config (idempotent); returns the regions whose mirror could not be made yet. `nc`
    reaches the hub's JetStream through `hub_domain` (None: no domains, and so no
    regions); `trajectory_backlog` bounds the trajectories' bytes."""
    if regions and hub_domain is None:
        raise ValueError("a region's mirror names the hub's JetStream domain: give it")
    hub = nc.jetstream(domain=hub_domain)
    for config in run_stream_configs(run, trajectory_backlog):
        await _ensure(hub, config)
    for stream, consumer in run_consumer_configs(run, waits):
        await hub.add_consumer(stream, consumer)  # made, or brought to its config
    missing = []
    for region in regions:
        try:
            await _ensure(nc.jetstream(domain=region), weights_mirror_config(run, hub_domain))
        except (nats.errors.Error, TimeoutError) as error:
            log.warning("weights mirror of run %s in region %s: %s", run, region, error)
            missing.append(region)
    return missing


async def delete_run_streams(
    nc: Client, run: str, hub_domain: str | None, regions: Sequence[str] = ()
) -> list[str]:
    """Deletes the run's streams on the hub and its weights' mirror in each region, so
    nothing of it outlives the run; returns the regions whose mirror is left. A stream
    that is not there is already gone."""
    hub = nc.jetstream(domain=hub_domain)
    for config in run_stream_configs(run):
        with contextlib.suppress(NotFoundError):
            await hub.delete_stream(config.name)
    left = []
    for region in regions:
        try:
            with contextlib.suppress(NotFoundError):
                await nc.jetstream(domain=region).delete_stream(weights_stream(run))
        except (nats.errors.Error, TimeoutError) as error:
            log.warning("weights mirror of run %s in region %s: %s", run, region, error)
            left.append(region)
    return left


async def bind_consumer(js: JetStreamContext, stream: str, name: str) -> ConsumerInfo:
    """The durable consumer `name` of `stream`, as `js` reaches it, waiting up to
    `BIND_WAIT_S` for the run's owner to make it; StreamMissing, naming both, when it is
    still not there."""
    deadline = time.monotonic() + BIND_WAIT_S
    while True:
        try:
            return await js.consumer_info(stream, name)
        except NotFoundError:
            if time.monotonic() >= deadline:
                raise StreamMissing(
                    f"consumer {name} of stream {stream} does not exist: a run's consumers "
                    "are made with its streams by whoever starts it (the hub operator, or "
                    "`rlfleet run`), not by its components"
                ) from None
            log.info("waiting for consumer %s of %s, which its run's owner makes", name, stream)
            await asyncio.sleep(1.0)


async def bind_stream(js: JetStreamContext, name: str) -> StreamInfo:
    """The stream `name` as `js` reaches it, waiting up to `BIND_WAIT_S` for its owner to
    make it; StreamMissing, naming it, when it is still not there."""
    deadline = time.monotonic() + BIND_WAIT_S
    while True:
        try:
            return await js.stream_info(name)
        except NotFoundError:
            if time.monotonic() >= deadline:
                raise StreamMissing(
                    f"stream {name} does not exist: a run's streams are made by "
                    "whoever starts it (the hub operator, or `rlfleet run`), not by its "
                    "components"
                ) from None
            log.info("waiting for stream %s, which its run's owner makes", name)
            await asyncio.sleep(1.0)

"""What a run lost or did twice, from durable state alone (`rlfleet.testbed.chaos`'s audit).

`Ledger.read` collects it: the run's trajectory stream and the trainer's consumer of it,
the trainer's step and drop logs, the task queue, and the weight manifests on the hub
and in each region. `audit` (pure) counts what is not accounted for.
"""

from __future__ import annotations

import asyncio
import statistics
from collections import Counter
from dataclasses import dataclass
from pathlib import Path

import msgspec
from nats.js import JetStreamContext

from rlfleet.api.wire import (
    StepReport,
    TrajectoryDrop,
    decode_manifest,
    decode_step_report,
    decode_trajectory,
    task_stream,
    task_subject,
    trajectory_id,
    trajectory_stream,
    trajectory_subject,
    weights_prefix,
    weights_stream,
)
from rlfleet.bus import connection
from rlfleet.bus.reading import messages
from rlfleet.bus.streams import TRAINER_CONSUMER

STEP_LOG, DROP_LOG = "steps.jsonl", "drops.jsonl"  # in the trainer's checkpoint folder


@dataclass(frozen=True)
class Ledger:
    """What durable state says after a run."""

    trajectories: dict[int, str | None]  # TRAJ stream sequence -> id (None: unreadable)
    acked_through: int  # the trainer's ack floor on that stream
    # Delivered to the trainer and not acknowledged (held, or held by a trainer that was
    # killed: redelivered after its ack wait), or not delivered yet.
    outstanding: int
    steps: list[StepReport]  # the trainer's step log
    drops: list[TrajectoryDrop]  # the trainer's drop log
    tasks_issued: int  # the task stream's last sequence: every task the feed published
    tasks_waiting: set[int]  # tasks still on the stream: not done yet, or given up on
    versions: dict[str, set[int]]  # the hub and each region -> versions its weights hold

    @classmethod
    def read(
        cls, run: str, hub_url: str, leaf_urls: dict[str, str], credentials: Path, checkpoints: Path
    ) -> Ledger:
        """From the run's streams (on the hub, and each region's mirror through its leaf
        node, read as the user of `credentials`) and the trainer's logs in `checkpoints`."""
        return asyncio.run(_read(run, hub_url, leaf_urls, credentials, checkpoints))


def step_log(checkpoints: Path) -> list[StepReport]:
    path = checkpoints / STEP_LOG
    lines = path.read_bytes().splitlines() if path.exists() else []
    return [decode_step_report(line) for line in lines if line.strip()]


def _drop_log(checkpoints: Path) -> list[TrajectoryDrop]:
    path = checkpoints / DROP_LOG
    lines = path.read_bytes().splitlines() if path.exists() else []
    return [msgspec.json.decode(line, type=TrajectoryDrop) for line in lines if line.strip()]


async def _read(
    run: str, hub_url: str, leaf_urls: dict[str, str], credentials: Path, checkpoints: Path
) -> Ledger:
    hub = await connection.connect(hub_url, credentials)
    try:
        js = hub.jetstream()
        trajectories: dict[int, str | None] = {}
        # The trajectory stream and the task queue allow no direct gets.
        read = messages(js, trajectory_stream(run), trajectory_subject(run), direct=False)
        async for message in read:
            try:
                trajectories[message.seq] = trajectory_id(decode_trajectory(message.data))
            except (msgspec.ValidationError, msgspec.DecodeError):
                trajectories[message.seq] = None
        consumer = await js.consumer_info(trajectory_stream(run), TRAINER_CONSUMER)
        tasks = await js.stream_info(task_stream(run))
        # A worker's acknowledgement deletes a task: those left are waiting or given up on.
        queue = messages(js, task_stream(run), task_subject(run), direct=False)
        waiting = {m.seq async for m in queue}
        versions = {"hub": await _versions(js, run)}
    finally:
        await hub.close()
    for region, url in leaf_urls.items():
        leaf = await connection.connect(url, credentials)
        try:
            versions[region] = await _versions(leaf.jetstream(domain=region), run)
        finally:
            await leaf.close()
    return Ledger(
        trajectories,
        consumer.ack_floor.stream_seq if consumer.ack_floor else 0,
        (consumer.num_ack_pending or 0) + (consumer.num_pending or 0),
        step_log(checkpoints),
        _drop_log(checkpoints),
        tasks.state.last_seq,
        waiting,
        versions,
    )


async def _versions(js: JetStreamContext, run: str) -> set[int]:
    subject = f"{weights_prefix(run)}.*.manifest.*"
    return {
        decode_manifest(m.data).version async for m in messages(js, weights_stream(run), subject)
    }


@dataclass(frozen=True)
class Audit:
    trajectories_published: int
    trajectories_trained: int
    trajectories_dropped: dict[str, int]  # by reason
    trajectories_pending: int  # still out with the trainer's consumer when the run stopped
    trajectories_lost: int
    trajectories_trained_twice: int
    tasks_issued: int
    tasks_attempted: int
    tasks_waiting: int
    tasks_lost: int
    newest_version: int
    versions_missing: int


def _task_seq(trajectory: str) -> int:
    """`<task>@<task stream seq>/<attempt>` -> the task's sequence."""
    return int(trajectory.rsplit("/", 1)[0].rsplit("@", 1)[1])


def audit(ledger: Ledger) -> Audit:
    """Every trajectory the trainer acknowledged was trained on exactly once or dropped
    with a reason; every task was attempted or is still waiting; every version the
    trainer reported is held wherever its weights are (back to the oldest kept there)."""
    # A step logged again as it was (a resume mends a lost line) is one step.
    steps = {msgspec.json.encode(s): s for s in ledger.steps}.values()
    trained = Counter(t for step in steps for t in step.trajectories)
    dropped_ids = {d.trajectory for d in ledger.drops}
    dropped_seqs = {d.seq for d in ledger.drops}
    unaccounted = [
        seq
        for seq, trajectory in ledger.trajectories.items()
        if seq not in dropped_seqs
        and (trajectory is None or (trajectory not in trained and trajectory not in dropped_ids))
    ]
    # Under the ack floor each one is lost; past it, any beyond what the trainer's
    # consumer still has out are.
    below = sum(1 for seq in unaccounted if seq <= ledger.acked_through)
    lost = max(below, len(unaccounted) - ledger.outstanding)
    attempted = {_task_seq(t) for t in ledger.trajectories.values() if t is not None}
    done = set(range(1, ledger.tasks_issued + 1)) - ledger.tasks_waiting
    reported = {s.policy_version for s in steps}
    newest = max(reported, default=0)
    missing = 0
    for held in ledger.versions.values():
        oldest = min(held, default=newest)  # the older ones may have been retired
        missing += len(({v for v in reported if v >= oldest} | ({newest} & reported)) - held)
    return Audit(
        trajectories_published=len(ledger.trajectories),
        trajectories_trained=len(trained),
        trajectories_dropped=dict(Counter(d.reason for d in ledger.drops)),
        trajectories_pending=ledger.outstanding,
        trajectories_lost=lost,
        trajectories_trained_twice=sum(n - 1 for n in trained.values() if n > 1),
        tasks_issued=ledger.tasks_issued,
        tasks_attempted=len(attempted),
        tasks_waiting=len(ledger.tasks_waiting),
        tasks_lost=len(done - attempted),
        newest_version=newest,
        versions_missing=missing,
    )


def recovery_seconds(injected: list[tuple[float, str]], steps: list[StepReport]) -> dict:
    """Per kind of fault, the p50 and p99 of the seconds from one (wall clock) to the
    trainer's next step: how long the run stood still, or took to notice nothing was
    wrong."""
    ends = sorted(s.finished_at for s in steps)
    waits: dict[str, list[float]] = {}
    for at, kind in injected:
        after = next((end for end in ends if end > at), None)
        if after is not None:
            waits.setdefault(kind, []).append(after - at)
    return {
        kind: {"p50": statistics.median(w), "p99": _quantile(w, 0.99)} for kind, w in waits.items()
    }


def _quantile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q * (len(ordered) - 1)))]

"""The JetStream streams of one run, defined once.

The hub operator creates them when a run starts; each component also ensures the streams
it uses when it starts (idempotent), so a run without the operator (`rlfleet run`, the
tests) has them too. The weights stream belongs to weightsync (`WeightStream.create`).
"""

from __future__ import annotations

from nats.js import JetStreamContext
from nats.js.api import DiscardPolicy, RetentionPolicy, StorageType, StreamConfig
from nats.js.errors import BadRequestError

from rlfleet.api.wire import (
    evaluation_subject,
    step_subject,
    task_stream,
    task_subject,
    trajectory_stream,
    trajectory_subject,
)

# Step reports kept per run: enough history to read a run's recent progress after a
# restart, bounded so a run of a million steps does not grow the stream without end.
STEP_REPORTS_KEPT = 10_000
EVALUATIONS_KEPT = 1_000  # one every `everyVersions` versions: a long run's whole history


def step_stream(run: str) -> str:
    return f"STEPS-{run}"


def task_stream_config(run: str) -> StreamConfig:
    """The run's task queue: each task goes to exactly one worker."""
    return StreamConfig(
        name=task_stream(run),
        subjects=[task_subject(run)],
        retention=RetentionPolicy.WORK_QUEUE,
        storage=StorageType.FILE,
    )


def trajectory_stream_config(run: str) -> StreamConfig:
    """Trajectories for the trainer (work-queue semantics come from acknowledgement)."""
    return StreamConfig(
        name=trajectory_stream(run),
        subjects=[trajectory_subject(run)],
        storage=StorageType.FILE,
        discard=DiscardPolicy.OLD,
        max_msg_size=32 << 20,
    )


def _reports(name: str, subject: str, kept: int) -> StreamConfig:
    """Reports read by their newest (direct get), the last `kept` of them retained."""
    return StreamConfig(
        name=name,
        subjects=[subject],
        storage=StorageType.FILE,
        discard=DiscardPolicy.OLD,
        max_msgs=kept,
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


def run_stream_configs(run: str) -> list[StreamConfig]:
    return [
        task_stream_config(run),
        trajectory_stream_config(run),
        step_stream_config(run),
        evaluation_stream_config(run),
    ]


async def ensure_stream(js: JetStreamContext, config: StreamConfig) -> None:
    """Creates the stream, or brings an existing one to `config`."""
    try:
        await js.add_stream(config)
    except BadRequestError:
        await js.update_stream(config)

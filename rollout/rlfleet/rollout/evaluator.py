"""A run's evaluator: the evaluation suite (`spec.evaluation`) every few policy versions.

It reads the run's weights off the hub's stream as a rollout worker does, jumping straight
to the newest version, and when that version is `every_versions` past the last one it
scored (or it has scored none), it evaluates it (`rlfleet.rollout.evaluation`) and
publishes an `EvaluationReport`. The hub operator holds the run to the gate's floor. The
reports are its memory: a restarted evaluator reads the last one and carries on after it.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import sys
import time
from pathlib import Path

import nats
import nats.errors
import nats.js.errors
import prometheus_client

from rlfleet import launch
from rlfleet.api.wire import (
    EvaluationReport,
    decode_evaluation_report,
    encode,
    evaluation_subject,
)
from rlfleet.bus import auth
from rlfleet.bus.streams import bind_stream, evaluation_stream
from rlfleet.launch.settings import EvaluatorConfig
from rlfleet.rollout.evaluation import evaluable, evaluate
from rlfleet.rollout.stopping import run_until_signalled
from rlfleet.rollout.tasks import load_suite, suite_path
from rlfleet.weightsync import Receiver, WeightStream

log = logging.getLogger(__name__)


def due(version: int | None, last: int | None, every: int) -> bool:
    """Whether the newest version should be scored: none has been, or it is `every`
    versions past the last one that was."""
    return version is not None and (last is None or version >= last + every)


async def _last_report(js, run: str) -> EvaluationReport | None:
    try:
        message = await js.get_last_msg(
            evaluation_stream(run), evaluation_subject(run), direct=True
        )
    except (nats.js.errors.NotFoundError, nats.errors.NoRespondersError):
        return None
    return decode_evaluation_report(message.data)


async def run_evaluator(config: EvaluatorConfig, stop: asyncio.Event) -> None:
    tasks = load_suite(suite_path(config.suite))
    if not evaluable(tasks):
        raise ValueError(f"suite {config.suite}: only bare exact-answer tasks can be evaluated")
    nc = await auth.connect(config.nats_url, max_reconnect_attempts=-1)
    try:
        js = nc.jetstream(domain=config.jetstream_domain)
        stream = WeightStream(nc, config.run, config.weightsync, config.jetstream_domain)
        await bind_stream(js, evaluation_stream(config.run))
        await stream.bind()
        last_report = await _last_report(js, config.run)
        last = last_report.policy_version if last_report else None
        receiver = Receiver(stream)
        while not stop.is_set():
            version = await receiver.sync()
            if due(version, last, config.every_versions):
                found = await asyncio.to_thread(
                    evaluate,
                    Path(config.model),
                    tasks,
                    receiver.state.tensors,
                    version=version,
                    attempts=config.attempts,
                )
                report = EvaluationReport(
                    run=config.run,
                    suite=config.suite,
                    policy_version=found.version,
                    reward=found.reward,
                    pass_at_k=found.pass_at_k,
                    attempts=found.attempts,
                    tasks=found.tasks,
                    finished_at=time.time(),
                    task_rewards=found.task_rewards,
                    answers=found.answers,
                )
                await js.publish(evaluation_subject(config.run), encode(report))
                log.info(
                    "version %d: reward %.4f, pass@%d %.4f on %d tasks of %s",
                    *(found.version, found.reward, found.attempts, found.pass_at_k),
                    *(found.tasks, config.suite),
                )
                last = version
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(stop.wait(), config.poll_seconds)
    finally:
        await nc.close()


def main() -> None:
    logging.basicConfig(
        level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    config = launch.component_settings(sys.argv[1:], launch.EVALUATOR)
    if config.metrics_port is not None:
        prometheus_client.start_http_server(config.metrics_port)

    try:
        run_until_signalled(lambda stop: run_evaluator(config, stop))
    except ValueError as error:
        sys.exit(f"python -m rlfleet.rollout.evaluator: {error}")


if __name__ == "__main__":
    main()

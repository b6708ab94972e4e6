"""A run's evaluator: the evaluation suite (`spec.evaluation`) every few policy versions.

It reads the run's weights off the hub's stream as a rollout worker does, jumping straight
to the newest version, and when that version is `every_versions` past the last one it
scored (or it has scored none), it evaluates it (`rlfleet.rollout.evaluation.suite`) and
publishes an `EvaluationReport`. The hub operator holds the run to the gate's floor. The
reports are its memory: a restarted evaluator reads the last one and carries on after it.

A production run's evaluator (`on_request`) scores the versions its conductor asks for
instead (`EvaluationRequest`: a candidate and the serving version, for the gate), each
rebuilt from the weight stream however old, and each version once: the reports say which
it has scored.
"""

from __future__ import annotations

import asyncio
import logging
import sys
import time
from pathlib import Path

import prometheus_client

from rlfleet.api.wire import (
    EvaluationReport,
    EvaluationRequest,
    decode_evaluation_report,
    decode_evaluation_request,
    encode,
    evaluation_request_subject,
    evaluation_subject,
)
from rlfleet.bus import connection
from rlfleet.bus.reading import decoded, newest
from rlfleet.bus.streams import bind_stream, cycle_stream, evaluation_stream
from rlfleet.launch import components
from rlfleet.launch.settings import EvaluatorConfig
from rlfleet.launch.stopping import run_until_signalled, wait_set
from rlfleet.rollout.environment.tasks import load_suite, suite_path
from rlfleet.rollout.evaluation.suite import evaluable, evaluate
from rlfleet.weightsync import Receiver, WeightStream

log = logging.getLogger(__name__)


def due(version: int | None, last: int | None, every: int) -> bool:
    """Whether the newest version should be scored: none has been, or it is `every`
    versions past the last one that was."""
    return version is not None and (last is None or version >= last + every)


async def _last_report(js, run: str) -> EvaluationReport | None:
    return await newest(
        js, evaluation_stream(run), evaluation_subject(run), decode_evaluation_report
    )


async def _scored_versions(js, run: str) -> set[int]:
    """Every version the run's evaluation reports score."""
    stream, subject = evaluation_stream(run), evaluation_subject(run)
    return {
        r.policy_version async for _, r in decoded(js, stream, subject, decode_evaluation_report)
    }


async def _requested(js, run: str) -> EvaluationRequest | None:
    subject = evaluation_request_subject(run)
    return await newest(js, cycle_stream(run), subject, decode_evaluation_request)


async def _wanted(js, config: EvaluatorConfig, receiver: Receiver, last: int | None) -> list[int]:
    """The versions to score now, oldest first."""
    if not config.on_request:
        receiver.ceiling = None  # the newest there is
        version = await receiver.sync()
        return [version] if due(version, last, config.every_versions) else []
    request = await _requested(js, config.run)
    return [] if request is None or request.run != config.run else sorted(request.versions)


async def run_evaluator(config: EvaluatorConfig, stop: asyncio.Event) -> None:
    tasks = load_suite(suite_path(config.suite))
    if not evaluable(tasks):
        raise ValueError(f"suite {config.suite}: only bare exact-answer tasks can be evaluated")
    nc = await connection.connect(config.nats_url, max_reconnect_attempts=-1)
    try:
        js = nc.jetstream(domain=config.jetstream_domain)
        stream = WeightStream(nc, config.run, config.weightsync, config.jetstream_domain)
        await bind_stream(js, evaluation_stream(config.run))
        await stream.bind()
        last_report = await _last_report(js, config.run)
        last = last_report.policy_version if last_report else None
        scored = await _scored_versions(js, config.run) if config.on_request else set()
        receiver = Receiver(stream)
        while not stop.is_set():
            for version in await _wanted(js, config, receiver, last):
                if version in scored or not await _hold(receiver, version):
                    continue
                report = await _score(config, tasks, receiver)
                await js.publish(evaluation_subject(config.run), encode(report))
                scored.add(version)
                last = version
            await wait_set(stop, config.poll_seconds)
    finally:
        await nc.close()


async def _hold(receiver: Receiver, version: int) -> bool:
    """Rebuild `version` from the stream, forward or back; False if it cannot be had."""
    receiver.ceiling = version
    if receiver.version == version or await receiver.sync() == version:
        return True
    log.warning("version %d is not on the weight stream (holding %s)", version, receiver.version)
    return False


async def _score(config: EvaluatorConfig, tasks, receiver: Receiver) -> EvaluationReport:
    found = await asyncio.to_thread(
        evaluate,
        Path(config.model),
        tasks,
        receiver.state.tensors,
        version=receiver.version,
        attempts=config.attempts,
    )
    log.info(
        "version %d: reward %.4f, pass@%d %.4f on %d tasks of %s",
        *(found.version, found.reward, found.attempts, found.pass_at_k),
        *(found.tasks, config.suite),
    )
    return EvaluationReport(
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


def main() -> None:
    config = components.component_settings(sys.argv[1:], components.EVALUATOR)
    if config.metrics_port is not None:
        prometheus_client.start_http_server(config.metrics_port)

    try:
        run_until_signalled(lambda stop: run_evaluator(config, stop))
    except ValueError as error:
        sys.exit(f"python -m rlfleet.rollout.evaluation.evaluator: {error}")


if __name__ == "__main__":
    main()

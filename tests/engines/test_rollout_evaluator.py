"""The run's evaluator process over real NATS: it scores the versions the trainer publishes
on the weight stream, every `every_versions`, and a restarted evaluator carries on from its
last report instead of scoring a version twice."""

from __future__ import annotations

import asyncio
import json
import sys
import uuid
from pathlib import Path

import msgspec
import pytest
from conftest import wait_for
from safetensors.torch import load_file

from rlfleet.api.wire import (
    EvaluationReport,
    EvaluationRequest,
    decode_evaluation_report,
    encode,
    evaluation_request_subject,
    evaluation_subject,
)
from rlfleet.bus.reading import decoded
from rlfleet.bus.streams import ensure_run_streams, evaluation_stream
from rlfleet.local.nats import HUB_DOMAIN, NatsServer, StandaloneNats
from rlfleet.local.processes import Supervisor
from rlfleet.models.tiny import init_model
from rlfleet.rollout.environment.tasks import rules_suite, write_suite
from rlfleet.rollout.evaluation.evaluator import due
from rlfleet.weightsync import Publisher, SyncConfig, WeightStream


def test_an_evaluator_scores_the_first_version_then_every_nth() -> None:
    assert not due(None, None, 10)  # nothing published yet
    assert due(0, None, 10)
    assert not due(9, 0, 10)
    assert due(10, 0, 10) and due(13, 0, 10)


class Trainer:
    """Publishes versions of the tiny model's own weights, as a trainer would."""

    def __init__(self, hub: NatsServer, run: str, model: Path) -> None:
        self.hub, self.run = hub, run
        self.tensors = load_file(model / "model.safetensors")

    async def _publish(self, versions: list[int]) -> None:
        nc = await self.hub.connect()
        try:
            stream = WeightStream(nc, self.run, SyncConfig(), HUB_DOMAIN)
            publisher = Publisher(stream, SyncConfig())
            for version in versions:
                await publisher.publish(self.tensors, version)
        finally:
            await nc.close()

    def publish(self, *versions: int) -> None:
        asyncio.run(self._publish(list(versions)))


async def _make_streams(hub: NatsServer, run: str) -> None:
    """The run's streams, as whoever starts a run makes them."""
    nc = await hub.connect()
    try:
        await ensure_run_streams(nc, run, HUB_DOMAIN)
    finally:
        await nc.close()


async def _reports(hub: NatsServer, run: str) -> list[EvaluationReport]:
    nc = await hub.connect()
    try:
        js = nc.jetstream(domain=HUB_DOMAIN)
        stream, subject = evaluation_stream(run), evaluation_subject(run)
        return [r async for _, r in decoded(js, stream, subject, decode_evaluation_report)]
    finally:
        await nc.close()


def _evaluator(
    tmp_path: Path, hub: NatsServer, run: str, **mode: object
) -> tuple[Path, Path, list[str]]:
    """The tiny model, a three-task suite and an evaluator's settings for `run` (scoring in
    `mode`); returns the model, the suite and the evaluator's command."""
    model = init_model("tiny-moe", tmp_path / "model")
    suite = tmp_path / "suite.jsonl"
    write_suite(rules_suite(3, seed=1), suite)
    config = {
        "run": run,
        "nats_url": hub.url,
        "jetstream_domain": HUB_DOMAIN,
        "model": str(model),
        "suite": str(suite),
        "attempts": 2,
        "poll_seconds": 0.5,
    } | mode
    settings = tmp_path / "evaluator.json"
    settings.write_text(json.dumps(config))
    return (
        model,
        suite,
        [sys.executable, "-m", "rlfleet.rollout.evaluation.evaluator", str(settings)],
    )


def test_a_restarted_evaluator_goes_on_from_its_last_report(
    nats_servers: StandaloneNats, tmp_path: Path
) -> None:
    run = f"eval-{uuid.uuid4().hex[:6]}"
    hub = nats_servers.bed.hub
    model, suite, argv = _evaluator(tmp_path, hub, run, every_versions=2)
    supervisor = Supervisor(tmp_path / "logs", attached=True)
    trainer = Trainer(hub, run, model)

    def scored() -> list[int]:
        return [r.policy_version for r in asyncio.run(_reports(hub, run))]

    asyncio.run(_make_streams(hub, run))
    try:
        trainer.publish(0)
        supervisor.start("evaluator", argv, hub.client_env())
        wait_for("version 0 scored", lambda: scored() == [0], timeout=120)
        trainer.publish(1)  # not due: one version past the last scored
        assert supervisor.stop("evaluator") == 0  # SIGTERM: it stops cleanly
        trainer.publish(2)
        supervisor.start("evaluator", argv, hub.client_env())
        wait_for("version 2 scored", lambda: scored() == [0, 2], timeout=120)
        (report,) = [r for r in asyncio.run(_reports(hub, run)) if r.policy_version == 2]
        assert (report.run, report.suite, report.tasks, report.attempts) == (run, str(suite), 3, 2)
        assert 0.0 <= report.reward <= report.pass_at_k <= 1.0
        # Each task's score and how the version answered, for a gate to pair with another.
        assert len(report.task_rewards) == 3
        assert sum(report.task_rewards.values()) / 3 == pytest.approx(report.reward, abs=1e-4)
        answers = report.answers
        assert answers is not None and answers.answers == 6
        assert 6 <= answers.tokens <= 6 * 24 and answers.empty <= 6
        assert msgspec.json.decode(msgspec.json.encode(report), type=EvaluationReport) == report
    finally:
        supervisor.stop_all()
    log = (tmp_path / "logs" / "evaluator.log").read_text()
    assert "Traceback" not in log, log
    assert scored() == [0, 2], "a version was scored twice"


async def _request(hub: NatsServer, run: str, cycle: int, versions: list[int]) -> None:
    nc = await hub.connect()
    try:
        request = EvaluationRequest(run, cycle, versions)
        await nc.jetstream(domain=HUB_DOMAIN).publish(
            evaluation_request_subject(run), encode(request)
        )
    finally:
        await nc.close()


def test_a_production_runs_evaluator_scores_what_the_gate_asks_each_version_once(
    nats_servers: StandaloneNats, tmp_path: Path
) -> None:
    """The candidate and the serving version, whichever is newest on the stream: each is
    rebuilt and scored once, however often a gate asks for it."""
    run = f"eval-{uuid.uuid4().hex[:6]}"
    hub = nats_servers.bed.hub
    model, _, argv = _evaluator(tmp_path, hub, run, on_request=True)
    supervisor = Supervisor(tmp_path / "logs", attached=True)

    def scored() -> list[int]:
        return sorted(r.policy_version for r in asyncio.run(_reports(hub, run)))

    asyncio.run(_make_streams(hub, run))
    try:
        Trainer(hub, run, model).publish(0, 1, 2, 3)
        supervisor.start("evaluator", argv, hub.client_env())
        asyncio.run(_request(hub, run, 1, [2, 0]))  # an older version than the newest, too
        wait_for("versions 0 and 2 scored", lambda: scored() == [0, 2], timeout=120)
        asyncio.run(_request(hub, run, 2, [3, 2]))
        wait_for("version 3 scored", lambda: scored() == [0, 2, 3], timeout=120)
        assert supervisor.stop("evaluator") == 0
        assert scored() == [0, 2, 3]  # version 2 once, though asked twice
    finally:
        supervisor.stop_all()

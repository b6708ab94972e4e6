"""A production run's conductor on a real NATS hub, as the run's conductor user: the
components' reports, published as each component's own user, drive it through a
promotion, a refusal and a canary rolled back; its orders and its state are read back
from the streams as the components and the hub operator read them."""

from __future__ import annotations

import asyncio
import time
import uuid

from rlfleet.api.wire import (
    AnswerStats,
    BusRole,
    CycleOutcome,
    CyclePhase,
    CycleReport,
    EvaluationReport,
    LiveRewards,
    RewardTally,
    ServeOrder,
    StepReport,
    cycle_state_subject,
    cycle_subject,
    decode_cycle_state,
    decode_evaluation_request,
    decode_serving_target,
    decode_trainer_reset,
    encode,
    evaluation_request_subject,
    evaluation_subject,
    live_subject,
    serve_order_subject,
    serving_stream,
    serving_subject,
    step_subject,
    trainer_reset_subject,
)
from rlfleet.bus.connection import connect
from rlfleet.bus.streams import cycle_stream, ensure_run_streams
from rlfleet.launch.production import CanaryPolicy, ConductorConfig, GatePolicy
from rlfleet.local.nats import StandaloneNats
from rlfleet.operator.conductor import Conductor

TASKS = [f"task-{i}" for i in range(40)]
ANSWERS = AnswerStats(answers=40, empty=0, tokens=400)
CANARY = CanaryPolicy(
    detectable_drop=0.2, false_rollback_rate=0.05, miss_rate=0.05, window_s=0.5, min_samples=10
)


def _report(run: str, cycle: int, trained_on: int) -> CycleReport:
    return CycleReport(
        run=run, cycle=cycle, capture_seq=10 * cycle, captured=trained_on, with_feedback=trained_on,
        trained_on=trained_on, dropped={}, signals={"accepted": trained_on}, late_feedback=0,
        reward_mean=0.5, served_from=0.0, served_to=1.0, finished_at=time.time(),
    )  # fmt: skip


def _step(
    run: str, version: int, cycle: int, trajectories: int, held_out_gain: float | None = None
) -> StepReport:
    return StepReport(
        run=run, step=version, policy_version=version,
        trajectories=[f"cycle-{cycle}/0/{a}" for a in range(trajectories)], groups=1, tokens=10,
        reward_mean=0.5, loss=0.1, staleness_mean=0.0, staleness_max=0, mismatch_mean_abs=0.0,
        mismatch_max_abs=0.0, mismatch_kl=0.0, clipped_fraction=0.0, dropped_stale_total=0,
        rejected_total=0, step_seconds=0.1, finished_at=time.time(), held_out_gain=held_out_gain,
    )  # fmt: skip


def _scores(run: str, version: int, score: float) -> EvaluationReport:
    rewards = {task: score + (0.1 if i % 2 else -0.1) for i, task in enumerate(TASKS)}
    return EvaluationReport(
        run=run, suite="rules", policy_version=version, reward=score, pass_at_k=score,
        attempts=1, tasks=len(TASKS), finished_at=time.time(), task_rewards=rewards,
        answers=ANSWERS,
    )  # fmt: skip


def _tally(mean: float, count: int) -> RewardTally:
    tally = RewardTally()
    for i in range(count):
        tally = tally.add(mean + (0.2 if i % 2 else -0.2))
    return tally


def test_cycles_promote_refuse_and_roll_back_through_the_runs_streams(
    nats_servers: StandaloneNats, tmp_path
) -> None:
    run = "conduct-" + uuid.uuid4().hex[:6]
    bed = nats_servers.bed
    for role in (BusRole.CONDUCTOR, BusRole.COLLECTOR, BusRole.TRAINER, BusRole.EVALUATOR):
        (tmp_path / f"{role}.creds").write_text(bed.run_user(run, role))
    gate = GatePolicy(max_regression=0.05, max_held_out_loss=0.01)
    config = ConductorConfig(run=run, nats_url=bed.hub.url, gate=gate, canary=CANARY)

    async def scenario() -> None:
        admin = await bed.hub.connect()
        await ensure_run_streams(admin, run, None)
        users = {
            role: (await connect(bed.hub.url, tmp_path / f"{role}.creds")).jetstream()
            for role in (BusRole.CONDUCTOR, BusRole.COLLECTOR, BusRole.TRAINER, BusRole.EVALUATOR)
        }
        collector, trainer = users[BusRole.COLLECTOR], users[BusRole.TRAINER]
        evaluator = users[BusRole.EVALUATOR]
        conductor = Conductor(config, users[BusRole.CONDUCTOR])
        js = admin.jetstream()

        async def newest(stream: str, subject: str, decode):
            return decode((await js.get_last_msg(stream, subject)).data)

        async def target(replica_set: str) -> int:
            subject = serving_subject(run, replica_set)
            return (await newest(serving_stream(run), subject, decode_serving_target)).version

        async def turn(state):
            return await conductor.turn(state, time.time())

        state = await conductor.start()
        assert (state.number, state.phase, state.serving) == (1, CyclePhase.COLLECTING, 0)
        assert await turn(state) == state  # nothing collected yet

        # Cycle 1: collected, trained into version 2, gated, canaried, promoted.
        await collector.publish(cycle_subject(run), encode(_report(run, 1, 6)))
        state = await turn(state)
        assert (state.phase, state.collected) == (CyclePhase.TRAINING, 6)
        await trainer.publish(step_subject(run), encode(_step(run, 1, 1, 4, 0.004)))
        assert (await turn(state)).phase == CyclePhase.TRAINING  # 4 of 6 taken
        await trainer.publish(step_subject(run), encode(_step(run, 2, 1, 2, -0.012)))
        state = await turn(state)
        assert (state.phase, state.candidate) == (CyclePhase.EVALUATING, 2)
        request = await newest(
            cycle_stream(run), evaluation_request_subject(run), decode_evaluation_request
        )
        assert (request.cycle, sorted(request.versions)) == (1, [0, 2])
        for version, score in ((2, 0.6), (0, 0.5)):
            await evaluator.publish(evaluation_subject(run), encode(_scores(run, version, score)))
        state = await turn(state)
        assert state.phase == CyclePhase.CANARY
        assert [e.reason for e in state.events] == ["CanaryStarted"]
        # The cycle's steps' held-out gains add up: -0.008, within the bound of 0.01.
        assert "held-out gain -8.00e-03 per token" in state.events[0].message
        canary = await newest(
            serving_stream(run), serving_subject(run, "canary"), decode_serving_target
        )
        assert canary.version == 2
        live = LiveRewards(run, 1, {2: _tally(0.5, 30), 0: _tally(0.5, 60)}, time.time())
        await collector.publish(live_subject(run), encode(live))
        await asyncio.sleep(CANARY.window_s)
        state = await turn(state)
        assert (state.number, state.phase, state.serving) == (2, CyclePhase.COLLECTING, 2)
        assert state.history[-1].outcome == CycleOutcome.PROMOTED
        stable = await newest(
            serving_stream(run), serving_subject(run, "stable"), decode_serving_target
        )
        assert stable.version == 2

        # Cycle 2: its candidate scores worse than the gate allows and learnt against the
        # users of cycle 1: refused for both, trainer reset.
        await collector.publish(cycle_subject(run), encode(_report(run, 2, 2)))
        state = await turn(state)
        await trainer.publish(step_subject(run), encode(_step(run, 3, 2, 2, -0.02)))
        state = await turn(state)
        await evaluator.publish(evaluation_subject(run), encode(_scores(run, 3, 0.3)))
        state = await turn(state)  # version 2's score is already on the stream
        assert (state.number, state.serving) == (3, 2)
        assert state.history[-1].outcome == CycleOutcome.REJECTED
        assert "not shown within 0.05" in state.events[0].message
        assert "held-out gain -2.00e-02 per token, below -0.01" in state.events[0].message
        reset = await newest(cycle_stream(run), trainer_reset_subject(run), decode_trainer_reset)
        assert (reset.number, reset.version) == (2, 2)

        # Cycle 3: through the gate, but users like it less: rolled back, reset again.
        await collector.publish(cycle_subject(run), encode(_report(run, 3, 2)))
        state = await turn(state)
        await trainer.publish(step_subject(run), encode(_step(run, 4, 3, 2)))
        state = await turn(state)
        await evaluator.publish(evaluation_subject(run), encode(_scores(run, 4, 0.55)))
        state = await turn(state)
        assert state.phase == CyclePhase.CANARY
        live = LiveRewards(run, 3, {4: _tally(-0.5, 30), 2: _tally(0.5, 60)}, time.time())
        await collector.publish(live_subject(run), encode(live))
        state = await turn(state)  # confidently worse: no need to wait for the window
        assert state.history[-1].outcome == CycleOutcome.ROLLED_BACK
        assert [e.reason for e in state.events] == ["CanaryRolledBack"]
        canary = await newest(
            serving_stream(run), serving_subject(run, "canary"), decode_serving_target
        )
        assert canary.version == 2
        reset = await newest(cycle_stream(run), trainer_reset_subject(run), decode_trainer_reset)
        assert (reset.number, reset.version) == (3, 2)

        # On call, as the hub passes `rlfleet rollback` on: back to the version before 2.
        assert (state.serving, state.previous) == (2, 0)
        await js.publish(serve_order_subject(run), encode(ServeOrder(run, 1, 0)))
        state = await turn(state)
        assert (state.number, state.serving, state.previous, state.orders) == (5, 0, 2, 1)
        assert state.history[-1].outcome == CycleOutcome.OVERRIDDEN
        assert [e.reason for e in state.events] == ["ServingOverridden"]
        assert (await target("canary"), await target("stable")) == (0, 0)
        reset = await newest(cycle_stream(run), trainer_reset_subject(run), decode_trainer_reset)
        assert (reset.number, reset.version) == (4, 0)
        assert await turn(state) == state  # carried out once
        # Version 4 was rolled back: its weights are not kept, so no order can serve it.
        await js.publish(serve_order_subject(run), encode(ServeOrder(run, 2, 4)))
        state = await turn(state)
        assert (state.serving, state.orders) == (0, 2)
        assert [e.reason for e in state.events] == ["OrderRefused"]

        # A restarted conductor goes on from the state it published.
        again = await Conductor(config, users[BusRole.CONDUCTOR]).start()
        assert again == state
        published = await newest(cycle_stream(run), cycle_state_subject(run), decode_cycle_state)
        assert published == state and [c.outcome for c in state.history] == [
            CycleOutcome.PROMOTED, CycleOutcome.REJECTED, CycleOutcome.ROLLED_BACK,
            CycleOutcome.OVERRIDDEN,
        ]  # fmt: skip
        await admin.close()

    asyncio.run(scenario())

"""`python -m rlfleet.operator.conductor CONFIG.json`: a production run's conductor. It
runs the run's cycles (`rlfleet.operator.cycles` decides) over the run's NATS, where
everything it watches is reported and everything it orders is read:

- it observes the collector's cycle reports and live reward tallies, the trainer's step
  reports and the evaluator's reports;
- it orders by publishing: an `EvaluationRequest` for the gate, a `ServingTarget` per set
  of the pool's servers, a `TrainerReset` after a refused candidate;
- then its new `CycleState`, with the transition's events: its memory across restarts,
  the collector's pace, and what the hub operator shows in the run's status.

Orders go out before the state that follows from them, and each is idempotent (a target
is a version; a request names its versions; a reset is numbered by its cycle), so a
conductor killed between the two repeats the transition and changes nothing twice.
"""

from __future__ import annotations

import asyncio
import logging
import sys
import time
from collections.abc import Callable
from typing import TypeVar

import prometheus_client
from msgspec.structs import replace

from rlfleet.api.wire import (
    CycleState,
    EvaluationReport,
    EvaluationRequest,
    RewardTally,
    ServingTarget,
    StepReport,
    TrainerReset,
    WireMessage,
    cycle_groups,
    cycle_state_subject,
    cycle_subject,
    decode_cycle_report,
    decode_cycle_state,
    decode_evaluation_report,
    decode_live_rewards,
    decode_serve_order,
    decode_step_report,
    encode,
    evaluation_request_subject,
    evaluation_subject,
    live_subject,
    serve_order_subject,
    serving_subject,
    step_subject,
    trainer_reset_subject,
)
from rlfleet.bus import connection
from rlfleet.bus.reading import newest, recent
from rlfleet.bus.streams import cycle_stream, evaluation_stream, step_stream
from rlfleet.launch import components
from rlfleet.launch.production import ConductorConfig
from rlfleet.launch.stopping import run_until_signalled, wait_set
from rlfleet.operator.cycles import Act, Action, Observed, Phase, Step, advance, first_state
from rlfleet.operator.promotion import gate_reports

log = logging.getLogger(__name__)

M = TypeVar("M", bound=WireMessage)

transitions = prometheus_client.Counter(
    "rlfleet_conductor_transitions_total", "Cycle transitions, by event", ["reason"]
)
# From 0, so that an alert's increase() sees the first of each too.
for reason in ("CanaryRolledBack", "CycleHeldBack", "FeedbackDistrusted"):
    transitions.labels(reason)
unreadable = prometheus_client.Counter(
    "rlfleet_conductor_unreadable_total", "Reports the conductor could not read, skipped"
)
# Reports read back at most, newest first, when looking for a cycle's steps or a version's
# evaluation: far more than one cycle makes.
LOOK_BACK = 1000


class Conductor:
    def __init__(self, config: ConductorConfig, js) -> None:
        self.config = config
        self.js = js
        self.run_name = config.run

    async def start(self) -> CycleState:
        """The state a restart goes on from, or the first cycle's, published."""
        state = await self._newest(cycle_state_subject(self.run_name), decode_cycle_state)
        if state is None:
            state = first_state(self.run_name, self.config.base_version, time.time())
            await self.js.publish(cycle_state_subject(self.run_name), encode(state))
            log.info("run %s: cycle 1 collecting, serving version %d", state.run, state.serving)
        return state

    async def turn(self, state: CycleState, now: float) -> CycleState:
        """Observe, decide, act; the state after, published if it changed."""
        step = advance(
            state, await self.observe(state, now), self.config.canary, self.config.phase_deadline_s
        )
        if step.state == state and not step.actions:
            return state
        await self.act(state, step)
        new = replace(step.state, events=step.events)
        await self.js.publish(cycle_state_subject(self.run_name), encode(new))
        for event in step.events:
            transitions.labels(event.reason).inc()
            log.warning("%s: %s", event.reason, event.message)  # on-call reads these
        return new

    async def observe(self, state: CycleState, now: float) -> Observed:
        order = await self._newest(serve_order_subject(self.run_name), decode_serve_order)
        if order is not None and order.run != self.run_name:
            order = None  # not this run's: a forgery, or a bug
        match state.phase:
            case Phase.COLLECTING:
                report = await self._newest(cycle_subject(self.run_name), decode_cycle_report)
                return Observed(now, report, order=order)
            case Phase.TRAINING:
                taken, after = await self._taken(state.number)
                return Observed(now, None, taken=taken, version_after=after, order=order)
            case Phase.EVALUATING:
                return Observed(now, None, gate=await self._gate(state), order=order)
            case Phase.CANARY:
                return Observed(now, None, live=await self._live(state), order=order)

    async def act(self, state: CycleState, step: Step) -> None:
        run, now = self.run_name, time.time()
        evaluate = [a.version for a in step.actions if a.act == Act.EVALUATE]
        if evaluate:
            request = EvaluationRequest(run, state.number, evaluate)
            await self.js.publish(evaluation_request_subject(run), encode(request))
        for action in step.actions:
            await self._order(state, action, now)

    async def _order(self, state: CycleState, action: Action, now: float) -> None:
        run = self.run_name
        if action.act == Act.SERVE:
            assert action.replica_set is not None
            target = ServingTarget(
                run, action.replica_set, action.version, now, standby=action.standby
            )
            await self.js.publish(serving_subject(run, action.replica_set), encode(target))
        elif action.act == Act.RESET_TRAINER:
            reset = TrainerReset(run, state.number, action.version)
            await self.js.publish(trainer_reset_subject(run), encode(reset))

    async def _taken(self, cycle: int) -> tuple[int, int | None]:
        """How many of the cycle's trajectories the trainer has trained on, and the version
        its last step that took any made."""
        steps, prefix = await self._steps(cycle), f"{cycle_groups(cycle)}/"
        taken = sum(t.startswith(prefix) for report in steps for t in report.trajectories)
        return taken, steps[0].policy_version if steps else None

    async def _steps(self, cycle: int) -> list[StepReport]:
        """The trainer's reports of the steps that took the cycle's trajectories, newest
        first. The collector names their groups after the cycle (`cycle-N/...`); the steps
        that took them are the newest, as the conductor lets no later cycle's
        trajectories out before this one is decided."""
        prefix, found = f"{cycle_groups(cycle)}/", []
        steps = step_stream(self.run_name), step_subject(self.run_name)
        for report in await self._reports(*steps, decode_step_report):
            if not any(t.startswith(prefix) for t in report.trajectories):
                break
            found.append(report)
        return found

    async def _gate(self, state: CycleState):
        """The gate's verdict once both versions are scored, else None."""
        wanted = {state.candidate, state.serving}
        found: dict[int, EvaluationReport] = {}
        stream, subject = evaluation_stream(self.run_name), evaluation_subject(self.run_name)
        for report in await self._reports(stream, subject, decode_evaluation_report):
            if report.policy_version in wanted:
                found.setdefault(report.policy_version, report)
            if len(found) == len(wanted):
                break
        if state.candidate not in found or state.serving not in found:
            return None
        gains = [report.held_out_gain for report in await self._steps(state.number)]
        held_out = None if None in gains or not gains else sum(gains)
        return gate_reports(
            found[state.candidate], found[state.serving], self.config.gate, held_out
        )

    async def _live(self, state: CycleState):
        """Users' rewards on the candidate and on the serving version since the canary
        began, as the collector last tallied them."""
        live = await self._newest(live_subject(self.run_name), decode_live_rewards)
        if live is None or live.cycle != state.number or live.at < state.since:
            return None
        tallies = live.by_version
        nothing = RewardTally()
        return tallies.get(state.candidate, nothing), tallies.get(state.serving, nothing)

    async def _newest(self, subject: str, decode: Callable[[bytes], M]) -> M | None:
        return await newest(self.js, cycle_stream(self.run_name), subject, decode, unreadable.inc)

    async def _reports(self, stream: str, subject: str, decode: Callable[[bytes], M]) -> list[M]:
        """The stream's reports, newest first, among its last `LOOK_BACK`."""
        return await recent(self.js, stream, subject, decode, LOOK_BACK, unreadable.inc)


async def conduct(config: ConductorConfig, stopping: asyncio.Event) -> None:
    nc = await connection.connect(config.nats_url, max_reconnect_attempts=-1)
    try:
        conductor = Conductor(config, nc.jetstream(domain=config.jetstream_domain))
        state = await conductor.start()
        while not stopping.is_set():
            try:
                state = await conductor.turn(state, time.time())
            except Exception:  # NATS away, a report it cannot use: try again next turn
                log.exception("cycle %d (%s): trying again", state.number, state.phase)
            await wait_set(stopping, config.poll_s)
    finally:
        await nc.close()


def main() -> None:
    config = components.component_settings(sys.argv[1:], components.CONDUCTOR)
    if config.metrics_port is not None:
        prometheus_client.start_http_server(config.metrics_port)
    run_until_signalled(lambda stopping: conduct(config, stopping))


if __name__ == "__main__":
    main()

"""The evaluation gate (`spec.evaluation`): what the evaluator's newest report means for
the run. Pure: no I/O.

A version scored under `minReward` fails the run (phase and condition `Failed`, event
`EvaluationBelowFloor`); one scored at `targetReward` or above completes it (`Succeeded`,
`EvaluationReachedTarget`). Either way the hub holds the run as if suspended: trainer,
feed and evaluator at zero, regions giving their GPUs back, the last weights kept on the
stream. The last report lives in `status.lastEvaluation`, so the verdict stands while
NATS does not answer and after an operator restart. Moving the floor or the target (or
removing the gate) lets the run go on.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from datetime import UTC, datetime

from rlfleet.api.meta import Condition
from rlfleet.api.rlrun import EvaluationGate, EvaluationStatus, RLRunSpec, RLRunStatus
from rlfleet.api.wire import EvaluationReport
from rlfleet.operator.status import Event, condition, is_true, timestamp


@dataclass
class Verdict:
    fields: RLRunStatus  # status fields: lastEvaluation once there is one
    failed: bool  # scored under the floor
    succeeded: bool  # scored the target
    conditions: list[Condition]  # Failed and Succeeded; none without a gate
    events: list[Event] = field(default_factory=list)

    @property
    def held(self) -> bool:
        """The run stops: it failed or it is done."""
        return self.failed or self.succeeded

    @property
    def why(self) -> str:
        """What holds the run, for its Ready condition."""
        held = [c.message for c in self.conditions if c.status == "True"]
        return "; ".join(held)


def judge(
    report: EvaluationReport | None, spec: RLRunSpec, old: RLRunStatus, generation: int
) -> Verdict:
    """`report` is the evaluator's newest, None if there is none or NATS did not answer;
    `old` is the run's current status."""
    gate = spec.evaluation
    if gate is None:
        return Verdict(RLRunStatus(), False, False, [])
    last = old.last_evaluation
    events: list[Event] = []
    if report is not None:
        scored = _scored(report)
        if last is None or last.version != scored.version:
            events.append(_evaluated(report, gate))
        last = scored
    if last is None:
        scored_text = f"no version scored on {gate.suite} yet"
        failed = succeeded = False
    else:
        scored_text = f"version {last.version} scored {last.reward:.4f} on {last.suite}"
        verdict = gate.verdict(last.reward)
        failed, succeeded = verdict == "Failed", verdict == "Succeeded"
    fail = condition(
        old.conditions,
        "Failed",
        failed,
        "NotEvaluated"
        if last is None
        else "EvaluationBelowFloor"
        if failed
        else "EvaluationAboveFloor",
        f"{scored_text}, {'under' if failed else 'at or above'} minReward {gate.min_reward:g}",
        generation,
    )
    found = [fail]
    events += _turns(
        old.conditions, fail, "EvaluationBelowFloor", "EvaluationAboveFloor", "Warning"
    )
    if gate.target_reward is not None:
        goal = f"targetReward {gate.target_reward:g}"
        done = condition(
            old.conditions,
            "Succeeded",
            succeeded,
            "EvaluationReachedTarget" if succeeded else "EvaluationBelowTarget",
            f"{scored_text}, {'at or above' if succeeded else 'under'} {goal}",
            generation,
        )
        found.append(done)
        events += _turns(old.conditions, done, "EvaluationReachedTarget", "EvaluationBelowTarget")
    fields = RLRunStatus() if last is None else RLRunStatus(last_evaluation=last)
    return Verdict(fields, failed, succeeded, found, events)


def _scored(report: EvaluationReport) -> EvaluationStatus:
    return EvaluationStatus(
        version=report.policy_version,
        reward=report.reward,
        pass_at_k=report.pass_at_k,
        suite=report.suite,
        time=timestamp(datetime.fromtimestamp(report.finished_at, UTC)),
    )


def _evaluated(report: EvaluationReport, gate: EvaluationGate) -> Event:
    target = f", targetReward {gate.target_reward:g}" if gate.target_reward else ""
    return Event(
        "Normal",
        "Evaluated",
        f"version {report.policy_version} scored {report.reward:.4f} "
        f"(pass@{report.attempts} {report.pass_at_k:.4f}) on {report.tasks} tasks "
        f"of {report.suite}; minReward {gate.min_reward:g}{target}",
    )


def _turns(
    previous: list[Condition], now: Condition, on: str, off: str, severity: str = "Normal"
) -> list[Event]:
    """The event for a condition that just turned True (the run is held) or back."""
    was = is_true(previous, now.type)
    if now.status == "True" and not was:
        return [Event(severity, on, f"{now.message}: the run is held")]
    if now.status == "False" and was:
        return [Event("Normal", off, f"{now.message}: the run goes on")]
    return []

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

from rlfleet.api.rlrun import RLRunSpec
from rlfleet.api.wire import EvaluationReport
from rlfleet.operator.status import Event, condition, is_true, timestamp


@dataclass
class Verdict:
    fields: dict  # status fields: lastEvaluation once there is one
    failed: bool  # scored under the floor
    succeeded: bool  # scored the target
    conditions: list[dict]  # Failed and Succeeded; none without a gate
    events: list[Event] = field(default_factory=list)

    @property
    def held(self) -> bool:
        """The run stops: it failed or it is done."""
        return self.failed or self.succeeded

    @property
    def why(self) -> str:
        """What holds the run, for its Ready condition."""
        held = [c["message"] for c in self.conditions if c["status"] == "True"]
        return "; ".join(held)


def judge(report: EvaluationReport | None, spec: RLRunSpec, old: dict, generation: int) -> Verdict:
    """`report` is the evaluator's newest, None if there is none or NATS did not answer;
    `old` is the run's current status."""
    gate = spec.evaluation
    if gate is None:
        return Verdict({}, False, False, [])
    last = old.get("lastEvaluation")
    events: list[Event] = []
    if report is not None:
        scored = {
            "version": report.policy_version,
            "reward": report.reward,
            "passAtK": report.pass_at_k,
            "suite": report.suite,
            "time": timestamp(datetime.fromtimestamp(report.finished_at, UTC)),
        }
        if last is None or last.get("version") != scored["version"]:
            target = f", targetReward {gate.target_reward:g}" if gate.target_reward else ""
            events.append(
                Event(
                    "Normal",
                    "Evaluated",
                    f"version {report.policy_version} scored {report.reward:.4f} "
                    f"(pass@{report.attempts} {report.pass_at_k:.4f}) on {report.tasks} tasks "
                    f"of {report.suite}; minReward {gate.min_reward:g}{target}",
                )
            )
        last = scored
    conditions = old.get("conditions", [])
    if last is None:
        scored_text = f"no version scored on {gate.suite} yet"
        failed = succeeded = False
    else:
        scored_text = f"version {last['version']} scored {last['reward']:.4f} on {last['suite']}"
        verdict = gate.verdict(last["reward"])
        failed, succeeded = verdict == "Failed", verdict == "Succeeded"
    floor = f"minReward {gate.min_reward:g}"
    fail = condition(
        conditions,
        "Failed",
        failed,
        "NotEvaluated"
        if last is None
        else "EvaluationBelowFloor"
        if failed
        else "EvaluationAboveFloor",
        f"{scored_text}, {'under' if failed else 'at or above'} {floor}",
        generation,
    )
    found = [fail]
    events += _turns(conditions, fail, "EvaluationBelowFloor", "EvaluationAboveFloor", "Warning")
    if gate.target_reward is not None:
        goal = f"targetReward {gate.target_reward:g}"
        done = condition(
            conditions,
            "Succeeded",
            succeeded,
            "EvaluationReachedTarget" if succeeded else "EvaluationBelowTarget",
            f"{scored_text}, {'at or above' if succeeded else 'under'} {goal}",
            generation,
        )
        found.append(done)
        events += _turns(conditions, done, "EvaluationReachedTarget", "EvaluationBelowTarget")
    return Verdict({"lastEvaluation": last} if last else {}, failed, succeeded, found, events)


def _turns(
    previous: list[dict], now: dict, on: str, off: str, severity: str = "Normal"
) -> list[Event]:
    """The event for a condition that just turned True (the run is held) or back."""
    was = is_true(previous, now["type"])
    if now["status"] == "True" and not was:
        return [Event(severity, on, f"{now['message']}: the run is held")]
    if now["status"] == "False" and was:
        return [Event("Normal", off, f"{now['message']}: the run goes on")]
    return []

"""The evaluation gate (`spec.evaluation`): what the evaluator's newest report means for
the run. Pure: no I/O.

A version scored under `minReward` fails the run: the hub then holds it as if suspended
(trainer, feed and evaluator at zero, regions giving their GPUs back) with phase `Failed`,
a `Failed` condition and an `EvaluationBelowFloor` event. The last report lives in
`status.lastEvaluation`, so the verdict stands while NATS does not answer and after an
operator restart. Lowering the floor (or removing the gate) lets the run go on.
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
    failed: bool
    condition: dict | None  # Failed; None without a gate
    events: list[Event] = field(default_factory=list)


def judge(report: EvaluationReport | None, spec: RLRunSpec, old: dict, generation: int) -> Verdict:
    """`report` is the evaluator's newest, None if there is none or NATS did not answer;
    `old` is the run's current status."""
    gate = spec.evaluation
    if gate is None:
        return Verdict({}, False, None)
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
            events.append(
                Event(
                    "Normal",
                    "Evaluated",
                    f"version {report.policy_version} scored {report.reward:.4f} "
                    f"(pass@{report.attempts} {report.pass_at_k:.4f}) on {report.tasks} tasks "
                    f"of {report.suite}; minReward {gate.min_reward:g}",
                )
            )
        last = scored
    failed = last is not None and last["reward"] < gate.min_reward
    if last is None:
        reason, message = "NotEvaluated", f"no version scored on {gate.suite} yet"
    else:
        reason = "EvaluationBelowFloor" if failed else "EvaluationAboveFloor"
        relation = "under" if failed else "at or above"
        message = (
            f"version {last['version']} scored {last['reward']:.4f} on {last['suite']}, "
            f"{relation} minReward {gate.min_reward:g}"
        )
    was_failed = is_true(old.get("conditions", []), "Failed")
    if failed and not was_failed:
        events.append(Event("Warning", "EvaluationBelowFloor", f"{message}: the run is held"))
    elif was_failed and not failed:
        events.append(Event("Normal", "EvaluationAboveFloor", f"{message}: the run goes on"))
    verdict = condition(old.get("conditions", []), "Failed", failed, reason, message, generation)
    return Verdict({"lastEvaluation": last} if last else {}, failed, verdict, events)

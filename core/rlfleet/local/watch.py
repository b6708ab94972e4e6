"""Watching a local run while it trains: where its processes run and how they are reached
(`Plane`), and its step reports, evaluations and production cycles followed from NATS and
shown in a live table (`follow`) until the training budget is spent, Ctrl-C or the
evaluation gate's verdict.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Protocol

import msgspec
from nats.aio.msg import Msg
from rich.console import Console
from rich.live import Live
from rich.table import Table

from rlfleet.api.rlrun import EvaluationGate
from rlfleet.api.wire import (
    CyclePhase,
    CycleState,
    EvaluationReport,
    StepReport,
    cycle_state_subject,
    decode_cycle_state,
    decode_evaluation_report,
    decode_step_report,
    evaluation_subject,
    step_subject,
)
from rlfleet.bus import connection
from rlfleet.launch.stopping import wait_set

console = Console()

# While this file is in the run folder, a production run's simulated users say the
# opposite of what they think (`--invert-cycle`).
INVERTED = "inverted"
STARTUP_LIMIT_S = 900  # the first step must come within this; DeepSpeed and vLLM start slowly


class Plane(Protocol):
    """Where a run's processes run and how they are reached: started on entering."""

    url: str  # the hub's NATS
    key: str  # the run's name there: its streams, subjects and user
    root: Path  # the run's folder
    production: bool  # learns from a production pool's users (`spec.production`)
    credentials: Path  # the run's observer: reads all of it, changes nothing

    def __enter__(self) -> Plane: ...

    def __exit__(self, *exc: object) -> None: ...

    def check_alive(self) -> None:
        """Raises if a process the run needs has died."""

    def status(self, trained_s: float) -> str | None:
        """What to show under the live table, read every second of training."""

    def stop_run(self) -> None:
        """Stops the run's processes (each finishes what it is doing), leaving NATS up."""


def table(
    name: str,
    reports: list[StepReport],
    scores: list[EvaluationReport],
    trained_s: float,
    budget_s: float,
    status: str | None = None,
) -> Table:
    progress = f"{trained_s:.0f}s of {budget_s:.0f}s training" if reports else "starting"
    shown = Table(title=f"rlfleet run {name}: {progress}")
    for column in ("version", "reward", "staleness", "delta bytes", "sync s", "tokens/s"):
        shown.add_column(column, justify="right")
    for r in reports[-12:]:
        shown.add_row(
            str(r.policy_version),
            f"{r.reward_mean:.3f}",
            f"{r.staleness_mean:.2f} (max {r.staleness_max})",
            f"{r.weight_bytes:,}",
            f"{r.weight_seconds:.2f}",
            f"{r.tokens / max(r.step_seconds, 1e-9):.0f}",
        )
    captions = [f"evaluation: {scored(scores[-1])}"] if scores else []
    shown.caption = "\n".join(captions + ([status] if status else [])) or None
    return shown


def scored(score: EvaluationReport) -> str:
    return (
        f"version {score.policy_version} scored {score.reward:.4f} "
        f"(pass@{score.attempts} {score.pass_at_k:.4f}) on {score.tasks} tasks of {score.suite}"
    )


@dataclass
class _Followed:
    """What `follow` has seen of a run so far, kept up to date by its subscriptions."""

    name: str
    plane: Plane
    budget_s: float
    gate: EvaluationGate | None
    invert_cycle: int | None
    steps: list[StepReport] = field(default_factory=list)
    scores: list[EvaluationReport] = field(default_factory=list)
    cycles: list[CycleState] = field(default_factory=list)
    launched: float = field(default_factory=time.monotonic)
    first_step: float | None = None

    def __post_init__(self) -> None:
        if self.plane.production:
            self.first_step = self.launched

    def trained_s(self) -> float:
        return 0.0 if self.first_step is None else time.monotonic() - self.first_step

    async def on_step(self, message: Msg) -> None:
        with contextlib.suppress(msgspec.ValidationError, msgspec.DecodeError):
            self.steps.append(decode_step_report(message.data))
            self.first_step = self.first_step or time.monotonic()

    async def on_score(self, message: Msg) -> None:
        with contextlib.suppress(msgspec.ValidationError, msgspec.DecodeError):
            self.scores.append(decode_evaluation_report(message.data))

    async def on_cycle(self, message: Msg) -> None:
        with contextlib.suppress(msgspec.ValidationError, msgspec.DecodeError):
            self.cycles.append(decode_cycle_state(message.data))
            if self.invert_cycle is not None:
                inverted = self.plane.root / INVERTED
                if inverting(self.cycles[-1], self.invert_cycle):
                    inverted.touch()
                else:
                    inverted.unlink(missing_ok=True)

    def ruled(self) -> bool:
        """Whether the gate rules on the newest score, as the hub operator judges."""
        gate, scores = self.gate, self.scores
        return gate is not None and bool(scores) and gate.verdict(scores[-1].reward) is not None

    def shown(self) -> Table:
        status = self.plane.status(self.trained_s())
        if self.cycles:
            status = "\n".join(filter(None, [cycle_line(self.cycles[-1]), status]))
        return table(self.name, self.steps, self.scores, self.trained_s(), self.budget_s, status)


async def follow(
    name: str,
    plane: Plane,
    budget_s: float,
    stop: asyncio.Event,
    gate: EvaluationGate | None,
    invert_cycle: int | None = None,
) -> list[EvaluationReport]:
    """Shows step reports as they come until the training budget (counted from the first
    step, so start-up is not charged to it) is spent, `stop` is set, or an evaluation the
    gate rules on (under its floor, at its target) ends the run. Returns the evaluations.

    A production run's budget counts from its start (its first step waits for a cycle),
    its cycles are shown as they turn, and with `invert_cycle` its users say the opposite
    of what they think about all that cycle collects."""
    seen = _Followed(name, plane, budget_s, gate, invert_cycle)
    nc = await connection.connect(plane.url, plane.credentials)
    await nc.subscribe(step_subject(plane.key), cb=seen.on_step)
    await nc.subscribe(evaluation_subject(plane.key), cb=seen.on_score)
    await nc.subscribe(cycle_state_subject(plane.key), cb=seen.on_cycle)
    try:
        with Live(seen.shown(), console=console) as live:
            while not stop.is_set() and seen.trained_s() < budget_s and not seen.ruled():
                plane.check_alive()
                if seen.first_step is None and time.monotonic() - seen.launched > STARTUP_LIMIT_S:
                    raise TimeoutError(f"no training step in {STARTUP_LIMIT_S}s; see the logs")
                await wait_set(stop, 1.0)
                live.update(seen.shown())
    finally:
        await nc.close()
    return seen.scores


def inverting(state: CycleState, cycle: int) -> bool:
    """Whether what is served now is decided in `cycle`: from the close of the cycle before
    it (that one trains, is judged) until `cycle` itself closes."""
    collecting = state.phase == CyclePhase.COLLECTING
    return (state.number, collecting) in ((cycle - 1, False), (cycle, True))


def cycle_line(state: CycleState) -> str:
    done = ", ".join(f"{c.number} {c.outcome}" for c in state.history[-6:])
    line = f"cycle {state.number}: {state.phase}, production serves version {state.serving}"
    if state.candidate is not None:
        line += f", candidate {state.candidate}"
    return line + (f" (before: {done})" if done else "")


def tell(verdict: str, gate: EvaluationGate, score: EvaluationReport) -> None:
    if verdict == "Failed":
        console.print(f"[red]Failed: {scored(score)}, under minReward {gate.min_reward:g}[/red]")
    else:
        target = f"targetReward {gate.target_reward:g}"
        console.print(f"[green]Succeeded: {scored(score)}, at or above {target}[/green]")

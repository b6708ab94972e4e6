"""A run's report folder: `summary.json` and plots, from the trainer's step reports and
the evaluations of the starting model and the last version.

The step reports come from the run's step stream, which keeps them across re-runs, so a
resumed run reports on all of its steps.
"""

from __future__ import annotations

import json
import statistics
from pathlib import Path

import matplotlib

matplotlib.use("Agg")  # files only, no display
import matplotlib.pyplot as plt

from rlfleet.api.wire import StepReport

EDGE_STEPS = 25  # reward_start and reward_end average this many steps at each end
SMOOTHING_STEPS = 25  # a step's reward is over a few dozen trajectories: noisy alone


def mean_reward(steps: list[StepReport]) -> float:
    """The mean reward over the trajectories of `steps` (steps differ in size)."""
    count = sum(len(r.trajectories) for r in steps)
    return sum(r.reward_mean * len(r.trajectories) for r in steps) / max(count, 1)


def rolling_reward(reports: list[StepReport], window: int = SMOOTHING_STEPS) -> list[float]:
    """Per step, the mean reward of the trajectories of the last `window` steps."""
    return [mean_reward(reports[max(0, i + 1 - window) : i + 1]) for i in range(len(reports))]


def reward_curve(reports: list[StepReport]) -> list[tuple[float, float]]:
    """(seconds since the first step began, rolling reward) per step."""
    start = reports[0].finished_at - reports[0].step_seconds
    rewards = rolling_reward(reports)
    return [(r.finished_at - start, reward) for r, reward in zip(reports, rewards, strict=True)]


def summary(
    reports: list[StepReport],
    start: dict | None = None,
    end: dict | None = None,
    gate: dict | None = None,
) -> dict:
    """With the evaluations of the starting model and the last version (`start`, `end`),
    the reward is theirs: every task of the suite attempted alike. The batch reward is
    what the tasks the feed chose earned, and with the curriculum those are mostly the
    ones still being learnt. `gate` is what the evaluation gate saw and said, if any."""
    gated = {"evaluation_gate": gate} if gate is not None else {}
    if not reports:
        return {"steps": 0} | gated
    first, last = reports[:EDGE_STEPS], reports[-EDGE_STEPS:]
    batch_start, batch_end = round(mean_reward(first), 4), round(mean_reward(last), 4)
    evaluated = start is not None and end is not None
    rewards = (start["reward"], end["reward"]) if evaluated else (batch_start, batch_end)
    return {
        "steps": len(reports),
        "policy_version": reports[-1].policy_version,
        "seconds": round(reports[-1].finished_at - reports[0].finished_at, 1),
        "reward_start": rewards[0],
        "reward_end": rewards[1],
        "reward_from": "evaluation" if evaluated else "batch",
        **(
            {
                "evaluated_version": end["version"],
                "pass_at_k_start": start["pass_at_k"],
                "pass_at_k_end": end["pass_at_k"],
            }
            if evaluated
            else {}
        ),
        "batch_reward_start": batch_start,
        "batch_reward_end": batch_end,
        "staleness_mean": round(statistics.fmean(r.staleness_mean for r in reports), 3),
        "dropped_stale": reports[-1].dropped_stale_total,
        "delta_bytes_mean": round(statistics.fmean(r.weight_bytes for r in reports)),
        "weight_seconds_mean": round(statistics.fmean(r.weight_seconds for r in reports), 3),
        "tokens": sum(r.tokens for r in reports),
        **gated,
    }


def write(
    reports: list[StepReport],
    folder: Path,
    start: dict | None = None,
    end: dict | None = None,
    gate: dict | None = None,
) -> dict:
    folder.mkdir(parents=True, exist_ok=True)
    found = summary(reports, start, end, gate)
    (folder / "summary.json").write_text(json.dumps(found, indent=2) + "\n")
    if reports:
        _plots(reports, folder)
    return found


def _plots(reports: list[StepReport], folder: Path) -> None:
    start = reports[0].finished_at
    seconds = [r.finished_at - start for r in reports]
    versions = [r.policy_version for r in reports]
    rewards = [r.reward_mean for r in reports]
    smoothed = rolling_reward(reports)
    figure, axes = plt.subplots(2, 2, figsize=(11, 8))
    for axis, x, name, unit in (
        (axes[0][0], seconds, "time", "seconds"),
        (axes[0][1], versions, "policy version", "version"),
    ):
        axis.plot(x, rewards, color="lightsteelblue", label="per step")
        axis.plot(x, smoothed, color="navy", label=f"last {SMOOTHING_STEPS} steps")
        axis.set(title=f"reward vs {name}", xlabel=unit, ylabel="mean reward")
        axis.legend(loc="upper left")
    axes[1][0].hist([r.staleness_mean for r in reports], bins=20)
    axes[1][0].set(title="staleness per step", xlabel="versions behind (mean)", ylabel="steps")
    axes[1][1].bar(versions, [r.weight_bytes for r in reports])
    axes[1][1].set(title="weight delta per version", xlabel="version", ylabel="bytes")
    figure.tight_layout()
    figure.savefig(folder / "report.png", dpi=100)
    plt.close(figure)


def compare(runs: dict[str, list[StepReport]], path: Path) -> None:
    """Smoothed reward against training time, one line per run (a benchmark's plot)."""
    figure, axis = plt.subplots(figsize=(8, 5))
    for name, reports in runs.items():
        if reports:
            seconds, rewards = zip(*reward_curve(reports), strict=True)
            axis.plot(seconds, rewards, label=f"{name} ({len(reports)} steps)")
    axis.set(
        title=f"reward (last {SMOOTHING_STEPS} steps) vs time",
        xlabel="seconds of training",
        ylabel="mean reward",
    )
    axis.legend(loc="upper left")
    path.parent.mkdir(parents=True, exist_ok=True)
    figure.savefig(path, dpi=100)
    plt.close(figure)

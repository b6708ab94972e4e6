"""A run's report folder: `summary.json` and plots, from the trainer's step reports.

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

EDGE_STEPS = 5  # reward_start and reward_end average this many steps at each end


def summary(reports: list[StepReport]) -> dict:
    if not reports:
        return {"steps": 0}
    first, last = reports[:EDGE_STEPS], reports[-EDGE_STEPS:]
    return {
        "steps": len(reports),
        "policy_version": reports[-1].policy_version,
        "seconds": round(reports[-1].finished_at - reports[0].finished_at, 1),
        "reward_start": round(statistics.fmean(r.reward_mean for r in first), 4),
        "reward_end": round(statistics.fmean(r.reward_mean for r in last), 4),
        "staleness_mean": round(statistics.fmean(r.staleness_mean for r in reports), 3),
        "dropped_stale": reports[-1].dropped_stale_total,
        "delta_bytes_mean": round(statistics.fmean(r.weight_bytes for r in reports)),
        "weight_seconds_mean": round(statistics.fmean(r.weight_seconds for r in reports), 3),
        "tokens": sum(r.tokens for r in reports),
    }


def write(reports: list[StepReport], folder: Path) -> dict:
    folder.mkdir(parents=True, exist_ok=True)
    found = summary(reports)
    (folder / "summary.json").write_text(json.dumps(found, indent=2) + "\n")
    if reports:
        _plots(reports, folder)
    return found


def _plots(reports: list[StepReport], folder: Path) -> None:
    start = reports[0].finished_at
    seconds = [r.finished_at - start for r in reports]
    versions = [r.policy_version for r in reports]
    rewards = [r.reward_mean for r in reports]
    figure, axes = plt.subplots(2, 2, figsize=(11, 8))
    axes[0][0].plot(seconds, rewards)
    axes[0][0].set(title="reward vs time", xlabel="seconds", ylabel="mean reward")
    axes[0][1].plot(versions, rewards)
    axes[0][1].set(title="reward vs policy version", xlabel="version", ylabel="mean reward")
    axes[1][0].hist([r.staleness_mean for r in reports], bins=20)
    axes[1][0].set(title="staleness per step", xlabel="versions behind (mean)", ylabel="steps")
    axes[1][1].bar(versions, [r.weight_bytes for r in reports])
    axes[1][1].set(title="weight delta per version", xlabel="version", ylabel="bytes")
    figure.tight_layout()
    figure.savefig(folder / "report.png", dpi=100)
    plt.close(figure)

"""`rlfleet run` end to end on this machine: embedded NATS with two region leaf nodes, the
tiny MoE made and warmed up, the real trainer (DeepSpeed), two real vLLM rollout workers
and the task feeder; stopped on its budget, evaluated, reported, and resumed by a second
run."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml
from conftest import ROOT

EXAMPLE = ROOT / "examples" / "local.yaml"


def run(state: Path, minutes: float, spec: Path = EXAMPLE, exit_code: int = 0) -> dict:
    done = subprocess.run(
        [
            *(sys.executable, "-m", "rlfleet.cli", "run", str(spec)),
            *("--state", str(state), "--minutes", str(minutes), "--warmup-steps", "5"),
        ],
        capture_output=True,
        text=True,
        timeout=900,
        env=os.environ | {"COLUMNS": "120"},
    )
    logs = "\n".join(
        f"== {p.name}\n{p.read_text()[-3000:]}" for p in (state / "logs").glob("*.log")
    )
    assert done.returncode == exit_code, done.stdout[-3000:] + done.stderr[-3000:] + logs
    return json.loads((state / "report" / "summary.json").read_text()) | {"stdout": done.stdout}


def test_a_local_run_trains_reports_and_resumes(tmp_path: Path) -> None:
    first = run(tmp_path, minutes=0.5)
    assert first["steps"] > 0 and first["policy_version"] == first["steps"]
    assert (tmp_path / "report" / "report.png").stat().st_size > 0
    # The reward is the evaluation's on the whole suite: the starting model's, and the last
    # version's as read back off the run's weight stream.
    assert first["reward_from"] == "evaluation"
    assert first["evaluated_version"] == first["policy_version"]
    for region in ("region-a", "region-b"):
        log = (tmp_path / "logs" / f"rollout-{region}.log").read_text()
        assert f"worker {region}/0 taking tasks" in log and "policy version" in log
    second = run(tmp_path, minutes=0.5)
    # The trainer resumed from its checkpoint: versions go on, and the report covers both.
    assert second["policy_version"] > first["policy_version"]
    assert second["steps"] > first["steps"]
    assert second["evaluated_version"] == second["policy_version"]
    assert second["reward_start"] == first["reward_start"]  # the same starting model


def test_a_local_run_stops_failed_when_a_version_scores_under_the_gates_floor(
    tmp_path: Path,
) -> None:
    # Sixteen of the rules suite's tasks, so that each evaluation of the whole suite is quick.
    suite = tmp_path / "rules-16.jsonl"
    rules = (ROOT / "rollout" / "rlfleet" / "rollout" / "suites" / "rules.jsonl").read_text()
    suite.write_text("".join(rules.splitlines(keepends=True)[:16]))
    gated = yaml.safe_load(EXAMPLE.read_text())
    gated["spec"]["rollout"]["taskSuite"] = str(suite)
    gated["spec"]["evaluation"] = {"suite": str(suite), "everyVersions": 1, "minReward": 0.99}
    spec = tmp_path / "gated.yaml"
    spec.write_text(yaml.safe_dump(gated))
    # A budget far beyond the test's timeout: only the gate's verdict can end this run.
    summary = run(tmp_path / "run", minutes=60, spec=spec, exit_code=1)
    gate = summary["evaluation_gate"]
    assert gate["verdict"] == "Failed"
    last = gate["evaluations"][-1]
    assert last["reward"] < 0.99 and last["suite"] == str(suite) and last["tasks"] == 16
    assert f"Failed: version {last['policy_version']} scored" in summary["stdout"]
    assert "under minReward 0.99" in summary["stdout"]


@pytest.mark.parametrize(
    ("change", "error"),
    [
        ({"metadata": {"name": "tiny.moe"}}, "metadata.name: an RLRun's name must be a DNS label"),
        ({"spec": {"maxStaleness": -1}}, "maxStaleness"),
    ],
)
@pytest.mark.parametrize("operator", [False, True])
def test_rlfleet_run_refuses_what_the_api_server_refuses_before_starting_anything(
    change: dict, error: str, operator: bool, tmp_path: Path
) -> None:
    document = yaml.safe_load(EXAMPLE.read_text())
    for part, fields in change.items():
        document[part] |= fields
    bad = tmp_path / "bad.yaml"
    bad.write_text(yaml.safe_dump(document))
    done = subprocess.run(
        [
            *(sys.executable, "-m", "rlfleet.cli", "run", str(bad)),
            *("--state", str(tmp_path / "run"), "--bed", str(tmp_path / "bed")),
            *(("--operator",) if operator else ()),
        ],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 2
    assert error in " ".join(done.stderr.split())
    assert not (tmp_path / "bed").exists() and not (tmp_path / "run").exists()

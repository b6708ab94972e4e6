"""`rlfleet run` end to end on this machine: embedded NATS with two region leaf nodes, the
tiny MoE made and warmed up, the real trainer (DeepSpeed), two real vLLM rollout workers
and the task feeder; stopped on its budget, evaluated, reported, and resumed by a second
run."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml
from conftest import ROOT, rules_suite
from object_store import ObjectStore

from rlfleet.launch.caches import CACHE_FOLDERS
from rlfleet.local import plan
from rlfleet.local.run import EVALUATION_START, evaluate, load, make_model

EXAMPLE = ROOT / "examples" / "local.yaml"
# Both runs below train and evaluate on sixteen of the rules suite's tasks: each evaluation
# of the whole suite is quick. Forty warm-up steps (all 16 tasks each) leave the model right
# on 35% of attempts, some attempt right on 88% of tasks and 81% of groups mixed (20 steps:
# 2%, 19%, 19%): where RL has something to learn within a minute, as in `make demo`.
SUITE_TASKS = 16
WARMUP_STEPS = 40


def run(
    state: Path, minutes: float, spec: Path, exit_code: int = 0, env: dict | None = None
) -> dict:
    done = subprocess.run(
        [
            *(sys.executable, "-m", "rlfleet.cli", "run", str(spec)),
            *("--state", str(state), "--minutes", str(minutes)),
            *("--warmup-steps", str(WARMUP_STEPS)),
        ],
        capture_output=True,
        text=True,
        timeout=900,
        env=(env or os.environ) | {"COLUMNS": "120"},
    )
    logs = "\n".join(
        f"== {p.name}\n{p.read_text()[-3000:]}" for p in (state / "logs").glob("*.log")
    )
    assert done.returncode == exit_code, done.stdout[-3000:] + done.stderr[-3000:] + logs
    return json.loads((state / "report" / "summary.json").read_text()) | {"stdout": done.stdout}


@pytest.fixture(scope="module")
def small(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    """The example on the small suite (its spec file), and a run's folder holding the model
    made and warmed up for it and the starting model's evaluation, which every run from
    that spec would make alike: each test copies them rather than making them again."""
    folder = tmp_path_factory.mktemp("small")
    suite = rules_suite(folder / f"rules-{SUITE_TASKS}.jsonl", SUITE_TASKS)
    document = yaml.safe_load(EXAMPLE.read_text())
    document["spec"]["rollout"]["taskSuite"] = str(suite)
    spec = folder / "small.yaml"
    spec.write_text(yaml.safe_dump(document))
    _, loaded = load(spec)
    started = plan.Layout(folder / "started")
    make_model(loaded, started, WARMUP_STEPS)
    start = started.report / EVALUATION_START
    start.parent.mkdir(parents=True)
    assert evaluate(plan.model_path(loaded, started), str(suite), start) is not None
    return spec, started.root


@pytest.fixture(scope="module")
def small_in_store(small: tuple[Path, Path], object_store: ObjectStore) -> Path:
    """The same run's spec with its model, made and warmed up, in a real object store."""
    spec, started = small
    object_store.upload(started / "model", "models", "small")
    document = yaml.safe_load(spec.read_text())
    document["spec"]["model"] = {"uri": "s3://models/small", "endpoint": object_store.endpoint}
    stored = spec.with_name("small-in-store.yaml")
    stored.write_text(yaml.safe_dump(document))
    return stored


def state_from(started: Path, state: Path) -> Path:
    shutil.copytree(started, state)
    return state


def test_a_local_run_trains_learns_reports_and_resumes(
    small: tuple[Path, Path],
    small_in_store: Path,
    object_store: ObjectStore,
    session_caches: Path,
    tmp_path: Path,
) -> None:
    _, started = small
    spec = small_in_store  # the model comes from the object store, as a team keeps it
    state = state_from(started, tmp_path / "run")
    # Under a home of its own, the run's processes show that they cache nothing in the
    # user's shared defaults: only under the root the tree owns (its temporary folder too).
    home = tmp_path / "home"
    home.mkdir()
    env = os.environ | object_store.credentials
    first = run(state, minutes=0.5, spec=spec, env=env | {"HOME": str(home)})
    assert sorted(home.rglob("*")) == []
    assert "fetching the model s3://models/small" in first["stdout"]
    (fetched,) = [p for p in (state / "models").iterdir() if p.is_dir()]
    assert (fetched / "config.json").read_bytes() == (started / "model/config.json").read_bytes()
    owned = session_caches / CACHE_FOLDERS["TMPDIR"]
    assert any(owned.glob("torchinductor_*/precompiled_headers/*"))
    assert any((session_caches / CACHE_FOLDERS["TORCHINDUCTOR_CACHE_DIR"]).rglob("*"))
    assert first["steps"] > 0 and first["policy_version"] == first["steps"]
    assert (state / "report" / "report.png").stat().st_size > 0
    # The reward is the evaluation's on the whole suite: the starting model's, and the last
    # version's as read back off the run's weight stream.
    assert first["reward_from"] == "evaluation"
    assert first["evaluated_version"] == first["policy_version"]
    for region in ("region-a", "region-b"):
        log = (state / "logs" / f"rollout-{region}.log").read_text()
        assert f"worker {region}/0 taking tasks" in log and "policy version" in log
    # The first run's half minute is what learns: a few more steps show the resume.
    second = run(state, minutes=0.1, spec=spec, env=env)
    # The trainer resumed from its checkpoint: versions go on, and the report covers both.
    assert second["policy_version"] > first["policy_version"]
    assert second["steps"] > first["steps"]
    assert second["evaluated_version"] == second["policy_version"]
    assert second["reward_start"] == first["reward_start"]  # the same starting model
    # It learnt: the last version scores above the starting model on the same tasks,
    # attempts and seed. The batch reward is no such measure: the curriculum moves the
    # feed towards the tasks not yet learnt, so within a few dozen steps it may fall.
    assert second["reward_end"] > second["reward_start"], second
    assert 0.0 <= second["batch_reward_end"] <= 1.0, second
    # The version it made last, exported off the run's weight stream, is a checkpoint that
    # scores exactly what the run's evaluation of that version scored: the same bits.
    version, out = second["policy_version"], tmp_path / "exported"
    wrote = export(spec, state, version, out, env)
    assert wrote["version"] == version and wrote["files"] == ["model.safetensors"]
    assert {"config.json", "tokenizer.json"} <= {p.name for p in out.iterdir()}
    suite = yaml.safe_load(spec.read_text())["spec"]["rollout"]["taskSuite"]
    scored = evaluate(out, suite, tmp_path / "exported.json")
    assert scored is not None
    assert (scored["reward"], scored["pass_at_k"]) == (
        second["reward_end"],
        second["pass_at_k_end"],
    )
    # A version the stream never had is refused, naming what it has; nothing is written.
    missing = export(spec, state, version + 1000, tmp_path / "none", env, exit_code=1)
    assert f"version {version + 1000} cannot be rebuilt" in missing["stderr"]
    assert not (tmp_path / "none").exists()


def export(spec: Path, state: Path, version: int, out: Path, env: dict, exit_code: int = 0) -> dict:
    done = subprocess.run(
        [
            *(sys.executable, "-m", "rlfleet.cli", "export", str(spec)),
            *("--state", str(state), "--version", str(version), "--to", str(out)),
        ],
        capture_output=True,
        text=True,
        timeout=300,
        env=env,
    )
    assert done.returncode == exit_code, done.stdout[-3000:] + done.stderr[-3000:]
    wrote = json.loads(done.stdout.splitlines()[-1]) if exit_code == 0 else {}
    return wrote | {"stderr": done.stderr}


def test_a_local_run_stops_failed_when_a_version_scores_under_the_gates_floor(
    small: tuple[Path, Path], tmp_path: Path
) -> None:
    spec, started = small
    gated = yaml.safe_load(spec.read_text())
    suite = gated["spec"]["rollout"]["taskSuite"]
    gated["spec"]["evaluation"] = {"suite": suite, "everyVersions": 1, "minReward": 0.99}
    spec = tmp_path / "gated.yaml"
    spec.write_text(yaml.safe_dump(gated))
    # A budget far beyond the test's timeout: only the gate's verdict can end this run.
    summary = run(state_from(started, tmp_path / "run"), minutes=60, spec=spec, exit_code=1)
    gate = summary["evaluation_gate"]
    assert gate["verdict"] == "Failed"
    last = gate["evaluations"][-1]
    assert last["reward"] < 0.99 and last["suite"] == suite and last["tasks"] == SUITE_TASKS
    said = " ".join(summary["stdout"].split())  # as read, whatever the terminal wrapped
    assert f"Failed: version {last['policy_version']} scored" in said
    assert "under minReward 0.99" in said


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

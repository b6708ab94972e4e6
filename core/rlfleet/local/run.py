"""`rlfleet run FILE`: an RLRun trained on this machine, end to end.

An embedded NATS hub with a leaf node per region, a tiny MoE made on the spot and warmed
up on the task suite, then the trainer, one rollout worker per region, a task feeder and,
with an evaluation gate, the evaluator, as local processes (`plan.processes`). The
trainer's step reports drive a live display (`watch.follow`); the run stops after its
time budget, on Ctrl-C (each process finishes what it is doing) or at the gate's verdict,
and leaves a report. Everything lives under one folder, so running again resumes.
"""

from __future__ import annotations

import asyncio
import json
import os
import shutil
import signal
import subprocess
import sys
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import msgspec
import yaml

from rlfleet.api.environment import BUILT_IN
from rlfleet.api.rlrun import RLRunSpec, check_run_name
from rlfleet.api.wire import (
    BusRole,
    CycleState,
    EvaluationReport,
    StepReport,
    cycle_state_subject,
    decode_cycle_state,
    decode_step_report,
    step_subject,
)
from rlfleet.bus import connection
from rlfleet.bus.reading import decoded, newest
from rlfleet.bus.streams import (
    TRAJECTORY_BACKLOG,
    cycle_stream,
    ensure_run_streams,
    step_stream,
)
from rlfleet.launch import objectstore
from rlfleet.launch.caches import own_caches
from rlfleet.launch.components import EVALUATION, WARMUP
from rlfleet.launch.settings import to_json
from rlfleet.local import plan, realtime, report
from rlfleet.local.nats import NatsBed, start_nats
from rlfleet.local.processes import Supervisor, stop_pids
from rlfleet.local.watch import INVERTED, Plane, console, follow, tell


class InvalidRun(Exception):
    """The file is not an RLRun the API server would take: nothing was started."""


def read_rlrun(path: Path) -> tuple[str, RLRunSpec]:
    """An RLRun manifest's name and spec, checked as the API server would check them."""
    try:
        document = yaml.safe_load(path.read_text())
        if not isinstance(document, dict) or document.get("kind") != "RLRun":
            raise ValueError("not an RLRun document")
        name = check_run_name((document.get("metadata") or {}).get("name"))
        return name, RLRunSpec.model_validate(document.get("spec"))
    except (OSError, ValueError, yaml.YAMLError) as error:
        raise InvalidRun(f"{path}: {error}") from error


def load(path: Path) -> tuple[str, RLRunSpec]:
    """`read_rlrun`, and what only a cluster can run refused."""
    name, spec = read_rlrun(path)
    if spec.trainer.deep_speed_config_map is not None:
        raise InvalidRun(
            f"{path}: spec.trainer.deepSpeedConfigMap: a local run has no ConfigMap to read "
            "it from; leave it out, or apply the run to a cluster"
        )
    if spec.model.credentials_secret is not None:
        raise InvalidRun(
            f"{path}: spec.model.credentialsSecret: a local run reads no Secret; leave it out,"
            " and give the store's keys as AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY"
        )
    if spec.rollout and spec.rollout.tasks and spec.rollout.tasks.volume is not None:
        raise InvalidRun(
            f"{path}: spec.rollout.tasks.volume: a local run mounts no volume; leave it out,"
            " and give the path relative to this file"
        )
    return name, spec


def fetch_model(spec: RLRunSpec, layout: plan.Layout) -> None:
    """An s3:// model, fetched (what it lacks) and checked, credentials from the
    environment (AWS_ACCESS_KEY_ID, AWS_SECRET_ACCESS_KEY) as the pods' init container has
    them from the run's Secret."""
    uri = spec.model.uri
    if not uri.startswith(objectstore.S3_SCHEME):
        return
    from minio.error import S3Error
    from urllib3.exceptions import HTTPError

    console.print(f"fetching the model {uri}")
    try:
        objectstore.fetch(uri, plan.model_path(spec, layout), spec.model.endpoint)
    except (objectstore.FetchError, S3Error, HTTPError) as error:
        raise InvalidRun(f"spec.model.uri {uri}: {error}") from error


def make_model(spec: RLRunSpec, layout: plan.Layout, warmup_steps: int) -> None:
    """A tiny model of the kind the URI names, warmed up on the suite; kept for re-runs."""
    if not spec.model.uri.startswith(plan.TINY_SCHEME) or (layout.model / "config.json").exists():
        return
    kind = spec.model.uri.removeprefix(plan.TINY_SCHEME)
    staging = layout.root / "model.partial"
    shutil.rmtree(staging, ignore_errors=True)  # what an interrupted warm-up left
    console.print(f"making a {kind} model and warming it up")
    subprocess.run(
        [sys.executable, "-m", "rlfleet.cli", "model", "init", "--kind", kind, str(staging)],
        check=True,
    )
    warmup = [*WARMUP.command(sys.executable), str(staging), spec.suite]
    warmup += ["--steps", str(warmup_steps)]
    if spec.rollout is not None and spec.rollout.environment.name != BUILT_IN:
        environment = spec.rollout.environment
        warmup += ["--environment", environment.name]
        warmup += ["--settings", json.dumps(environment.settings)]
    subprocess.run(warmup, check=True)
    staging.rename(layout.model)  # only a finished warm-up counts


EVALUATION_START, EVALUATION_END = "evaluation-start.json", "evaluation-end.json"


async def recorded_steps(run: str, url: str, credentials: Path) -> list[StepReport]:
    """Every step report the run's stream holds, re-runs included, oldest first."""
    nc = await connection.connect(url, credentials)
    try:
        steps = decoded(nc.jetstream(), step_stream(run), step_subject(run), decode_step_report)
        return [report async for _, report in steps]
    finally:
        await nc.close()


def evaluate(
    model: Path, suite: str, out: Path, *published: str, credentials: Path | None = None
) -> dict | None:
    """The policy's evaluation on the whole suite (`rlfleet.rollout.evaluation.suite`): the
    starting model's, or with `published` (`--run NAME --nats-url URL`) the newest version
    the run published, read as the user of `credentials`. None, with the reason shown,
    for a suite it cannot grade."""
    done = subprocess.run(
        [*EVALUATION.command(sys.executable), str(model), suite, str(out), *published],
        capture_output=True,
        text=True,
        env=os.environ | ({connection.CREDENTIALS_ENV: str(credentials)} if credentials else {}),
    )
    if done.returncode != 0:
        reason = (done.stderr.strip().splitlines() or ["no output"])[-1]
        console.print(f"[yellow]no evaluation: {reason}[/yellow]")
        return None
    return json.loads(out.read_text())


def launch(process: plan.Process, supervisor: Supervisor) -> None:
    """Writes the process's settings where its argv names it, then starts it."""
    process.settings_path.write_bytes(to_json(process.config))
    supervisor.start(process.name, process.argv, process.env)


@dataclass
class Trained:
    steps: list[StepReport]  # every step the run has recorded, re-runs included
    end: dict | None  # the last version's evaluation on the whole suite
    scores: list[EvaluationReport]  # the gate's evaluator's, this time round
    cycles: CycleState | None = None  # a production run's conductor's, at the end
    # A production run's captured completions: the version that answered each, by id.
    served: dict[str, int] = field(default_factory=dict)

    def verdict(self, spec: RLRunSpec) -> str | None:
        """`Failed` or `Succeeded` when the evaluation gate ended the run."""
        if spec.evaluation is None or not self.scores:
            return None
        return spec.evaluation.verdict(self.scores[-1].reward)


PlaneFactory = Callable[[str, RLRunSpec, plan.Layout, plan.Tuning], Plane]


async def make_streams(
    bed: NatsBed, run: str, trajectory_backlog: int = TRAJECTORY_BACKLOG
) -> None:
    """The run's streams, and its weights' mirror in every region, as the hub operator
    makes them for a run in a cluster: the run's processes only bind to them."""
    nc = await bed.hub.connect()
    try:
        leaves = list(bed.leaves)
        missing = await ensure_run_streams(nc, run, bed.hub.domain, leaves, trajectory_backlog)
    finally:
        await nc.close()
    if missing:
        raise RuntimeError(f"run {run}: no weights mirror in {', '.join(missing)}")


def print_metrics(processes: list[plan.Process]) -> None:
    """Where each process serves its Prometheus metrics, as a pod would on its port."""
    for process in processes:
        if process.metrics_url:
            console.print(f"  {process.name} metrics: {process.metrics_url}")


def production_processes(
    key: str, spec: RLRunSpec, layout: plan.Layout, bed: NatsBed, tuning: plan.Tuning
) -> list[plan.Process]:
    """A production run's processes, its pool's servers and simulated users with them,
    whose users start honest (a run stopped while they misreported left its file)."""
    (layout.root / INVERTED).unlink(missing_ok=True)
    inverted = layout.root / INVERTED
    return realtime.processes(key, spec, layout, bed, tuning, inverted_while=inverted)


class LocalPlane:
    """An embedded NATS hub with a leaf node per region, and the run's processes."""

    def __init__(
        self, name: str, spec: RLRunSpec, layout: plan.Layout, tuning: plan.Tuning
    ) -> None:
        self.name, self.spec, self.layout, self.tuning = name, spec, layout, tuning
        self.key = name  # the run has NATS to itself
        self.root, self.production = layout.root, spec.production is not None
        self.credentials = layout.credentials(BusRole.OBSERVER)
        self.supervisor = Supervisor(layout.logs, attached=True)
        self.components: list[str] = []

    def __enter__(self) -> LocalPlane:
        try:
            regions = self.spec.region_names
            bed = start_nats(regions, self.supervisor, self.layout.nats)
            self.url, self.bed = bed.hub.url, bed
            bed.keep_run_users(self.key, self.users())
            backlog = self.spec.trajectory_backlog_mib << 20
            asyncio.run(make_streams(bed, self.key, backlog))
            if self.spec.production is not None:
                processes = production_processes(self.key, self.spec, self.layout, bed, self.tuning)
            else:
                processes = plan.processes(self.key, self.spec, self.layout, bed, self.tuning)
            for process in processes:
                launch(process, self.supervisor)
                self.components.append(process.name)
        except BaseException:
            self.__exit__()
            raise
        console.print(f"started {self.name}: logs in {self.layout.logs}; Ctrl-C stops and reports")
        print_metrics(processes)
        return self

    def users(self) -> dict[BusRole, Path]:
        return {role: self.layout.credentials(role) for role in BusRole}

    def check_alive(self) -> None:
        self.supervisor.check_alive()
        self.bed.keep_run_users(self.key, self.users())  # renewed before they expire

    def status(self, trained_s: float) -> str | None:
        return None

    def stop_run(self) -> None:
        pids = self.supervisor.pids()
        stop_pids([pid for name, pid in pids.items() if name in self.components], 30)

    def __exit__(self, *exc: object) -> None:
        self.stop_run()  # before NATS, so the trainer's last step still gets out
        self.supervisor.stop_all(grace_seconds=30)


def train(
    name: str,
    spec: RLRunSpec,
    layout: plan.Layout,
    budget_s: float,
    tuning: plan.Tuning,
    plane_for: PlaneFactory = LocalPlane,
    invert_cycle: int | None = None,
) -> Trained:
    """Runs the RLRun's processes until `budget_s` of training, Ctrl-C or the evaluation
    gate's verdict, then stops them, and evaluates the last version. A production run
    goes on until its budget (its gate judges each candidate, not the run), and its
    conductor's last state says what its cycles did."""
    for folder in (layout.root, layout.logs, layout.configs, layout.nats):
        folder.mkdir(parents=True, exist_ok=True)
    stop = asyncio.Event()
    with plane_for(name, spec, layout, tuning) as plane:

        async def watched() -> list[EvaluationReport]:
            loop = asyncio.get_running_loop()
            loop.add_signal_handler(signal.SIGINT, stop.set)
            loop.add_signal_handler(signal.SIGTERM, stop.set)
            gate = None if spec.production is not None else spec.evaluation
            return await follow(name, plane, budget_s, stop, gate, invert_cycle)

        scores = asyncio.run(watched())
        # The run's own processes stop first, so the trainer's last step gets out, and the
        # evaluation reads the version it made while NATS is still there.
        plane.stop_run()
        if spec.production is not None:
            state = asyncio.run(last_cycle_state(plane.key, plane.url, plane.credentials))
            steps = asyncio.run(recorded_steps(plane.key, plane.url, plane.credentials))
            served = asyncio.run(realtime.served_versions(plane.key, plane.url, plane.credentials))
            return Trained(steps, None, scores, state, served)
        console.print("evaluating the last version on the whole suite")
        end = evaluate(
            plan.model_path(spec, layout),
            spec.suite,
            layout.report / EVALUATION_END,
            *("--run", plane.key, "--nats-url", plane.url),
            credentials=plane.credentials,
        )
        steps = asyncio.run(recorded_steps(plane.key, plane.url, plane.credentials))
    return Trained(steps, end, scores)


async def last_cycle_state(run: str, url: str, credentials: Path) -> CycleState | None:
    nc = await connection.connect(url, credentials)
    try:
        subject = cycle_state_subject(run)
        return await newest(nc.jetstream(), cycle_stream(run), subject, decode_cycle_state)
    finally:
        await nc.close()


def run(
    path: Path,
    root: Path | None,
    minutes: float,
    warmup_steps: int | None,
    plane_for: PlaneFactory = LocalPlane,
    invert_cycle: int | None = None,
) -> int:
    """Trains the run; exits 1 when its evaluation gate failed it."""
    name, spec = load(path)
    layout = plan.Layout.of(name, path, root)
    own_caches(layout.caches)  # here, unless whoever started the run gave it a root
    tuning = plan.Tuning()
    fetch_model(spec, layout)
    make_model(spec, layout, warmup_steps or tuning.warmup_steps)
    start = layout.report / EVALUATION_START
    if not start.exists():  # the model a run starts from never changes: once is enough
        console.print("evaluating the starting model on the whole suite")
        evaluate(plan.model_path(spec, layout), spec.suite, start)
    trained = train(name, spec, layout, minutes * 60, tuning, plane_for, invert_cycle)
    if spec.production is not None:
        found = realtime.write_report(layout, trained.cycles, invert_cycle, trained.served)
        console.print_json(data=found)
        console.print(f"report in {layout.report}")
        return 0
    evaluated = json.loads(start.read_text()) if start.exists() and trained.end else None
    verdict = trained.verdict(spec)
    gate = {
        "verdict": verdict,
        "evaluations": [msgspec.to_builtins(score) for score in trained.scores],
    }
    summary = report.write(
        trained.steps, layout.report, evaluated, trained.end, gate if spec.evaluation else None
    )
    console.print_json(data=summary)
    console.print(f"report in {layout.report}")
    if spec.evaluation is not None and verdict is not None:
        tell(verdict, spec.evaluation, trained.scores[-1])
    return 1 if verdict == "Failed" else 0

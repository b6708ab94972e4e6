"""Runs through the operators left running on the dev bed (`rlfleet run --operator
--detach`, what `make bed` starts), until `rlfleet dev down` stops them.

A detached run is `rlfleet run --operator` in a session of its own, its output in a log,
recorded in the bed's state folder (`runs/NAMESPACE.json`). Starting one waits until the
hub reports its first version, so whoever started it finds its columns filled. Stopping
one is Ctrl-C's: SIGTERM to the run's process alone (`rlfleet run --operator` takes it
as Ctrl-C from its first line), upon which it stops its pods, evaluates and reports, and
deletes its RLRun and namespace while the operators still run; only then do they stop.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path

import psutil

from rlfleet.local.binaries import binary
from rlfleet.testbed.bed import BedInfo
from rlfleet.testbed.fleet import HUB

RUNS = "runs"  # in the bed's state folder: one record per detached run
# A stopped run reports first: its pods' grace, its last version's evaluation on the
# whole suite, and the hub's deletion of its streams (`operated.DELETE_WAIT_S`).
STOP_GRACE_S = 240.0
LOG_TAIL_BYTES = 4000  # of a run's log, shown when it ends before it trains


@dataclass(frozen=True)
class DetachedRun:
    namespace: str  # the run's namespace in the bed's hub (and its regions)
    pid: int  # `rlfleet run`'s; the leader of its own process group
    started: float  # the process's creation time: a pid used again is not the run
    log: str

    def record(self, bed_state: Path) -> Path:
        return bed_state / RUNS / f"{self.namespace}.json"

    def alive(self) -> bool:
        try:
            process = psutil.Process(self.pid)
            return process.create_time() == self.started and process.status() not in (
                psutil.STATUS_ZOMBIE,
                psutil.STATUS_DEAD,
            )
        except psutil.NoSuchProcess:
            return False

    def log_tail(self) -> str:
        with Path(self.log).open("rb") as log:
            log.seek(0, 2)
            log.seek(max(0, log.tell() - LOG_TAIL_BYTES))
            return log.read().decode(errors="replace")


class DetachedRunEnded(RuntimeError):
    """The run's process ended before the hub reported a version."""


def start(argv: Sequence[str], bed_state: Path, namespace: str, log: Path) -> DetachedRun:
    """`rlfleet ARGV` (an `rlfleet run --operator` into `namespace`) in a session of its
    own, recorded in the bed's state folder."""
    log.parent.mkdir(parents=True, exist_ok=True)
    with log.open("ab") as out:
        process = subprocess.Popen(
            [sys.executable, "-m", "rlfleet.cli", *argv],
            stdin=subprocess.DEVNULL,
            stdout=out,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
    started = psutil.Process(process.pid).create_time()
    run = DetachedRun(namespace, process.pid, started, str(log.resolve()))
    record = run.record(bed_state)
    partial = record.with_suffix(".partial")
    partial.write_text(json.dumps(asdict(run)))
    partial.replace(record)  # whole or not there: `rlfleet dev down` reads every record
    return run


def policy_version(bed: BedInfo, namespace: str) -> int | None:
    """The version the hub reports for the RLRun in `namespace`; None before it has one,
    or while the hub does not answer."""
    try:
        found = subprocess.run(
            [
                binary("kubectl"),
                f"--kubeconfig={bed.kubeconfig}",
                f"--context={HUB}",
                *("-n", namespace, "get", "rlrun"),
                "-o=jsonpath={.items[*].status.policyVersion}",
            ],
            capture_output=True,
            text=True,
            timeout=60,
        ).stdout.split()
    except subprocess.TimeoutExpired:
        return None
    return max(map(int, found)) if found else None


def wait_training(bed: BedInfo, run: DetachedRun, timeout_s: float) -> int:
    """The run's first version as the hub reports it, once there is one; raises
    `DetachedRunEnded` (with its log's tail) if the run ends first, TimeoutError if it
    takes longer than `timeout_s`."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if not run.alive():
            raise DetachedRunEnded(f"the run ended before it trained:\n{run.log_tail()}")
        version = policy_version(bed, run.namespace)
        if version:
            return version
        time.sleep(2.0)
    raise TimeoutError(f"no version reported in {timeout_s:.0f}s; see {run.log}")


def recorded(bed_state: Path) -> list[DetachedRun]:
    return [
        DetachedRun(**json.loads(path.read_text()))
        for path in sorted((bed_state / RUNS).glob("*.json"))
    ]


def stop(bed_state: Path, runs: Sequence[DetachedRun], grace_s: float = STOP_GRACE_S) -> None:
    """Stops detached runs as Ctrl-C would, each given `grace_s` to report and delete its
    namespace before its process group is killed, and forgets them."""
    live = [run for run in runs if run.alive()]
    for run in live:
        with contextlib.suppress(ProcessLookupError):
            os.kill(run.pid, signal.SIGTERM)  # the run alone: its kubectl calls finish
    deadline = time.monotonic() + grace_s
    while (live := [run for run in live if run.alive()]) and time.monotonic() < deadline:
        time.sleep(0.5)
    for run in live:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(run.pid, signal.SIGKILL)  # its operators and pods die with it
    for run in runs:
        run.record(bed_state).unlink(missing_ok=True)


def stop_all(bed_state: Path) -> list[DetachedRun]:
    """Stops every detached run of the bed; returns those that were still running."""
    runs = recorded(bed_state)
    live = [run for run in runs if run.alive()]
    stop(bed_state, runs)
    return live

"""The bed never leaves a process behind: not after `rlfleet dev down`, not when the test run
that owns it is killed outright."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import psutil
from conftest import ROOT


def wait_gone(pids: list[int], timeout: float = 30) -> list[int]:
    deadline = time.monotonic() + timeout
    alive = pids
    while alive and time.monotonic() < deadline:
        alive = [
            pid
            for pid in alive
            if psutil.pid_exists(pid) and psutil.Process(pid).status() != "zombie"
        ]
        time.sleep(0.2)
    return alive


def test_dev_up_status_down_leaves_nothing(tmp_path: Path) -> None:
    state = tmp_path / "dev"
    rlfleet = [sys.executable, "-m", "rlfleet.cli", "dev"]
    up = subprocess.run(
        [*rlfleet, "up", "--state", str(state)], capture_output=True, text=True, timeout=300
    )
    assert up.returncode == 0, up.stderr
    pids = list(json.loads((state / "bed.json").read_text())["pids"].values())
    try:
        status = subprocess.run(
            [*rlfleet, "status", "--state", str(state)], capture_output=True, text=True
        )
        assert status.returncode == 0, status.stdout
        report = json.loads(status.stdout)
        assert all(report["processes"].values()) and report["resident_mib"] > 0
        kubeconfig = report["kubeconfig"]
        nodes = subprocess.run(
            [
                str(ROOT / ".bin" / "kubectl"),
                f"--kubeconfig={kubeconfig}",
                "--context=region-c",
                "get",
                "nodes",
                "-o",
                "name",
            ],
            capture_output=True,
            text=True,
            check=True,
        )
        assert len(nodes.stdout.split()) == 4
    finally:
        down = subprocess.run(
            [*rlfleet, "down", "--state", str(state)], capture_output=True, text=True, timeout=120
        )
    assert down.returncode == 0, down.stderr
    assert wait_gone(pids) == []
    assert (
        subprocess.run([*rlfleet, "status", "--state", str(state)], capture_output=True).returncode
        != 0
    )


def test_killed_owner_takes_the_bed_with_it(tmp_path: Path) -> None:
    """A test run killed with SIGKILL runs no teardown; its bed must still go."""
    owner = textwrap.dedent(
        f"""
        import time
        from pathlib import Path
        from rlfleet.testbed.bed import Bed
        from rlfleet.testbed.kube import ClusterSpec
        clusters = (ClusterSpec("hub", 1, 8, "hub"), ClusterSpec("region-a", 1, 8, "region-a"))
        Bed(Path({str(tmp_path / "bed")!r}), attached=True, clusters=clusters).start()
        print("up", flush=True)
        time.sleep(600)
        """
    )
    process = subprocess.Popen([sys.executable, "-c", owner], stdout=subprocess.PIPE, text=True)
    try:
        assert process.stdout is not None and process.stdout.readline().strip() == "up"
        pids = list(json.loads((tmp_path / "bed" / "bed.json").read_text())["pids"].values())
        assert len(pids) == 1 + 2 + 2 * 4  # etcd, NATS hub and leaf, four per cluster
        assert all(psutil.pid_exists(pid) for pid in pids)
    finally:
        os.kill(process.pid, signal.SIGKILL)
        process.wait()
    assert wait_gone(pids) == []

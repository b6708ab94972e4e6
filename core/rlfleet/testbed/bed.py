"""The whole test bed: four Kubernetes clusters and NATS, started and stopped as one.

`Bed.start()` brings everything up in a state directory and writes `bed.json` there, so
another process (`rlfleet dev status|down`) can find and stop it.
"""

from __future__ import annotations

import json
import shutil
from dataclasses import dataclass
from pathlib import Path

import psutil

from rlfleet.local.files import write_secret
from rlfleet.local.nats import NatsBed, start_nats
from rlfleet.local.processes import Supervisor, stop_pids
from rlfleet.testbed.kube import (
    DEFAULT_CLUSTERS,
    ClusterSpec,
    start_clusters,
    start_etcd,
)
from rlfleet.testbed.pki import make_pki

STATE_FILE = "bed.json"


@dataclass
class BedInfo:
    """What a started bed publishes about itself in bed.json."""

    state_dir: Path
    kubeconfig: Path
    kubeconfigs: dict[str, Path]
    nats: NatsBed
    pids: dict[str, int]

    def save(self) -> None:
        data = {
            "kubeconfig": str(self.kubeconfig),
            "kubeconfigs": {k: str(v) for k, v in self.kubeconfigs.items()},
            "nats": json.loads(self.nats.to_json()),
            "pids": self.pids,
        }
        write_secret(self.state_dir / STATE_FILE, json.dumps(data, indent=2))

    @classmethod
    def load(cls, state_dir: Path) -> BedInfo:
        data = json.loads((state_dir / STATE_FILE).read_text())
        return cls(
            state_dir,
            Path(data["kubeconfig"]),
            {k: Path(v) for k, v in data["kubeconfigs"].items()},
            NatsBed.from_json(json.dumps(data["nats"])),
            data["pids"],
        )

    @classmethod
    def running(cls, state_dir: Path) -> BedInfo | None:
        """The bed recorded in `state_dir` if every one of its processes runs; None if
        there is none, or only part of one (`stop_recorded` clears what is left)."""
        if not (state_dir / STATE_FILE).exists():
            return None
        info = cls.load(state_dir)
        return info if all(info.alive().values()) else None

    def alive(self) -> dict[str, bool]:
        return {name: psutil.pid_exists(pid) for name, pid in self.pids.items()}

    def resident_bytes(self) -> int:
        """Resident memory of every bed process and its children."""
        total = 0
        for pid in self.pids.values():
            try:
                root = psutil.Process(pid)
                for process in [root, *root.children(recursive=True)]:
                    total += process.memory_info().rss
            except psutil.NoSuchProcess:
                continue
        return total


class Bed:
    def __init__(
        self,
        state_dir: Path,
        *,
        attached: bool,
        clusters: tuple[ClusterSpec, ...] = DEFAULT_CLUSTERS,
    ) -> None:
        self.state_dir = state_dir
        self.cluster_specs = clusters
        self.supervisor = Supervisor(state_dir / "logs", attached=attached)
        self.info: BedInfo | None = None  # once started

    def start(self) -> BedInfo:
        self.state_dir.mkdir(parents=True, exist_ok=True)
        # Every bed is new (fresh PKI and credentials): stores an earlier bed left behind
        # would hold its nodes and streams, and creating those again would conflict.
        for store in ("etcd", "nats"):
            shutil.rmtree(self.state_dir / store, ignore_errors=True)
        try:
            pki = make_pki(self.state_dir / "pki")
            etcd = start_etcd(self.supervisor, self.state_dir / "etcd")
            regions = [spec.region for spec in self.cluster_specs if spec.name != "hub"]
            nats = start_nats(regions, self.supervisor, self.state_dir / "nats")
            kube = start_clusters(self.cluster_specs, self.supervisor, etcd, pki, self.state_dir)
        except BaseException:
            self.stop()
            raise
        info = BedInfo(
            self.state_dir,
            kube.merged_kubeconfig,
            {name: cluster.kubeconfig for name, cluster in kube.clusters.items()},
            nats,
            self.supervisor.pids(),
        )
        info.save()
        self.info = info
        return info

    def restart(self, name: str) -> None:
        """Kills one of the bed's processes and starts it again as it was (a fault)."""
        self.supervisor.restart(name)
        self._record_pids()

    def revive(self, name: str) -> None:
        """Starts again, as it was, one of the bed's processes that exited."""
        self.supervisor.revive(name)
        self._record_pids()

    def _record_pids(self) -> None:
        # bed.json must name the processes running now: `rlfleet run --bed` takes a bed
        # whose recorded pids are gone for half-dead, and stops what is left of it.
        assert self.info is not None, "start the bed first"
        self.info.pids = self.supervisor.pids()
        self.info.save()

    def stop(self) -> None:
        self.supervisor.stop_all()
        (self.state_dir / STATE_FILE).unlink(missing_ok=True)


def stop_recorded(state_dir: Path) -> int:
    """Stops a bed started by another process; returns how many processes it stopped."""
    info = BedInfo.load(state_dir)
    stop_pids(list(info.pids.values()))
    (state_dir / STATE_FILE).unlink(missing_ok=True)
    return len(info.pids)

"""`rlfleet dev up|status|down`: the four-cluster test bed and NATS, for a developer."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from rlfleet.cli.commands import add_group
from rlfleet.testbed.bed import STATE_FILE, Bed, BedInfo, stop_recorded

DEFAULT_STATE = Path(".rlfleet/dev")


def _up(args: argparse.Namespace) -> int:
    if (info := BedInfo.running(args.state)) is not None:
        print(f"already up; export KUBECONFIG={info.kubeconfig}")
        return 0
    if (args.state / STATE_FILE).exists():
        stop_recorded(args.state)  # a half-dead bed from an earlier run
    info = Bed(args.state.resolve(), attached=False).start()
    print(f"four clusters and NATS are up; export KUBECONFIG={info.kubeconfig}")
    print("contexts: " + ", ".join(info.kubeconfigs))
    print(
        f"NATS hub {info.nats.hub.url}; leaf nodes: "
        + ", ".join(f"{r} {s.url}" for r, s in info.nats.leaves.items())
    )
    print(f"NATS user: export RLFLEET_NATS_CREDS={info.nats.hub.credentials}")
    print(f"credentials and logs in {args.state}")
    return 0


def _status(args: argparse.Namespace) -> int:
    if not (args.state / STATE_FILE).exists():
        print("down")
        return 1
    info = BedInfo.load(args.state)
    alive = info.alive()
    report = {
        "kubeconfig": str(info.kubeconfig),
        "processes": alive,
        "resident_mib": round(info.resident_bytes() / 2**20),
    }
    print(json.dumps(report, indent=2))
    return 0 if all(alive.values()) else 1


def _down(args: argparse.Namespace) -> int:
    from rlfleet.testbed import detached

    # Runs first, while the clusters and operators they report to and clean up in run.
    for run in detached.stop_all(args.state):
        print(f"stopped the run in namespace {run.namespace}; its output: {run.log}")
    if not (args.state / STATE_FILE).exists():
        print("nothing to stop")
        return 0
    print(f"stopped {stop_recorded(args.state)} processes")
    return 0


def register(groups: argparse._SubParsersAction) -> None:
    add_group(
        groups,
        "dev",
        "the local four-cluster test bed",
        [
            ("up", _up, "start four clusters and NATS in the background"),
            ("status", _status, "show whether the bed runs and what it uses"),
            ("down", _down, "stop the bed and the runs left on it (`rlfleet run --detach`)"),
        ],
        lambda command: command.add_argument("--state", type=Path, default=DEFAULT_STATE),
    )

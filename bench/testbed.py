"""Benchmark: start-up time and idle footprint of the four-cluster bed with NATS.

Prints one JSON object. Memory is the resident set of every bed process, after the bed
has idled; CPU is the bed's share of one core over the idle window. `--quick` idles for
two seconds, to check the script (the bed's start is what it is).
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from collections import defaultdict
from pathlib import Path

import psutil

from rlfleet.testbed.bed import Bed

IDLE_SECONDS = 30
QUICK = {"IDLE_SECONDS": 2}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="smallest sizes: check the script")
    if parser.parse_args().quick:
        globals().update(QUICK)
    with tempfile.TemporaryDirectory(prefix="rlfleet-bench-bed-") as state:
        bed = Bed(Path(state), attached=True)
        started = time.monotonic()
        info = bed.start()
        start_seconds = time.monotonic() - started
        try:
            processes = {name: psutil.Process(pid) for name, pid in info.pids.items()}
            cpu_before = {n: sum(p.cpu_times()[:2]) for n, p in processes.items()}
            time.sleep(IDLE_SECONDS)
            cpu_after = {n: sum(p.cpu_times()[:2]) for n, p in processes.items()}
            rss_by_component: dict[str, int] = defaultdict(int)
            for name, process in processes.items():
                component = (
                    name.split("-", 2)[-1]
                    if name.startswith("region-")
                    else name.removeprefix("hub-")
                )
                rss_by_component[component] += process.memory_info().rss
            idle_cpu = sum(cpu_after[n] - cpu_before[n] for n in processes) / IDLE_SECONDS
        finally:
            bed.stop()
    print(
        json.dumps(
            {
                "bench": "testbed",
                "clusters": len(info.kubeconfigs),
                "processes": len(info.pids),
                "start_seconds": round(start_seconds, 1),
                "idle_rss_mib": round(sum(rss_by_component.values()) / 2**20),
                "idle_rss_mib_by_component": {
                    k: round(v / 2**20) for k, v in sorted(rss_by_component.items())
                },
                "idle_cpu_cores": round(idle_cpu, 3),
            }
        )
    )


if __name__ == "__main__":
    main()

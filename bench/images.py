"""Benchmark: each image's Python environment, built as its Dockerfile builds it.

Prints one JSON object: per image, the seconds to build its environment from uv's cache
and its size on disk; for the operator, the seconds and peak resident memory of
importing everything it runs (kopf, the Kubernetes client, NATS, the operator's modules),
which is most of its start before the first reconcile, and the same for the whole
development environment (`.venv`) for comparison.
"""

from __future__ import annotations

import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
import images  # the tests' builder: one way to build an image's environment

# Imports the operator's modules, then prints the seconds and peak resident MiB it took.
OPERATOR_START = """
import importlib, json, pkgutil, resource, time
started = time.perf_counter()
import rlfleet.operator.__main__
for module in pkgutil.walk_packages(rlfleet.operator.__path__, "rlfleet.operator."):
    importlib.import_module(module.name)
print(json.dumps({
    "import_seconds": round(time.perf_counter() - started, 2),
    "peak_rss_mib": round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024),
}))
"""


def size_mib(folder: Path) -> int:
    """Bytes on disk, counting a file hard-linked from uv's cache once, as an image would."""
    seen: set[int] = set()
    total = 0
    for path in folder.rglob("*"):
        if path.is_file() and not path.is_symlink():
            stat = path.stat()
            if stat.st_ino not in seen:
                seen.add(stat.st_ino)
                total += stat.st_size
    return round(total / 2**20)


def operator_start(python: str) -> dict:
    done = subprocess.run(
        [python, "-c", OPERATOR_START], capture_output=True, text=True, check=True
    )
    return json.loads(done.stdout.splitlines()[-1])


def main() -> None:
    report: dict = {"images": {}}
    with tempfile.TemporaryDirectory(prefix="rlfleet-bench-images-") as work:
        for dockerfile in images.dockerfiles():
            started = time.monotonic()
            python = images.environment(dockerfile, Path(work) / dockerfile.name)
            report["images"][dockerfile.name] = {
                "build_seconds": round(time.monotonic() - started, 1),
                "size_mib": size_mib(python.parents[1]),
            }
            if dockerfile.name == "operator":
                report["operator_start"] = operator_start(str(python))
    report["operator_start_in_dev_venv"] = operator_start(sys.executable)
    report["ratio_operator_peak_rss_image_to_dev"] = round(
        report["operator_start"]["peak_rss_mib"]
        / report["operator_start_in_dev_venv"]["peak_rss_mib"],
        2,
    )
    print(json.dumps(report))


if __name__ == "__main__":
    main()

"""Benchmark: each image's Python environment, built as its Dockerfile builds it.

Prints one JSON object: per image, the seconds to build its environment from uv's cache
and its size on disk; for the operator, the seconds and peak resident memory of
importing everything it runs (kopf, the Kubernetes client, NATS, the operator's modules),
which is most of its start before the first reconcile, and the same for the whole
development environment (`.venv`) for comparison.

It is also a check: every module of each component's packages imports in its image's
environment (the tests import only what each image runs, `tests/engines/test_images.py`), and
none of the operator's imports a data-plane library. Per image, `import_all` gives the
modules imported, the seconds and peak MiB it took, the heavy packages that came along
and the modules that failed; the command exits 1 when one failed or the operator's
imports bring a heavy package. `--quick` is the same run: every image is the check, and
uv's cache makes the whole of it about half a minute.
"""

from __future__ import annotations

import argparse
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

# The packages each component's image holds, whose every module must import there.
PACKAGES = {
    "operator": ["rlfleet.operator", "rlfleet.api"],
    "trainer": ["rlfleet.trainer"],
    "rollout": ["rlfleet.rollout"],
}
HEAVY = ["torch", "vllm", "deepspeed", "transformers"]
# Imports every module of the packages given; prints what it imported and what failed.
IMPORT_ALL = """
import importlib, json, pkgutil, resource, sys, time
started = time.perf_counter()
modules, failed = 0, {}
for package in sys.argv[1:]:
    root = importlib.import_module(package)
    for module in pkgutil.walk_packages(root.__path__, package + "."):
        try:
            importlib.import_module(module.name)
            modules += 1
        except Exception as error:
            failed[module.name] = f"{type(error).__name__}: {error}"
print(json.dumps({
    "modules": modules,
    "import_seconds": round(time.perf_counter() - started, 2),
    "peak_rss_mib": round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024),
    "heavy": sorted({m.split(".")[0] for m in sys.modules} & set(%r)),
    "failed": failed,
}))
"""


def import_all(python: str, packages: list[str]) -> dict:
    done = subprocess.run(
        [python, "-c", IMPORT_ALL % (HEAVY,), *packages], capture_output=True, text=True
    )
    if done.returncode != 0:  # a package itself did not import
        reason = (done.stderr.strip().splitlines() or ["no output"])[-1]
        return {"modules": 0, "heavy": [], "failed": {" ".join(packages): reason}}
    return json.loads(done.stdout.splitlines()[-1])


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
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="the same run: already small")
    parser.parse_args()
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
            if dockerfile.name in PACKAGES:
                found = import_all(str(python), PACKAGES[dockerfile.name])
                report["images"][dockerfile.name]["import_all"] = found
    report["operator_start_in_dev_venv"] = operator_start(sys.executable)
    report["ratio_operator_peak_rss_image_to_dev"] = round(
        report["operator_start"]["peak_rss_mib"]
        / report["operator_start_in_dev_venv"]["peak_rss_mib"],
        2,
    )
    imported = [image["import_all"] for image in report["images"].values() if "import_all" in image]
    report["import_all_ok"] = (
        not any(found["failed"] for found in imported)
        and not report["images"]["operator"]["import_all"]["heavy"]
    )
    print(json.dumps(report))
    if not report["import_all_ok"]:
        sys.exit(1)


if __name__ == "__main__":
    main()

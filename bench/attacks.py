"""Benchmark: every known attack on rlfleet's trust boundaries, tried against the real parts.

Prints one JSON object. Each attack is a test marked `attack(surface)` (feedback, sandbox,
nats, kubernetes) that fails when the attack gets through; this runs them all with
pytest, in this process, and counts:

- `attacks_tried`, and by surface in `by_surface` (`tried`, `succeeded`, `skipped`);
- `attacks_succeeded`: the names of the attacks whose test failed or errored (the
  boundary gave way, or the attack could not be judged: either needs a look);
- `attacks_skipped`: tests that did not run (a part missing on this machine, or left
  out by `--quick`).

It exits with pytest's status when pytest itself failed (a usage error, no tests), as
then nothing was judged.

`python bench/attacks.py [--quick] [-k EXPR]`; extra arguments go to pytest. `--quick`
tries only the attacks that need no four-cluster bed (`QUICK_MARKS`), to check the script.
"""

from __future__ import annotations

import contextlib
import json
import sys
from collections import defaultdict
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
MARKS = "attack"
QUICK_MARKS = "attack and not bed"  # the bed's tier marker, from its tests' folder


class Tally:
    """A pytest plugin: each attack test's surface and outcome."""

    def __init__(self) -> None:
        self.surface: dict[str, str] = {}
        self.outcome: dict[str, str] = {}

    def pytest_collection_modifyitems(self, items) -> None:
        for item in items:
            marker = item.get_closest_marker("attack")
            if marker is not None:
                self.surface[item.nodeid] = marker.args[0] if marker.args else "unknown"

    def pytest_runtest_logreport(self, report) -> None:
        if report.nodeid not in self.surface:
            return
        if report.failed:
            self.outcome[report.nodeid] = "succeeded"  # the attack got through (or broke)
        elif report.skipped:
            self.outcome.setdefault(report.nodeid, "skipped")
        elif report.when == "call":
            self.outcome.setdefault(report.nodeid, "stopped")

    def summary(self) -> dict:
        surfaces: dict[str, dict] = defaultdict(lambda: {"tried": 0, "succeeded": []})
        for nodeid, surface in sorted(self.surface.items()):
            outcome = self.outcome.get(nodeid, "skipped")
            entry = surfaces[surface]
            name = nodeid.split("::", 1)[-1]
            if outcome == "skipped":
                entry.setdefault("skipped", []).append(name)
                continue
            entry["tried"] += 1
            if outcome == "succeeded":
                entry["succeeded"].append(name)
        return {
            "attacks_tried": sum(s["tried"] for s in surfaces.values()),
            "attacks_succeeded": [n for s in surfaces.values() for n in s["succeeded"]],
            "attacks_skipped": [n for s in surfaces.values() for n in s.get("skipped", [])],
            "by_surface": dict(surfaces),
        }


def main() -> None:
    tally = Tally()
    extra = [arg for arg in sys.argv[1:] if arg != "--quick"]
    marks = QUICK_MARKS if len(extra) < len(sys.argv[1:]) else MARKS
    arguments = ["-q", "-p", "no:cacheprovider", "-m", marks, str(ROOT / "tests")]
    with contextlib.redirect_stdout(sys.stderr):  # stdout holds the JSON object alone
        code = pytest.main([*arguments, *extra], plugins=[tally])
    result = tally.summary() | {"pytest_exit_code": int(code)}
    print(json.dumps(result))
    if code not in (pytest.ExitCode.OK, pytest.ExitCode.TESTS_FAILED):
        sys.exit(int(code))  # pytest itself failed (no tests, a usage error): nothing judged


if __name__ == "__main__":
    main()

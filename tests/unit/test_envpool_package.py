"""The EnvPool session server's package is all the sandbox image copies: importing every
module of it pulls in the standard library alone, and no other rlfleet module."""

from __future__ import annotations

import json
import subprocess
import sys

IMPORT_ALL = """
import importlib, json, pkgutil, sys
import rlfleet.rollout.envpool as package
for module in pkgutil.iter_modules(package.__path__):  # __main__ too: importing it serves not
    importlib.import_module(f"rlfleet.rollout.envpool.{module.name}")
print(json.dumps(sorted(sys.modules)))
"""
# What the interpreter itself, and this checkout's editable install, bring along.
NOT_IMPORTED_BY_IT = ("__main__", "__editable__", "_distutils_hack")


def test_importing_the_session_server_pulls_in_nothing_but_the_standard_library() -> None:
    done = subprocess.run(
        [sys.executable, "-I", "-c", IMPORT_ALL], capture_output=True, text=True, timeout=60
    )
    assert done.returncode == 0, done.stderr
    modules = json.loads(done.stdout)
    assert "rlfleet.rollout.envpool.server" in modules
    rlfleet = [m for m in modules if m.split(".")[0] == "rlfleet"]
    assert [m for m in rlfleet if not m.startswith("rlfleet.rollout.envpool")] == [
        "rlfleet",
        "rlfleet.rollout",
    ]
    outside = {
        top
        for top in (m.split(".")[0] for m in modules)
        if top not in sys.stdlib_module_names and top != "rlfleet"
    }
    assert not {t for t in outside if not t.startswith(NOT_IMPORTED_BY_IT)}

"""`rlfleet export FILE`: a version of a local run, off the weight stream its state keeps,
as a Hugging Face checkpoint (`rlfleet.weightsync.checkpoint` writes and checks it).

The run's NATS hub is started again from the run's folder for the length of the export,
and read as the run's observer, as the evaluation of its last version reads it."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from rlfleet.api.wire import BusRole
from rlfleet.launch.components import EXPORT
from rlfleet.local import plan
from rlfleet.local.nats import start_nats
from rlfleet.local.processes import Supervisor
from rlfleet.local.run import InvalidRun, load


def export(path: Path, root: Path | None, version: int | None, out: Path) -> int:
    """Exports `version` (None: the newest) of the run `path` trained under `root`; the
    checkpoint program's exit code (it prints what it wrote, or why not)."""
    name, spec = load(path)
    layout = plan.Layout.of(name, path, root)
    if not (layout.nats / "keys.json").exists():
        raise InvalidRun(f"{layout.root}: no run's state here (rlfleet run {path} first)")
    supervisor = Supervisor(layout.logs / "export", attached=True)
    try:
        bed = start_nats([], supervisor, layout.nats)
        observer = layout.credentials(BusRole.OBSERVER)
        bed.keep_run_users(name, {BusRole.OBSERVER: observer})
        command = [*EXPORT.command(sys.executable), "--run", name, "--nats-url", bed.hub.url]
        command += ["--credentials", str(observer), "--model", str(plan.model_path(spec, layout))]
        command += ["--to", str(out), *(("--version", str(version)) if version is not None else ())]
        return subprocess.run(command, check=False).returncode
    finally:
        supervisor.stop_all(grace_seconds=10)

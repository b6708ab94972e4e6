"""Named environment snapshots: found, built into a run's own folder, listed, evicted.

A snapshot is an environment's set-up done once per run and forked by every session that
names it (as an overlay's lower layer, see `sandbox_init.py`), so it must stay while a
live session forks it; a run keeps at most `max_snapshots`, its least recently forked
idle ones going first. The run's own builds shadow the pool's shared ones, which the
image provides under `snapshots_dir`."""

import asyncio
import base64
import json
import os
import re
import shutil
import tempfile
import time
from collections import Counter
from pathlib import Path

from rlfleet.rollout.envpool.confinement import confine
from rlfleet.rollout.envpool.protocol import HttpError, invalid

_SNAPSHOT = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,127}")
_RUN_SNAPSHOTS = ".runs"  # under snapshots_dir: each run's own builds, root's alone


class Snapshots:
    """The pool's shared snapshots and each run's own, and which live sessions fork each."""

    def __init__(self, config: dict, advertise: str):
        self.root = Path(config["snapshots_dir"])
        self.max_snapshots = config["max_snapshots"]
        self.advertise = advertise
        (self.root / _RUN_SNAPSHOTS).mkdir(mode=0o700, parents=True, exist_ok=True)
        # Each snapshot's list of files, made once: this server's, root's alone.
        self.manifests_dir = Path(
            tempfile.mkdtemp(prefix=".manifests-", dir=self.root / _RUN_SNAPSHOTS)
        )
        self.manifests: dict[Path, Path] = {}
        # Live sessions forking each snapshot (an overlay's lower layer must stay), and
        # when each was last forked: the least recent idle one goes first.
        self.forking: Counter[Path] = Counter()
        self.last_fork: dict[Path, float] = {}
        self.builds: dict[tuple[str, str], asyncio.Lock] = {}
        self.evicted = 0

    def find(self, run: str, name) -> Path:
        """The run's own build of `name`, else the pool's shared one."""
        _check_name(name)
        for path in (self.root / _RUN_SNAPSHOTS / _run_dir(run) / name, self.root / name):
            if path.is_dir():
                return path
        # Each server builds its own: the client builds it here (`endpoint`) and claims again.
        raise HttpError(
            404,
            f"no snapshot named {name!r} on this server",
            "snapshot_missing",
            "snapshot",
            endpoint=self.advertise,
        )

    def hold(self, snapshot: Path) -> None:
        """A session is to fork `snapshot`: no eviction may take it until `release`."""
        self.forking[snapshot] += 1
        self.last_fork[snapshot] = time.monotonic()

    def release(self, snapshot: Path) -> None:
        self.forking[snapshot] -= 1

    async def manifest(self, snapshot: Path) -> Path:
        """The snapshot's files with their sizes and times, listed on its first fork."""
        if snapshot not in self.manifests:
            target = self.manifests_dir / f"{len(self.manifests)}.json"
            await asyncio.to_thread(_write_manifest, snapshot, target)
            self.manifests[snapshot] = target
        return self.manifests[snapshot]

    def target(self, run: str, name) -> Path:
        """Where the run's own build of `name` goes."""
        _check_name(name)
        return self.root / _RUN_SNAPSHOTS / _run_dir(run) / name

    def building(self, run: str, name: str) -> asyncio.Lock:
        """Held while the run's `name` is built: a second build waits, then finds it."""
        return self.builds.setdefault((run, name), asyncio.Lock())

    async def make_room(self, run_dir: Path) -> None:
        """Below `max_snapshots` environments for the run: its least recently forked ones
        that no live session forks go."""
        held = _built(run_dir)
        over = len(held) - self.max_snapshots + 1
        if over <= 0:
            return
        idle = [p for p in held if not self.forking[p]]
        if len(idle) < over:
            raise HttpError(
                409,
                f"the run holds its most environments ({len(held)}), each forked by a live session",
                "snapshot_limit",
                "name",
            )
        for path in sorted(idle, key=lambda p: self.last_fork.get(p, 0.0))[:over]:
            await asyncio.to_thread(shutil.rmtree, path, True)
            self.manifests.pop(path, None)
            self.last_fork.pop(path, None)
            self.evicted += 1

    def close(self) -> None:
        shutil.rmtree(self.manifests_dir, ignore_errors=True)


def _check_name(name) -> None:
    if not isinstance(name, str) or not _SNAPSHOT.fullmatch(name):
        raise invalid("a snapshot is named by letters, digits, '.', '_' and '-'", "snapshot")


def _run_dir(run: str) -> str:
    """A run's folder name: runs are named by the operator, but never trusted as paths."""
    return base64.urlsafe_b64encode(run.encode()).decode()


def _built(run_dir: Path) -> list[Path]:
    """The environments a run has built (not those being built: their names start '.')."""
    if not run_dir.is_dir():
        return []
    return [p for p in run_dir.iterdir() if p.is_dir() and not p.name.startswith(".")]


def _write_manifest(snapshot: Path, target: Path) -> None:
    """Each regular file under `snapshot`: its size and modification time, as JSON."""
    files = {}
    pending = [snapshot]
    while pending:
        with os.scandir(pending.pop()) as entries:
            for entry in entries:
                if entry.is_dir(follow_symlinks=False):
                    pending.append(Path(entry.path))
                elif entry.is_file(follow_symlinks=False):
                    info = entry.stat(follow_symlinks=False)
                    relative = str(Path(entry.path).relative_to(snapshot))
                    files[relative] = [info.st_size, info.st_mtime_ns]
    target.write_text(json.dumps(files))


def _publish(building: Path, target: Path) -> None:
    building.chmod(0o755)
    building.rename(target)


async def copy_tree(source: Path, target: Path) -> int:
    """`source` to `target` (made whole, then renamed into place), owned by root, holding
    only what stays in its tree (`confine`); how many entries were left out."""
    target.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
    building = Path(tempfile.mkdtemp(prefix=f".{target.name}-", dir=target.parent))
    process = await asyncio.create_subprocess_exec("cp", "-a", "--", f"{source}/.", str(building))
    if await process.wait() != 0:
        shutil.rmtree(building, ignore_errors=True)
        return 0
    removed = await asyncio.to_thread(confine, building)
    await (await asyncio.create_subprocess_exec("chown", "-R", "0:0", str(building))).wait()
    _publish(building, target)
    return len(removed)

"""The sandboxes behind sessions, and the warm pool that starts them ahead of claims.

A sandbox is `sandbox_init.py` as PID 1 of fresh namespaces (`unshare`), which gets ready
(tmpfs root, system folders bound) before any claim and takes its claim's tree, uid and
limits on one line of stdin; a session then speaks JSON lines to the sandbox's
`envserver.py` over the same pipe. Warming ahead is what lets a claim skip the start."""

import asyncio
import contextlib
import json
import logging
import os
import shutil
import signal
import sys
import tempfile
import time
from pathlib import Path

from rlfleet.rollout.envpool.confinement import SYSTEM_DIRS

log = logging.getLogger("envsessions")

_HERE = Path(__file__).parent
LIMIT_FIELDS = (
    "cpu_seconds",
    "memory_bytes",
    "file_bytes",
    "disk_bytes",
    "processes",
    "open_files",
    "wall_seconds",
    "call_seconds",
)
# What `sandbox_init.py` sets as rlimits.
RLIMIT_FIELDS = ("cpu_seconds", "memory_bytes", "file_bytes", "processes", "open_files")


class Sandbox:
    """A sandbox process (`sandbox_init.py`): warm until claimed, then a session's."""

    def __init__(self, process, host_dir: Path):
        self.process, self.host_dir = process, host_dir

    async def line(self, seconds: float):
        """The next JSON line it prints, or None if it exited or took too long."""
        try:
            line = await asyncio.wait_for(self.process.stdout.readline(), seconds)
            return json.loads(line) if line else None
        except (TimeoutError, ValueError, OSError):
            return None

    async def kill(self) -> None:
        if self.process.returncode is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.process.pid, signal.SIGKILL)
            await self.process.wait()
        # The tmpfs lived in the sandbox's mount namespace: only the empty mountpoint is here.
        shutil.rmtree(self.host_dir, ignore_errors=True)

    @property
    def work(self) -> Path:
        """Its working tree as this server sees it: through its mount namespace, whose root
        is the sandbox's own once claimed (pivot_root moves every process of the namespace
        that stood on the old root, `unshare` too)."""
        return Path(f"/proc/{self.process.pid}/root/work")


class Session:
    """One claimed sandbox and the pipe to its envserver; calls take turns."""

    def __init__(self, id, run, sandbox: Sandbox, limits, slot, grace, lease_seconds):
        self.id, self.run, self.sandbox = id, run, sandbox
        self.process = sandbox.process
        self.limits, self.slot, self.grace = limits, slot, grace
        self.deadline = time.monotonic() + limits["wall_seconds"]
        self.lease_seconds = lease_seconds
        self.renew()
        self.lock = asyncio.Lock()
        self.stopped: str | None = None  # why the sandbox stopped, once it has
        self.snapshot: Path | None = None  # the environment it forked, if any

    def renew(self) -> None:
        self.lease_until = time.monotonic() + self.lease_seconds

    async def call(self, request: dict) -> dict:
        """The envserver's reply; on any failure the sandbox is stopped and `stopped` says why."""
        async with self.lock:
            remaining = self.deadline - time.monotonic()
            if self.stopped is None and remaining <= 0:
                await self.stop("it reached its deadline")
            if self.stopped is not None:
                return {}
            seconds = self.limits["call_seconds"]
            if request["tool"] == "run":
                seconds = min(request.get("timeout", seconds), remaining)
                request = request | {"timeout": seconds}
            try:
                self.process.stdin.write(json.dumps(request).encode() + b"\n")
                await self.process.stdin.drain()
                # The envserver times commands out itself; this bounds one that hangs.
                line = await asyncio.wait_for(
                    self.process.stdout.readline(), min(seconds + self.grace, remaining)
                )
                reply = json.loads(line) if line else None
            except TimeoutError:
                await self.stop("a call outlived its timeout or the session its deadline")
                return {}
            except (OSError, ValueError) as error:  # a broken pipe, an overlong or bad line
                await self.stop(f"its server failed: {type(error).__name__}")
                return {}
            finally:
                self.renew()  # a long call is not a lapsed lease
            if not isinstance(reply, dict):
                await self.stop("its server misspoke" if line else "its server exited")
                return {}
            return reply

    async def stop(self, reason: str) -> None:
        if self.stopped is None:
            self.stopped = reason
        await self.sandbox.kill()


class WarmPool:
    """Sandboxes started and waiting, namespaces and tmpfs made, for the claims to come."""

    def __init__(self, config: dict):
        self.config = config
        self.warm = config["warm"]
        self.ready: list[Sandbox] = []  # warm, waiting for a claim
        self.warming = 0
        self._warmers: set[asyncio.Task] = set()  # held: the loop keeps only weak references
        # Sandboxes' mountpoints: root's alone, as a sandbox's tree is its root once claimed.
        self.mounts = Path(config["mounts_dir"])
        self.mounts.mkdir(mode=0o700, parents=True, exist_ok=True)
        self.private_dirs = [path for path in config["private_dirs"] if Path(path).is_dir()]
        # Each sandbox covers these with empty folders of its own: what is below is hidden.
        for path in self.private_dirs:
            for own in ("mounts_dir", "snapshots_dir"):
                if Path(config[own]).resolve().is_relative_to(Path(path).resolve()):
                    raise ValueError(f"config: {own} is inside private directory {path}")

    def refill(self, sessions: int) -> None:
        """Warms sandboxes until `warm` wait, within `max_sessions` held in all (`sessions`
        of them claimed)."""
        held = sessions + len(self.ready) + self.warming
        for _ in range(
            min(self.warm - len(self.ready) - self.warming, self.config["max_sessions"] - held)
        ):
            self.warming += 1  # now, not when the task starts: a second refill counts it
            warmer = asyncio.get_running_loop().create_task(self.start())
            self._warmers.add(warmer)
            warmer.add_done_callback(self._warmers.discard)

    async def take(self) -> Sandbox | None:
        """A warm sandbox still alive, if one waits."""
        while self.ready:
            sandbox = self.ready.pop()
            if sandbox.process.returncode is None:
                return sandbox
            await sandbox.kill()  # died since the reaper looked
        return None

    async def start(self, counted: bool = True) -> Sandbox | None:
        """A sandbox prepared and waiting: into the pool if `counted` (among `warming`, by
        `refill`), else for the claim that waits on it."""
        host_dir = _mountpoint(self.mounts)
        settings = {
            "root": str(host_dir),
            "disk_bytes": int(self.config["limits"]["disk_bytes"]),
            "server": str(_HERE / "envserver.py"),
            "python": self.config["sandbox_python"],
            "private_dirs": self.private_dirs,
            "system_dirs": SYSTEM_DIRS,
        }
        try:
            process = await asyncio.create_subprocess_exec(
                *("unshare", "--net", "--pid", "--mount", "--ipc", "--uts"),
                *("--fork", "--kill-child", "--mount-proc"),
                *(sys.executable, "-I", str(_HERE / "sandbox_init.py"), json.dumps(settings)),
                stdin=asyncio.subprocess.PIPE,
                stdout=asyncio.subprocess.PIPE,
                stderr=asyncio.subprocess.DEVNULL,
                start_new_session=True,
                limit=self.config["max_body_bytes"],  # one reply line: an archive the largest
            )
            sandbox = Sandbox(process, host_dir)
            if await sandbox.line(30.0) != {"ready": True}:
                await sandbox.kill()
                log.warning("a sandbox did not get ready")
                return None
        finally:
            self.warming -= counted
        if not counted:
            return sandbox
        self.ready.append(sandbox)
        return None

    async def drop_dead(self) -> None:
        """Removes the warm sandboxes that exited while waiting."""
        for sandbox in [s for s in self.ready if s.process.returncode is not None]:
            self.ready.remove(sandbox)
            await sandbox.kill()

    async def close(self) -> None:
        self.warm = 0
        for sandbox in self.ready:
            await sandbox.kill()


def _mountpoint(parent: Path) -> Path:
    # Only an empty directory here: the sandbox mounts its tmpfs over it privately.
    path = Path(tempfile.mkdtemp(prefix="sandbox-", dir=parent))
    path.chmod(0o755)
    return path

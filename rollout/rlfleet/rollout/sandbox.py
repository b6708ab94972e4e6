"""Local sandboxes: one per attempt, each a fresh copy of the task's starting state.

A sandbox is a process tree in its own network namespace (no network: not even the
host's loopback), PID, mount, IPC and UTS namespaces, on a size-limited tmpfs, run by
a uid of its own with limits on CPU time, memory, file size, processes and open files,
and a wall-clock deadline enforced from outside. Inside runs `envserver`; the harness
talks to it over a pipe, asynchronously, so the engine never waits on a tool call.
In Kubernetes the same server runs in an EnvPool pod instead.
"""

from __future__ import annotations

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

import msgspec

from rlfleet.launch.settings import Limits

log = logging.getLogger(__name__)

_HERE = Path(__file__).parent
# The server needs only the standard library; the system Python is readable by any uid.
SANDBOX_PYTHON = "/usr/bin/python3"
_UID_BASE = 200_000 + (os.getpid() % 500) * 1000
DEFAULT_LIMITS = Limits()
MOUNTPOINTS = "/tmp"


def _mountpoint() -> Path:
    # Only an empty directory on the host: the sandbox mounts its tmpfs over it privately.
    # In the system's /tmp, not under $TMPDIR: a process tree's TMPDIR may be a folder of
    # its own (`rlfleet.launch.caches`) that the sandbox's uid cannot traverse.
    path = Path(tempfile.mkdtemp(prefix="rlfleet-sandbox-", dir=MOUNTPOINTS))
    path.chmod(0o755)
    return path


class SandboxClosed(RuntimeError):
    """The sandbox is gone: killed at its deadline, or its server died."""


class Sandbox:
    _next_slot = 0

    def __init__(self, process: asyncio.subprocess.Process, host_dir: Path, limits: Limits):
        self.process = process
        self.host_dir = host_dir
        self.limits = limits
        self.deadline = time.monotonic() + limits.wall_seconds
        self._lock = asyncio.Lock()

    @classmethod
    async def start(cls, start_state: Path | None, limits: Limits = DEFAULT_LIMITS) -> Sandbox:
        host_dir = _mountpoint()
        uid = _UID_BASE + cls._next_slot % 1000
        cls._next_slot += 1
        settings = {
            "root": str(host_dir),
            "start": str(start_state) if start_state else None,
            "uid": uid,
            "disk_bytes": limits.disk_bytes,
            "server": str(_HERE / "envserver.py"),
            "python": SANDBOX_PYTHON,
            "limits": msgspec.to_builtins(limits),
        }
        process = await asyncio.create_subprocess_exec(
            "unshare",
            "--net",
            "--pid",
            "--mount",
            "--ipc",
            "--uts",
            "--fork",
            "--kill-child",
            "--mount-proc",
            sys.executable,
            "-I",
            str(_HERE / "sandbox_init.py"),
            json.dumps(settings),
            stdin=asyncio.subprocess.PIPE,
            stdout=asyncio.subprocess.PIPE,
            stderr=asyncio.subprocess.DEVNULL,
            start_new_session=True,
            limit=24 << 20,  # one reply line: an archive of the tree is the largest
        )
        return cls(process, host_dir, limits)

    async def call(self, request: dict, seconds: float | None = None) -> dict:
        """One tool call's reply; `SandboxClosed` if the sandbox had to be stopped."""
        timeout = self.limits.call_seconds if seconds is None else seconds
        if request.get("tool") == "run":
            request = request | {"timeout": timeout}
        remaining = self.deadline - time.monotonic()
        async with self._lock:
            if self.process.returncode is not None or remaining <= 0:
                await self.close()
                raise SandboxClosed("the sandbox reached its deadline or exited")
            assert self.process.stdin is not None and self.process.stdout is not None
            try:
                self.process.stdin.write(json.dumps(request).encode() + b"\n")
                await self.process.stdin.drain()
                # The server times commands out itself; this bounds a server that hangs.
                line = await asyncio.wait_for(
                    self.process.stdout.readline(), min(timeout + 5, remaining)
                )
            except (TimeoutError, ConnectionError) as error:
                await self.close()
                raise SandboxClosed(f"sandbox stopped: {type(error).__name__}") from error
            if not line:
                await self.close()
                raise SandboxClosed("the sandbox's server exited")
            return json.loads(line)

    async def close(self) -> None:
        if self.process.returncode is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.process.pid, signal.SIGKILL)
            await self.process.wait()
        # The tmpfs lived in the sandbox's mount namespace; only the empty mountpoint is here.
        shutil.rmtree(self.host_dir, ignore_errors=True)

    async def __aenter__(self) -> Sandbox:
        return self

    async def __aexit__(self, *exc) -> None:
        await self.close()

"""What the harness asks of a sandbox, wherever it runs: one per attempt, tools by call.

A sandbox is a session of an environment pool (`envsessions`): a process tree in its
own network, PID, mount, IPC and UTS namespaces, on a size-limited tmpfs, run by a uid
of its own with limits on CPU time, memory, file size, processes and open files, and a
wall-clock deadline enforced from outside. Inside runs `envserver`; `envclient` reaches
it over HTTP, asynchronously, so the engine never waits on a tool call.
"""

from __future__ import annotations

from typing import Protocol

from rlfleet.launch.settings import Limits

DEFAULT_LIMITS = Limits()


class SandboxClosed(RuntimeError):
    """The sandbox is gone: killed at its deadline, its lease lapsed, or its server died."""


class Sandbox(Protocol):
    limits: Limits

    async def call(self, request: dict, seconds: float | None = None) -> dict:
        """An envserver request's reply; `SandboxClosed` once the sandbox is gone."""
        ...

    async def close(self) -> None: ...

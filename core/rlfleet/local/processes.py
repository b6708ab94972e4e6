"""Starts server processes (a local run's, the bed's) and guarantees none outlives them.

Each process leads its own process group, so stopping it stops its children too. Under
pytest the bed is attached: every process also gets PR_SET_PDEATHSIG, so even a SIGKILLed
test run leaves nothing behind. `rlfleet dev up` detaches instead and records the pids for
`rlfleet dev down`.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import random
import signal
import socket
import subprocess
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

_PR_SET_PDEATHSIG = 1


def _die_with_parent() -> None:
    ctypes.CDLL("libc.so.6", use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)


# Ports are chosen below the kernel's ephemeral range (net.ipv4.ip_local_port_range).
# One from bind(0) is in that range, where any outgoing connection may take it as its own
# end before the server it was chosen for binds it: in CI an operator's health port was
# taken so, and the operator died ("address already in use").
_PORTS_FROM = 10000
_given: set[int] = set()  # this process's choices, never handed out twice


def _ephemeral_start() -> int:
    try:
        return int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768  # Linux's default


def free_port() -> int:
    """A TCP port on loopback that nothing listens on right now, and that no outgoing
    connection will take before its server binds it."""
    end = max(_ephemeral_start(), _PORTS_FROM + 1024)  # a range set oddly low: share it
    for _ in range(1000):
        port = random.randrange(_PORTS_FROM, end)
        if port in _given:
            continue
        with socket.socket() as sock:
            try:
                sock.bind(("127.0.0.1", port))
            except OSError:
                continue
        _given.add(port)
        return port
    raise RuntimeError(f"no free port between {_PORTS_FROM} and {end}")


@dataclass
class Managed:
    name: str
    process: subprocess.Popen[bytes]
    log: Path
    argv: list[str]
    env: dict[str, str] | None


class Supervisor:
    """Owns a set of long-running server processes."""

    def __init__(self, log_dir: Path, *, attached: bool) -> None:
        self.log_dir = log_dir
        self.attached = attached
        self.processes: list[Managed] = []
        log_dir.mkdir(parents=True, exist_ok=True)

    def start(self, name: str, argv: Sequence[str], env: dict[str, str] | None = None) -> Managed:
        log = self.log_dir / f"{name}.log"
        with log.open("ab") as out:
            process = subprocess.Popen(
                list(argv),
                stdin=subprocess.DEVNULL,
                stdout=out,
                stderr=subprocess.STDOUT,
                env={**os.environ, **(env or {})},
                start_new_session=True,
                preexec_fn=_die_with_parent if self.attached else None,
            )
        managed = Managed(name, process, log, list(argv), env)
        self.processes.append(managed)
        return managed

    def restart(self, name: str) -> Managed:
        """Kill a process outright (no grace: a crash) and start it again as it was.

        Attached children die with the thread that started them (PR_SET_PDEATHSIG is
        per thread): call this from a thread that outlives them, never a worker thread.
        """
        old = self._take(name)  # first, so a concurrent `check_alive` never sees it dead
        with contextlib.suppress(ProcessLookupError):
            os.killpg(old.process.pid, signal.SIGKILL)
        old.process.wait(timeout=10)
        return self.start(name, old.argv, old.env)

    def revive(self, name: str) -> Managed:
        """Start again, as it was, a process that has exited (as a kubelet restarts a
        container), after stopping what is left of its group."""
        old = self._take(name)
        stop_pids([old.process.pid], grace_seconds=5)
        return self.start(name, old.argv, old.env)

    def exited(self) -> list[str]:
        """The processes that have exited on their own."""
        return [m.name for m in self.processes if m.process.poll() is not None]

    def _take(self, name: str) -> Managed:
        managed = next(m for m in self.processes if m.name == name)
        self.processes.remove(managed)
        return managed

    def stop(self, name: str, grace_seconds: float = 10.0) -> int | None:
        """Stops one process as a kubelet stops a container: SIGTERM to the process alone
        (its children, such as vLLM's engine, are its to stop while it drains), then
        whatever is left of its group after the grace period. Returns its exit code."""
        managed = self._take(name)
        with contextlib.suppress(ProcessLookupError):
            managed.process.send_signal(signal.SIGTERM)
        with contextlib.suppress(subprocess.TimeoutExpired):
            managed.process.wait(timeout=grace_seconds)
        stop_pids([managed.process.pid], grace_seconds=5)
        return managed.process.poll()

    def check_alive(self) -> None:
        for managed in self.processes:
            if managed.process.poll() is not None:
                raise RuntimeError(
                    f"{managed.name} exited with {managed.process.returncode}; "
                    f"last log lines:\n{tail(managed.log)}"
                )

    def wait_until(
        self, what: str, check: Callable[[], bool], timeout: float, interval: float = 0.25
    ) -> None:
        """Polls check until it holds; fails early if a bed process died meanwhile."""
        deadline = time.monotonic() + timeout
        last_error: Exception | None = None
        while time.monotonic() < deadline:
            self.check_alive()
            try:
                if check():
                    return
            except (OSError, ValueError) as error:  # not up yet: refused, reset, 5xx, half JSON
                last_error = error
            time.sleep(interval)
        raise TimeoutError(f"{what} not ready after {timeout:.0f}s (last error: {last_error})")

    def pids(self) -> dict[str, int]:
        return {m.name: m.process.pid for m in self.processes}

    def stop_all(self, grace_seconds: float = 10.0) -> None:
        stop_pids([m.process.pid for m in reversed(self.processes)], grace_seconds)
        for managed in self.processes:
            with contextlib.suppress(subprocess.TimeoutExpired):
                managed.process.wait(timeout=1)
        self.processes.clear()


def stop_pids(pids: Sequence[int], grace_seconds: float = 10.0) -> None:
    """SIGTERM each process group, then SIGKILL whatever is left after the grace period."""
    for pid in pids:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(pid, signal.SIGTERM)
    deadline = time.monotonic() + grace_seconds
    remaining = list(pids)
    while remaining and time.monotonic() < deadline:
        remaining = [pid for pid in remaining if _group_alive(pid)]
        time.sleep(0.1)
    for pid in remaining:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(pid, signal.SIGKILL)


def _group_alive(pgid: int) -> bool:
    try:
        os.killpg(pgid, 0)
    except ProcessLookupError:
        return False
    # A zombie leader of our own still counts as a live group until reaped.
    with contextlib.suppress(ChildProcessError):
        os.waitpid(pgid, os.WNOHANG)
    return True


def tail(path: Path, lines: int = 30) -> str:
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])
    except FileNotFoundError:
        return "(no log)"


def run_in_session(
    argv: Sequence[str], env: dict[str, str], timeout: float
) -> subprocess.CompletedProcess[str]:
    """Run a command in a session of its own, killing the whole session on a timeout.

    Engines such as vLLM start processes that outlive a killed parent; killing the
    session leaves nothing behind to slow down what runs next.
    """
    with subprocess.Popen(
        list(argv),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=env,
        start_new_session=True,
    ) as process:
        try:
            stdout, stderr = process.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            os.killpg(process.pid, signal.SIGKILL)
            process.communicate()
            raise
    return subprocess.CompletedProcess(list(argv), process.returncode, stdout, stderr)

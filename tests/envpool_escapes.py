"""Escape attempts from inside an environment session, for the tests and `bench/envpool.py`.

Each attempt runs what a hostile model could send (commands in its own session) against a
real session server, and says how it escaped, or None when it was contained. Every
attempt ends by checking that the server still serves and that another run's session
still works: taking the server down is an escape too.
"""

from __future__ import annotations

import asyncio
import tempfile
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from pathlib import Path

import httpx

from rlfleet.rollout.environment.envclient import EnvClient, RemoteSandbox
from rlfleet.rollout.environment.sandbox import SandboxClosed

MARK = "ESCAPED"
# How a command prints the mark without holding it, so listing the command shows no mark.
PY_MARK, SH_MARK = "'ESC' + 'APED'", "ESC''APED"


@dataclass
class Target:
    """What the attacker aims at: the server, its token, another run's session."""

    url: str
    port: int
    server_pid: int
    tokens_file: Path
    token: str  # the attacker's own run's token
    other_token: str  # another run's, which must never show
    client: EnvClient  # the attacker's run
    other: EnvClient  # the other run
    disk_bytes: int
    snapshots_dir: Path  # where the server keeps environments, the other run's among them


async def _run(session: RemoteSandbox, command: str, seconds: float = 5) -> str:
    """What the command printed; a session that died of its own attack prints nothing."""
    try:
        reply = await session.call({"tool": "run", "command": command}, seconds)
    except SandboxClosed as closed:
        return f"[session closed: {closed}]"
    return f"{reply.get('output', '')}{reply.get('error', '')}"


def _py(code: str) -> str:
    return f'python3 -c "{code}"'


def _alive(uid: int) -> int:
    """How many host processes run as `uid`."""
    count = 0
    for entry in Path("/proc").iterdir():
        try:
            count += entry.name.isdigit() and entry.stat().st_uid == uid
        except OSError:
            continue  # it exited meanwhile
    return count


async def network_server_port(target: Target, session: RemoteSandbox) -> str | None:
    code = (
        f"import socket; socket.create_connection(('127.0.0.1', {target.port}), timeout=2); "
        f"print({PY_MARK})"
    )
    output = await _run(session, _py(code))
    return f"reached the server's port: {output}" if MARK in output else None


async def network_external(target: Target, session: RemoteSandbox) -> str | None:
    code = f"import socket; socket.create_connection(('1.1.1.1', 53), timeout=2); print({PY_MARK})"
    output = await _run(session, _py(code))
    return f"reached the internet: {output}" if MARK in output else None


async def other_session_files(target: Target, session: RemoteSandbox) -> str | None:
    secret = "SECRET-OF-THE-OTHER-RUN"
    async with await target.other.create() as victim:
        for place in ("secret.txt", "/tmp/secret.txt", "/dev/shm/secret.txt", "/var/tmp/s.txt"):
            await _run(victim, f"echo {secret} > {place}; chmod 644 {place}")
        output = await _run(
            session,
            "cat /run/rlfleet/sandboxes/*/work/secret.txt /tmp/*.txt /dev/shm/*.txt "
            "/var/tmp/*.txt /proc/*/cwd/secret.txt /proc/*/root/tmp/secret.txt 2>&1; "
            "ls -la /run/rlfleet/sandboxes/*/ 2>&1",
        )
    return f"read another session's files: {output}" if secret in output else None


async def other_run_environment(target: Target, session: RemoteSandbox) -> str | None:
    secret = "ENVIRONMENT-OF-THE-OTHER-RUN"
    with tempfile.TemporaryDirectory() as tree:
        (Path(tree) / "secret.txt").write_text(secret)
        await target.other.build_snapshot("private", Path(tree), "chmod 644 secret.txt")
    root = target.snapshots_dir
    output = await _run(
        session,
        f"cat {root}/.runs/*/*/secret.txt {root}/*/secret.txt 2>&1; ls -laR {root} 2>&1; "
        f"find / -name secret.txt -exec cat {{}} + 2>/dev/null; "
        f"echo x > {root}/.runs/planted 2>&1",
    )
    if secret in output:
        return f"read another run's environment: {output[:300]}"
    if (root / ".runs" / "planted").exists():
        return "wrote into the server's environments"
    return None


async def server_token(target: Target, session: RemoteSandbox) -> str | None:
    output = await _run(
        session,
        f"env; cat {target.tokens_file} /proc/*/environ /proc/*/cmdline "
        f"/proc/{target.server_pid}/environ /proc/{target.server_pid}/cmdline 2>&1 | tr '\\0' ' '",
    )
    for token in (target.token, target.other_token):
        if token in output:
            return f"read a token: {output[:200]}"
    return None


async def host_processes(target: Target, session: RemoteSandbox) -> str | None:
    pid = target.server_pid
    code = (
        "import ctypes; libc = ctypes.CDLL(None); "
        f"print({PY_MARK} if libc.ptrace(16, {pid}, 0, 0) == 0 else 'no ptrace')"
    )
    output = await _run(session, f"ps -eo pid,user,args; cat /proc/{pid}/cmdline; {_py(code)}")
    if MARK in output or "envsessions" in output:
        return f"saw or traced the server: {output[:300]}"
    # Killing everything it may kill takes down its own session at most.
    await _run(session, f"kill -9 {pid}; kill -9 -1")
    return None


async def fill_memory(target: Target, session: RemoteSandbox) -> str | None:
    output = await _run(session, _py(f"b = bytearray(4 << 30); print({PY_MARK})"))
    return f"allocated 4 GiB: {output}" if MARK in output else None


async def fill_disk(target: Target, session: RemoteSandbox) -> str | None:
    megabytes = 2 * target.disk_bytes >> 20
    output = await _run(
        session,
        f"for f in big /tmp/big /dev/shm/big; do dd if=/dev/zero of=$f bs=1M count={megabytes}"
        f" 2>/dev/null; done; [ $(cat big /tmp/big /dev/shm/big | wc -c) -gt {target.disk_bytes} ]"
        f" && echo {SH_MARK}",
    )
    return f"wrote past its disk: {output}" if MARK in output else None


async def fork_bomb(target: Target, session: RemoteSandbox) -> str | None:
    # `wait` is a builtin: once the bomb holds the process limit the shell needs no fork.
    output = await _run(session, "sleep 60 & b(){ b|b& }; b 2>/dev/null; wait", 3)
    if "timed out" not in output:
        return f"the bomb was not stopped: {output[:200]}"
    return None


async def hold_cpu(target: Target, session: RemoteSandbox) -> str | None:
    # A spinner that leaves the call's process group, and one the call's timeout stops.
    uid = int(await _run(session, "setsid sh -c 'while :; do :; done' >/dev/null 2>&1 & id -u"))
    output = await _run(session, "while :; do :; done", 1)
    if "timed out" not in output:
        return f"a spinning call was not stopped: {output}"
    await session.close()
    # Everything dies with the session's PID namespace; the kernel reaps it in a moment.
    for _ in range(50):
        if not _alive(uid):
            return None
        await asyncio.sleep(0.1)
    return f"{_alive(uid)} processes outlived their session"


Attempt = Callable[[Target, RemoteSandbox], Awaitable[str | None]]
ATTEMPTS: dict[str, Attempt] = {
    attempt.__name__: attempt
    for attempt in (
        network_server_port,
        network_external,
        other_session_files,
        other_run_environment,
        server_token,
        host_processes,
        fill_memory,
        fill_disk,
        fork_bomb,
        hold_cpu,
    )
}


async def bystander(other: EnvClient) -> RemoteSandbox:
    """The other run's session, which every attempt must leave as it was."""
    session = await other.create()
    await session.call({"tool": "write", "path": "mine.txt", "content": "still here\n"})
    return session


async def still_serving(target: Target, bystander: RemoteSandbox) -> str | None:
    """Why the server or the other run's session is hurt, or None."""
    async with httpx.AsyncClient() as http:
        health = await http.get(f"{target.url}/healthz", timeout=10)
    if health.status_code != 200:
        return f"the server's health is {health.status_code}"
    reply = await bystander.call({"tool": "run", "command": "cat mine.txt"})
    if reply.get("output") != "still here\n":
        return f"the other run's session changed: {reply}"
    return None


async def attempt(name: str, target: Target, bystander: RemoteSandbox) -> str | None:
    """Runs one escape attempt in a fresh session; how it escaped, or None."""
    async with await target.client.create() as session:
        escaped = await ATTEMPTS[name](target, session)
    return escaped or await still_serving(target, bystander)

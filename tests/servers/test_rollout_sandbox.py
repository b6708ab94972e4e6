"""Sandboxes (namespaces, tmpfs, rlimits, own uid) claimed from a real session server, as a
worker's own pool, and the tool protocol."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import pytest
from msgspec.structs import replace

from rlfleet.rollout.environment import tools
from rlfleet.rollout.environment.envclient import EnvClient, local_server
from rlfleet.rollout.environment.sandbox import Limits, Sandbox, SandboxClosed

LIMITS = Limits(disk_bytes=8 << 20, file_bytes=4 << 20, call_seconds=5, processes=32)
POOL: tuple[str, str]  # the session server's URL and token, from the fixture `pool`


@pytest.fixture(scope="module", autouse=True)
def pool() -> Iterator[None]:
    global POOL  # a module's own fixture: `claimed` claims from it
    with local_server(replace(LIMITS, call_seconds=30), 8, warm=2) as POOL:
        yield


@contextlib.asynccontextmanager
async def claimed(start: Path | None, limits: Limits = LIMITS) -> AsyncIterator[Sandbox]:
    async with EnvClient(*POOL) as client, await client.create(start, limits) as sandbox:
        yield sandbox


@pytest.fixture
def task(tmp_path: Path) -> Path:
    start = tmp_path / "task"
    start.mkdir()
    (start / "notes.txt").write_text("the answer is 42\n")
    return start


def run(coroutine):
    return asyncio.run(coroutine)


def test_a_session_writes_a_file_runs_a_command_and_reads_back(task: Path) -> None:
    async def session() -> None:
        async with claimed(task) as sandbox:
            turns = [
                '<tool>{"name": "write", "arguments": {"path": "src/add.py", '
                '"content": "print(40 + 2)"}}</tool>',
                '<tool>{"name": "run", "arguments": {"command": "python3 src/add.py > out.txt"}}'
                "</tool>",
                '<tool>{"name": "read", "arguments": {"path": "out.txt"}}</tool>',
            ]
            replies = [await sandbox.call(tools.request(tools.parse(turn))) for turn in turns]
            assert [r["ok"] for r in replies] == [True, True, True]
            assert replies[2]["output"] == "42\n"
            # Each attempt starts from its own copy of the task's state.
            assert (await sandbox.call({"tool": "read", "path": "notes.txt"}))["ok"]
        assert not (task / "src").exists()

    run(session())


def test_each_attempt_gets_a_fresh_copy(task: Path) -> None:
    async def attempts() -> None:
        async with claimed(task) as first:
            await first.call({"tool": "run", "command": "rm notes.txt"})
        async with claimed(task) as second:
            assert (await second.call({"tool": "read", "path": "notes.txt"}))["output"].startswith(
                "the answer"
            )

    run(attempts())


@pytest.mark.parametrize(
    ("command", "expect"),
    [
        # No network at all: not the internet, not the host's loopback.
        (
            "python3 -c \"import socket; socket.create_connection(('1.1.1.1', 80), timeout=2)\"",
            "Network is unreachable",
        ),
        (
            "python3 -c \"import socket; socket.create_connection(('127.0.0.1', 22), timeout=2)\"",
            "Error",
        ),
        # Disk: the tmpfs is full long before the host's disk notices.
        (
            "for i in 1 2 3 4; do dd if=/dev/zero of=f$i bs=1M count=3; done",
            "No space left on device",
        ),
        ("dd if=/dev/zero of=big bs=1M count=100", "File size limit exceeded"),
    ],
)
def test_a_sandbox_keeps_its_abuse_to_itself(task: Path, command: str, expect: str) -> None:
    async def abuse() -> None:
        async with claimed(task) as sandbox:
            reply = await sandbox.call({"tool": "run", "command": command})
            assert expect in reply["output"] or expect in reply.get("error", "")
            assert (await sandbox.call({"tool": "run", "command": "echo fine"}))[
                "output"
            ] == "fine\n"

    run(abuse())


def test_a_fork_bomb_is_contained_and_cleaned_up(task: Path) -> None:
    async def bomb() -> None:
        async with claimed(task) as sandbox:
            # `wait` is a builtin: once the bomb holds the process limit the shell needs no fork.
            command = "sleep 60 & b(){ b|b& }; b 2>/dev/null; wait"
            reply = await sandbox.call({"tool": "run", "command": command}, 3)
            assert not reply["ok"] and "timed out" in reply["error"]
            after = await sandbox.call({"tool": "run", "command": "ps -e --no-headers | wc -l"})
            # init, the server, this shell, ps and wc: the bomb is gone.
            assert int(after["output"]) <= 6

    run(bomb())


def test_a_command_that_runs_forever_is_stopped_and_so_is_a_sandbox_past_its_deadline(
    task: Path,
) -> None:
    async def forever() -> None:
        async with claimed(task) as sandbox:
            reply = await sandbox.call({"tool": "run", "command": "sleep 1000"}, 1)
            assert reply["error"] == "timed out after 1s" or "timed out" in reply["error"]
        short = replace(LIMITS, wall_seconds=2, call_seconds=30)
        async with claimed(task, short) as sandbox:
            with pytest.raises(SandboxClosed):
                await sandbox.call({"tool": "run", "command": "sleep 1000"})
            with pytest.raises(SandboxClosed, match="deadline"):
                await sandbox.call({"tool": "run", "command": "true"})
        # And the next sandbox works.
        async with claimed(task) as sandbox:
            assert (await sandbox.call({"tool": "run", "command": "echo ok"}))["output"] == "ok\n"

    run(forever())


def test_paths_may_not_leave_the_working_directory(task: Path) -> None:
    async def escape() -> None:
        async with claimed(task) as sandbox:
            reply = await sandbox.call({"tool": "write", "path": "../../x", "content": "x"})
            assert not reply["ok"] and "leaves the working directory" in reply["error"]

    run(escape())


@pytest.mark.parametrize(
    ("turn", "problem"),
    [
        ('<tool>{"name": "run", "arguments": {"cmd": "ls"}}</tool>', "unknown field `cmd`"),
        ("<tool>{name: run}</tool>", "not valid JSON"),
        ('<tool>{"name": "rm", "arguments": {}}</tool>', "Invalid enum value 'rm'"),
        ('<tool>{"name": "read", "arguments": {"path": 3}}</tool>', "Expected `str`"),
        ('<tool>{"name": "read", "arguments": {}}</tool>', "missing required field `path`"),
        ("<tool>{}</tool><tool>{}</tool>", "2 tool calls in one turn"),
        ('I will run it <tool>{"name": "run"', "without its </tool>"),
    ],
)
def test_a_malformed_tool_call_becomes_an_error_observation(turn: str, problem: str) -> None:
    parsed = tools.parse(turn)
    assert isinstance(parsed, tools.ToolError)
    assert problem in parsed.message
    assert tools.PROTOCOL in parsed.message  # the model is told how to do it right


def test_well_formed_calls_and_plain_text() -> None:
    assert tools.parse("thinking...") is None
    call = '<tool>{"name": "submit", "arguments": {"answer": "42"}}</tool>'
    assert tools.parse(f"Done. {call}") == tools.Submit(answer="42")

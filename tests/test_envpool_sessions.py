"""The environment session server over HTTP: sessions, authentication, bad requests, escapes.

One real server (root, namespace sandboxes) serves two runs for the whole module; every
request crosses a real socket.
"""

from __future__ import annotations

import asyncio
import base64
import json
import socket
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import envpool_escapes
import httpx
import pytest
from msgspec.structs import replace

from rlfleet.launch.settings import Limits
from rlfleet.rollout import tools
from rlfleet.rollout.envclient import EnvClient, EnvServerError, LocalServer, ServerConfig
from rlfleet.rollout.sandbox import SandboxClosed

LIMITS = Limits(
    disk_bytes=8 << 20,
    file_bytes=4 << 20,
    memory_bytes=512 << 20,
    processes=32,
    call_seconds=5,
    wall_seconds=120,
)
TOKENS = {"run-a": "a" * 8 + "-token-of-run-a", "run-b": "b" * 8 + "-token-of-run-b"}


@dataclass
class Served:
    server: LocalServer
    tokens_file: Path
    task: Path

    @property
    def url(self) -> str:
        return self.server.url


@pytest.fixture(scope="module")
def served(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Served]:
    root = tmp_path_factory.mktemp("envpool")
    tokens_file = root / "tokens.json"
    tokens_file.write_text(json.dumps(TOKENS))
    tokens_file.chmod(0o600)
    (root / "snapshots" / "hello").mkdir(parents=True)
    (root / "snapshots" / "hello" / "greeting.txt").write_text("hello from a snapshot\n")
    task = root / "task"
    (task / "src").mkdir(parents=True)
    (task / "notes.txt").write_text("the answer is 42\n")
    (task / "src" / "add.py").write_text("print(40 + 2)\n")
    config = ServerConfig(
        tokens_file=str(tokens_file),
        snapshots_dir=str(root / "snapshots"),
        limits=LIMITS,
        max_sessions=16,
        max_body_bytes=1 << 20,
        uid_base=810_000,
    )
    with LocalServer(config) as server:
        yield Served(server, tokens_file, task)


def client(served: Served, run: str = "run-a") -> EnvClient:
    return EnvClient(served.url, TOKENS[run])


def raw(served: Served, method: str, path: str, token: str | None = TOKENS["run-a"], **kw):
    headers = {"Authorization": f"Bearer {token}"} if token else {}
    return httpx.request(method, served.url + path, headers=headers, timeout=30, **kw)


def test_a_session_round_trip_as_the_harness_makes_it(served: Served) -> None:
    async def session() -> None:
        async with client(served) as env:
            sandbox = await env.create(served.task, LIMITS)
            turns = [
                '<tool>{"name": "write", "arguments": {"path": "out/x.txt", "content": "hi"}}'
                "</tool>",
                '<tool>{"name": "run", "arguments": {"command": "python3 src/add.py"}}</tool>',
                '<tool>{"name": "read", "arguments": {"path": "notes.txt"}}</tool>',
            ]
            replies = [await sandbox.call(tools.request(tools.parse(t))) for t in turns]
            assert replies[0] == {"ok": True, "output": "wrote 2 bytes to out/x.txt"}
            assert replies[1] == {"ok": True, "exit_code": 0, "output": "42\n"}
            assert replies[2]["output"] == "the answer is 42\n"
            archive = await sandbox.call({"tool": "archive"})
            files = {p: base64.b64decode(c) for p, c in archive["files"].items()}
            assert files == {
                "notes.txt": b"the answer is 42\n",
                "src/add.py": b"print(40 + 2)\n",
                "out/x.txt": b"hi",
            }
            # A tool's own failure is an observation for the model, not an HTTP error.
            escape = await sandbox.call({"tool": "read", "path": "../../etc/passwd"})
            assert not escape["ok"] and "leaves the working directory" in escape["error"]
            await sandbox.close()
            with pytest.raises(SandboxClosed, match="gone: it was destroyed"):
                await sandbox.call({"tool": "run", "command": "true"})
            await sandbox.close()  # twice is fine

    asyncio.run(session())
    assert not (served.task / "out").exists()


def test_a_session_starts_from_a_named_snapshot(served: Served) -> None:
    async def session() -> None:
        async with client(served) as env, await env.create(snapshot="hello") as sandbox:
            reply = await sandbox.call({"tool": "run", "command": "cat greeting.txt"})
            assert reply["output"] == "hello from a snapshot\n"
            with pytest.raises(EnvServerError) as missing:
                await env.create(snapshot="nope")
            assert missing.value.status == 400 and missing.value.param == "snapshot"

    asyncio.run(session())


def test_tokens_keep_runs_apart(served: Served) -> None:
    created = raw(served, "POST", "/v1/sessions", json={})
    assert created.status_code == 201
    call = f"/v1/sessions/{created.json()['id']}/call"
    body = {"tool": "run", "command": "true"}
    for token in (None, "not-a-token", TOKENS["run-a"] + "x"):
        refused = raw(served, "POST", call, token=token, json=body)
        assert refused.status_code == 401
        assert refused.json()["error"]["param"] == "Authorization"
    other = raw(served, "POST", call, token=TOKENS["run-b"], json=body)
    assert other.status_code == 403 and "another run" in other.json()["error"]["message"]
    assert raw(served, "DELETE", call[: -len("/call")], token=TOKENS["run-b"]).status_code == 403
    assert raw(served, "POST", call, json=body).json()["exit_code"] == 0  # still its owner's
    assert raw(served, "POST", "/v1/sessions/nosuch/call", json=body).status_code == 404
    assert raw(served, "DELETE", call[: -len("/call")]).status_code == 200
    gone = raw(served, "POST", call, json=body)
    assert gone.status_code == 410 and "destroyed" in gone.json()["error"]["message"]
    assert raw(served, "GET", "/healthz", token=None).status_code == 200  # the probe needs none


def test_a_run_minted_later_is_let_in_once_its_token_is_written(served: Served) -> None:
    token = "c" * 24
    assert raw(served, "POST", "/v1/sessions", token=token, json={}).status_code == 401
    served.tokens_file.write_text(json.dumps(TOKENS | {"run-c": token}))
    try:
        created = raw(served, "POST", "/v1/sessions", token=token, json={})
        assert created.status_code == 201
        path = f"/v1/sessions/{created.json()['id']}"
        assert raw(served, "DELETE", path, token=token).status_code == 200
    finally:
        served.tokens_file.write_text(json.dumps(TOKENS))


@pytest.mark.parametrize(
    ("body", "param"),
    [
        (b"{not json", "body"),
        (b"[1, 2]", "body"),
        (b'{"command": "ls"}', "tool"),
        (b'{"tool": "rm"}', "tool"),
        (b'{"tool": "run"}', "command"),
        (b'{"tool": "run", "cmd": "ls", "command": "ls"}', "cmd"),
        (b'{"tool": "read", "path": 3}', "path"),
        (b'{"tool": "write", "path": "a"}', "content"),
        (b'{"tool": "run", "command": "ls", "timeout": -1}', "timeout"),
        (b'{"tool": "run", "command": "ls", "timeout": true}', "timeout"),
        (b"[" * 100_000 + b"]" * 100_000, "body"),
    ],
)
def test_a_malformed_call_is_refused_naming_the_field(
    served: Served, body: bytes, param: str
) -> None:
    created = raw(served, "POST", "/v1/sessions", json={})
    path = f"/v1/sessions/{created.json()['id']}"
    refused = raw(served, "POST", f"{path}/call", content=body)
    assert refused.status_code == 400
    assert refused.json()["error"]["param"] == param
    # The session is unharmed.
    ok = raw(served, "POST", f"{path}/call", json={"tool": "run", "command": "echo fine"})
    assert ok.json()["output"] == "fine\n"
    raw(served, "DELETE", path)


@pytest.mark.parametrize(
    ("body", "param"),
    [
        ({"limits": {"memory_bytes": 1 << 40}}, "limits.memory_bytes"),
        ({"limits": {"call_seconds": "5"}}, "limits.call_seconds"),
        ({"limits": {"gpus": 1}}, "limits.gpus"),
        ({"files": {"../escape": "eA=="}}, "files.../escape"),
        ({"files": {"/etc/passwd": "eA=="}}, "files./etc/passwd"),
        ({"files": {"a.txt": "not base64!"}}, "files.a.txt"),
        ({"files": {"big": base64.b64encode(bytes(900 << 10)).decode()}}, None),
        ({"files": {}, "snapshot": "hello"}, "snapshot"),
        ({"snapshot": "../etc"}, "snapshot"),
        ({"image": "x"}, "image"),
    ],
)
def test_a_malformed_create_is_refused_naming_the_field(
    served: Served, body: dict, param: str | None
) -> None:
    refused = raw(served, "POST", "/v1/sessions", json=body)
    if param is None:  # over the server's body limit
        assert refused.status_code == 413
        assert refused.json()["error"]["param"] == "Content-Length"
    else:
        assert refused.status_code == 400
        assert refused.json()["error"]["param"] == param


def test_garbage_on_the_wire_does_not_stop_the_server(served: Served) -> None:
    port = int(served.url.rsplit(":", 1)[1])
    for garbage in (
        b"\x00\xff\xfe nonsense\r\n\r\n",
        b"GET / HTTP/1.1\r\n" + b"X: " + b"y" * (64 << 10) + b"\r\n\r\n",
        b"POST /v1/sessions HTTP/1.1\r\nContent-Length: -5\r\n\r\n",
        b"POST /v1/sessions HTTP/1.1\r\nTransfer-Encoding: chunked\r\n\r\n0\r\n\r\n",
        b"POST /v1/sessions HTTP/1.1\r\nContent-Length: 10\r\n\r\nshort",
    ):
        with socket.create_connection(("127.0.0.1", port), timeout=10) as connection:
            connection.sendall(garbage)
            connection.shutdown(socket.SHUT_WR)
            answer = connection.recv(4096)
        assert answer == b"" or answer.split(b" ")[1] in (b"400", b"431"), answer
    assert raw(served, "GET", "/healthz", token=None).json()["sessions"] >= 0


def test_a_session_past_its_deadline_is_gone_even_if_nobody_calls(served: Served) -> None:
    async def short() -> None:
        async with client(served) as env:
            sandbox = await env.create(None, replace(LIMITS, wall_seconds=1, call_seconds=1))
            await asyncio.sleep(2.5)
            with pytest.raises(SandboxClosed, match="deadline"):
                await sandbox.call({"tool": "run", "command": "true"})

    asyncio.run(short())


@pytest.mark.parametrize("name", sorted(envpool_escapes.ATTEMPTS))
def test_an_escape_from_inside_a_session_fails(served: Served, name: str) -> None:
    async def escape() -> str | None:
        async with client(served) as own, client(served, "run-b") as other:
            target = envpool_escapes.Target(
                url=served.url,
                port=int(served.url.rsplit(":", 1)[1]),
                server_pid=served.server.process.pid,
                tokens_file=served.tokens_file,
                token=TOKENS["run-a"],
                other_token=TOKENS["run-b"],
                client=own,
                other=other,
                disk_bytes=LIMITS.disk_bytes,
            )
            async with await envpool_escapes.bystander(other) as bystander:
                return await envpool_escapes.attempt(name, target, bystander)

    assert asyncio.run(escape()) is None

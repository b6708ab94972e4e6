"""The environment session server over HTTP: sessions, authentication, bad requests, escapes.

One real server (root, namespace sandboxes) serves two runs for the whole module; every
request crosses a real socket.
"""

from __future__ import annotations

import asyncio
import base64
import json
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import envpool_escapes
import httpx
import msgspec
import pytest
from msgspec.structs import replace

from rlfleet.api.wire import Environment
from rlfleet.launch.settings import Limits, ServerConfig
from rlfleet.local.processes import free_port
from rlfleet.rollout.environment import tools
from rlfleet.rollout.environment.envclient import (
    LOCAL_POOLS,
    ClaimTimeout,
    EnvClient,
    EnvServerError,
    LocalServer,
    _endpoint,
    local_server,
)
from rlfleet.rollout.environment.sandbox import SandboxClosed
from rlfleet.rollout.envpool import server as envpool_server
from rlfleet.testbed.sandboxes import Relay

LIMITS = Limits(
    disk_bytes=8 << 20,
    file_bytes=4 << 20,
    memory_bytes=512 << 20,
    processes=32,
    call_seconds=5,
    wall_seconds=120,
)
SNAPSHOTS_PARENT = "/run/rlfleet"  # beside the server's mounts_dir


def snapshots_home() -> str:
    """A fresh snapshots folder outside /tmp, made whichever test of the session runs first."""
    Path(SNAPSHOTS_PARENT).mkdir(parents=True, exist_ok=True)
    return tempfile.mkdtemp(prefix="snapshots-", dir=SNAPSHOTS_PARENT)


TOKENS = {"run-a": "a" * 8 + "-token-of-run-a", "run-b": "b" * 8 + "-token-of-run-b"}


@dataclass
class Served:
    server: LocalServer
    tokens_file: Path
    task: Path
    snapshots_dir: Path

    @property
    def url(self) -> str:
        return self.server.url


@pytest.fixture(scope="module")
def served(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Served]:
    root = tmp_path_factory.mktemp("envpool")
    tokens_file = root / "tokens.json"
    tokens_file.write_text(json.dumps(TOKENS))
    tokens_file.chmod(0o600)
    # Outside /tmp: sandboxes fork snapshots once their private /tmp covers the host's.
    snapshots = Path(snapshots_home())
    snapshots.chmod(0o755)  # as an image's: anyone may read the shared environments
    (snapshots / "hello").mkdir()
    (snapshots / "hello" / "greeting.txt").write_text("hello from a snapshot\n")
    task = root / "task"
    (task / "src").mkdir(parents=True)
    (task / "notes.txt").write_text("the answer is 42\n")
    (task / "src" / "add.py").write_text("print(40 + 2)\n")
    config = ServerConfig(
        tokens_file=str(tokens_file),
        snapshots_dir=str(snapshots),
        limits=LIMITS,
        max_sessions=16,
        max_body_bytes=1 << 20,
        uid_base=810_000,
    )
    try:
        with LocalServer(config) as server:
            yield Served(server, tokens_file, task, snapshots)
    finally:
        shutil.rmtree(snapshots)


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
            forged = await sandbox.call({"tool": "write", "path": "a\nb.py", "content": ""})
            assert not forged["ok"] and "control character" in forged["error"]
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
            assert missing.value.status == 404 and missing.value.param == "snapshot"

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
        ({"files": {"a\nb.py": "eA=="}}, "files.a\nb.py"),  # forges a line in listings
        ({"files": {"a\x7f": "eA=="}}, "files.a\x7f"),
        ({"files": {"a.txt": "not base64!"}}, "files.a.txt"),
        ({"files": {"big": base64.b64encode(bytes(900 << 10)).decode()}}, None),
        ({"wait_seconds": -1}, "wait_seconds"),
        ({"wait_seconds": "5"}, "wait_seconds"),
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
                snapshots_dir=served.snapshots_dir,
            )
            async with await envpool_escapes.bystander(other) as bystander:
                return await envpool_escapes.attempt(name, target, bystander)

    assert asyncio.run(escape()) is None


# --- claims: a small pool of its own, with short leases


@pytest.fixture(scope="module")
def small(served: Served) -> Iterator[Served]:
    """Two sessions at most, one kept warm, leases of two seconds, two environments a run."""
    config = ServerConfig(
        tokens_file=str(served.tokens_file),
        snapshots_dir=snapshots_home(),
        limits=LIMITS,
        max_sessions=2,
        warm=1,
        lease_seconds=2.0,
        claim_wait_seconds=20.0,
        uid_base=820_000,
        max_snapshots=2,
    )
    try:
        with LocalServer(config) as server:
            yield Served(server, served.tokens_file, served.task, Path(config.snapshots_dir))
    finally:
        shutil.rmtree(config.snapshots_dir)


def health(served: Served) -> dict:
    return raw(served, "GET", "/healthz", token=None).json()


def settled(served: Served, **expected: int) -> dict:
    """The server's health once it shows `expected` (the reaper runs each second)."""
    for _ in range(100):
        seen = health(served)
        if all(seen[key] == value for key, value in expected.items()):
            return seen
        time.sleep(0.1)
    raise AssertionError(f"{seen} never showed {expected}")


def test_claims_come_from_the_warm_pool_and_it_refills(small: Served) -> None:
    before = settled(small, ready=1, sessions=0)

    async def claim() -> None:
        async with client(small) as env, await env.create(small.task) as sandbox:
            reply = await sandbox.call({"tool": "run", "command": "cat notes.txt"})
            assert reply["output"] == "the answer is 42\n"
            # The pool warms another behind the claim, within the server's two.
            settled(small, ready=1, sessions=1)

    asyncio.run(claim())
    after = settled(small, ready=1, sessions=0)
    assert after["claims"] == before["claims"] + 1
    assert after["cold_claims"] == before["cold_claims"]


def test_a_claim_waits_for_capacity_until_its_deadline(small: Served) -> None:
    async def claims() -> None:
        async with client(small) as env:
            held = [await env.create(None), await env.create(None)]
            env.claim_seconds = 0.5
            with pytest.raises(ClaimTimeout, match=r"no sandbox came free within 0\.5 s"):
                await env.create(None)
            # A claim that may wait gets the first sandbox given back.
            env.claim_seconds = 15
            waiting = asyncio.create_task(env.create(None))
            await asyncio.sleep(0.5)
            assert not waiting.done()
            await held.pop().close()
            sandbox = await asyncio.wait_for(waiting, 15)
            assert (await sandbox.call({"tool": "run", "command": "true"}))["exit_code"] == 0
            for each in (sandbox, *held):
                await each.close()

    asyncio.run(claims())


HOLDER = """
import asyncio, sys
from rlfleet.rollout.environment.envclient import EnvClient

async def main():
    env = EnvClient(sys.argv[1], sys.argv[2])
    for _ in range(2):
        sandbox = await env.create(None)
        await sandbox.call({"tool": "write", "path": "left.txt", "content": "from before"})
        print(sandbox.id, flush=True)
    await asyncio.sleep(3600)

asyncio.run(main())
"""


def test_a_client_killed_with_claims_held_lets_them_lapse(small: Served) -> None:
    settled(small, sessions=0)
    holder = subprocess.Popen(
        [sys.executable, "-c", HOLDER, small.url, TOKENS["run-a"]],
        stdout=subprocess.PIPE,
        text=True,
    )
    assert holder.stdout is not None
    ids = [holder.stdout.readline().strip() for _ in range(2)]
    expired = health(small)["expired"]
    time.sleep(5)  # over two leases: the living client renews them
    assert health(small)["sessions"] == 2
    holder.kill()
    holder.wait()
    seen = settled(small, sessions=0, ready=1)
    assert seen["expired"] == expired + 2
    for id in ids:
        gone = raw(small, "POST", f"/v1/sessions/{id}/call", json={"tool": "archive"})
        assert gone.status_code == 410 and "lease lapsed" in gone.json()["error"]["message"]

    async def fresh() -> None:
        async with client(small) as env, await env.create(None) as sandbox:
            archive = await sandbox.call({"tool": "archive"})
            assert archive["files"] == {}  # a sandbox is never handed on

    asyncio.run(fresh())


SETUP = "mkdir -p lib && python3 -c 'print(6 * 7)' > lib/built.txt && cat seed.txt >> lib/built.txt"


def test_a_claim_refused_for_its_token_reads_it_again_until_its_deadline(
    served: Served, tmp_path: Path
) -> None:
    """A new run's token reaches its pool's servers a little after its pods start, and a
    rotated one replaces the mounted file: a refused claim asks again, with the token read
    again, until its deadline; then it fails, saying why."""
    token_file = tmp_path / "token"
    token_file.write_text(TOKENS["run-a"] + "\n")

    async def claims() -> None:
        stale = "s" * 24
        refreshing = EnvClient(served.url, stale, token_file=str(token_file))
        async with refreshing as env, await env.create(None) as sandbox:
            reply = await sandbox.call({"tool": "run", "command": "echo in"})
            assert reply["output"] == "in\n"
        async with EnvClient(served.url, stale, claim_seconds=1.5) as env:
            with pytest.raises(EnvServerError) as refused:
                await env.create(None)
            assert refused.value.status == 401

    asyncio.run(claims())


def test_a_client_follows_only_an_endpoint_a_server_could_name() -> None:
    """A reply's `endpoint` gets the run's token and every call of its session: it must be
    an address and port, as a server advertises itself, or the pool's URL is used."""
    assert _endpoint("http://10.1.2.3:8080") == "http://10.1.2.3:8080"
    assert _endpoint("http://[fd00::5]:8080") == "http://[fd00::5]:8080"
    for odd in (
        "http://evil.example:8080",
        "https://10.1.2.3:8080",
        "http://10.1.2.3:80/x",
        "",
        None,
        7,
    ):
        assert _endpoint(odd) == ""
    assert envpool_server._bracketed("http://fd00::5:8080") == "http://[fd00::5]:8080"
    assert envpool_server._bracketed("http://10.1.2.3:8080") == "http://10.1.2.3:8080"


def test_a_local_pool_removes_what_a_killed_one_left_behind() -> None:
    """A process killed with its local pool never removes the pool's folder (its token,
    its environments): the next local pool on the machine does."""
    dead = subprocess.run(
        [sys.executable, "-c", "import os; print(os.getpid())"],
        capture_output=True,
        text=True,
        check=True,
    )
    Path(LOCAL_POOLS).mkdir(mode=0o700, parents=True, exist_ok=True)
    left = Path(tempfile.mkdtemp(prefix=f"pool-{dead.stdout.strip()}-", dir=LOCAL_POOLS))
    (left / "tokens.json").write_text("{}")
    with local_server(LIMITS, max_sessions=1, warm=0):
        assert not left.exists()
        mine = [
            home
            for home in Path(LOCAL_POOLS).iterdir()
            if home.name.startswith(f"pool-{os.getpid()}-")
        ]
        assert len(mine) == 1
    assert not mine[0].exists()


@pytest.mark.parametrize("own", ["tokens_file", "snapshots_dir", "mounts_dir"])
def test_a_server_whose_state_its_sandboxes_would_see_refuses_to_start(
    served: Served, own: str
) -> None:
    """Every sandbox sees the image's system folders (`SYSTEM_DIRS`): the server's tokens,
    environments and sandboxes may not lie in one, unless on a mount of their own (a
    Secret's volume under /etc), which a sandbox's bind of the folder leaves out."""
    config = msgspec.to_builtins(
        ServerConfig(tokens_file=str(served.tokens_file), snapshots_dir=str(served.snapshots_dir))
    )
    with pytest.raises(ValueError, match=rf"config: {own}: every sandbox sees /etc"):
        envpool_server.Server(config | {own: "/etc/rlfleet-state/x"})


def test_behind_one_service_claims_spread_and_each_session_stays_with_its_server(
    served: Served,
) -> None:
    """An EnvPool's servers behind one address, as its Service puts them (here a relay
    that sends each connection to the next, as kube-proxy does): claims land on both,
    each session's calls go to the server holding it (another knows no such session),
    and an environment is built on each server a claim of it lands on."""
    homes = [snapshots_home() for _ in range(2)]
    ports = [free_port(), free_port()]
    configs = [
        ServerConfig(
            tokens_file=str(served.tokens_file),
            snapshots_dir=home,
            limits=LIMITS,
            port=port,
            max_sessions=2,
            warm=1,
            uid_base=830_000 + 100 * i,
            advertise=f"http://127.0.0.1:{port}",
        )
        for i, (home, port) in enumerate(zip(homes, ports, strict=True))
    ]
    relay = Relay(lambda: [("127.0.0.1", port) for port in ports])
    environment = Environment(name="counted", setup="echo built > built.txt")

    async def claims() -> None:
        async with EnvClient(f"http://127.0.0.1:{relay.port}", TOKENS["run-a"]) as env:
            snapshot = await env.environment(environment)
            held = [await env.create(None, snapshot=snapshot) for _ in range(4)]
            assert {sandbox.url.split("/v1/")[0] for sandbox in held} == {
                c.advertise for c in configs
            }
            for sandbox in held:
                reply = await sandbox.call({"tool": "run", "command": "cat built.txt"})
                assert reply["output"] == "built\n"
            # Both full: a claim asks again each second, then fails at its deadline.
            env.claim_seconds = 1.5
            with pytest.raises(ClaimTimeout, match=r"within 1\.5 s"):
                await env.create(None)
            for sandbox in held:
                await sandbox.close()

    try:
        with LocalServer(configs[0]), LocalServer(configs[1]):
            asyncio.run(claims())
    finally:
        relay.close()
        for home in homes:
            shutil.rmtree(home)


def test_a_snapshot_is_built_once_and_forked_per_session(small: Served, tmp_path: Path) -> None:
    (tmp_path / "seed.txt").write_text("seeded\n")

    async def forks() -> None:
        async with client(small) as env, client(small, "run-b") as other:
            assert await env.build_snapshot("repo", tmp_path, SETUP)
            assert not await env.build_snapshot("repo", tmp_path, "exit 1")  # built already
            overlays = health(small)["overlay"]
            async with (
                await env.create(small.task, snapshot="repo") as a,
                await env.create(None, snapshot="repo") as b,
            ):
                built = await a.call({"tool": "read", "path": "lib/built.txt"})
                assert built["output"] == "42\nseeded\n"
                # The task's files lie over the fork; each fork's writes are its own.
                notes = await a.call({"tool": "read", "path": "notes.txt"})
                assert notes["output"] == "the answer is 42\n"
                edit = "echo changed > lib/built.txt && rm seed.txt && id -u"
                changed = await a.call({"tool": "run", "command": edit})
                assert changed["exit_code"] == 0, changed
                still = await b.call({"tool": "run", "command": "cat lib/built.txt seed.txt"})
                assert still["output"] == "42\nseeded\nseeded\n"
            assert health(small)["overlay"] == overlays + 2
            # Another run neither sees this run's snapshot nor can build over it.
            with pytest.raises(EnvServerError) as missing:
                await other.create(None, snapshot="repo")
            assert missing.value.param == "snapshot"
            with pytest.raises(EnvServerError) as failed:
                await other.build_snapshot("repo", tmp_path, "echo no such set-up; exit 3")
            assert failed.value.status == 422 and failed.value.param == "setup"
            assert "exit 3" in str(failed.value)

    asyncio.run(forks())


def test_a_run_keeps_its_most_environments_and_the_idle_ones_go_first(
    small: Served, tmp_path: Path
) -> None:
    def environment(name: str) -> Environment:
        return Environment(name=name, setup=f"echo {name} > which.txt")

    async def evictions() -> None:
        async with client(small, "run-b") as env:
            first, second = environment("first"), environment("second")
            await env.environment(first)
            await env.environment(second)
            evicted = health(small)["evicted"]
            async with await env.create(None, snapshot=await env.environment(second)) as held:
                # A third goes in place of the one not forked now, though forked longer ago.
                await env.environment(environment("third"))
                assert health(small)["evicted"] == evicted + 1
                async with client(small, "run-b") as stranger:  # knows no definition
                    with pytest.raises(EnvServerError) as gone:
                        await stranger.create(None, snapshot=first.snapshot)
                assert gone.value.status == 404 and gone.value.param == "snapshot"
                reply = await held.call({"tool": "run", "command": "cat which.txt"})
                assert reply["output"] == "second\n"  # its lower layer is still there
                # Every one kept is forked, or the newest: the next refuses, naming why.
                async with await env.create(None, snapshot=environment("third").snapshot):
                    with pytest.raises(EnvServerError) as full:
                        await env.environment(environment("fourth"))
                    assert full.value.status == 409 and full.value.param == "name"
            # A claim of the evicted one finds it missing: the client builds it again.
            async with await env.create(None, snapshot=await env.environment(first)) as again:
                reply = await again.call({"tool": "run", "command": "cat which.txt"})
                assert reply["output"] == "first\n"

    asyncio.run(evictions())

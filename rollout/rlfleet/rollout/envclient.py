"""The client of the environment session server (`envsessions`), and a local one to run.

`EnvClient.create` and `RemoteSandbox.call` mirror `Sandbox.start` and `Sandbox.call`:
the same requests, the same replies, `SandboxClosed` when the session is gone. So a
rollout worker switches from local sandboxes to an EnvPool by swapping one for the other.
"""

from __future__ import annotations

import base64
import contextlib
import json
import os
import subprocess
import sys
from pathlib import Path

import httpx
import msgspec

from rlfleet.launch.settings import MIB, Limits
from rlfleet.rollout.sandbox import DEFAULT_LIMITS, SANDBOX_PYTHON, SandboxClosed

_SERVER = Path(__file__).with_name("envsessions.py")


class ServerConfig(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """The session server's settings: the one home of their defaults."""

    tokens_file: str  # JSON {run: token}, re-read when it changes
    host: str = "127.0.0.1"
    port: int = 0  # 0: any free port, printed when listening
    snapshots_dir: str | None = None  # one directory per named environment snapshot
    limits: Limits = DEFAULT_LIMITS  # a session's, and the most a session may ask for
    max_sessions: int = 256
    max_body_bytes: int = 32 * MIB  # a request's body, and an envserver reply line
    max_header_bytes: int = 16 << 10
    idle_seconds: float = 60.0  # a keep-alive connection with no request is closed
    remembered: int = 4096  # destroyed sessions that still answer 410 rather than 404
    uid_base: int = 800_000  # session i runs as uid_base + i: above `sandbox.py`'s uids
    sandbox_python: str = SANDBOX_PYTHON
    reply_grace_seconds: float = 5.0  # beyond a call's timeout, for the envserver to answer
    mounts_dir: str = "/run/rlfleet/sandboxes"  # sessions' mountpoints: outside private_dirs
    # Directories anyone may write to: each session gets private ones, so none passes files.
    private_dirs: tuple[str, ...] = ("/tmp", "/var/tmp", "/run/lock", "/dev/shm")


class EnvServerError(RuntimeError):
    """The server refused a request: a bad token, a malformed request, no capacity."""

    def __init__(self, status: int, error: dict):
        where = f" ({error['param']})" if error.get("param") else ""
        super().__init__(f"{status} {error.get('type')}: {error.get('message')}{where}")
        self.status, self.param = status, error.get("param")


def _error(response: httpx.Response) -> dict:
    try:
        return response.json()["error"]
    except (ValueError, KeyError, TypeError):
        return {"message": response.text[:300]}


def _start_files(start: Path) -> dict[str, str]:
    """A starting tree as the server takes it: every regular file, base64 (links skipped)."""
    files = {}
    for directory, _, names in os.walk(start):
        for name in names:
            path = Path(directory) / name
            if path.is_file() and not path.is_symlink():
                files[str(path.relative_to(start))] = base64.b64encode(path.read_bytes()).decode()
    return files


class EnvClient:
    """A run's connection to one session server."""

    def __init__(
        self, url: str, token: str, connect_seconds: float = 10.0, create_seconds: float = 60.0
    ):
        self.create_seconds = create_seconds  # copying a tree in and starting its sandbox
        self._http = httpx.AsyncClient(
            base_url=url,
            headers={"Authorization": f"Bearer {token}"},
            timeout=httpx.Timeout(None, connect=connect_seconds),
        )

    async def create(
        self,
        start: Path | None = None,
        limits: Limits | None = None,
        *,
        snapshot: str | None = None,
    ) -> RemoteSandbox:
        """A fresh session holding a copy of `start` (or of the server's `snapshot`), with
        `limits` (each at most the server's) or else the server's own."""
        body: dict = {} if limits is None else {"limits": msgspec.to_builtins(limits)}
        if start is not None:
            body["files"] = _start_files(start)
        if snapshot is not None:
            body["snapshot"] = snapshot
        response = await self._http.post("/v1/sessions", json=body, timeout=self.create_seconds)
        if response.status_code != 201:
            raise EnvServerError(response.status_code, _error(response))
        reply = response.json()
        return RemoteSandbox(self, reply["id"], msgspec.convert(reply["limits"], Limits))

    async def request(self, method: str, path: str, body: dict | None, seconds: float):
        return await self._http.request(method, path, json=body, timeout=seconds)

    async def aclose(self) -> None:
        await self._http.aclose()

    async def __aenter__(self) -> EnvClient:
        return self

    async def __aexit__(self, *exc) -> None:
        await self.aclose()


class RemoteSandbox:
    """One session: `Sandbox`'s `call` and `close`, over the network."""

    def __init__(self, client: EnvClient, id: str, limits: Limits, grace: float = 10.0):
        self.client, self.id, self.limits, self.grace = client, id, limits, grace

    async def call(self, request: dict, seconds: float | None = None) -> dict:
        """One tool call's reply; `SandboxClosed` if the session is gone."""
        timeout = self.limits.call_seconds if seconds is None else seconds
        if request.get("tool") == "run":
            request = request | {"timeout": timeout}
        path = f"/v1/sessions/{self.id}/call"
        try:
            response = await self.client.request("POST", path, request, timeout + self.grace)
        except httpx.TransportError as error:
            raise SandboxClosed(f"the environment server is unreachable: {error!r}") from error
        if response.status_code in (404, 410):
            raise SandboxClosed(_error(response).get("message", "the session is gone"))
        if response.status_code != 200:
            raise EnvServerError(response.status_code, _error(response))
        return response.json()

    async def close(self) -> None:
        """Destroys the session; one already gone, or a server away, is not an error."""
        with contextlib.suppress(httpx.TransportError):
            response = await self.client.request(
                "DELETE", f"/v1/sessions/{self.id}", None, self.grace
            )
            if response.status_code not in (200, 404, 410):
                raise EnvServerError(response.status_code, _error(response))

    async def __aenter__(self) -> RemoteSandbox:
        return self

    async def __aexit__(self, *exc) -> None:
        await self.close()


class LocalServer:
    """The session server as a local process (as root: it makes namespaces)."""

    def __init__(self, config: ServerConfig):
        self.config = config
        self.process: subprocess.Popen | None = None
        self.url = ""

    def start(self) -> LocalServer:
        settings = json.dumps(msgspec.to_builtins(self.config))
        self.process = subprocess.Popen(
            [sys.executable, "-I", str(_SERVER), settings],
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            text=True,
        )
        assert self.process.stdout is not None
        line = self.process.stdout.readline()
        if not line:
            raise RuntimeError(f"the session server exited: {self.process.wait()}")
        self.url = f"http://{self.config.host}:{json.loads(line)['port']}"
        return self

    def stop(self) -> None:
        if self.process is not None and self.process.poll() is None:
            self.process.terminate()  # the server stops its sessions on the way out
            try:
                self.process.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()

    def __enter__(self) -> LocalServer:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()

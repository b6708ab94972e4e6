"""The client of the environment session server (`envsessions`), and a local one to run.

`EnvClient.create` claims a sandbox (`rlfleet.rollout.environment.sandbox.Sandbox`); `pool` is the
one a worker uses: its EnvPool's server when configured, else a server of its own.
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import ipaddress
import json
import logging
import os
import secrets
import shutil
import subprocess
import sys
import tempfile
from collections.abc import AsyncIterator, Iterator, Mapping
from pathlib import Path

import httpx
import msgspec

from rlfleet.api.wire import Environment
from rlfleet.launch.settings import ENVPOOL_SERVER, Limits, PoolConfig, ServerConfig
from rlfleet.rollout.environment.sandbox import DEFAULT_LIMITS, SandboxClosed

log = logging.getLogger(__name__)

# Local pools' own folders (tokens, snapshots): outside the /tmp that sandboxes cover.
LOCAL_POOLS = "/run/rlfleet/pools"
_LOCAL_UIDS, _UID_STRIDE = 1_000_000, 4096  # each local pool's uids, by its process id


class EnvServerError(RuntimeError):
    """The server refused a request: a bad token, a malformed request, no capacity."""

    def __init__(self, status: int, error: dict):
        where = f" ({error['param']})" if error.get("param") else ""
        super().__init__(f"{status} {error.get('type')}: {error.get('message')}{where}")
        self.status, self.param = status, error.get("param")


class ClaimTimeout(EnvServerError):
    """No sandbox came free within the claim's deadline."""


def _raise(response: httpx.Response) -> None:
    error = _error(response)
    if response.status_code == 503 and error.get("type") == "capacity_error":
        raise ClaimTimeout(response.status_code, error)
    raise EnvServerError(response.status_code, error)


def _error(response: httpx.Response) -> dict:
    try:
        return response.json()["error"]
    except (ValueError, KeyError, TypeError):
        return {"message": response.text[:300]}


def _endpoint(url: object) -> str:
    """The server a reply names, if it names one as a server names itself (`http://` and
    an IP address and port, nothing more), else "": the pool's URL."""
    if not isinstance(url, str):
        return ""
    host, _, port = url.removeprefix("http://").rpartition(":")
    try:
        ipaddress.ip_address(host.strip("[]"))
    except ValueError:
        return ""
    return url if url.startswith("http://") and port.isdigit() else ""


def _start_files(start: Path | Mapping[str, bytes]) -> dict[str, str]:
    """A starting tree as the server takes it: every regular file, base64 (links skipped)."""
    if isinstance(start, Mapping):
        return {path: base64.b64encode(data).decode() for path, data in start.items()}
    files = {}
    for directory, _, names in os.walk(start):
        for name in names:
            path = Path(directory) / name
            if path.is_file() and not path.is_symlink():
                files[str(path.relative_to(start))] = base64.b64encode(path.read_bytes()).decode()
    return files


def _claim_body(
    start: Path | Mapping[str, bytes] | None, limits: Limits | None, snapshot: str | None
) -> dict:
    """A claim's request, naming only what the caller gave: the server's own otherwise."""
    body: dict = {}
    if limits is not None:
        body["limits"] = msgspec.to_builtins(limits)
    if start is not None:
        body["files"] = _start_files(start)
    if snapshot is not None:
        body["snapshot"] = snapshot
    return body


class EnvClient:
    """A run's connection to a pool: one session server, or an EnvPool's servers behind
    one Service. Each claim's reply names the server (`endpoint`) that holds the session,
    where its calls then go. It renews the leases of the sessions it holds while it lives:
    a client that dies lets them lapse, and the servers free them."""

    def __init__(
        self,
        url: str,
        token: str,
        connect_seconds: float = 10.0,
        create_seconds: float = 60.0,
        claim_seconds: float = 30.0,
        retry_seconds: float = 1.0,
        token_file: str | None = None,
    ):
        self.token_file = token_file  # re-read when a claim is refused: a rotated token
        self.create_seconds = create_seconds  # writing a tree in and starting its server
        self.claim_seconds = claim_seconds  # the longest a claim waits for capacity
        self.retry_seconds = retry_seconds  # a claim's wait at one server
        self._http = httpx.AsyncClient(
            base_url=url,
            headers={"Authorization": f"Bearer {token}"},
            timeout=httpx.Timeout(None, connect=connect_seconds),
        )
        self.held: dict[str, str] = {}  # the sessions whose leases it renews: their servers
        self._renewing: asyncio.Task | None = None
        # Environments by snapshot name, each built once on each server ("": the URL's).
        self._environments: dict[str, Environment] = {}
        self._built: dict[tuple[str, str], asyncio.Lock] = {}
        self._ready: set[tuple[str, str]] = set()

    async def create(
        self,
        start: Path | Mapping[str, bytes] | None = None,
        limits: Limits | None = None,
        *,
        snapshot: str | None = None,
    ) -> RemoteSandbox:
        """A claim: a fresh session holding a copy of `start` (a folder, or its files by
        relative path) over a fork of `snapshot`, if named, with `limits` (each at most
        the server's) or else the server's own. `ClaimTimeout` if none comes free within
        `claim_seconds`.

        Behind a Service each claim is a connection of its own, so the Service spreads
        claims over the pool's servers, and a claim asks again every `retry_seconds`
        (landing on another) until its deadline when its server is full, when none took
        the connection (one starting or going away), or when the token is refused (a new
        run's token reaches the pool's servers within a resync and a Secret refresh; a
        rotated one is read again from `token_file`)."""
        body = _claim_body(start, limits, snapshot)
        response = await self._claim_by_deadline(body, snapshot)
        if response.status_code != 201:
            _raise(response)
        return self._hold(response.json())

    async def _claim_by_deadline(self, body: dict, snapshot: str | None) -> httpx.Response:
        """The answer to a claim, asked again (as `create` says) until one is not a full
        server's or `claim_seconds` have passed."""
        clock = asyncio.get_running_loop().time
        deadline = clock() + self.claim_seconds
        while True:
            wait = max(0.0, min(self.retry_seconds, deadline - clock()))
            try:
                response = await self._claim("", body | {"wait_seconds": wait})
            except (httpx.ConnectError, httpx.ConnectTimeout, httpx.RemoteProtocolError):
                # Not a read timeout: a server may have made a session this claim never saw.
                if clock() >= deadline:
                    raise
                await asyncio.sleep(min(self.retry_seconds, max(0.0, deadline - clock())))
                continue
            if response.status_code == 401 and clock() < deadline:
                if self.token_file is not None:
                    self._http.headers["Authorization"] = f"Bearer {_read_token(self.token_file)}"
                await asyncio.sleep(min(self.retry_seconds, max(0.0, deadline - clock())))
                continue
            error = _error(response) if response.status_code != 201 else {}
            if error.get("type") == "snapshot_missing" and snapshot in self._environments:
                # That server never built it, or evicted it: build it there, and claim there.
                server = _endpoint(error.get("endpoint"))
                self._ready.discard((server, snapshot))
                await self._build(server, self._environments[snapshot])
                response = await self._claim(server, body | {"wait_seconds": wait})
                error = _error(response) if response.status_code != 201 else {}
            if error.get("type") != "capacity_error":
                return response
            if clock() >= deadline:
                waited = f"no sandbox came free within {self.claim_seconds:g} s"
                raise ClaimTimeout(503, error | {"message": f"{waited}: {error.get('message')}"})

    def _hold(self, reply: dict) -> RemoteSandbox:
        """The sandbox a claim was given, its lease renewed from now on."""
        server = _endpoint(reply.get("endpoint"))
        sandbox = RemoteSandbox(self, reply["id"], server, msgspec.convert(reply["limits"], Limits))
        self.held[sandbox.id] = server
        if self._renewing is None or self._renewing.done():
            self._renewing = asyncio.create_task(self._renew(reply["lease_seconds"] / 3))
        return sandbox

    async def _claim(self, server: str, body: dict) -> httpx.Response:
        seconds = self.create_seconds + body["wait_seconds"]
        headers = {"Connection": "close"}  # the next claim may go to another server
        return await self._http.post(
            f"{server}/v1/sessions", json=body, timeout=seconds, headers=headers
        )

    async def environment(self, environment: Environment | None) -> str | None:
        """The snapshot to fork for `environment` (None for none), built on the server the
        first time; a server a claim lands on that lacks it builds it then."""
        if environment is None:
            return None
        self._environments[environment.snapshot] = environment
        await self._build("", environment)
        return environment.snapshot

    async def _build(self, server: str, environment: Environment) -> None:
        key = (server, environment.snapshot)
        async with self._built.setdefault(key, asyncio.Lock()):
            if key not in self._ready:
                files = {path: content.encode() for path, content in environment.files.items()}
                await self.build_snapshot(environment.snapshot, files, environment.setup, server)
                self._ready.add(key)

    async def build_snapshot(
        self, name: str, start: Path | Mapping[str, bytes], setup: str, server: str = ""
    ) -> bool:
        """The run's environment `name` (the tree `start`, then the command `setup`) built
        on the server (`server`, or the URL's) unless it was already: True if this call
        built it."""
        body = {"files": _start_files(start), "setup": setup}
        response = await self._http.put(f"{server}/v1/snapshots/{name}", json=body, timeout=None)
        if response.status_code not in (200, 201):
            _raise(response)
        return response.status_code == 201

    async def health(self) -> dict:
        response = await self._http.get("/healthz", timeout=10)
        response.raise_for_status()
        return response.json()

    async def _renew(self, every: float) -> None:
        while self.held:
            await asyncio.sleep(every)
            by_server: dict[str, list[str]] = {}
            for id, server in list(self.held.items()):
                by_server.setdefault(server, []).append(id)
            for server, ids in by_server.items():
                with contextlib.suppress(httpx.TransportError):
                    await self._http.post(f"{server}/v1/leases", json={"ids": ids}, timeout=every)

    async def request(self, method: str, url: str, body: dict | None, seconds: float):
        return await self._http.request(method, url, json=body, timeout=seconds)

    async def aclose(self) -> None:
        if self._renewing is not None:
            self._renewing.cancel()
        await self._http.aclose()

    async def __aenter__(self) -> EnvClient:
        return self

    async def __aexit__(self, *exc) -> None:
        await self.aclose()


class RemoteSandbox:
    """One session: `Sandbox`'s `call` and `close`, over the network."""

    def __init__(
        self, client: EnvClient, id: str, server: str, limits: Limits, grace: float = 10.0
    ):
        self.client, self.id, self.limits, self.grace = client, id, limits, grace
        self.url = f"{server}/v1/sessions/{id}"  # on the server holding it

    async def call(self, request: dict, seconds: float | None = None) -> dict:
        """One tool call's reply; `SandboxClosed` if the session is gone."""
        timeout = self.limits.call_seconds if seconds is None else seconds
        if request.get("tool") == "run":
            request = request | {"timeout": timeout}
        try:
            response = await self.client.request(
                "POST", f"{self.url}/call", request, timeout + self.grace
            )
        except httpx.TransportError as error:
            raise SandboxClosed(f"the environment server is unreachable: {error!r}") from error
        if response.status_code in (404, 410):
            self.client.held.pop(self.id, None)
            raise SandboxClosed(_error(response).get("message", "the session is gone"))
        if response.status_code != 200:
            _raise(response)
        return response.json()

    async def close(self) -> None:
        """Destroys the session; one already gone, or a server away, is not an error."""
        self.client.held.pop(self.id, None)
        with contextlib.suppress(httpx.TransportError):
            response = await self.client.request("DELETE", self.url, None, self.grace)
            if response.status_code not in (200, 404, 410):
                _raise(response)

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
            [sys.executable, "-I", "-m", ENVPOOL_SERVER, settings],
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


def _read_token(path: str) -> str:
    return Path(path).read_text().strip()


class NoPool(RuntimeError):
    """No environment pool: none configured, and this process cannot run sandboxes."""


def _forget_dead_pools(pools: Path) -> None:
    """Removes the folders (a token, environments) of local pools whose process is gone:
    one killed (a worker's SIGKILL, a test's) never removed its own."""
    for home in pools.glob("pool-*-*"):
        pid = home.name.split("-")[1]
        if pid.isdigit() and not Path(f"/proc/{pid}").exists():
            shutil.rmtree(home, ignore_errors=True)


@contextlib.contextmanager
def local_server(
    limits: Limits = DEFAULT_LIMITS, max_sessions: int = 64, warm: int = 8
) -> Iterator[tuple[str, str]]:
    """A session server of this process's own and a token minted for it (its URL and the
    token): the pool where none is configured (a local run, a test). It makes
    namespaces, so it needs root."""
    if os.geteuid() != 0:
        raise NoPool("sandboxes on this machine need root; configure an EnvPool instead")
    if max_sessions > _UID_STRIDE:
        raise ValueError(f"a local pool holds at most {_UID_STRIDE} sessions")
    Path(LOCAL_POOLS).mkdir(mode=0o700, parents=True, exist_ok=True)
    _forget_dead_pools(Path(LOCAL_POOLS))
    home = Path(tempfile.mkdtemp(prefix=f"pool-{os.getpid()}-", dir=LOCAL_POOLS))
    token = secrets.token_urlsafe(24)
    tokens = home / "tokens.json"
    tokens.write_text(json.dumps({"local": token}))
    tokens.chmod(0o600)
    config = ServerConfig(
        tokens_file=str(tokens),
        snapshots_dir=str(home / "snapshots"),
        limits=limits,
        max_sessions=max_sessions,
        warm=min(warm, max_sessions),
        # Uids of their own: a process limit counts a uid's processes in every sandbox.
        uid_base=_LOCAL_UIDS + (os.getpid() % 1000) * _UID_STRIDE,
    )
    try:
        with LocalServer(config) as server:
            yield server.url, token
    finally:
        shutil.rmtree(home, ignore_errors=True)


@contextlib.asynccontextmanager
async def local_pool(
    limits: Limits = DEFAULT_LIMITS, max_sessions: int = 64, warm: int = 8
) -> AsyncIterator[EnvClient]:
    """`local_server`'s client."""
    with local_server(limits, max_sessions, warm) as (url, token):
        async with EnvClient(url, token) as client:
            yield client


@contextlib.asynccontextmanager
async def pool(
    config: PoolConfig | None, limits: Limits, max_sessions: int
) -> AsyncIterator[EnvClient | None]:
    """The pool a worker claims sandboxes from: `config`'s, else its own (room for each
    session and its grading), else None, and tools fail their attempts saying why."""
    if config is not None:
        token = _read_token(config.token_file)
        async with EnvClient(
            config.url, token, claim_seconds=config.claim_seconds, token_file=config.token_file
        ) as client:
            yield client
        return
    async with contextlib.AsyncExitStack() as stack:
        try:
            own = await stack.enter_async_context(local_pool(limits, 2 * max_sessions))
        except NoPool as error:
            log.warning("no environment pool: attempts that use tools will fail: %s", error)
            own = None
        yield own

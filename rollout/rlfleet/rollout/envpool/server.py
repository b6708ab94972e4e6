"""The session server: its settings checked, its parts wired together, its routes, `serve`.

The protocol it serves is the package's docstring (`__init__.py`). The server owns one of
each part (tokens, snapshots, the warm pool, the sessions) and routes each request to the
part whose job it is; only a snapshot's build, a session's work copied into a snapshot,
needs two of them at once, so it is here."""

import asyncio
import json
import signal
import sys
import time
from pathlib import Path

from rlfleet.rollout.envpool.auth import Tokens
from rlfleet.rollout.envpool.claims import Sessions
from rlfleet.rollout.envpool.confinement import in_system_dir
from rlfleet.rollout.envpool.protocol import (
    SESSION_ROUTE,
    SNAPSHOT_ROUTE,
    HttpError,
    converse,
    decode_files,
    invalid,
    json_object,
    no_unknown,
    number,
    only,
    tool_request,
)
from rlfleet.rollout.envpool.sandboxes import WarmPool
from rlfleet.rollout.envpool.snapshots import Snapshots, copy_tree

CONFIG_FIELDS = {
    "host",
    "port",
    "tokens_file",
    "snapshots_dir",
    "limits",
    "max_sessions",
    "max_body_bytes",
    "max_header_bytes",
    "idle_seconds",
    "remembered",
    "uid_base",
    "sandbox_python",
    "reply_grace_seconds",
    "mounts_dir",
    "private_dirs",
    "warm",
    "lease_seconds",
    "claim_wait_seconds",
    "setup_seconds",
    "max_snapshots",
    "advertise",
}


class Server:
    """One server's sessions, warm pool, snapshots and tokens, answering HTTP requests."""

    def __init__(self, config: dict):
        unknown, missing = set(config) - CONFIG_FIELDS, CONFIG_FIELDS - set(config)
        if unknown or missing:
            raise ValueError(f"config: unknown {sorted(unknown)}, missing {sorted(missing)}")
        for own in ("tokens_file", "snapshots_dir", "mounts_dir"):
            if shown := in_system_dir(Path(config[own])):
                raise ValueError(f"config: {own}: every sandbox sees {shown} (SYSTEM_DIRS)")
        self.config = config
        self.limits = config["limits"]
        self.advertise = _bracketed(config["advertise"])
        self.tokens = Tokens(Path(config["tokens_file"]))
        self.snapshots = Snapshots(config, self.advertise)
        self.pool = WarmPool(config)
        self.sessions = Sessions(config, self.pool, self.snapshots)

    def health(self) -> dict:
        return {
            "sessions": len(self.sessions.live),
            "ready": len(self.pool.ready),
            "warming": self.pool.warming,
            "waiting": self.sessions.waiting,
            "max_sessions": self.config["max_sessions"],
            **self.sessions.counts,
            "evicted": self.snapshots.evicted,
        }

    async def connection(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter):
        idle, max_body = self.config["idle_seconds"], self.config["max_body_bytes"]
        await converse(reader, writer, self.dispatch, idle, max_body)

    async def dispatch(self, method: str, target: str, headers: dict, body: bytes):
        path = target.split("?", 1)[0]
        if path == "/healthz":
            only(method, "GET", path)
            return 200, self.health()
        run = self.tokens.authenticate(headers)
        if path == "/v1/sessions":
            only(method, "POST", path)
            return 201, await self._create(run, json_object(body))
        if path == "/v1/leases":
            only(method, "POST", path)
            return 200, self.sessions.renew(run, json_object(body))
        if match := SNAPSHOT_ROUTE.fullmatch(path):
            only(method, "PUT", path)
            return await self._build(run, match[1], json_object(body))
        match = SESSION_ROUTE.fullmatch(path)
        if match is None:
            raise HttpError(404, f"no route {path}", "not_found_error")
        session = self.sessions.lookup(run, match[1])
        if match[2] and method == "POST":
            reply = await session.call(tool_request(json_object(body)))
            if session.stopped is not None:
                self.sessions.forget(session)
                self.sessions.lookup(run, session.id)  # raises 410 with the reason
            return 200, reply
        if not match[2] and method == "DELETE":
            await session.stop("it was destroyed")
            self.sessions.forget(session)
            return 200, {"id": session.id}
        raise HttpError(405, f"{method} {path} is not served", "invalid_request_error")

    async def _create(self, run: str, body: dict) -> dict:
        no_unknown(body, {"files", "snapshot", "limits", "wait_seconds"}, "")
        limits = self.sessions.limits_for(body.get("limits", {}))
        files = decode_files(body.get("files", {}), limits["disk_bytes"])
        snapshot = self.snapshots.find(run, body["snapshot"]) if "snapshot" in body else None
        wait = body.get("wait_seconds", 0)
        if not number(wait) or wait < 0:
            raise invalid("must be a non-negative number of seconds", "wait_seconds")
        wait = min(wait, self.config["claim_wait_seconds"])  # the server's bound wins
        session = await self.sessions.claim(run, limits, files, snapshot, wait)
        lease = self.config["lease_seconds"]
        # Behind a Service that spreads claims over pods: where this session lives.
        endpoint = self.advertise
        return {"id": session.id, "limits": limits, "lease_seconds": lease, "endpoint": endpoint}

    async def _build(self, run: str, name: str, body: dict):
        """Builds the run's snapshot `name` once: its files, then its set-up command."""
        target = self.snapshots.target(run, name)
        no_unknown(body, {"files", "setup"}, "")
        if not isinstance(body.get("setup"), str):
            raise invalid("setup must be a command", "setup")
        files = decode_files(body.get("files", {}), self.limits["disk_bytes"])
        async with self.snapshots.building(run, name):
            if target.is_dir():
                return 200, {"name": name, "built_seconds": None}
            await self.snapshots.make_room(target.parent)
            started = time.monotonic()
            setup = self.config["setup_seconds"]
            limits = self.limits | {"wall_seconds": setup + 60, "call_seconds": setup}
            wait = self.config["claim_wait_seconds"]
            session = await self.sessions.claim(run, limits, files, None, wait)
            try:
                reply = await session.call({"tool": "run", "command": body["setup"]})
                if reply.get("ok") and reply.get("exit_code") == 0:
                    removed = await copy_tree(session.sandbox.work, target)
            finally:
                await session.stop("its snapshot was taken")
                self.sessions.forget(session)
            if not target.is_dir():
                why = reply.get("error") or f"exit {reply.get('exit_code')}"
                tail = (reply.get("output") or "")[-2000:]
                raise HttpError(422, f"the set-up failed ({why}): {tail}", "setup_failed", "setup")
            built = round(time.monotonic() - started, 3)
            return 201, {"name": name, "built_seconds": built, "removed": removed}

    async def reap(self) -> None:
        await self.sessions.reap()

    async def close(self) -> None:
        await self.sessions.close()
        self.snapshots.close()


def _bracketed(url: str) -> str:
    """`advertise` with an IPv6 address in brackets, as a URL needs it: the kubelet fills
    `$(POD_IP)` in with the bare address either way."""
    scheme, sep, rest = url.partition("://")
    host, colon, port = rest.rpartition(":")
    if sep and colon and ":" in host and not host.startswith("["):
        return f"{scheme}://[{host}]:{port}"
    return url


async def serve(config: dict) -> None:
    server = Server(config)
    listener = await asyncio.start_server(
        server.connection, config["host"], config["port"], limit=config["max_header_bytes"]
    )
    port = listener.sockets[0].getsockname()[1]
    sys.stdout.write(json.dumps({"port": port}) + "\n")
    sys.stdout.flush()
    stop = asyncio.Event()
    for signum in (signal.SIGTERM, signal.SIGINT):
        asyncio.get_running_loop().add_signal_handler(signum, stop.set)
    reaper = asyncio.create_task(server.reap())
    try:
        await stop.wait()
    finally:
        reaper.cancel()
        listener.close()
        await server.close()

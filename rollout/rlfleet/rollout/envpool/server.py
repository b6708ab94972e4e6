"""The environment session server: many agents' sandboxes behind one authenticated HTTP port.

Standard library only, started with `python -I` (the sandbox image installs nothing), with
its settings as one JSON object in argv[1] (`envclient.ServerConfig` writes it); once it
listens it prints `{"port": N}` on stdout. HTTP rather than NATS request/reply: an EnvPool
pod is reached only by its run's rollout pods (a NetworkPolicy on one port), answers a
kubelet readiness probe, needs no broker in its path and no client library in its image,
and the rollout workers already speak HTTP.

Each session is its own namespace sandbox: `sandbox_init.py` as PID 1 of fresh network,
PID, mount, IPC and UTS namespaces, its root a private size-limited tmpfs (`pivot_root`)
holding only the image's system folders read-only (SYSTEM_DIRS) beside its own tree, a
uid no other live session has, and rlimits; inside it `envserver.py` runs the tools, and
this server speaks JSON lines to it over a pipe. So a session has no network (not even
this server's port), sees neither this server's processes, nor its state (tokens,
environments), nor another session's files, and its uid owns nothing else. Making
namespaces needs root: on one machine the server runs as root, in a pod as root inside
the pod's VM-grade sandbox (gVisor or Kata).

Every call but the probe carries `Authorization: Bearer <token>`; `tokens_file` maps each
run to the token the operator minted for it (a Secret's file, re-read when it changes).
A session belongs to the run that created it. Errors are `{"error": {"message", "type",
"param"}}`, `param` naming the offending field.

    GET    /healthz                -> 200 {"sessions": n, "ready": n, "warming": n,
                                   "waiting": n (claims queued for capacity), ...}
    POST   /v1/sessions            a claim: {"files": {path: base64}} and/or {"snapshot":
                                   name}, optionally "limits" (each at most the server's)
                                   and "wait_seconds" (for capacity; the server's
                                   claim_wait_seconds at most)
                                   -> 201 {"id", "limits", "lease_seconds", "endpoint"}
    POST   /v1/sessions/{id}/call  an envserver request -> 200 its reply
    DELETE /v1/sessions/{id}       -> 200 {"id": ...}
    POST   /v1/leases              {"ids": [...]} -> 200 {"renewed": [...], "gone": [...]}
    PUT    /v1/snapshots/{name}    {"files": {...}, "setup": command} -> 201 built, 200 had

Claims come from a warm pool: `warm` sandboxes wait, namespaces and tmpfs made, for the
claim that gives them their tree, uid and limits (`sandbox_init.py`); the pool refills
behind each claim. A claim with no capacity waits up to its `wait_seconds`, then gets 503.
A session is never handed on: destroyed, its sandbox goes, and a fresh one warms.

In a pod, many servers sit behind one Service: `advertise` is this one's own URL, sent
with each claim (`endpoint`), where the client then sends the session's calls. Each server
builds its own snapshots: a claim naming one it lacks gets 404 `snapshot_missing` with
its `endpoint`, where the client builds it and claims again.

A claimed session holds a lease of `lease_seconds`, renewed by every request naming it
and by `/v1/leases`: a client that dies stops renewing, and its sessions are destroyed.

A snapshot is a named environment set-up, built once per run (its files, then `setup`
run in a session) and forked by every session that names it, as an overlay (see
`sandbox_init.py`). A run keeps at most `max_snapshots`: building one more removes its
least recently forked one that no live session forks (409 if every one is). The run's
own snapshots shadow the pool's shared ones, which the image provides under
`snapshots_dir`. A snapshot holds folders, regular files and links that stay in its own
tree: an absolute link, a relative one that leads out of the tree, a pipe or a device,
and a file with a name outside the tree are left out of it (the reply counts them in
`removed`); a claim's files are never written through a link (422 naming the file).

A session destroyed (by DELETE, at its deadline, when its lease lapsed, or because its
sandbox died) answers 410 saying why; another run's token gets 403; an unknown one 404.
"""

import asyncio
import base64
import binascii
import contextlib
import hmac
import json
import logging
import math
import os
import re
import secrets
import shutil
import signal
import stat
import sys
import tempfile
import time
from collections import Counter, OrderedDict
from pathlib import Path

log = logging.getLogger("envsessions")

_HERE = Path(__file__).parent
LIMIT_FIELDS = (
    "cpu_seconds",
    "memory_bytes",
    "file_bytes",
    "disk_bytes",
    "processes",
    "open_files",
    "wall_seconds",
    "call_seconds",
)
# What `sandbox_init.py` sets as rlimits.
RLIMIT_FIELDS = ("cpu_seconds", "memory_bytes", "file_bytes", "processes", "open_files")
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
# The tools a session runs, each with its fields: (type, required).
TOOLS = {
    "run": {"command": (str, True), "timeout": ((int, float), False)},
    "read": {"path": (str, True)},
    "write": {"path": (str, True), "content": (str, True)},
    "archive": {},
}
_SNAPSHOT = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,127}")
_SESSION = re.compile(r"/v1/sessions/([A-Za-z0-9_-]{1,64})(/call)?")
_SNAPSHOT_PATH = re.compile(r"/v1/snapshots/([^/]{1,200})")
_RUN_SNAPSHOTS = ".runs"  # under snapshots_dir: each run's own builds, root's alone
# The image's folders a sandbox sees, read-only, in its own root: its commands, libraries
# and settings. Nothing of this server's state may lie in one (`Server` checks).
SYSTEM_DIRS = ("/usr", "/bin", "/sbin", "/lib", "/lib32", "/lib64", "/libx32", "/etc", "/opt")
_REASONS = {
    200: "OK",
    201: "Created",
    400: "Bad Request",
    401: "Unauthorized",
    403: "Forbidden",
    404: "Not Found",
    405: "Method Not Allowed",
    410: "Gone",
    422: "Unprocessable Content",
    413: "Content Too Large",
    431: "Request Header Fields Too Large",
    500: "Internal Server Error",
    503: "Service Unavailable",
}


class HttpError(Exception):
    def __init__(self, status: int, message: str, kind: str, param: str | None = None, **more: str):
        super().__init__(message)
        self.status, self.message, self.kind, self.param = status, message, kind, param
        self.more = more

    def body(self) -> dict:
        error = {"message": self.message, "type": self.kind, "param": self.param}
        return {"error": error | self.more}


def _invalid(message: str, param: str | None) -> HttpError:
    return HttpError(400, message, "invalid_request_error", param)


class Sandbox:
    """A sandbox process (`sandbox_init.py`): warm until claimed, then a session's."""

    def __init__(self, process, host_dir: Path):
        self.process, self.host_dir = process, host_dir

    async def line(self, seconds: float):
        """The next JSON line it prints, or None if it exited or took too long."""
        try:
            line = await asyncio.wait_for(self.process.stdout.readline(), seconds)
            return json.loads(line) if line else None
        except (TimeoutError, ValueError, OSError):
            return None

    async def kill(self) -> None:
        if self.process.returncode is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.process.pid, signal.SIGKILL)
            await self.process.wait()
        # The tmpfs lived in the sandbox's mount namespace: only the empty mountpoint is here.
        shutil.rmtree(self.host_dir, ignore_errors=True)

    @property
    def work(self) -> Path:
        """Its working tree as this server sees it: through its mount namespace, whose root
        is the sandbox's own once claimed (pivot_root moves every process of the namespace
        that stood on the old root, `unshare` too)."""
        return Path(f"/proc/{self.process.pid}/root/work")


class Session:
    """One claimed sandbox and the pipe to its envserver; calls take turns."""

    def __init__(self, id, run, sandbox: Sandbox, limits, slot, grace, lease_seconds):
        self.id, self.run, self.sandbox = id, run, sandbox
        self.process = sandbox.process
        self.limits, self.slot, self.grace = limits, slot, grace
        self.deadline = time.monotonic() + limits["wall_seconds"]
        self.lease_seconds = lease_seconds
        self.renew()
        self.lock = asyncio.Lock()
        self.stopped: str | None = None  # why the sandbox stopped, once it has
        self.snapshot: Path | None = None  # the environment it forked, if any

    def renew(self) -> None:
        self.lease_until = time.monotonic() + self.lease_seconds

    async def call(self, request: dict) -> dict:
        """The envserver's reply; on any failure the sandbox is stopped and `stopped` says why."""
        async with self.lock:
            remaining = self.deadline - time.monotonic()
            if self.stopped is None and remaining <= 0:
                await self.stop("it reached its deadline")
            if self.stopped is not None:
                return {}
            seconds = self.limits["call_seconds"]
            if request["tool"] == "run":
                seconds = min(request.get("timeout", seconds), remaining)
                request = request | {"timeout": seconds}
            try:
                self.process.stdin.write(json.dumps(request).encode() + b"\n")
                await self.process.stdin.drain()
                # The envserver times commands out itself; this bounds one that hangs.
                line = await asyncio.wait_for(
                    self.process.stdout.readline(), min(seconds + self.grace, remaining)
                )
                reply = json.loads(line) if line else None
            except TimeoutError:
                await self.stop("a call outlived its timeout or the session its deadline")
                return {}
            except (OSError, ValueError) as error:  # a broken pipe, an overlong or bad line
                await self.stop(f"its server failed: {type(error).__name__}")
                return {}
            finally:
                self.renew()  # a long call is not a lapsed lease
            if not isinstance(reply, dict):
                await self.stop("its server misspoke" if line else "its server exited")
                return {}
            return reply

    async def stop(self, reason: str) -> None:
        if self.stopped is None:
            self.stopped = reason
        await self.sandbox.kill()


class Server:
    def __init__(self, config: dict):
        unknown, missing = set(config) - CONFIG_FIELDS, CONFIG_FIELDS - set(config)
        if unknown or missing:
            raise ValueError(f"config: unknown {sorted(unknown)}, missing {sorted(missing)}")
        for own in ("tokens_file", "snapshots_dir", "mounts_dir"):
            if shown := _in_system_dir(Path(config[own])):
                raise ValueError(f"config: {own}: every sandbox sees {shown} (SYSTEM_DIRS)")
        self.config = config
        self.limits = config["limits"]
        self.sessions: dict[str, Session] = {}
        self.gone: OrderedDict[str, tuple[str, str]] = OrderedDict()  # id -> (run, why)
        self.free_slots = list(range(config["max_sessions"]))
        self.capacity = asyncio.Semaphore(config["max_sessions"])  # one per free slot
        self.ready: list[Sandbox] = []  # warm, waiting for a claim
        self.warming = 0
        self.waiting = 0  # claims waiting for capacity: demand the pool does not hold yet
        self.advertise = _bracketed(config["advertise"])
        self.counts = {
            "claims": 0,
            "cold_claims": 0,
            "overlay": 0,
            "copy": 0,
            "expired": 0,
            "evicted": 0,
        }
        # Live sessions forking each snapshot (an overlay's lower layer must stay), and
        # when each was last forked: the least recent idle one goes first.
        self.forking: Counter[Path] = Counter()
        self.last_fork: dict[Path, float] = {}
        self.builds: dict[tuple[str, str], asyncio.Lock] = {}
        self._warmers: set[asyncio.Task] = set()  # held: the loop keeps only weak references
        self._tokens_seen: tuple | None = None
        self.tokens: dict[str, bytes] = {}
        self._load_tokens(strict=True)
        # Sandboxes' mountpoints: root's alone, as a sandbox's tree is its root once claimed.
        self.mounts = Path(config["mounts_dir"])
        self.mounts.mkdir(mode=0o700, parents=True, exist_ok=True)
        self.snapshots = Path(config["snapshots_dir"])
        (self.snapshots / _RUN_SNAPSHOTS).mkdir(mode=0o700, parents=True, exist_ok=True)
        # Each snapshot's list of files, made once: this server's, root's alone.
        self.manifests_dir = Path(
            tempfile.mkdtemp(prefix=".manifests-", dir=self.snapshots / _RUN_SNAPSHOTS)
        )
        self.manifests: dict[Path, Path] = {}
        self.private_dirs = [path for path in config["private_dirs"] if Path(path).is_dir()]
        for path in self.private_dirs:
            for own in ("mounts_dir", "snapshots_dir"):
                if Path(config[own]).resolve().is_relative_to(Path(path).resolve()):
                    raise ValueError(f"config: {own} is inside private directory {path}")

    # --- authentication

    def _load_tokens(self, strict: bool = False) -> None:
        path = Path(self.config["tokens_file"])
        try:
            info = path.stat()
            seen = (info.st_ino, info.st_mtime_ns, info.st_size)
            if seen == self._tokens_seen:
                return
            tokens = json.loads(path.read_text())
            if not isinstance(tokens, dict) or not all(
                isinstance(run, str) and isinstance(token, str) and len(token) >= 16
                for run, token in tokens.items()
            ):
                raise ValueError("not a JSON object of run names to tokens of 16+ characters")
        except (OSError, ValueError) as error:
            if strict:
                raise
            log.warning("kept the previous tokens: %s: %s", path, error)
            return
        self.tokens = {run: token.encode() for run, token in tokens.items()}
        self._tokens_seen = seen

    def _authenticate(self, headers: dict[str, str]) -> str:
        scheme, _, token = headers.get("authorization", "").partition(" ")
        if scheme.lower() != "bearer" or not token:
            raise HttpError(
                401, "a bearer token is required", "authentication_error", "Authorization"
            )
        self._load_tokens()
        given = token.strip().encode(errors="replace")
        # Every token is compared, each in constant time: which run matched does not show.
        found = [run for run, known in self.tokens.items() if hmac.compare_digest(given, known)]
        if not found:
            raise HttpError(401, "the token is not valid", "authentication_error", "Authorization")
        return found[0]

    # --- requests

    def health(self) -> dict:
        return {
            "sessions": len(self.sessions),
            "ready": len(self.ready),
            "warming": self.warming,
            "waiting": self.waiting,
            "max_sessions": self.config["max_sessions"],
            **self.counts,
        }

    async def dispatch(self, method: str, target: str, headers: dict, body: bytes):
        path = target.split("?", 1)[0]
        if path == "/healthz":
            _only(method, "GET", path)
            return 200, self.health()
        run = self._authenticate(headers)
        if path == "/v1/sessions":
            _only(method, "POST", path)
            return 201, await self._create(run, _json_object(body))
        if path == "/v1/leases":
            _only(method, "POST", path)
            return 200, self._renew(run, _json_object(body))
        if match := _SNAPSHOT_PATH.fullmatch(path):
            _only(method, "PUT", path)
            return await self._build(run, match[1], _json_object(body))
        match = _SESSION.fullmatch(path)
        if match is None:
            raise HttpError(404, f"no route {path}", "not_found_error")
        session = self._session(run, match[1])
        if match[2] and method == "POST":
            reply = await session.call(_tool_request(_json_object(body)))
            if session.stopped is not None:
                self._forget(session)
                self._session(run, session.id)  # raises 410 with the reason
            return 200, reply
        if not match[2] and method == "DELETE":
            await session.stop("it was destroyed")
            self._forget(session)
            return 200, {"id": session.id}
        raise HttpError(405, f"{method} {path} is not served", "invalid_request_error")

    def _session(self, run: str, id: str) -> Session:
        session = self.sessions.get(id)
        owner, why = (session.run, None) if session else self.gone.get(id, (None, None))
        if owner is None:
            raise HttpError(404, f"no session {id}", "not_found_error", "id")
        if owner != run:
            raise HttpError(403, f"session {id} belongs to another run", "permission_error", "id")
        if session is None:
            raise HttpError(410, f"session {id} is gone: {why}", "session_gone", "id")
        session.renew()
        return session

    def _renew(self, run: str, body: dict) -> dict:
        _no_unknown(body, {"ids"}, "")
        ids = body.get("ids")
        if not isinstance(ids, list) or not all(isinstance(i, str) for i in ids):
            raise _invalid("ids must be a list of session ids", "ids")
        if len(ids) > self.config["max_sessions"]:
            raise _invalid(f"at most {self.config['max_sessions']} ids", "ids")
        renewed, gone = [], []
        for id in ids:
            session = self.sessions.get(id)
            if session is not None and session.run == run:
                session.renew()
                renewed.append(id)
            else:
                gone.append(id)  # another run's looks as unknown as a destroyed one
        return {"renewed": renewed, "gone": gone}

    def _forget(self, session: Session) -> None:
        if self.sessions.pop(session.id, None) is not None:
            self.free_slots.append(session.slot)
            self.capacity.release()
            if session.snapshot is not None:
                self.forking[session.snapshot] -= 1
            self._refill()
        self.gone[session.id] = (session.run, session.stopped or "it stopped")
        while len(self.gone) > self.config["remembered"]:
            self.gone.popitem(last=False)

    # --- claims

    async def _create(self, run: str, body: dict) -> dict:
        _no_unknown(body, {"files", "snapshot", "limits", "wait_seconds"}, "")
        limits = self._session_limits(body.get("limits", {}))
        files = _files(body.get("files", {}), limits["disk_bytes"])
        snapshot = self._snapshot(run, body["snapshot"]) if "snapshot" in body else None
        wait = body.get("wait_seconds", 0)
        if not _number(wait) or wait < 0:
            raise _invalid("must be a non-negative number of seconds", "wait_seconds")
        wait = min(wait, self.config["claim_wait_seconds"])  # the server's bound wins
        if snapshot is not None:  # before any wait: no eviction may take it meanwhile
            self.forking[snapshot] += 1
            self.last_fork[snapshot] = time.monotonic()
        try:
            session = await self._claim(run, limits, files, snapshot, wait)
        except BaseException:
            if snapshot is not None:
                self.forking[snapshot] -= 1
            raise
        session.snapshot = snapshot
        lease = self.config["lease_seconds"]
        # Behind a Service that spreads claims over pods: where this session lives.
        endpoint = self.advertise
        return {"id": session.id, "limits": limits, "lease_seconds": lease, "endpoint": endpoint}

    async def _claim(self, run, limits, files, snapshot, wait) -> Session:
        queued = int(self.capacity.locked())  # no slot free: demand this server lacks room for
        self.waiting += queued
        try:
            await asyncio.wait_for(self.capacity.acquire(), wait or 1e-6)
        except TimeoutError:
            raise HttpError(
                503,
                f"no sandbox came free within {wait} s: the server holds its most sessions "
                f"({len(self.sessions)})",
                "capacity_error",
            ) from None
        finally:
            self.waiting -= queued
        slot = self.free_slots.pop()
        sandbox = None
        while self.ready and sandbox is None:
            sandbox = self.ready.pop()
            if sandbox.process.returncode is not None:  # died since the reaper looked
                await sandbox.kill()
                sandbox = None
        self.counts["claims"] += 1
        if sandbox is None:
            self.counts["cold_claims"] += 1
            sandbox = await self._warm_one(counted=False)
        if sandbox is None:
            self.free_slots.append(slot)
            self.capacity.release()
            raise HttpError(500, "the sandbox did not start", "server_error")
        self._refill()
        claim = {
            "uid": self.config["uid_base"] + slot,
            "limits": {name: math.ceil(limits[name]) for name in RLIMIT_FIELDS},
            "disk_bytes": int(limits["disk_bytes"]),
            "snapshot": str(snapshot) if snapshot else None,
            "manifest": str(await self._manifest(snapshot)) if snapshot else None,
            "files": {path: base64.b64encode(data).decode() for path, data in files.items()},
        }
        id = secrets.token_urlsafe(18)
        grace = self.config["reply_grace_seconds"]
        session = Session(id, run, sandbox, limits, slot, grace, self.config["lease_seconds"])
        self.sessions[id] = session
        started = None
        with contextlib.suppress(OSError):
            sandbox.process.stdin.write(json.dumps(claim).encode() + b"\n")
            await sandbox.process.stdin.drain()
            started = await sandbox.line(max(30.0, limits["call_seconds"]))
        if started and started.get("started") is False:  # the claim's files could not be
            await session.stop("its claim was refused")
            self._forget(session)
            message = f"the claim's files cannot be written: {started.get('error')}"
            raise HttpError(422, message, "invalid_request_error", started.get("param"))
        if started and started.get("fork") in ("overlay", "copy"):
            self.counts[started["fork"]] += 1
        reply = await session.call({"tool": "ping"}) if started else None
        if reply != {"ok": True}:
            await session.stop(session.stopped or "it did not start")
            self._forget(session)
            raise HttpError(500, f"the sandbox did not start: {session.stopped}", "server_error")
        return session

    def _refill(self) -> None:
        """Warms sandboxes until `warm` wait, within `max_sessions` held in all."""
        held = len(self.sessions) + len(self.ready) + self.warming
        for _ in range(
            min(
                self.config["warm"] - len(self.ready) - self.warming,
                self.config["max_sessions"] - held,
            )
        ):
            self.warming += 1  # now, not when the task starts: a second refill counts it
            warmer = asyncio.get_running_loop().create_task(self._warm_one())
            self._warmers.add(warmer)
            warmer.add_done_callback(self._warmers.discard)

    async def _warm_one(self, counted: bool = True) -> Sandbox | None:
        """A sandbox prepared and waiting: into the pool if `counted` (among `warming`, by
        `_refill`), else for the claim that waits on it."""
        host_dir = _mountpoint(self.mounts)
        settings = {
            "root": str(host_dir),
            "disk_bytes": int(self.limits["disk_bytes"]),
            "server": str(_HERE / "envserver.py"),
            "python": self.config["sandbox_python"],
            "private_dirs": self.private_dirs,
            "system_dirs": SYSTEM_DIRS,
        }
        try:
            process = await asyncio.create_subprocess_exec(
                *("unshare", "--net", "--pid", "--mount", "--ipc", "--uts"),
                *("--fork", "--kill-child", "--mount-proc"),
                *(sys.executable, "-I", str(_HERE / "sandbox_init.py"), json.dumps(settings)),
                stdin=asyncio.subprocess.PIPE,
                stdout=asyncio.subprocess.PIPE,
                stderr=asyncio.subprocess.DEVNULL,
                start_new_session=True,
                limit=self.config["max_body_bytes"],  # one reply line: an archive the largest
            )
            sandbox = Sandbox(process, host_dir)
            if await sandbox.line(30.0) != {"ready": True}:
                await sandbox.kill()
                log.warning("a sandbox did not get ready")
                return None
        finally:
            self.warming -= counted
        if not counted:
            return sandbox
        self.ready.append(sandbox)
        return None

    async def _manifest(self, snapshot: Path) -> Path:
        """The snapshot's files with their sizes and times, listed on its first fork."""
        if snapshot not in self.manifests:
            target = self.manifests_dir / f"{len(self.manifests)}.json"
            await asyncio.to_thread(_write_manifest, snapshot, target)
            self.manifests[snapshot] = target
        return self.manifests[snapshot]

    def _session_limits(self, asked) -> dict:
        if not isinstance(asked, dict):
            raise _invalid("limits must be an object", "limits")
        _no_unknown(asked, set(LIMIT_FIELDS), "limits.")
        limits = dict(self.limits)
        for name, value in asked.items():
            if not _number(value) or value <= 0 or value > self.limits[name]:
                raise _invalid(f"must be a number in (0, {self.limits[name]}]", f"limits.{name}")
            limits[name] = value
        return limits

    def _snapshot(self, run: str, name) -> Path:
        """The run's own build of `name`, else the pool's shared one."""
        _snapshot_name(name)
        for path in (self.snapshots / _RUN_SNAPSHOTS / _run_dir(run) / name, self.snapshots / name):
            if path.is_dir():
                return path
        # Each server builds its own: the client builds it here (`endpoint`) and claims again.
        raise HttpError(
            404,
            f"no snapshot named {name!r} on this server",
            "snapshot_missing",
            "snapshot",
            endpoint=self.advertise,
        )

    async def _build(self, run: str, name: str, body: dict):
        """Builds the run's snapshot `name` once: its files, then its set-up command."""
        _snapshot_name(name)
        _no_unknown(body, {"files", "setup"}, "")
        if not isinstance(body.get("setup"), str):
            raise _invalid("setup must be a command", "setup")
        target = self.snapshots / _RUN_SNAPSHOTS / _run_dir(run) / name
        files = _files(body.get("files", {}), self.limits["disk_bytes"])
        async with self.builds.setdefault((run, name), asyncio.Lock()):
            if target.is_dir():
                return 200, {"name": name, "built_seconds": None}
            await self._make_room(target.parent)
            started = time.monotonic()
            setup = self.config["setup_seconds"]
            limits = self.limits | {"wall_seconds": setup + 60, "call_seconds": setup}
            session = await self._claim(run, limits, files, None, self.config["claim_wait_seconds"])
            try:
                reply = await session.call({"tool": "run", "command": body["setup"]})
                if reply.get("ok") and reply.get("exit_code") == 0:
                    removed = await _copy_tree(session.sandbox.work, target)
            finally:
                await session.stop("its snapshot was taken")
                self._forget(session)
            if not target.is_dir():
                why = reply.get("error") or f"exit {reply.get('exit_code')}"
                tail = (reply.get("output") or "")[-2000:]
                raise HttpError(422, f"the set-up failed ({why}): {tail}", "setup_failed", "setup")
            built = round(time.monotonic() - started, 3)
            return 201, {"name": name, "built_seconds": built, "removed": removed}

    async def _make_room(self, run_dir: Path) -> None:
        """Below `max_snapshots` environments for the run: its least recently forked ones
        that no live session forks go."""
        held = _built(run_dir)
        over = len(held) - self.config["max_snapshots"] + 1
        if over <= 0:
            return
        idle = [p for p in held if not self.forking[p]]
        if len(idle) < over:
            raise HttpError(
                409,
                f"the run holds its most environments ({len(held)}), each forked by a live session",
                "snapshot_limit",
                "name",
            )
        for path in sorted(idle, key=lambda p: self.last_fork.get(p, 0.0))[:over]:
            await asyncio.to_thread(shutil.rmtree, path, True)
            self.manifests.pop(path, None)
            self.last_fork.pop(path, None)
            self.counts["evicted"] += 1

    async def reap(self) -> None:
        """Stops sessions past their deadline or lease, or whose sandbox died, even if
        nobody calls; and keeps the warm pool full."""
        self._refill()
        while True:
            await asyncio.sleep(1)
            now = time.monotonic()
            for session in list(self.sessions.values()):
                if session.lock.locked():
                    continue  # a call is under way and bounds itself
                if session.deadline <= now:
                    await session.stop("it reached its deadline")
                elif session.lease_until <= now:
                    self.counts["expired"] += 1
                    await session.stop("its lease lapsed: its client stopped renewing it")
                elif session.process.returncode is not None:
                    await session.stop("its sandbox exited")
                else:
                    continue
                self._forget(session)
            for sandbox in [s for s in self.ready if s.process.returncode is not None]:
                self.ready.remove(sandbox)
                await sandbox.kill()
            self._refill()

    async def close(self) -> None:
        for session in list(self.sessions.values()):
            await session.stop("the server stopped")
            self._forget(session)
        self.config = self.config | {"warm": 0}
        for sandbox in self.ready:
            await sandbox.kill()
        shutil.rmtree(self.manifests_dir, ignore_errors=True)

    # --- HTTP/1.1, just enough: keep-alive, Content-Length bodies, bounds everywhere

    async def connection(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter):
        try:
            while True:
                request = None
                try:
                    request = await self._read(reader)
                    if request is None:
                        return
                    method, target, headers, body, keep = request
                    status, reply = await self.dispatch(method, target, headers, body)
                except HttpError as error:
                    # After a request that could not be read, the stream is out of step.
                    status, reply = error.status, error.body()
                    keep = request is not None and request[4] and error.status < 500
                except Exception:  # nothing a client sends may take the server down
                    log.exception("a request failed")
                    status, keep = 500, False
                    reply = {"error": {"message": "internal error", "type": "server_error"}}
                data = json.dumps(reply).encode()
                head = (
                    f"HTTP/1.1 {status} {_REASONS.get(status, 'Error')}\r\n"
                    f"Content-Type: application/json\r\nContent-Length: {len(data)}\r\n"
                    f"Connection: {'keep-alive' if keep else 'close'}\r\n\r\n"
                )
                writer.write(head.encode() + data)
                await writer.drain()
                if not keep:
                    return
        except (ConnectionError, TimeoutError, asyncio.IncompleteReadError):
            return
        finally:
            writer.close()

    async def _read(self, reader: asyncio.StreamReader):
        idle = self.config["idle_seconds"]
        try:
            head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), idle)
        except asyncio.IncompleteReadError as error:
            if error.partial.strip():
                raise _invalid("the request ended inside its header", None) from None
            return None
        except asyncio.LimitOverrunError:
            raise HttpError(
                431, "the request header is too large", "invalid_request_error"
            ) from None
        except TimeoutError:
            return None
        lines = head.decode("latin-1").split("\r\n")
        parts = lines[0].split(" ")
        if len(parts) != 3 or not parts[2].startswith("HTTP/1."):
            raise _invalid("malformed request line", None)
        method, target, version = parts
        headers = {}
        for line in lines[1:]:
            if line:
                name, colon, value = line.partition(":")
                if not colon:
                    raise _invalid("malformed header line", None)
                headers[name.strip().lower()] = value.strip()
        if "transfer-encoding" in headers:
            raise _invalid("send a Content-Length body, not chunks", "Transfer-Encoding")
        length = headers.get("content-length", "0")
        if not length.isdigit():
            raise _invalid("must be a non-negative integer", "Content-Length")
        if int(length) > self.config["max_body_bytes"]:
            raise HttpError(
                413,
                f"the body is over {self.config['max_body_bytes']} bytes",
                "invalid_request_error",
                "Content-Length",
            )
        try:
            body = await asyncio.wait_for(reader.readexactly(int(length)), idle)
        except (asyncio.IncompleteReadError, TimeoutError):
            raise _invalid("the body is shorter than its length", "Content-Length") from None
        keep = version == "HTTP/1.1" and headers.get("connection", "").lower() != "close"
        return method, target, headers, body, keep


def _mountpoint(parent: Path) -> Path:
    # Only an empty directory here: the sandbox mounts its tmpfs over it privately.
    path = Path(tempfile.mkdtemp(prefix="sandbox-", dir=parent))
    path.chmod(0o755)
    return path


def _bracketed(url: str) -> str:
    """`advertise` with an IPv6 address in brackets, as a URL needs it: the kubelet fills
    `$(POD_IP)` in with the bare address either way."""
    scheme, sep, rest = url.partition("://")
    host, colon, port = rest.rpartition(":")
    if sep and colon and ":" in host and not host.startswith("["):
        return f"{scheme}://[{host}]:{port}"
    return url


def _only(method: str, allowed: str, path: str) -> None:
    if method != allowed:
        raise HttpError(405, f"{method} {path} is not served", "invalid_request_error")


def _snapshot_name(name) -> None:
    if not isinstance(name, str) or not _SNAPSHOT.fullmatch(name):
        raise _invalid("a snapshot is named by letters, digits, '.', '_' and '-'", "snapshot")


def _run_dir(run: str) -> str:
    """A run's folder name: runs are named by the operator, but never trusted as paths."""
    return base64.urlsafe_b64encode(run.encode()).decode()


def _built(run_dir: Path) -> list[Path]:
    """The environments a run has built (not those being built: their names start '.')."""
    if not run_dir.is_dir():
        return []
    return [p for p in run_dir.iterdir() if p.is_dir() and not p.name.startswith(".")]


def _write_manifest(snapshot: Path, target: Path) -> None:
    """Each regular file under `snapshot`: its size and modification time, as JSON."""
    files = {}
    pending = [snapshot]
    while pending:
        with os.scandir(pending.pop()) as entries:
            for entry in entries:
                if entry.is_dir(follow_symlinks=False):
                    pending.append(Path(entry.path))
                elif entry.is_file(follow_symlinks=False):
                    info = entry.stat(follow_symlinks=False)
                    relative = str(Path(entry.path).relative_to(snapshot))
                    files[relative] = [info.st_size, info.st_mtime_ns]
    target.write_text(json.dumps(files))


def _publish(building: Path, target: Path) -> None:
    building.chmod(0o755)
    building.rename(target)


async def _copy_tree(source: Path, target: Path) -> int:
    """`source` to `target` (made whole, then renamed into place), owned by root, holding
    only what stays in its tree (`_confine`); how many entries were left out."""
    target.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
    building = Path(tempfile.mkdtemp(prefix=f".{target.name}-", dir=target.parent))
    process = await asyncio.create_subprocess_exec("cp", "-a", "--", f"{source}/.", str(building))
    if await process.wait() != 0:
        shutil.rmtree(building, ignore_errors=True)
        return 0
    removed = await asyncio.to_thread(_confine, building)
    await (await asyncio.create_subprocess_exec("chown", "-R", "0:0", str(building))).wait()
    _publish(building, target)
    return len(removed)


def _confine(tree: Path) -> list[str]:
    """Leaves in `tree` folders, regular files and links that stay in it, and removes the
    rest (returned, relative): absolute links and those that lead out (to a fixed point,
    as removing one link can turn where another leads), pipes, sockets, devices, and
    files with a name outside the tree. So nothing that forks it, or writes below it, is
    led out of it."""
    tree = tree.resolve()
    removed: list[str] = []
    links: list[Path] = []
    files: dict[int, list[Path]] = {}  # inode -> its names in the tree
    pending = [tree]
    while pending:
        with os.scandir(pending.pop()) as entries:
            for entry in entries:
                path = Path(entry.path)
                info = entry.stat(follow_symlinks=False)
                if stat.S_ISDIR(info.st_mode):
                    pending.append(path)
                elif stat.S_ISLNK(info.st_mode):
                    links.append(path)
                elif stat.S_ISREG(info.st_mode):
                    files.setdefault(info.st_ino, []).append(path)
                else:
                    path.unlink()
                    removed.append(str(path.relative_to(tree)))
    for names in files.values():
        if names[0].lstat().st_nlink > len(names):
            for path in names:
                path.unlink()
                removed.append(str(path.relative_to(tree)))
    while escaped := [link for link in links if _leads_out(tree, link)]:
        for link in escaped:
            link.unlink()
            links.remove(link)
            removed.append(str(link.relative_to(tree)))
    return removed


def _leads_out(tree: Path, link: Path) -> bool:
    target = link.readlink()
    if target.is_absolute():
        return True
    written = Path(os.path.normpath(link.parent / target))  # as its text says
    followed = Path(os.path.realpath(link))  # as the tree resolves it now
    return not (written.is_relative_to(tree) and followed.is_relative_to(tree))


def _in_system_dir(path: Path) -> Path | None:
    """The system folder sandboxes see `path` in, if one: a folder is bound alone, so a
    mount below it (a Secret's volume) does not show."""
    path = path.resolve()
    for name in SYSTEM_DIRS:
        shown = Path(name).resolve()
        if path.is_relative_to(shown) and shown.exists():
            nearest = next(p for p in (path, *path.parents) if p.exists())
            if nearest.stat().st_dev == shown.stat().st_dev:
                return shown
    return None


def _number(value) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


def _json_object(body: bytes) -> dict:
    try:
        value = json.loads(body or b"{}")
    except (ValueError, RecursionError):
        raise _invalid("the body is not valid JSON", "body") from None
    if not isinstance(value, dict):
        raise _invalid("the body must be a JSON object", "body")
    return value


def _no_unknown(value: dict, known: set, prefix: str) -> None:
    for name in value:
        if name not in known:
            raise _invalid(f"unknown field {name!r}", f"{prefix}{name}")


def _tool_request(body: dict) -> dict:
    tool = body.get("tool")
    if tool not in TOOLS:
        raise _invalid(f"tool must be one of {sorted(TOOLS)}", "tool")
    fields = TOOLS[tool]
    _no_unknown(body, {"tool", *fields}, "")
    for name, (kind, required) in fields.items():
        if name not in body:
            if required:
                raise _invalid(f"{tool} needs {name}", name)
        elif not isinstance(body[name], kind) or isinstance(body[name], bool):
            raise _invalid(f"{name} has the wrong type", name)
    if "timeout" in body and not (_number(body["timeout"]) and body["timeout"] > 0):
        raise _invalid("timeout must be a positive number of seconds", "timeout")
    return body


def _files(files, disk_bytes: int) -> dict[str, bytes]:
    """A task's starting files, decoded; paths are relative and stay inside the tree."""
    if not isinstance(files, dict):
        raise _invalid("files must map relative paths to base64", "files")
    decoded, total = {}, 0
    for path, content in files.items():
        parts = path.split("/")
        if path.startswith("/") or "\0" in path or any(p in ("", ".", "..") for p in parts):
            raise _invalid("a file's path must be relative and plain", f"files.{path}")
        try:
            decoded[path] = base64.b64decode(content, validate=True)
        except (binascii.Error, TypeError, ValueError):
            raise _invalid("not base64", f"files.{path}") from None
        total += len(decoded[path])
    if total > disk_bytes:
        raise _invalid(f"the files are over the session's {disk_bytes} bytes of disk", "files")
    return decoded


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

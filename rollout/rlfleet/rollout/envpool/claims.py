"""Claims and the sessions they make: capacity, leases, and every way a session ends.

A claim takes a free slot (its uid), waiting for one up to its `wait_seconds`, and a warm
sandbox, else starts one cold; the pool refills behind it. A session is never handed on:
once it ends (destroyed, at its deadline, its lease lapsed, its sandbox dead) its slot
frees, and its id answers 410 with the reason for as long as it is `remembered`."""

import asyncio
import base64
import contextlib
import json
import math
import secrets
import time
from collections import OrderedDict
from pathlib import Path

from rlfleet.rollout.envpool.protocol import HttpError, invalid, no_unknown, number
from rlfleet.rollout.envpool.sandboxes import (
    LIMIT_FIELDS,
    RLIMIT_FIELDS,
    Sandbox,
    Session,
    WarmPool,
)
from rlfleet.rollout.envpool.snapshots import Snapshots


class Sessions:
    """The live sessions, by id, and those gone: each belongs to the run that claimed it."""

    def __init__(self, config: dict, pool: WarmPool, snapshots: Snapshots):
        self.config = config
        self.limits = config["limits"]
        self.pool, self.snapshots = pool, snapshots
        self.live: dict[str, Session] = {}
        self.gone: OrderedDict[str, tuple[str, str]] = OrderedDict()  # id -> (run, why)
        self.free_slots = list(range(config["max_sessions"]))
        self.capacity = asyncio.Semaphore(config["max_sessions"])  # one per free slot
        self.waiting = 0  # claims waiting for capacity: demand the pool does not hold yet
        self.counts = {"claims": 0, "cold_claims": 0, "overlay": 0, "copy": 0, "expired": 0}

    def limits_for(self, asked) -> dict:
        """A claim's limits: the server's, lowered where the claim asks."""
        if not isinstance(asked, dict):
            raise invalid("limits must be an object", "limits")
        no_unknown(asked, set(LIMIT_FIELDS), "limits.")
        limits = dict(self.limits)
        for name, value in asked.items():
            if not number(value) or value <= 0 or value > self.limits[name]:
                raise invalid(f"must be a number in (0, {self.limits[name]}]", f"limits.{name}")
            limits[name] = value
        return limits

    def lookup(self, run: str, id: str) -> Session:
        """The run's live session `id`, its lease renewed; else 404, 403 or 410 (why)."""
        session = self.live.get(id)
        owner, why = (session.run, None) if session else self.gone.get(id, (None, None))
        if owner is None:
            raise HttpError(404, f"no session {id}", "not_found_error", "id")
        if owner != run:
            raise HttpError(403, f"session {id} belongs to another run", "permission_error", "id")
        if session is None:
            raise HttpError(410, f"session {id} is gone: {why}", "session_gone", "id")
        session.renew()
        return session

    def renew(self, run: str, body: dict) -> dict:
        """Renews the leases of the run's sessions that `ids` names."""
        no_unknown(body, {"ids"}, "")
        ids = body.get("ids")
        if not isinstance(ids, list) or not all(isinstance(i, str) for i in ids):
            raise invalid("ids must be a list of session ids", "ids")
        if len(ids) > self.config["max_sessions"]:
            raise invalid(f"at most {self.config['max_sessions']} ids", "ids")
        renewed, gone = [], []
        for id in ids:
            session = self.live.get(id)
            if session is not None and session.run == run:
                session.renew()
                renewed.append(id)
            else:
                gone.append(id)  # another run's looks as unknown as a destroyed one
        return {"renewed": renewed, "gone": gone}

    def forget(self, session: Session) -> None:
        """A stopped session: its slot and its snapshot free, its id remembered as gone."""
        if self.live.pop(session.id, None) is not None:
            self.free_slots.append(session.slot)
            self.capacity.release()
            if session.snapshot is not None:
                self.snapshots.release(session.snapshot)
            self.pool.refill(len(self.live))
        self.gone[session.id] = (session.run, session.stopped or "it stopped")
        while len(self.gone) > self.config["remembered"]:
            self.gone.popitem(last=False)

    async def claim(
        self, run: str, limits: dict, files: dict[str, bytes], snapshot: Path | None, wait: float
    ) -> Session:
        """A started session for `run`, forking `snapshot` if one; held from before any
        wait, so that no eviction takes it meanwhile."""
        if snapshot is not None:
            self.snapshots.hold(snapshot)
        try:
            session = await self._claim(run, limits, files, snapshot, wait)
        except BaseException:
            if snapshot is not None:
                self.snapshots.release(snapshot)
            raise
        session.snapshot = snapshot
        return session

    async def _claim(
        self, run: str, limits: dict, files: dict[str, bytes], snapshot: Path | None, wait: float
    ) -> Session:
        slot = await self._slot(wait)
        sandbox = await self._sandbox()
        if sandbox is None:
            self.free_slots.append(slot)
            self.capacity.release()
            raise HttpError(500, "the sandbox did not start", "server_error")
        self.pool.refill(len(self.live))
        claim = {
            "uid": self.config["uid_base"] + slot,
            "limits": {name: math.ceil(limits[name]) for name in RLIMIT_FIELDS},
            "disk_bytes": int(limits["disk_bytes"]),
            "snapshot": str(snapshot) if snapshot else None,
            "manifest": str(await self.snapshots.manifest(snapshot)) if snapshot else None,
            "files": {path: base64.b64encode(data).decode() for path, data in files.items()},
        }
        id = secrets.token_urlsafe(18)
        grace = self.config["reply_grace_seconds"]
        session = Session(id, run, sandbox, limits, slot, grace, self.config["lease_seconds"])
        self.live[id] = session
        await self._start(session, claim)
        return session

    async def _slot(self, wait: float) -> int:
        """A free slot, once one is free within `wait` seconds, else 503."""
        queued = int(self.capacity.locked())  # no slot free: demand this server lacks room for
        self.waiting += queued
        try:
            await asyncio.wait_for(self.capacity.acquire(), wait or 1e-6)
        except TimeoutError:
            raise HttpError(
                503,
                f"no sandbox came free within {wait} s: the server holds its most sessions "
                f"({len(self.live)})",
                "capacity_error",
            ) from None
        finally:
            self.waiting -= queued
        return self.free_slots.pop()

    async def _sandbox(self) -> Sandbox | None:
        """A warm sandbox, else one started now (a cold claim)."""
        sandbox = await self.pool.take()
        self.counts["claims"] += 1
        if sandbox is None:
            self.counts["cold_claims"] += 1
            sandbox = await self.pool.start(counted=False)
        return sandbox

    async def _start(self, session: Session, claim: dict) -> None:
        """Hands the sandbox its claim, then waits for its envserver to answer."""
        started = None
        with contextlib.suppress(OSError):
            session.process.stdin.write(json.dumps(claim).encode() + b"\n")
            await session.process.stdin.drain()
            started = await session.sandbox.line(max(30.0, session.limits["call_seconds"]))
        if started and started.get("started") is False:  # the claim's files could not be
            await session.stop("its claim was refused")
            self.forget(session)
            message = f"the claim's files cannot be written: {started.get('error')}"
            raise HttpError(422, message, "invalid_request_error", started.get("param"))
        if started and started.get("fork") in ("overlay", "copy"):
            self.counts[started["fork"]] += 1
        reply = await session.call({"tool": "ping"}) if started else None
        if reply != {"ok": True}:
            await session.stop(session.stopped or "it did not start")
            self.forget(session)
            raise HttpError(500, f"the sandbox did not start: {session.stopped}", "server_error")

    async def reap(self) -> None:
        """Stops sessions past their deadline or lease, or whose sandbox died, even if
        nobody calls; and keeps the warm pool full."""
        self.pool.refill(len(self.live))
        while True:
            await asyncio.sleep(1)
            await self._sweep(time.monotonic())
            await self.pool.drop_dead()
            self.pool.refill(len(self.live))

    async def _sweep(self, now: float) -> None:
        for session in list(self.live.values()):
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
            self.forget(session)

    async def close(self) -> None:
        for session in list(self.live.values()):
            await session.stop("the server stopped")
            self.forget(session)
        await self.pool.close()

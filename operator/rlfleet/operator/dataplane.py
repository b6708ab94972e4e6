"""The hub's NATS, seen from the operator: each run's streams, and its trainer's progress.

kopf runs our handlers in threads; nats-py is asyncio. One event loop on its own thread
holds the one connection, and handlers submit to it with a timeout, so a NATS outage
slows a reconcile by at most `timeout_s` and never blocks kopf.
"""

from __future__ import annotations

import asyncio
import logging
import threading
from collections.abc import Callable, Coroutine
from dataclasses import dataclass
from typing import Any, TypeVar

import nats
import nats.errors
import nats.js.errors

from rlfleet.api.wire import (
    BusRole,
    EvaluationReport,
    ServeOrder,
    StepReport,
    cycle_state_subject,
    cycle_subject,
    decode_cycle_report,
    decode_cycle_state,
    decode_evaluation_report,
    decode_serve_order,
    decode_step_report,
    encode,
    evaluation_subject,
    serve_order_subject,
    step_subject,
)
from rlfleet.bus import connection
from rlfleet.bus.credentials import account_of
from rlfleet.bus.permissions import mint_run_user
from rlfleet.bus.reading import decoded, newest
from rlfleet.bus.streams import (
    cycle_stream,
    delete_run_streams,
    ensure_run_streams,
    evaluation_stream,
    largest_message,
    step_stream,
)
from rlfleet.launch import pods
from rlfleet.operator.production import CycleUpdates

log = logging.getLogger(__name__)
# Conductor states a reconcile reads at most: one per transition, a few per cycle. A hub
# that was away longer posts the newest transitions' events, not every one.
STATES_READ = 100
T = TypeVar("T")


class DataPlaneUnavailable(Exception):
    """NATS did not answer in time, or refused what was asked."""


class StorageRefused(DataPlaneUnavailable):
    """The hub's JetStream cannot reserve what a run's streams ask for: a stream's byte
    bound is reserved from the server's store when it is made."""


# JetStream's "insufficient storage resources available".
_NO_STORAGE = 10047


@dataclass(frozen=True)
class NatsLogin:
    """How the operator reaches NATS, from its Secret (read at each connect)."""

    credentials: str | None  # the operator's own user (.creds text); None: anonymous
    signing_seed: str | None = None  # the account's signing key, which mints runs' users
    # Both or neither: what revokes a deleted run's users (`rlfleet.bus.connection.AccountOwner`).
    operator_seed: str | None = None  # the NATS operator's key, which signs the account
    system_credentials: str | None = None  # a system account user (.creds text)


class DataPlane:
    def __init__(
        self,
        url: str,
        login: Callable[[], NatsLogin],
        domain: str,
        timeout_s: float,
    ) -> None:
        self.url = url
        self.login = login
        self.domain = domain  # the hub's JetStream domain, which region mirrors name
        self.timeout_s = timeout_s
        self._loop = asyncio.new_event_loop()
        threading.Thread(target=self._loop.run_forever, name="nats", daemon=True).start()
        self._nc: nats.NATS | None = None
        self._connecting = asyncio.Lock()

    def _run(self, coroutine: Coroutine[Any, Any, Any], calls: int = 1) -> Any:
        """`coroutine`'s result, given `calls` times the timeout (it makes that many)."""
        future = asyncio.run_coroutine_threadsafe(coroutine, self._loop)
        try:
            return future.result(self.timeout_s * calls)
        except TimeoutError as error:
            future.cancel()
            raise DataPlaneUnavailable(
                f"NATS {self.url}: no answer in {self.timeout_s * calls}s"
            ) from error
        except nats.js.errors.APIError as error:
            if error.err_code == _NO_STORAGE:
                raise StorageRefused(error.description or str(error)) from error
            raise DataPlaneUnavailable(f"NATS {self.url}: {error}") from error
        except (nats.errors.Error, OSError) as error:
            raise DataPlaneUnavailable(f"NATS {self.url}: {error}") from error

    async def _client(self) -> nats.NATS:
        async with self._connecting:
            if self._nc is None or self._nc.is_closed:
                self._nc = await connection.connect(
                    self.url,
                    self.login().credentials,
                    connect_timeout=self.timeout_s,
                    max_reconnect_attempts=-1,
                    name="rlfleet-operator",
                )
                if self._nc.max_payload < largest_message():
                    log.warning(
                        "NATS %s takes messages of at most %d bytes (its max_payload), a "
                        "run's streams up to %d: a larger trajectory or task is refused at "
                        "publish; give every server, leaf nodes too, max_payload: %d",
                        *(self.url, self._nc.max_payload, largest_message(), largest_message()),
                    )
            return self._nc

    def run_users(self, run: str, incarnation: str, ttl_s: float) -> dict[BusRole, str]:
        """The run's users (.creds text), signed now for `ttl_s`: one per component, each
        allowed what that component does with the run's subjects and streams, and a
        read-only observer; `incarnation` (the run's uid) names their keys."""
        login = self.login()
        if login.credentials is None or login.signing_seed is None:
            raise DataPlaneUnavailable(
                "the operator's NATS Secret has no `creds` and `signing-seed`: "
                f"no user can be made for run {run}"
            )
        account = account_of(login.credentials)
        return {
            role: mint_run_user(login.signing_seed, account, run, role, incarnation, ttl_s)
            for role in pods.POD_ROLES
        }

    def revoke_users(self, run: str, incarnation: str, ttl_s: float, servers: int) -> None:
        """Revokes the users of a deleted run (`incarnation`: its uid) on every server that
        hears the hub's system account (`servers` of them: the hub and a leaf node per
        region); without the keys that takes, they only expire (within `ttl_s`)."""
        login = self.login()
        if login.operator_seed is None or login.system_credentials is None:
            log.warning(
                "run %s: its NATS users are left to expire (within %.0fs): the operator's "
                "NATS Secret has no `operator-seed` and `system-creds` to revoke them with",
                *(run, ttl_s),
            )
            return
        assert login.credentials is not None and login.signing_seed is not None
        owner = connection.AccountOwner(
            login.operator_seed,
            login.system_credentials,
            account_of(login.credentials),
            login.signing_seed,
        )
        try:
            # Five calls: the record kept, the records read, a login, the push and answers.
            took = self._run(self._revoke(owner, incarnation, ttl_s, servers), calls=5)
        except ValueError as error:  # a server refused the account
            raise DataPlaneUnavailable(str(error)) from error
        if len(took) < servers:
            log.warning(
                "run %s: %d of %d NATS servers said they revoked its users (%s)",
                *(run, len(took), servers, ", ".join(took)),
            )

    async def _revoke(
        self, owner: connection.AccountOwner, incarnation: str, ttl_s: float, servers: int
    ) -> list[str]:
        nc = await self._client()
        return await connection.revoke_run_users(
            nc, self.url, self.domain, owner, incarnation, ttl_s, servers, self.timeout_s
        )

    def ensure_streams(self, run: str, regions: list[str], trajectory_backlog: int) -> list[str]:
        """Creates the run's streams in the hub (its trajectories' bytes bounded by
        `trajectory_backlog`) and a mirror of its weights in each region's JetStream
        domain; returns the regions whose mirror could not be made yet. StorageRefused
        when the hub has no room to reserve the bound."""
        return self._run(self._ensure_streams(run, regions, trajectory_backlog))

    async def _ensure_streams(
        self, run: str, regions: list[str], trajectory_backlog: int
    ) -> list[str]:
        nc = await self._client()
        return await ensure_run_streams(nc, run, self.domain, regions, trajectory_backlog)

    def delete_streams(self, run: str, regions: list[str]) -> list[str]:
        """Deletes the run's streams in the hub and its weights' mirror in each region, so
        nothing of it outlives the run; returns the regions whose mirror is left."""
        return self._run(self._delete_streams(run, regions))

    async def _delete_streams(self, run: str, regions: list[str]) -> list[str]:
        return await delete_run_streams(await self._client(), run, self.domain, regions)

    def last_step(self, run: str) -> StepReport | None:
        """The trainer's newest step report, None before its first step."""
        return self._run(self._last(step_stream(run), step_subject(run), decode_step_report))

    def last_evaluation(self, run: str) -> EvaluationReport | None:
        """The evaluator's newest report, None before its first."""
        return self._run(
            self._last(evaluation_stream(run), evaluation_subject(run), decode_evaluation_report)
        )

    def cycle_updates(self, run: str, after: int) -> CycleUpdates:
        """A production run's conductor states after sequence `after` (at most
        `STATES_READ`, the oldest of them first), and its collector's newest report."""
        return self._run(self._cycle_updates(run, after))

    async def _cycle_updates(self, run: str, after: int) -> CycleUpdates:
        js = (await self._client()).jetstream()
        stream, subject = cycle_stream(run), cycle_state_subject(run)
        report = await newest(js, stream, cycle_subject(run), decode_cycle_report)
        try:
            last = (await js.get_last_msg(stream, subject, direct=True)).seq or 0
        except (nats.js.errors.NotFoundError, nats.errors.NoRespondersError):
            return CycleUpdates(run, (), report)
        if last < after:  # the stream was made anew: its history starts again
            after = 0
        start = max(after, last - STATES_READ)
        states = [s async for s in decoded(js, stream, subject, decode_cycle_state, start)]
        return CycleUpdates(run, states, report)

    def pass_order(self, order: ServeOrder) -> bool:
        """Publishes an on-call order to the run's conductor unless it has it (a newer or
        the same number is on the stream); returns whether it published."""
        return self._run(self._pass_order(order))

    async def _pass_order(self, order: ServeOrder) -> bool:
        nc = await self._client()
        subject = serve_order_subject(order.run)
        passed = await newest(nc.jetstream(), cycle_stream(order.run), subject, decode_serve_order)
        if passed is not None and passed.number >= order.number:
            return False
        await nc.jetstream().publish(subject, encode(order))
        return True

    async def _last(self, stream: str, subject: str, decode: Callable[[bytes], T]) -> T | None:
        return await newest((await self._client()).jetstream(), stream, subject, decode)

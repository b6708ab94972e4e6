"""Least privilege on NATS, tried as a matrix: each of a run's users (one per component,
and the observer) attempts every kind of operation on its own run's subjects and
streams and on another run's, and the servers' verdicts are compared with what that
component needs.

The table here is written from what each component does, apart from the permissions
the hub mints (`rlfleet.bus.permissions.role_access`), so that a user allowed too much or too
little shows up as a mismatch. Each operation is one publish or subscribe on the subject
that a client, or nats-py on its behalf, uses for it; the server answers a refused one
with a permissions violation naming the subject, which is how the verdict is read, with
no timeout to wait out.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, replace

from rlfleet.api.wire import (
    BusRole,
    capture_stream,
    capture_subject,
    cycle_state_subject,
    cycle_subject,
    evaluation_subject,
    feedback_stream,
    feedback_subject,
    live_subject,
    serving_stream,
    serving_subject,
    step_subject,
    task_stream,
    task_subject,
    trajectory_stream,
    trajectory_subject,
    weights_prefix,
    weights_stream,
)
from rlfleet.bus.connection import connect
from rlfleet.bus.permissions import run_inbox
from rlfleet.bus.streams import (
    TRAINER_CONSUMER,
    WORKER_CONSUMER,
    cycle_stream,
    evaluation_stream,
    step_stream,
)
from rlfleet.local.nats import NatsBed, NatsServer

VERDICT_WAIT_S = 10.0  # the longest to wait for the servers' refusals

# Every stream of a run but the task queue, and every subject but the weights'.
_STREAMS = ("STEPS", "EVALS", "TRAJ", "WEIGHTS", "CAPTURE", "FEEDBACK", "CYCLES", "SERVING")
_SUBJECTS = (
    *("steps", "evaluations", "tasks", "trajectories"),
    *("captures", "feedback", "cycles", "live", "conductor", "serving"),
)

# What each component needs, by the kinds of operations below (on its own run only). No
# one lists streams or makes a consumer: a component pulls from, and acknowledges for,
# the durable consumer its run's owner made for it, and reads the rest by direct gets.
NEEDS: dict[BusRole, set[str]] = {
    BusRole.TRAINER: {
        "publish steps",
        "publish weights",
        "publish manifest",
        *(f"{op} {s}" for op in ("info", "get") for s in ("TRAJ", "STEPS", "WEIGHTS", "CYCLES")),
        "pull TRAJ",
        "inspect-consumer TRAJ",
        "ack TRAJ",
        "purge WEIGHTS",  # retires versions older than the kept snapshots
    },
    BusRole.ROLLOUT: {
        "publish trajectories",
        *(f"{op} {s}" for op in ("info", "get") for s in ("TASKS", "TRAJ", "WEIGHTS")),
        "pull TASKS",
        "inspect-consumer TASKS",
        "ack TASKS",
        "listen manifest",  # a new version wakes its receiver
    },
    BusRole.FEED: {
        "publish tasks",
        *(f"{op} {s}" for op in ("info", "get") for s in ("STEPS", "TASKS")),
        "listen steps",  # a new step report wakes it
    },
    BusRole.EVALUATOR: {
        "publish evaluations",
        *(f"{op} {s}" for op in ("info", "get") for s in ("EVALS", "WEIGHTS", "CYCLES")),
        "listen manifest",
    },
    BusRole.SERVING: {
        "publish captures",
        "publish feedback",
        *(f"{op} {s}" for op in ("info", "get") for s in ("CAPTURE", "WEIGHTS", "SERVING")),
        "listen manifest",
    },
    BusRole.COLLECTOR: {
        "publish trajectories",
        "publish cycles",
        "publish live",
        *(f"{op} {s}" for op in ("info", "get") for s in ("CAPTURE", "FEEDBACK", "CYCLES", "TRAJ")),
    },
    BusRole.CONDUCTOR: {
        "publish conductor",
        "publish serving",
        *(f"{op} {s}" for op in ("info", "get") for s in ("STEPS", "EVALS", "CYCLES", "SERVING")),
    },
    BusRole.OBSERVER: {
        *(f"{op} {s}" for op in ("info", "get") for s in (*_STREAMS, "TASKS")),
        "inspect-consumer TRAJ",  # the trainer's acknowledgements, for an audit
        *(f"listen {s}" for s in _SUBJECTS),
    },
}

# Each stream's durable consumer, where it has one: whose it is is in NEEDS.
_DURABLES = {"TRAJ": TRAINER_CONSUMER, "TASKS": WORKER_CONSUMER}


@dataclass(frozen=True)
class Check:
    role: BusRole
    operation: str  # "<kind> <target>", prefixed "theirs:" for another run's
    subscribe: bool
    subject: str
    expected: bool  # allowed
    allowed: bool | None = None  # the servers' verdict, once tried

    @property
    def violation(self) -> bool:
        return self.allowed is not self.expected


def _operations(run: str, role: BusRole) -> list[tuple[str, bool, str]]:
    """(operation, is a subscription, subject) for every kind of operation on `run`."""
    return [*_subject_operations(run), *_stream_operations(run), *_inbox_operations(run, role)]


def _subject_operations(run: str) -> list[tuple[str, bool, str]]:
    """Publishing to and listening on each of the run's subjects, and listing streams."""
    subjects = {
        "tasks": task_subject(run),
        "trajectories": trajectory_subject(run),
        "steps": step_subject(run),
        "evaluations": evaluation_subject(run),
        "weights": f"{weights_prefix(run)}.v1.shard.0",
        "manifest": f"{weights_prefix(run)}.1.manifest.delta",
        "captures": capture_subject(run, "chatcmpl-1"),
        "feedback": feedback_subject(run, "chatcmpl-1", "event-1"),
        "cycles": cycle_subject(run),
        "live": live_subject(run),
        "conductor": cycle_state_subject(run),
        "serving": serving_subject(run, "stable"),
    }
    found = []
    for short, subject in subjects.items():
        found.append((f"publish {short}", False, subject))
        found.append((f"listen {short}", True, subject))
    found.append(("list streams", False, "$JS.API.STREAM.NAMES"))
    found.append(("list streams' configs", False, "$JS.API.STREAM.LIST"))
    return found


def _stream_operations(run: str) -> list[tuple[str, bool, str]]:
    """Every JetStream API call on each of the run's streams and their consumers."""
    streams = {
        "TASKS": task_stream(run),
        "TRAJ": trajectory_stream(run),
        "STEPS": step_stream(run),
        "EVALS": evaluation_stream(run),
        "WEIGHTS": weights_stream(run),
        "CAPTURE": capture_stream(run),
        "FEEDBACK": feedback_stream(run),
        "CYCLES": cycle_stream(run),
        "SERVING": serving_stream(run),
    }
    found = []
    for short, stream in streams.items():
        durable = _DURABLES.get(short, "any")
        api = {
            "info": f"STREAM.INFO.{stream}",
            "get": f"DIRECT.GET.{stream}",
            "consume": f"CONSUMER.CREATE.{stream}",
            "name-consumer": f"CONSUMER.CREATE.{stream}.{durable}",
            "make-durable": f"CONSUMER.DURABLE.CREATE.{stream}.{durable}",
            "pull": f"CONSUMER.MSG.NEXT.{stream}.{durable}",
            "inspect-consumer": f"CONSUMER.INFO.{stream}.{durable}",
            "create": f"STREAM.CREATE.{stream}",
            "update": f"STREAM.UPDATE.{stream}",
            "delete": f"STREAM.DELETE.{stream}",
            "purge": f"STREAM.PURGE.{stream}",
            "delete-message": f"STREAM.MSG.DELETE.{stream}",
            "delete-consumer": f"CONSUMER.DELETE.{stream}.rollout",
        }
        for op, tail in api.items():
            found.append((f"{op} {short}", False, f"$JS.API.{tail}"))
        # The same through a JetStream domain's prefix, as a region reaches the hub.
        found.append((f"delete {short} (domain)", False, f"$JS.hub.API.STREAM.DELETE.{stream}"))
        found.append((f"ack {short}", False, f"$JS.ACK.{stream}.{durable}.1.1.1.1.0"))
    return found


def _inbox_operations(run: str, role: BusRole) -> list[tuple[str, bool, str]]:
    """Reading, and answering on, every other user's reply subjects."""
    found = []
    for other in BusRole:
        if other != role:
            inbox = f"{run_inbox(run, other)}.x"
            found.append((f"read the {other}'s replies", True, inbox))
            found.append((f"answer as the {other}'s replier", False, inbox))
    return found


def checks(run: str, another_run: str) -> list[Check]:
    """Every (role, operation) pair, with whether the component needs it."""
    found = []
    for role in BusRole:
        needs = NEEDS[role]
        for op, subscribe, subject in _operations(run, role):
            found.append(Check(role, op, subscribe, subject, op in needs))
        found.append(Check(role, "own replies", True, f"{run_inbox(run, role)}.x", True))
        for op, subscribe, subject in _operations(another_run, role):
            found.append(Check(role, f"theirs: {op}", subscribe, subject, False))
    return found


async def _verdicts(server: NatsServer, credentials: str, tried: list[Check]) -> list[Check]:
    refused: list[str] = []

    async def record(error: Exception) -> None:
        refused.append(str(error).lower())

    nc = await connect(
        server.url, credentials, error_cb=record, allow_reconnect=False, connect_timeout=5
    )
    try:
        for check in tried:
            if check.subscribe:
                await nc.subscribe(check.subject)
            else:
                # Empty bodies, on a run made for the matrix: what an allowed request
                # does there (an empty message stored, a purge) harms nothing.
                await nc.publish(check.subject, b"")
        # Violations may reach `record` after a flush returns (without waiting, 286 went
        # unseen): wait for one per check that should be refused, or a while. A check
        # refused that should not be only adds one; one allowed that should not be is
        # missing, and shows once the wait ends.
        loop = asyncio.get_running_loop()
        deadline = loop.time() + VERDICT_WAIT_S
        while len(refused) < sum(not c.expected for c in tried) and loop.time() < deadline:
            await nc.flush()
            await asyncio.sleep(0.05)
    finally:
        await nc.close()
    verdicts = []
    for check in tried:
        word = "subscription" if check.subscribe else "publish"
        # A server takes its own domain's API prefix off before it checks permissions.
        subject = check.subject.replace(f"$JS.{server.domain}.API.", "$JS.API.")
        denied = any(f'{word} to "{subject.lower()}"' in text for text in refused)
        verdicts.append(replace(check, allowed=not denied))
    return verdicts


async def nats_matrix(bed: NatsBed, run: str, another_run: str) -> list[Check]:
    """Tries every check as its role's user, minted as the hub operator mints it; a
    rollout worker connects at a region's leaf node, as its pods do."""
    region = next(iter(bed.leaves.values()), bed.hub)
    every = checks(run, another_run)
    tried = []
    for role in BusRole:
        server = region if role in (BusRole.ROLLOUT, BusRole.SERVING) else bed.hub
        mine = [c for c in every if c.role == role]
        tried += await _verdicts(server, bed.run_user(run, role), mine)
    return tried

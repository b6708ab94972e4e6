"""Who may do what on NATS: decentralized (JWT) authentication, and the users of each run.

The servers trust one operator key and know one account (`RLFLEET`), whose JWT is given
to every server in its configuration. Users are JWTs signed by the account's signing key,
so a user needs no change to any server: the hub operator mints one per component of each
run (`mint_run_user`), allowed only what that component does with the run's subjects and
streams (`role_access`), and the component's pods connect with it. A
`.creds` file holds a user's JWT and its seed; `connect` signs the server's nonce with the
seed, read again at each (re)connect so a rotated file is picked up.

Keys are nkeys: Ed25519, written in base32 with a role prefix and a CRC-16, as every NATS
tool reads them; `cryptography` does the signing.
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import json
import os
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import nats
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey
from cryptography.hazmat.primitives.serialization import Encoding, PublicFormat

from rlfleet.api.wire import (
    BusRole,
    capture_stream,
    capture_subject,
    conductor_subjects,
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
from rlfleet.bus.streams import cycle_stream, evaluation_stream, step_stream

# A pod's user credentials: the path of a .creds file (a mounted Secret's key).
CREDENTIALS_ENV = "RLFLEET_NATS_CREDS"

RUN_USER_PREFIX = "run:"  # run:<run>:<role>; its replies come to `run_inbox(run, role)`

# nkey role prefixes (the first base32 letter of a key says what it is: O, A, U, S...).
OPERATOR, ACCOUNT, USER = 14 << 3, 0, 20 << 3
_SEED = 18 << 3


def _crc16(data: bytes) -> bytes:
    return binascii.crc_hqx(data, 0).to_bytes(2, "little")  # CRC-16/XMODEM, as nkeys


def _b32(data: bytes) -> str:
    return base64.b32encode(data).decode().rstrip("=")


def _unb32(text: str) -> bytes:
    return base64.b32decode(text + "=" * (-len(text) % 8))


def _b64url(data: bytes) -> str:
    return base64.urlsafe_b64encode(data).decode().rstrip("=")


@dataclass(frozen=True)
class NKey:
    """An Ed25519 key pair of one role, known by its seed."""

    role: int
    raw_seed: bytes

    @classmethod
    def generate(cls, role: int) -> NKey:
        return cls(role, os.urandom(32))

    @classmethod
    def from_seed(cls, seed: str) -> NKey:
        raw = _unb32(seed.strip())
        body, crc = raw[:-2], raw[-2:]
        if len(body) != 34 or _crc16(body) != crc or body[0] & 0xF8 != _SEED:
            raise ValueError("not an nkey seed")
        role = ((body[0] & 0x07) << 5) | (body[1] >> 3)
        return cls(role, body[2:])

    @property
    def seed(self) -> str:
        body = bytes([_SEED | self.role >> 5, (self.role & 31) << 3]) + self.raw_seed
        return _b32(body + _crc16(body))

    @property
    def public(self) -> str:
        key = self._private().public_key().public_bytes(Encoding.Raw, PublicFormat.Raw)
        body = bytes([self.role]) + key
        return _b32(body + _crc16(body))

    def sign(self, data: bytes) -> bytes:
        return self._private().sign(data)

    def _private(self) -> Ed25519PrivateKey:
        return Ed25519PrivateKey.from_private_bytes(self.raw_seed)


def _jwt(issuer: NKey, subject: str, name: str, nats_claims: dict[str, Any]) -> str:
    header = _b64url(json.dumps({"typ": "JWT", "alg": "ed25519-nkey"}).encode())
    claims = {"iat": int(time.time()), "iss": issuer.public, "name": name, "sub": subject}
    claims["nats"] = nats_claims | {"version": 2}
    body = json.dumps(claims, sort_keys=True).encode()
    claims["jti"] = _b32(hashlib.sha256(body).digest())
    payload = _b64url(json.dumps(claims, sort_keys=True).encode())
    signature = _b64url(issuer.sign(f"{header}.{payload}".encode()))
    return f"{header}.{payload}.{signature}"


def claims_of(jwt: str) -> dict[str, Any]:
    """A JWT's claims, unverified (the server verifies; this is for reading them)."""
    payload = jwt.split(".")[1]
    return json.loads(base64.urlsafe_b64decode(payload + "=" * (-len(payload) % 4)))


def operator_jwt(operator: NKey, system_account: str) -> str:
    return _jwt(
        operator,
        operator.public,
        "rlfleet",
        {"type": "operator", "system_account": system_account},
    )


_UNLIMITED = {
    "subs": -1,
    "data": -1,
    "payload": -1,
    "imports": -1,
    "exports": -1,
    "wildcards": True,
    "conn": -1,
    "leaf": -1,
}


def account_jwt(
    operator: NKey, account: NKey, name: str, signing_key: str | None, jetstream: bool
) -> str:
    limits = dict(_UNLIMITED)
    if jetstream:
        limits |= {"mem_storage": -1, "disk_storage": -1, "streams": -1, "consumer": -1}
    claims: dict[str, Any] = {"type": "account", "limits": limits}
    if signing_key is not None:
        claims["signing_keys"] = [signing_key]
    return _jwt(operator, account.public, name, claims)


@dataclass(frozen=True)
class Permissions:
    """Subjects a user may publish to and subscribe to; None: any."""

    publish: list[str] | None = None
    subscribe: list[str] | None = None


def user_jwt(signer: NKey, account: str, user: NKey, name: str, allowed: Permissions) -> str:
    claims: dict[str, Any] = {
        "type": "user",
        "issuer_account": account,
        "subs": -1,
        "data": -1,
        "payload": -1,
    }
    if allowed.publish is not None:
        claims["pub"] = {"allow": allowed.publish}
    if allowed.subscribe is not None:
        claims["sub"] = {"allow": allowed.subscribe}
    return _jwt(signer, user.public, name, claims)


def creds(jwt: str, seed: str) -> str:
    """A .creds file's text, as `nats` and nats-server read it."""
    return (
        f"-----BEGIN NATS USER JWT-----\n{jwt}\n------END NATS USER JWT------\n\n"
        f"-----BEGIN USER NKEY SEED-----\n{seed}\n------END USER NKEY SEED------\n"
    )


def parse_creds(text: str) -> tuple[str, NKey]:
    """A .creds file's JWT and user key."""
    blocks = [part.split("\n", 1)[1] for part in text.split("-----BEGIN ")[1:]]
    if len(blocks) != 2:
        raise ValueError("a .creds file holds a user JWT and its seed")
    jwt, seed = (block.split("\n")[0].strip() for block in blocks)
    return jwt, NKey.from_seed(seed)


def mint_user(signer_seed: str, account: str, name: str, allowed: Permissions) -> str:
    """New user credentials (.creds text) of `account`, signed by its signing key."""
    user = NKey.generate(USER)
    return creds(user_jwt(NKey.from_seed(signer_seed), account, user, name, allowed), user.seed)


def account_of(credentials: str) -> str:
    """The account a user (.creds text) belongs to."""
    return claims_of(parse_creds(credentials)[0])["nats"]["issuer_account"]


def mint_run_user(signer_seed: str, account: str, run: str, role: BusRole) -> str:
    """The user (.creds text) one of a run's components connects as: allowed what that
    component does with the run's subjects and streams, nothing else."""
    name = f"{RUN_USER_PREFIX}{run}:{role}"
    return mint_user(signer_seed, account, name, role_permissions(run, role))


def run_inbox(run: str, role: BusRole) -> str:
    """The reply subjects of one of a run's users: no other user may subscribe to them, of
    this run or another, so none reads another's replies."""
    return f"_INBOX_{run}.{role}"


@dataclass(frozen=True)
class Access:
    """What one role does with a run's subjects and streams."""

    publishes: tuple[str, ...] = ()  # subjects it writes into their streams
    consumes: tuple[str, ...] = ()  # streams it takes messages from, acknowledging each
    follows: tuple[str, ...] = ()  # streams it reads in order through consumers, no acks
    reads: tuple[str, ...] = ()  # streams it looks into: info, one message, direct gets
    purges: tuple[str, ...] = ()  # streams whose old messages it removes
    listens: tuple[str, ...] = ()  # subjects it subscribes to without a consumer


def role_access(run: str, role: BusRole) -> Access:
    """The one table of who does what on a run's NATS (each component's code is the
    reference: what it publishes, binds to and consumes)."""
    steps, evaluations = step_stream(run), evaluation_stream(run)
    tasks, trajectories, weights = task_stream(run), trajectory_stream(run), weights_stream(run)
    captures, feedback, cycles = capture_stream(run), feedback_stream(run), cycle_stream(run)
    serving = serving_stream(run)
    everything = (
        *(steps, evaluations, tasks, trajectories, weights),
        *(captures, feedback, cycles, serving),
    )
    match role:
        case BusRole.TRAINER:  # learns from trajectories; reports steps; publishes weights
            return Access(
                publishes=(step_subject(run), f"{weights_prefix(run)}.>"),
                consumes=(trajectories,),
                follows=(weights,),
                # Cycles: a production run's resets, back to the serving version.
                reads=(trajectories, steps, weights, cycles),
                purges=(weights,),  # retires versions older than the kept snapshots
            )
        case BusRole.ROLLOUT:  # takes tasks; publishes trajectories; follows weights
            return Access(
                publishes=(trajectory_subject(run),),
                consumes=(tasks,),
                follows=(weights,),
                reads=(tasks, trajectories, weights),
            )
        case BusRole.FEED:  # follows step reports; publishes tasks
            return Access(publishes=(task_subject(run),), follows=(steps,), reads=(steps, tasks))
        case BusRole.EVALUATOR:  # follows weights; publishes evaluation reports
            return Access(
                publishes=(evaluation_subject(run),),
                follows=(weights,),
                reads=(evaluations, weights, cycles),  # cycles: what a gate asks it to score
            )
        case BusRole.SERVING:  # captures what it serves; records feedback; loads versions
            return Access(
                publishes=(capture_subject(run), feedback_subject(run)),
                follows=(weights,),
                # Captures: is a response id one of ours. Serving: its set's version.
                reads=(captures, weights, serving),
            )
        case BusRole.COLLECTOR:  # reads captures and feedback; publishes trajectories
            return Access(
                publishes=(trajectory_subject(run), cycle_subject(run), live_subject(run)),
                reads=(captures, feedback, cycles, trajectories),
            )
        case BusRole.CONDUCTOR:  # reads reports; publishes its state and its orders
            return Access(
                publishes=(conductor_subjects(run), serving_subject(run)),
                reads=(steps, evaluations, cycles, serving),
            )
        case BusRole.OBSERVER:  # reads everything, writes nothing, acknowledges nothing
            return Access(
                # Not the task queue: a consumer without acks cannot read a work queue.
                follows=(
                    *(steps, evaluations, trajectories, weights),
                    *(captures, feedback, cycles, serving),
                ),
                reads=everything,
                listens=(
                    step_subject(run),
                    evaluation_subject(run),
                    task_subject(run),
                    trajectory_subject(run),
                    capture_subject(run),
                    feedback_subject(run),
                    cycle_subject(run),
                    live_subject(run),
                    conductor_subjects(run),
                    serving_subject(run),
                ),
            )


# The JetStream API is reached on the local domain or through another one's prefix (the
# hub's, from a region; a region's mirror, from the hub).
_API = ("$JS.API", "$JS.*.API")
# No DELETE: nobody deletes a consumer (an ephemeral one goes when unused), so a component
# cannot take another's away.
_CONSUMER_OPS = ("CREATE", "DURABLE.CREATE", "INFO", "MSG.NEXT")


def role_permissions(run: str, role: BusRole) -> Permissions:
    """NATS permissions for `role_access`: each stream operation as its JetStream API
    subject, so a user may not create, update, delete or purge a stream it only uses."""
    access = role_access(run, role)
    publish = list(access.publishes)
    for api in _API:
        publish += [f"{api}.INFO", f"{api}.STREAM.NAMES"]
        for stream in access.reads:
            publish += [
                f"{api}.STREAM.INFO.{stream}",
                f"{api}.STREAM.MSG.GET.{stream}",
                f"{api}.DIRECT.GET.{stream}",
                f"{api}.DIRECT.GET.{stream}.>",
            ]
        for stream in dict.fromkeys(access.consumes + access.follows):
            for op in _CONSUMER_OPS:
                publish += [f"{api}.CONSUMER.{op}.{stream}", f"{api}.CONSUMER.{op}.{stream}.>"]
        publish += [f"{api}.STREAM.PURGE.{stream}" for stream in access.purges]
    for stream in access.consumes:
        publish += [f"$JS.ACK.{stream}.>", f"$JS.ACK.*.*.{stream}.>"]
    publish += [f"$JS.FC.{stream}.>" for stream in dict.fromkeys(access.consumes + access.follows)]
    inbox = f"{run_inbox(run, role)}.>"
    return Permissions(publish=publish, subscribe=[*access.listens, inbox])


def connect_options(credentials: str | Path | None = None) -> dict[str, Any]:
    """nats.connect's arguments for a user's credentials: .creds text, or the path of a
    .creds file (read at every connect); None: the file `$RLFLEET_NATS_CREDS` names, if
    set, else none (the URL may carry a user and password)."""
    if credentials is None:
        path = os.environ.get(CREDENTIALS_ENV)
        if not path:
            return {}
        credentials = Path(path)

    def read() -> tuple[str, NKey]:
        text = credentials.read_text() if isinstance(credentials, Path) else credentials
        return parse_creds(text)

    options: dict[str, Any] = {
        "user_jwt_cb": lambda: read()[0].encode(),
        "signature_cb": lambda nonce: base64.b64encode(read()[1].sign(nonce.encode())),
    }
    name = claims_of(read()[0]).get("name", "")
    if name.startswith(RUN_USER_PREFIX):
        run, _, role = name.removeprefix(RUN_USER_PREFIX).rpartition(":")
        options["inbox_prefix"] = run_inbox(run, BusRole(role))
    return options


async def connect(
    url: str, credentials: str | Path | None = None, **options: Any
) -> nats.aio.client.Client:
    """nats.connect with the user's credentials (see `connect_options`)."""
    return await nats.connect(url, **connect_options(credentials), **options)

"""Who may do what on NATS: decentralized (JWT) authentication, and the users of each run.

The servers trust one operator key and know one account (`RLFLEET`), whose JWT is given
to every server in its configuration. Users are JWTs signed by the account's signing key,
so a user needs no change to any server: the hub operator mints one per component of each
run (`mint_run_user`), allowed only what that component does with the run's subjects and
streams (`role_access`), and the component's pods connect with it. A run's user JWT
expires (`USER_TTL_S`): whoever minted it signs it again before then (`renewal_due`) and
writes the new one where the pods read it. A `.creds` file holds a user's JWT and its
seed; `connect` signs the server's nonce with the seed, read again at each (re)connect,
and reconnects by itself when the file holds a new JWT, so a renewed user is picked up
before the old one expires.

Keys are nkeys: Ed25519, written in base32 with a role prefix and a CRC-16, as every NATS
tool reads them; `cryptography` does the signing.
"""

from __future__ import annotations

import asyncio
import base64
import binascii
import hashlib
import hmac
import json
import logging
import os
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import nats
import nats.errors
import nats.js.errors
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey
from cryptography.hazmat.primitives.serialization import Encoding, PublicFormat
from nats.aio.client import Client

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
from rlfleet.bus.reading import messages
from rlfleet.bus.streams import (
    REVOCATIONS,
    TRAINER_CONSUMER,
    WORKER_CONSUMER,
    cycle_stream,
    evaluation_stream,
    revocation_stream_config,
    revocation_subject,
    step_stream,
)

log = logging.getLogger(__name__)

# A pod's user credentials: the path of a .creds file (a mounted Secret's key).
CREDENTIALS_ENV = "RLFLEET_NATS_CREDS"

# How long a run's user JWT is valid: a leaked one stops working after this at the latest.
USER_TTL_S = 24 * 3600.0
# A user is signed again once this share of its life is left: room for the new one to reach
# the pods (a Secret's mounted file follows it within about a minute) and for an owner
# that was down a while.
RENEW_WHEN_LEFT = 1 / 3
# A client looks at its .creds file for a renewed JWT this often, or 20 times in its
# JWT's life if that is shorter.
RENEWAL_POLL_S = 10.0

RUN_USER_PREFIX = "run:"  # run:<run>:<role>; its replies come to `run_inbox(run, role)`
RUN_INBOXES = "_RUN_INBOX"  # the first token of every run user's reply subjects

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


def _jwt(
    issuer: NKey,
    subject: str,
    name: str,
    nats_claims: dict[str, Any],
    expires: int | None = None,
) -> str:
    header = _b64url(json.dumps({"typ": "JWT", "alg": "ed25519-nkey"}).encode())
    claims: dict[str, Any] = {
        "iat": int(time.time()),
        "iss": issuer.public,
        "name": name,
        "sub": subject,
    }
    if expires is not None:
        claims["exp"] = expires
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
    operator: NKey,
    account: str,
    name: str,
    signing_key: str | None,
    jetstream: bool,
    revocations: dict[str, int] | None = None,
) -> str:
    """An account's JWT; `revocations`: user public key -> Unix time before which none of
    that user's JWTs is taken (nor a connection kept)."""
    limits = dict(_UNLIMITED)
    if jetstream:
        limits |= {"mem_storage": -1, "disk_storage": -1, "streams": -1, "consumer": -1}
    claims: dict[str, Any] = {"type": "account", "limits": limits}
    if signing_key is not None:
        claims["signing_keys"] = [signing_key]
    if revocations:
        claims["revocations"] = dict(sorted(revocations.items()))
    return _jwt(operator, account, name, claims)


RUNS_ACCOUNT = "RLFLEET"


def runs_account_jwt(
    operator: NKey, account: str, signer: str, revocations: dict[str, int] | None = None
) -> str:
    """The one account every run's users belong to, as every server knows it: users are
    signed by its signing key `signer`; `revocations` name deleted runs' users."""
    return account_jwt(operator, account, RUNS_ACCOUNT, signer, True, revocations)


@dataclass(frozen=True)
class Permissions:
    """Subjects a user may publish to and subscribe to; None: any."""

    publish: list[str] | None = None
    subscribe: list[str] | None = None


# How a user may connect: as a client, or as a leaf node logging in to the hub.
CLIENT, LEAF = "STANDARD", "LEAFNODE"


def user_jwt(
    signer: NKey,
    account: str,
    user: NKey,
    name: str,
    allowed: Permissions,
    expires: int | None = None,
    connections: tuple[str, ...] = (),
) -> str:
    """A user's JWT, signed by `signer` for `account`; `expires`: the Unix time after which
    no server takes it; `connections`: the kinds of connection it may make (empty: any)."""
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
    if connections:
        claims["allowed_connection_types"] = list(connections)
    return _jwt(signer, user.public, name, claims, expires)


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


def mint_user(
    signer_seed: str,
    account: str,
    name: str,
    allowed: Permissions,
    *,
    ttl_s: float | None = None,
    user: NKey | None = None,
    connections: tuple[str, ...] = (),
) -> str:
    """User credentials (.creds text) of `account`, signed by its signing key: a new user
    unless `user` is given; valid for `ttl_s` (None: until revoked)."""
    user = user if user is not None else NKey.generate(USER)
    expires = None if ttl_s is None else int(time.time() + ttl_s)
    signer = NKey.from_seed(signer_seed)
    jwt = user_jwt(signer, account, user, name, allowed, expires, connections)
    return creds(jwt, user.seed)


def account_of(credentials: str) -> str:
    """The account a user (.creds text) belongs to."""
    return claims_of(parse_creds(credentials)[0])["nats"]["issuer_account"]


def run_user_key(signer_seed: str, incarnation: str, role: BusRole) -> NKey:
    """The key of one of a run's users: the same through the run's life, so that signing
    it again (a renewal, an owner restarted) needs no record of it, and so that the keys
    of a deleted run can be named to revoke them; another for a run made again under the
    same name (another `incarnation`: its Kubernetes uid)."""
    secret = NKey.from_seed(signer_seed).raw_seed
    raw = hmac.new(secret, f"rlfleet-user/{incarnation}/{role}".encode(), "sha256").digest()
    return NKey(USER, raw)


def run_user_keys(signer_seed: str, incarnation: str) -> list[str]:
    """The public keys of every user of one incarnation of a run."""
    return [run_user_key(signer_seed, incarnation, role).public for role in BusRole]


def mint_run_user(
    signer_seed: str,
    account: str,
    run: str,
    role: BusRole,
    incarnation: str,
    ttl_s: float = USER_TTL_S,
) -> str:
    """The user (.creds text) one of a run's components connects as: allowed what that
    component does with the run's subjects and streams, nothing else, as a client (never
    as a leaf node), for `ttl_s`."""
    return mint_user(
        signer_seed,
        account,
        f"{RUN_USER_PREFIX}{run}:{role}",
        role_permissions(run, role),
        ttl_s=ttl_s,
        user=run_user_key(signer_seed, incarnation, role),
        connections=(CLIENT,),
    )


def expires_at(credentials: str) -> int | None:
    """When a user's JWT (.creds text) expires, as Unix time; None: never."""
    return claims_of(parse_creds(credentials)[0]).get("exp")


def renewal_due(credentials: str, now: float, ttl_s: float) -> bool:
    """Whether a user (.creds text) minted for `ttl_s` is to be signed again: less than
    `RENEW_WHEN_LEFT` of its life is left (or it has none)."""
    expires = expires_at(credentials)
    return expires is not None and expires - now < ttl_s * RENEW_WHEN_LEFT


def run_inbox(run: str, role: BusRole) -> str:
    """The reply subjects of one of a run's users: no other user may subscribe to them, of
    this run or another, so none reads another's replies."""
    return f"{RUN_INBOXES}.{run}.{role}"


@dataclass(frozen=True)
class Access:
    """What one role does with a run's subjects and streams. No role makes, changes or
    deletes a consumer, nor lists streams: it reads through direct gets, and takes
    messages from the durable consumer made for it with the run's streams."""

    publishes: tuple[str, ...] = ()  # subjects it writes into their streams
    # (stream, durable consumer) it takes messages from, acknowledging each
    consumes: tuple[tuple[str, str], ...] = ()
    reads: tuple[str, ...] = ()  # streams it looks into: info, one message, direct gets
    # (stream, durable consumer) whose state it reads (acknowledged through, pending),
    # taking nothing from it
    watches: tuple[tuple[str, str], ...] = ()
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
    # A new version's manifest wakes a receiver, which reads it from its stream.
    manifests = f"{weights_prefix(run)}.*.manifest.*"
    match role:
        case BusRole.TRAINER:  # learns from trajectories; reports steps; publishes weights
            return Access(
                publishes=(step_subject(run), f"{weights_prefix(run)}.>"),
                consumes=((trajectories, TRAINER_CONSUMER),),
                # Cycles: a production run's resets, back to the serving version.
                reads=(trajectories, steps, weights, cycles),
                purges=(weights,),  # retires versions older than the kept snapshots
            )
        case BusRole.ROLLOUT:  # takes tasks; publishes trajectories; follows weights
            return Access(
                publishes=(trajectory_subject(run),),
                consumes=((tasks, WORKER_CONSUMER),),
                reads=(tasks, trajectories, weights),
                listens=(manifests,),
            )
        case BusRole.FEED:  # follows step reports; publishes tasks
            return Access(
                publishes=(task_subject(run),),
                reads=(steps, tasks),
                listens=(step_subject(run),),  # a new report wakes it
            )
        case BusRole.EVALUATOR:  # follows weights; publishes evaluation reports
            return Access(
                publishes=(evaluation_subject(run),),
                reads=(evaluations, weights, cycles),  # cycles: what a gate asks it to score
                listens=(manifests,),
            )
        case BusRole.SERVING:  # captures what it serves; records feedback; loads versions
            return Access(
                publishes=(capture_subject(run), feedback_subject(run)),
                # Captures: is a response id one of ours. Serving: its set's version.
                reads=(captures, weights, serving),
                listens=(manifests,),
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
                reads=everything,
                # How far the trainer has acknowledged: an audit's "nothing lost".
                watches=((trajectories, TRAINER_CONSUMER),),
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


def role_permissions(run: str, role: BusRole) -> Permissions:
    """NATS permissions for `role_access`: each stream operation as its JetStream API
    subject, so a user may not create, update, delete or purge a stream it only uses,
    list streams, make a consumer, or take from (or acknowledge for) a consumer not its
    own."""
    access = role_access(run, role)
    publish = list(access.publishes)
    for api in _API:
        for stream in access.reads:
            publish += [
                f"{api}.STREAM.INFO.{stream}",
                f"{api}.STREAM.MSG.GET.{stream}",
                f"{api}.DIRECT.GET.{stream}",
                f"{api}.DIRECT.GET.{stream}.>",
            ]
        for stream, consumer in (*access.consumes, *access.watches):
            publish.append(f"{api}.CONSUMER.INFO.{stream}.{consumer}")
        for stream, consumer in access.consumes:
            publish.append(f"{api}.CONSUMER.MSG.NEXT.{stream}.{consumer}")
        publish += [f"{api}.STREAM.PURGE.{stream}" for stream in access.purges]
    for stream, consumer in access.consumes:
        publish += [f"$JS.ACK.{stream}.{consumer}.>", f"$JS.ACK.*.*.{stream}.{consumer}.>"]
    inbox = f"{run_inbox(run, role)}.>"
    return Permissions(publish=publish, subscribe=[*access.listens, inbox])


def leaf_permissions(hub_domain: str, region: str) -> Permissions:
    """What a region's leaf node may carry to and from the hub, as the user it logs in
    with there (every client at the leaf is bound by its own user besides): the region's
    work (trajectories, captures and feedback published into the hub's streams; tasks
    pulled from, and acknowledged to, the workers' consumer; streams read), its weights'
    mirror (the ephemeral consumer it makes on the hub, and what that delivers), and the
    hub's requests to the region's JetStream and their answers. Not a stream made,
    changed, purged or deleted at the hub, nor a durable consumer made, deleted or pulled
    from there but the workers', nor a step, weight, task or order published there: a
    region's credentials cannot steer training."""
    hub, mine = f"$JS.{hub_domain}.API", f"$JS.{region}.API"
    api = [
        f"{hub}.STREAM.INFO.*",
        f"{hub}.STREAM.MSG.GET.*",
        f"{hub}.DIRECT.GET.>",
        f"{hub}.CONSUMER.INFO.*.{WORKER_CONSUMER}",
        f"{hub}.CONSUMER.MSG.NEXT.*.{WORKER_CONSUMER}",
        # The weights' mirror's: an ephemeral consumer, which this subject cannot name, so
        # cannot be a durable one (the server refuses a durable name here).
        f"{hub}.CONSUMER.CREATE.*",
    ]
    work = [trajectory_subject("*"), capture_subject("*"), feedback_subject("*")]
    acks = [f"$JS.ACK.*.{WORKER_CONSUMER}.>", f"$JS.ACK.*.*.*.{WORKER_CONSUMER}.>"]
    # The region's JetStream answers the hub's operator (its own user's `_INBOX`) and the
    # trainer (its run user's inbox), which keep the region's weights mirror.
    replies = ["_INBOX.>", f"{RUN_INBOXES}.*.{BusRole.TRAINER}.>"]
    return Permissions(
        publish=[*api, *work, *acks, "$JS.FC.>", *replies],  # FC: the mirror's consumer's
        subscribe=[
            f"{mine}.>",  # the hub's operator and trainer keep the region's mirror
            f"{weights_prefix('*')}.*.manifest.*",  # a new version wakes its receivers
            "$JSC.R.>",  # the hub's answer when the mirror makes its consumer
            "$JS.M.>",  # what the mirror's consumer delivers
            "$JS.FC.>",
            "_INBOX.>",
            # Answers to the region's components, its rollout workers and pool servers.
            *(f"{RUN_INBOXES}.*.{role}.>" for role in (BusRole.ROLLOUT, BusRole.SERVING)),
        ],
    )


@dataclass(frozen=True)
class AccountOwner:
    """What signs the runs' account again and sends it to every server: the NATS
    operator's key (or one of its signing keys), and a user of the system account; and
    the account's key and signing key (which signs the runs' users)."""

    operator_seed: str
    system_credentials: str
    account: str
    signer_seed: str


async def push_account(system: Client, jwt: str, servers: int, wait_s: float) -> list[str]:
    """Sends an account's JWT to every server that hears the system account (leaf nodes
    through their system account link), each of which takes it at once; returns the
    names of those that said so, waiting up to `wait_s` for `servers` of them.
    ValueError when one refuses it."""
    account = claims_of(jwt)["sub"]
    inbox = system.new_inbox()
    answers = await system.subscribe(inbox, max_msgs=servers)
    await system.publish(f"$SYS.REQ.ACCOUNT.{account}.CLAIMS.UPDATE", jwt.encode(), reply=inbox)
    took: list[str] = []
    deadline = time.monotonic() + wait_s
    try:
        while len(took) < servers and (left := deadline - time.monotonic()) > 0:
            try:
                answer = json.loads((await answers.next_msg(timeout=left)).data)
            except nats.errors.TimeoutError:
                break
            server = answer.get("server", {}).get("name", "?")
            if "error" in answer:
                raise ValueError(f"NATS server {server} refused account {account}: {answer}")
            took.append(server)
    finally:
        await answers.unsubscribe()
    return took


async def revoke_run_users(
    admin: Client,
    url: str,
    hub_domain: str | None,
    owner: AccountOwner,
    incarnation: str,
    ttl_s: float,
    servers: int,
    wait_s: float,
) -> list[str]:
    """Revokes every user of one incarnation of a run (deleted): records their keys in the
    hub's `REVOCATIONS` stream, signs the runs' account again with every revocation
    recorded there, and sends it to the servers (`push_account`), which refuse those
    users' JWTs and close their connections. Each revocation also covers JWTs signed for
    `ttl_s` after it (an owner that renewed them late), and is kept as long. Returns
    the servers that took the account."""
    js = admin.jetstream(domain=hub_domain)
    config = revocation_stream_config(ttl_s)
    try:
        await js.add_stream(config)
    except nats.js.errors.BadRequestError:
        await js.update_stream(config)
    until = int(time.time() + ttl_s)
    record = {"until": until, "keys": run_user_keys(owner.signer_seed, incarnation)}
    await js.publish(revocation_subject(incarnation), json.dumps(record).encode())
    revocations: dict[str, int] = {}
    async for message in messages(js, REVOCATIONS, revocation_subject()):
        found = json.loads(message.data)
        revocations |= dict.fromkeys(found["keys"], found["until"])
    signer = NKey.from_seed(owner.signer_seed).public
    operator = NKey.from_seed(owner.operator_seed)
    jwt = runs_account_jwt(operator, owner.account, signer, revocations)
    system = await connect(url, owner.system_credentials)
    try:
        return await push_account(system, jwt, servers, wait_s)
    finally:
        await system.close()


@dataclass
class _Login:
    """A client's credentials, and the JWT it last connected with."""

    credentials: str | Path
    sent: str = field(default="")

    def read(self) -> tuple[str, NKey]:
        text = self.credentials
        return parse_creds(text.read_text() if isinstance(text, Path) else text)

    def jwt(self) -> bytes:
        self.sent = self.read()[0]
        return self.sent.encode()

    def sign(self, nonce: str) -> bytes:
        return base64.b64encode(self.read()[1].sign(nonce.encode()))


def _credentials(credentials: str | Path | None) -> str | Path | None:
    if credentials is not None:
        return credentials
    path = os.environ.get(CREDENTIALS_ENV)
    return Path(path) if path else None


def _options(login: _Login) -> dict[str, Any]:
    options: dict[str, Any] = {"user_jwt_cb": login.jwt, "signature_cb": login.sign}
    name = claims_of(login.read()[0]).get("name", "")
    if name.startswith(RUN_USER_PREFIX):
        run, _, role = name.removeprefix(RUN_USER_PREFIX).rpartition(":")
        options["inbox_prefix"] = run_inbox(run, BusRole(role))
    return options


def connect_options(credentials: str | Path | None = None) -> dict[str, Any]:
    """nats.connect's arguments for a user's credentials: .creds text, or the path of a
    .creds file (read at every connect); None: the file `$RLFLEET_NATS_CREDS` names, if
    set, else none (the URL may carry a user and password)."""
    found = _credentials(credentials)
    return {} if found is None else _options(_Login(found))


def _poll_s(jwt: str) -> float:
    claims = claims_of(jwt)
    if "exp" not in claims:
        return RENEWAL_POLL_S
    return min(RENEWAL_POLL_S, max(0.05, (claims["exp"] - claims["iat"]) / 20))


async def _follow_renewals(nc: nats.aio.client.Client, login: _Login, path: Path) -> None:
    """Reconnects `nc` once its .creds file holds another JWT than the one it connected
    with (its owner renewed it), so the connection never outlives its JWT: a server closes
    a connection whose JWT expires, and nats-py does not come back from that."""
    while not nc.is_closed:
        await asyncio.sleep(_poll_s(login.sent))
        try:
            jwt = parse_creds(await asyncio.to_thread(path.read_text))[0]
        except (OSError, ValueError):  # being replaced: read it next time
            continue
        if nc.is_connected and login.sent and jwt != login.sent:
            log.info("NATS user renewed: reconnecting with it")
            login.sent = jwt
            await nc.force_reconnect()


async def connect(
    url: str, credentials: str | Path | None = None, **options: Any
) -> nats.aio.client.Client:
    """nats.connect with the user's credentials (see `connect_options`); a client whose
    credentials are a file reconnects by itself when the file is renewed."""
    found = _credentials(credentials)
    if found is None:
        return await nats.connect(url, **options)
    login = _Login(found)
    if not isinstance(found, Path):
        return await nats.connect(url, **_options(login), **options)
    following: list[asyncio.Task] = []
    closed = options.pop("closed_cb", None)

    async def on_closed() -> None:
        for task in following:
            task.cancel()
        if closed is not None:
            await closed()

    nc = await nats.connect(url, **_options(login), closed_cb=on_closed, **options)
    following.append(asyncio.create_task(_follow_renewals(nc, login, found)))
    return nc

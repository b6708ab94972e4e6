"""Talking to NATS as a user: connecting with a `.creds` file, following its renewals, and
sending the servers the runs' account signed again with deleted runs' users revoked.

`connect` signs the server's nonce with the user's seed, read again at each (re)connect,
and reconnects by itself when the file holds a new JWT, so a renewed user
(`rlfleet.bus.permissions.renewal_due`) is picked up before the old one expires.
"""

from __future__ import annotations

import asyncio
import base64
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
from nats.aio.client import Client

from rlfleet.api.wire import BusRole
from rlfleet.bus.credentials import NKey, claims_of, parse_creds, runs_account_jwt
from rlfleet.bus.permissions import RUN_USER_PREFIX, run_inbox, run_user_keys
from rlfleet.bus.reading import messages
from rlfleet.bus.streams import REVOCATIONS, revocation_stream_config, revocation_subject

log = logging.getLogger(__name__)

# A pod's user credentials: the path of a .creds file (a mounted Secret's key).
CREDENTIALS_ENV = "RLFLEET_NATS_CREDS"

# A client looks at its .creds file for a renewed JWT this often, or 20 times in its
# JWT's life if that is shorter.
RENEWAL_POLL_S = 10.0


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

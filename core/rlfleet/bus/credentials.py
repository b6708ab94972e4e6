"""NATS credentials, made and read: nkeys, the JWTs of operators, accounts and users, and
`.creds` files.

The servers trust one operator key and know one account (`RLFLEET`), whose JWT is given
to every server in its configuration. Users are JWTs signed by the account's signing key,
so a user needs no change to any server. A `.creds` file holds a user's JWT and its seed.
Who each user is and what it may do is `rlfleet.bus.permissions`; connecting with one,
`rlfleet.bus.connection`.

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
from typing import Any

from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey
from cryptography.hazmat.primitives.serialization import Encoding, PublicFormat

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


def expires_at(credentials: str) -> int | None:
    """When a user's JWT (.creds text) expires, as Unix time; None: never."""
    return claims_of(parse_creds(credentials)[0]).get("exp")

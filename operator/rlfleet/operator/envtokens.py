"""Each run's bearer token for its EnvPool, minted by the region operator.

A token is an HMAC of the run's namespace, pool, name and uid (its mirror's, in this
region) under one key, the region's,
kept in a Secret in the operator's own namespace (made on first use). So the operator
writes the tokens it mints (the run's Secret for its rollout pods, the pool's for its
servers) without reading any Secret but that one, and a restart mints the same tokens.
To rotate them all, delete the key Secret and restart the operator.
"""

from __future__ import annotations

import base64
import hashlib
import hmac
import secrets
import threading

from rlfleet.operator.kube import Kube, Ref

KEY_FIELD = "key"


class TokenMint:
    def __init__(self, kube: Kube, namespace: str, secret: str) -> None:
        self.kube, self.ref = kube, Ref("v1", "Secret", secret, namespace)
        self._key: bytes | None = None
        self._lock = threading.Lock()

    def key(self) -> bytes:
        with self._lock:
            if self._key is None:
                self.kube.create(
                    {
                        "apiVersion": "v1",
                        "kind": "Secret",
                        "metadata": {"name": self.ref.name, "namespace": self.ref.namespace},
                        "type": "Opaque",
                        "stringData": {KEY_FIELD: secrets.token_urlsafe(32)},
                    }
                )  # unless one is there: then that one
                found = self.kube.get(self.ref)
                if found is None or KEY_FIELD not in found.get("data", {}):
                    raise RuntimeError(
                        f"Secret {self.ref.namespace}/{self.ref.name} has no {KEY_FIELD}"
                    )
                self._key = base64.b64decode(found["data"][KEY_FIELD])
            return self._key

    def token(self, namespace: str, envpool: str, run: str, uid: str) -> str:
        """The run's token: bound to its uid too, so a run made again under the same name
        gets another (a leaked token dies with its run)."""
        message = f"{namespace}/{envpool}/{run}/{uid}".encode()
        digest = hmac.new(self.key(), message, hashlib.sha256).digest()
        return base64.urlsafe_b64encode(digest).decode().rstrip("=")

"""Bearer-token authentication: which run a request comes from.

`tokens_file` maps each run to the token the operator minted for it (a Secret's file). It
is read again whenever it changes, so a run minted after the server started is let in
without a restart, and a bad rewrite keeps the tokens that worked."""

import hmac
import json
import logging
from pathlib import Path

from rlfleet.rollout.envpool.protocol import HttpError

log = logging.getLogger("envsessions")


class Tokens:
    """The runs' tokens, as `tokens_file` last held them; unreadable at start, it raises."""

    def __init__(self, path: Path):
        self.path = path
        self._seen: tuple | None = None
        self._tokens: dict[str, bytes] = {}
        self._load(strict=True)

    def _load(self, strict: bool = False) -> None:
        try:
            info = self.path.stat()
            seen = (info.st_ino, info.st_mtime_ns, info.st_size)
            if seen == self._seen:
                return
            tokens = json.loads(self.path.read_text())
            if not isinstance(tokens, dict) or not all(
                isinstance(run, str) and isinstance(token, str) and len(token) >= 16
                for run, token in tokens.items()
            ):
                raise ValueError("not a JSON object of run names to tokens of 16+ characters")
        except (OSError, ValueError) as error:
            if strict:
                raise
            log.warning("kept the previous tokens: %s: %s", self.path, error)
            return
        self._tokens = {run: token.encode() for run, token in tokens.items()}
        self._seen = seen

    def authenticate(self, headers: dict[str, str]) -> str:
        """The run whose token the request's `Authorization: Bearer` carries, else 401."""
        scheme, _, token = headers.get("authorization", "").partition(" ")
        if scheme.lower() != "bearer" or not token:
            raise HttpError(
                401, "a bearer token is required", "authentication_error", "Authorization"
            )
        self._load()
        given = token.strip().encode(errors="replace")
        # Every token is compared, each in constant time: which run matched does not show.
        found = [run for run, known in self._tokens.items() if hmac.compare_digest(given, known)]
        if not found:
            raise HttpError(401, "the token is not valid", "authentication_error", "Authorization")
        return found[0]

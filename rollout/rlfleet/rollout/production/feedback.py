"""`POST /v1/feedback`: a client's event about a response it was served, made durable.

Feedback is bound to its response and to its user. The pool's server gives each
completion it may capture a feedback token (`TOKEN_HEADER`: an HMAC-SHA256 of the response
id and the user the pool's gateway named, under the pool's key); an event must carry the
token of its response, posted as the same user, or it is refused. So only the user a
completion was served to speaks of it, whatever response ids they learn, and a user is
who the gateway authenticated, never what a request body says.

Each answer says what happened: 200 once the event is stored in the run's feedback
stream (or was already: the stream keeps one message per response and event id, so a
client's retry is recorded once however late it comes), 400 naming what is wrong with
the body (`value` on a kind that takes none, among others), 401 without the pool's API
key or without a token, 403 with a token not of this response and user, 404 for a
response this pool did not capture (200 `not_captured` for one this server served
without capturing: it spanned a version switch, or its capture was dropped), 409 once
the response has had `max_events_per_response` events, 413 for a body over
`MAX_BODY_BYTES`, 503 while the stream cannot be reached (nothing is stored; retry).
Feedback after the pool's window is stored too, marked and counted as late. Errors are
shaped as OpenAI's (`{"error": {"message", "type", "param", "code"}}`), `param` naming
the field at fault.

The cap on events is kept by each server for the responses it remembers, so a client
that spreads one response's events over several servers may store a few times the cap;
the collector reads no more than the cap of any one response.
"""

from __future__ import annotations

import base64
import hashlib
import hmac
import re
import time
from collections import OrderedDict
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Annotated

import msgspec
import nats.errors
from nats.js.errors import APIError, NotFoundError
from prometheus_client import Counter

from rlfleet.api.inferencepool import FEEDBACK_KEY_FILE, USER_HEADER_FILE
from rlfleet.api.wire import (
    Feedback,
    FeedbackKind,
    SubjectToken,
    capture_stream,
    capture_subject,
    decode_captured,
    encode,
    feedback_subject,
    takes_value,
)
from rlfleet.launch.production import ServingConfig
from rlfleet.rollout.production.capture import Bus

answered = Counter(
    "rlfleet_serving_feedback_total",
    "Feedback requests, by answer",
    ["outcome"],  # recorded, late, duplicate, not_captured, unauthorized, forbidden,
    # malformed, unknown_kind, unknown_response, too_many_events, unavailable
)

# JetStream's answer to a second message on a subject that keeps one and refuses more.
_SUBJECT_FULL = 10077

# On a completion's answer: the token its user's feedback on it must carry.
TOKEN_HEADER = b"x-rlfleet-feedback-token"
# A gateway's user name longer than this is refused: it is a name, not a document.
MAX_USER_BYTES = 256
# A feedback body longer than this is refused unread (an edit's text is most of it).
MAX_BODY_BYTES = 48 << 10
_TOKEN_CONTEXT = b"rlfleet-feedback-token/v1"


@dataclass(frozen=True)
class PoolFeedback:
    """The pool's key and the header its gateway names users in (lower case), as its
    Secret holds them (`rlfleet.api.inferencepool.feedback_secret`)."""

    key: bytes
    user_header: bytes

    @classmethod
    def from_dir(cls, folder: Path) -> PoolFeedback:
        """ValueError (or OSError) unless `folder` holds both, the key not empty."""
        key = (folder / FEEDBACK_KEY_FILE).read_bytes().strip()
        header = (folder / USER_HEADER_FILE).read_text().strip().lower()
        if not key:
            raise ValueError(f"the feedback key in {folder} is empty")
        if not re.fullmatch(r"[a-z0-9][a-z0-9-]*", header):
            raise ValueError(f"{folder / USER_HEADER_FILE} names no header: {header!r}")
        return cls(key, header.encode())

    def token(self, response_id: str, user: str) -> str:
        """The feedback token of a response served to `user`. A response id is one subject
        token (no NUL), so the message names one pair only."""
        message = b"\0".join((_TOKEN_CONTEXT, response_id.encode(), user.encode()))
        digest = hmac.new(self.key, message, hashlib.sha256).digest()
        return base64.urlsafe_b64encode(digest).decode().rstrip("=")

    def user(self, headers: dict[bytes, bytes]) -> str | None:
        """Who the gateway says sent a request ("" when it says no one); None when what it
        says is no user name (too long, not UTF-8)."""
        given = headers.get(self.user_header, b"")
        if len(given) > MAX_USER_BYTES:
            return None
        try:
            return given.decode()
        except UnicodeDecodeError:
            return None


class FeedbackRequest(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    response_id: SubjectToken
    event_id: SubjectToken  # the client's own id of the event: a retry sends the same
    kind: str
    value: float | None = None
    text: str | None = None
    token: Annotated[str, msgspec.Meta(max_length=128)] | None = None  # `TOKEN_HEADER`'s


class _Unreachable(Exception):
    pass


_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    409: "invalid_request_error",
    413: "invalid_request_error",
    503: "service_unavailable_error",
}


@dataclass(frozen=True)
class Answer:
    status: int
    body: dict

    @classmethod
    def refuse(cls, status: int, outcome: str, message: str, param: str | None = None) -> Answer:
        answered.labels(outcome).inc()
        error = {"message": message, "type": _TYPES[status], "param": param, "code": status}
        return cls(status, {"error": error})


def _param(error: msgspec.ValidationError) -> str | None:
    """The field a body's validation error names, as msgspec words it."""
    found = re.search(r"at `\$\.(\w+)", str(error)) or re.search(r"field `(\w+)`", str(error))
    return found.group(1) if found else None


@dataclass(frozen=True)
class Served:
    user: str
    served_at: float
    # False: served here but not captured (it spanned a version switch, or its capture was
    # dropped), so there is nothing to learn from feedback on it; the client is told so,
    # not that it is unknown, and nothing is stored that no capture would ever match.
    captured: bool = True
    # The events this server took on it, by a hash of their ids: a retry of one of them
    # is still answered past the cap (`duplicate`), a new one is not.
    events: tuple[int, ...] = ()


class Remembered:
    """The response ids this server captured or was asked about lately, so feedback on them
    needs no lookup, with the events it took on each."""

    def __init__(self, size: int) -> None:
        self.size = size
        self._served: OrderedDict[str, Served] = OrderedDict()

    def add(self, response_id: str, served: Served) -> None:
        known = self._served.get(response_id)
        self._served[response_id] = replace(served, events=known.events if known else ())
        while len(self._served) > self.size:
            self._served.popitem(last=False)

    def get(self, response_id: str) -> Served | None:
        return self._served.get(response_id)

    def not_captured(self, response_id: str) -> None:
        """Its capture was dropped after all (too large, refused by the stream)."""
        if (served := self._served.get(response_id)) is not None:
            self._served[response_id] = replace(served, captured=False)

    def took(self, response_id: str, event: int, taken: bool = True) -> None:
        """Counts `event` on the response (or, not `taken`, counts it no more)."""
        if (served := self._served.get(response_id)) is not None:
            others = tuple(e for e in served.events if e != event)
            events = (*others, event) if taken else others
            self._served[response_id] = replace(served, events=events)


class FeedbackDesk:
    def __init__(
        self, config: ServingConfig, bus: Bus, api_keys: list[str], pool: PoolFeedback
    ) -> None:
        self.config = config
        self.bus = bus
        self.api_keys = [key.encode() for key in api_keys]
        self.pool = pool
        self.kinds = [*FeedbackKind, *config.custom_kinds]
        self.remembered = Remembered(config.remembered)

    def authorized(self, authorization: bytes) -> bool:
        if not self.api_keys:  # as vLLM: a pool without a key serves anyone
            return True
        given = authorization.removeprefix(b"Bearer ")
        return any(hmac.compare_digest(given, key) for key in self.api_keys)

    async def answer(self, body: bytes | None, headers: dict[bytes, bytes]) -> Answer:
        """The answer to one request; `body` None: it was longer than `MAX_BODY_BYTES`."""
        admitted = self._admitted(body, headers)
        if isinstance(admitted, Answer):
            return admitted
        request, user = admitted
        js = self.bus.jetstream()
        served = await self._served(js, request, user)
        if isinstance(served, Answer):
            return served
        if not served.captured:
            answered.labels("not_captured").inc()
            return Answer(200, {"status": "not_captured"})
        event, cap = hash(request.event_id), self.config.max_events_per_response
        known = event in served.events  # a retry of an event this server took
        if not known and len(served.events) >= cap:
            error = f"response {request.response_id!r} has had its {cap} feedback events"
            return Answer.refuse(409, "too_many_events", error, "response_id")
        feedback = self._feedback(request, served)
        self.remembered.took(request.response_id, event)  # before the wait: others see it
        answer = await self._store(js, feedback)
        if answer.status != 200 and not known:
            self.remembered.took(request.response_id, event, taken=False)
        return answer

    def _admitted(
        self, body: bytes | None, headers: dict[bytes, bytes]
    ) -> tuple[FeedbackRequest, str] | Answer:
        """The request and the user it is from, when its key, body, user and token are all
        good; else the refusal."""
        if not self.authorized(headers.get(b"authorization", b"")):
            return Answer.refuse(401, "unauthorized", "a valid API key is required")
        if body is None:
            error = f"feedback bodies are at most {MAX_BODY_BYTES} bytes"
            return Answer.refuse(413, "malformed", error)
        try:
            request = msgspec.json.decode(body, type=FeedbackRequest)
        except msgspec.ValidationError as error:
            return Answer.refuse(400, "malformed", f"malformed feedback: {error}", _param(error))
        except msgspec.DecodeError as error:
            return Answer.refuse(400, "malformed", f"malformed feedback: {error}")
        user = self.pool.user(headers)
        header = self.pool.user_header.decode()
        if user is None:
            error = f"header {header} names no user (UTF-8, at most {MAX_USER_BYTES} bytes)"
            return Answer.refuse(400, "malformed", error, header)
        if request.token is None:
            error = "a feedback token is required: the one the response came with"
            return Answer.refuse(401, "unauthorized", error, "token")
        expected = self.pool.token(request.response_id, user)
        if not hmac.compare_digest(request.token.encode(), expected.encode()):
            error = "the token is not that of this response served to this user"
            return Answer.refuse(403, "forbidden", error, "token")
        if refused := self._invalid(request):
            return refused
        return request, user

    async def _served(self, js, request: FeedbackRequest, user: str) -> Served | Answer:
        """What this pool served as the response the event is about, to `user`; else the
        refusal."""
        try:
            served = self.remembered.get(request.response_id) or await self._lookup(js, request)
        except _Unreachable:
            return Answer.refuse(503, "unavailable", "feedback store unreachable; retry")
        if served is None:
            error = f"response {request.response_id!r} was not captured by this pool"
            return Answer.refuse(404, "unknown_response", error, "response_id")
        if served.user != user:  # a token of the right pair, for a capture of another user
            error = "the response was served to another user"
            return Answer.refuse(403, "forbidden", error, "token")
        return served

    def _feedback(self, request: FeedbackRequest, served: Served) -> Feedback:
        """The event as the stream keeps it, received now, late past the window."""
        now = time.time()
        return Feedback(
            run=self.config.run,
            response_id=request.response_id,
            event_id=request.event_id,
            kind=request.kind,
            value=request.value,
            text=request.text,
            user=served.user,
            received_at=now,
            late=now - served.served_at > self.config.feedback_window_s,
        )

    def _invalid(self, request: FeedbackRequest) -> Answer | None:
        """Why the event cannot be stored as it is, naming its field; None: it can."""
        if request.kind not in self.kinds:
            kinds = ", ".join(self.kinds)
            error = f"kind {request.kind!r} is not one this pool takes ({kinds})"
            return Answer.refuse(400, "unknown_kind", error, "kind")
        if request.value is not None and not takes_value(request.kind):
            error = f"kind {request.kind!r} takes no value"
            return Answer.refuse(400, "malformed", error, "value")
        if request.kind == FeedbackKind.THUMBS and request.value not in (1.0, -1.0):
            error = f"thumbs take a value of 1 or -1, not {request.value}"
            return Answer.refuse(400, "malformed", error, "value")
        if request.value is not None and not -1.0 <= request.value <= 1.0:
            return Answer.refuse(400, "malformed", "a value lies in [-1, 1]", "value")
        if request.kind == FeedbackKind.EDITED and request.text is None:
            error = "an edited response's feedback needs its final text"
            return Answer.refuse(400, "malformed", error, "text")
        return None

    async def _lookup(self, js, request: FeedbackRequest) -> Served | None:
        """The capture of `request`'s response in the run's stream, None if not there;
        remembered, so that the events this server takes on it are counted."""
        if js is None:
            raise _Unreachable
        subject = capture_subject(self.config.run, request.response_id)
        try:
            message = await js.get_last_msg(capture_stream(self.config.run), subject, direct=True)
            capture = decode_captured(message.data)
        except (NotFoundError, msgspec.DecodeError):
            return None
        except (nats.errors.Error, TimeoutError) as error:
            raise _Unreachable from error
        self.remembered.add(request.response_id, Served(capture.user, capture.served_at))
        return self.remembered.get(request.response_id)

    async def _store(self, js, feedback: Feedback) -> Answer:
        if js is None:
            return Answer.refuse(503, "unavailable", "feedback store unreachable; retry")
        subject = feedback_subject(feedback.run, feedback.response_id, feedback.event_id)
        try:
            await js.publish(subject, encode(feedback), timeout=5)
        except APIError as error:
            if error.err_code != _SUBJECT_FULL:
                return Answer.refuse(503, "unavailable", f"feedback store refused: {error}")
            answered.labels("duplicate").inc()
            return Answer(200, {"status": "duplicate"})
        except (nats.errors.Error, TimeoutError):
            return Answer.refuse(503, "unavailable", "feedback store unreachable; retry")
        answered.labels("late" if feedback.late else "recorded").inc()
        return Answer(200, {"status": "recorded", "late": feedback.late})

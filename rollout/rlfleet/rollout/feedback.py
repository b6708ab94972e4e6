"""`POST /v1/feedback`: a client's event about a response it was served, made durable.

Each answer says what happened: 200 once the event is stored in the run's feedback
stream (or was already: the stream keeps one message per response and event id, so a
client's retry is recorded once however late it comes), 400 naming what is wrong with
the body, 401 without the pool's API key, 404 for a response this pool did not capture
(200 `not_captured` for one this server served without capturing: it spanned a
version switch, or its capture was dropped), 413 for a body over `MAX_BODY_BYTES`, 503
while the stream cannot be reached (nothing is stored; retry). Feedback after the pool's
window is stored too, marked and counted as late.
"""

from __future__ import annotations

import hmac
import time
from collections import OrderedDict
from dataclasses import dataclass, replace

import msgspec
import nats.errors
from nats.js.errors import APIError, NotFoundError
from prometheus_client import Counter

from rlfleet.api.wire import (
    Feedback,
    FeedbackKind,
    SubjectToken,
    capture_stream,
    capture_subject,
    decode_captured,
    encode,
    feedback_subject,
)
from rlfleet.launch.settings import ServingConfig
from rlfleet.rollout.capture import Bus

answered = Counter(
    "rlfleet_serving_feedback_total",
    "Feedback requests, by answer",
    ["outcome"],  # recorded, late, duplicate, not_captured, unauthorized, malformed,
    # unknown_kind, unknown_response, unavailable
)

# JetStream's answer to a second message on a subject that keeps one and refuses more.
_SUBJECT_FULL = 10077


# A feedback body longer than this is refused unread (an edit's text is most of it).
MAX_BODY_BYTES = 48 << 10


class FeedbackRequest(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    response_id: SubjectToken
    event_id: SubjectToken  # the client's own id of the event: a retry sends the same
    kind: str
    value: float | None = None
    text: str | None = None


class _Unreachable(Exception):
    pass


@dataclass(frozen=True)
class Answer:
    status: int
    body: dict

    @classmethod
    def refuse(cls, status: int, outcome: str, error: str) -> Answer:
        answered.labels(outcome).inc()
        return cls(status, {"error": error})


@dataclass(frozen=True)
class Served:
    user: str
    served_at: float
    # False: served here but not captured (it spanned a version switch, or its capture was
    # dropped), so there is nothing to learn from feedback on it; the client is told so,
    # not that it is unknown, and nothing is stored that no capture would ever match.
    captured: bool = True


class Remembered:
    """The response ids this server captured lately, so feedback on them needs no lookup."""

    def __init__(self, size: int) -> None:
        self.size = size
        self._served: OrderedDict[str, Served] = OrderedDict()

    def add(self, response_id: str, served: Served) -> None:
        self._served[response_id] = served
        while len(self._served) > self.size:
            self._served.popitem(last=False)

    def get(self, response_id: str) -> Served | None:
        return self._served.get(response_id)

    def not_captured(self, response_id: str) -> None:
        """Its capture was dropped after all (too large, refused by the stream)."""
        if (served := self._served.get(response_id)) is not None:
            self._served[response_id] = replace(served, captured=False)


class FeedbackDesk:
    def __init__(self, config: ServingConfig, bus: Bus, api_keys: list[str]) -> None:
        self.config = config
        self.bus = bus
        self.api_keys = [key.encode() for key in api_keys]
        self.kinds = [*FeedbackKind, *config.custom_kinds]
        self.remembered = Remembered(config.remembered)

    def authorized(self, authorization: bytes) -> bool:
        if not self.api_keys:  # as vLLM: a pool without a key serves anyone
            return True
        given = authorization.removeprefix(b"Bearer ")
        return any(hmac.compare_digest(given, key) for key in self.api_keys)

    async def answer(self, body: bytes | None, authorization: bytes) -> Answer:
        """The answer to one request; `body` None: it was longer than `MAX_BODY_BYTES`."""
        if not self.authorized(authorization):
            return Answer.refuse(401, "unauthorized", "a valid API key is required")
        if body is None:
            error = f"feedback bodies are at most {MAX_BODY_BYTES} bytes"
            return Answer.refuse(413, "malformed", error)
        try:
            request = msgspec.json.decode(body, type=FeedbackRequest)
        except msgspec.DecodeError as error:  # ValidationError names the field
            return Answer.refuse(400, "malformed", f"malformed feedback: {error}")
        if request.kind not in self.kinds:
            kinds = ", ".join(self.kinds)
            error = f"kind {request.kind!r} is not one this pool takes ({kinds})"
            return Answer.refuse(400, "unknown_kind", error)
        js = self.bus.jetstream()
        try:
            served = self.remembered.get(request.response_id) or await self._lookup(js, request)
        except _Unreachable:
            return Answer.refuse(503, "unavailable", "feedback store unreachable; retry")
        if served is None:
            error = f"response {request.response_id!r} was not captured by this pool"
            return Answer.refuse(404, "unknown_response", error)
        if not served.captured:
            answered.labels("not_captured").inc()
            return Answer(200, {"status": "not_captured"})
        now = time.time()
        try:
            feedback = Feedback(
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
        except (ValueError, msgspec.ValidationError) as error:
            return Answer.refuse(400, "malformed", f"malformed feedback: {error}")
        return await self._store(js, feedback)

    async def _lookup(self, js, request: FeedbackRequest) -> Served | None:
        """The capture of `request`'s response in the run's stream, None if not there."""
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
        return Served(capture.user, capture.served_at)

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

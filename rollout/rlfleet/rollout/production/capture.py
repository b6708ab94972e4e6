"""What a production pool's server captures of a completion it serves, and how.

A captured completion is what the trainer needs to learn from it later: the prompt's
and the completion's token ids, each sampled token's log-prob under the weights that
served it, the policy version of every token, and, for an MoE model whose run replays
routes, the experts every token it ran was routed to (recorded in vLLM's workers:
`rlfleet.rollout.engine.vllm_experts`). The server asks vLLM for the rest on the client's
behalf (`prepare`) and gives the client back only what it asked for (`give_back`), so
a client sees the same answer with capture on or off. A streamed answer is relayed
event by event as it comes, each given back so (`Streamed`), and captured once its
last token is out; its end goes to the client after that.

Serving must not wait on NATS: captures go into a bounded buffer (`Captures`) that one
task drains into the run's capture stream, reconnecting as long as it takes. A full
buffer drops the newest capture and counts it; the request it came from is served.
A response id names one capture: the stream takes a capture only on a subject that has
none (its id is the server's own anyway, `rlfleet.rollout.production.serving`), so feedback on it
rewards one completion.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from dataclasses import dataclass
from enum import StrEnum
from typing import Any

import msgspec
import nats.errors
import nats.js.errors
import numpy as np
from prometheus_client import Counter, Gauge

from rlfleet.api.wire import (
    CapturedCompletion,
    Segment,
    SubjectToken,
    capture_subject,
    encode_captured,
)
from rlfleet.bus.connection import connect
from rlfleet.launch.production import ServingConfig

log = logging.getLogger(__name__)

# A request with this header set to "off" is served and never captured.
OPT_OUT_HEADER = b"x-rlfleet-capture"
MIN_LOGPROB = -1e4  # for -inf: the wire holds log-probs finite

captured = Counter(
    "rlfleet_serving_captures_total",
    "Completions captured, by what became of them",
    # stored; duplicate (its id had one: a retry's); dropped_buffer_full; dropped_too_large;
    # dropped_refused
    ["outcome"],
)
skipped = Counter(
    "rlfleet_serving_capture_skipped_total",
    "Completions served without a capture, by why",
    ["reason"],
)
buffered = Gauge("rlfleet_serving_capture_buffered", "Captures waiting for NATS")


class Skip(StrEnum):
    OPTED_OUT = "opted_out"  # the request's header said so
    SAMPLED_OUT = "sampled_out"  # outside the pool's sample rate
    UNFINISHED = "unfinished"  # a stream that ended before its last token (the client left)
    SEVERAL = "several_choices"  # n > 1: feedback names a response, not one of its choices
    TEMPERATURE = "temperature"  # sampled at another than the trainer scores at
    VERSION_CHANGED = "version_changed"  # the weights changed while it was generated
    FAILED = "failed"  # vLLM did not answer 200
    UNREADABLE = "unreadable"  # a request or response not of the shape expected
    NO_EXPERTS = "no_experts"  # an MoE model's routed experts for it were not kept


@dataclass(frozen=True)
class Asked:
    """What the client itself asked vLLM to return, of what capture needs."""

    logprobs: bool
    token_ids: bool


def prepare(request: dict[str, Any], temperature: float) -> tuple[dict[str, Any], Asked] | Skip:
    """The chat completion request to send vLLM so that its answer can be captured, and
    what the client asked for; or why this one is not captured. Its log-probs are of the
    distribution it was sampled from, so only one sampled at `temperature` (the trainer's,
    and vLLM's default) can be scored by the trainer as it was served."""
    if request.get("n", 1) != 1:
        return Skip.SEVERAL
    asked_temperature = request.get("temperature")
    if (1.0 if asked_temperature is None else asked_temperature) != temperature:
        return Skip.TEMPERATURE
    asked = Asked(bool(request.get("logprobs")), bool(request.get("return_token_ids")))
    return {**request, "logprobs": True, "return_token_ids": True}, asked


def give_back(response: dict[str, Any], asked: Asked) -> dict[str, Any]:
    """`response` as vLLM answers a request without what capture added."""
    response = dict(response)
    choices = [dict(choice) for choice in response["choices"]]
    for choice in choices:
        if not asked.logprobs:
            choice["logprobs"] = None
        if not asked.token_ids:
            choice["token_ids"] = None
    if not asked.token_ids:
        response["prompt_token_ids"] = None
    response["choices"] = choices
    return response


_EVENT_END = b"\n\n"
_DATA = b"data: "


class Streamed:
    """A streamed answer (server-sent events of chat completion chunks) on its way to the
    client: each whole event given back as the client asked (`relay`), and what capture
    takes of the chunks gathered into the shape `extract` reads (`response`)."""

    def __init__(self, asked: Asked) -> None:
        self.asked = asked
        self.unreadable = False  # an event not of the shape expected: relayed as it was
        self.finished = False  # the last token's chunk came
        self._pending = b""  # the start of an event whose end has not come yet
        self._id: str | None = None
        self._prompt: list[int] | None = None
        self._tokens: list[int] = []
        self._logprobs: list[dict] = []
        self._text: list[str] = []
        self._finish_reason: str | None = None

    def relay(self, body: bytes, last: bool) -> bytes:
        """The events `body` completes, as the client asked; with `last`, all that is left."""
        *events, tail = (self._pending + body).split(_EVENT_END)
        self._pending = b"" if last else tail
        relayed = b"".join(self._event(event) + _EVENT_END for event in events)
        return relayed + tail if last else relayed  # a cut-off event's start, as it came

    def _event(self, event: bytes) -> bytes:
        if not event.startswith(_DATA) or event[len(_DATA) :].strip() == b"[DONE]":
            return event
        try:
            chunk = msgspec.json.decode(event[len(_DATA) :])
            self._note(chunk)
            return _DATA + msgspec.json.encode(give_back(chunk, self.asked))
        except (KeyError, TypeError, AttributeError, ValueError, msgspec.DecodeError):
            self.unreadable = True
            return event

    def _note(self, chunk: dict[str, Any]) -> None:
        self._id = self._id or chunk["id"]
        if chunk.get("prompt_token_ids") is not None:
            self._prompt = list(chunk["prompt_token_ids"])
        for choice in chunk["choices"]:  # one (n = 1); none in a usage chunk
            self._tokens += choice.get("token_ids") or []
            self._logprobs += (choice.get("logprobs") or {}).get("content") or []
            self._text.append((choice.get("delta") or {}).get("content") or "")
            if choice.get("finish_reason") is not None:
                self._finish_reason, self.finished = choice["finish_reason"], True

    def response(self) -> dict[str, Any]:
        """The chunks gathered as one whole answer."""
        choice = {
            "token_ids": self._tokens,
            "logprobs": {"content": self._logprobs},
            "message": {"content": "".join(self._text)},
            "finish_reason": self._finish_reason,
        }
        return {"id": self._id, "prompt_token_ids": self._prompt, "choices": [choice]}


def extract(
    run: str,
    response: dict[str, Any],
    user: str,
    version: int,
    served_at: float,
    experts: np.ndarray | None = None,
) -> CapturedCompletion:
    """The capture of vLLM's answer to a `prepare`d request, all of it sampled by
    `version`, with the `experts` an MoE model routed every token it ran to (uint16
    [tokens - 1, layers, k]); ValueError (or a KeyError, TypeError) if the answer is not
    of that shape."""
    (choice,) = response["choices"]
    prompt, tokens = list(response["prompt_token_ids"]), list(choice["token_ids"])
    entries = choice["logprobs"]["content"]
    logprobs = [max(float(entry["logprob"]), MIN_LOGPROB) for entry in entries]
    if len(logprobs) != len(tokens):
        raise ValueError(f"{len(logprobs)} log-probs for {len(tokens)} tokens")
    segment = Segment(
        tokens=prompt + tokens,
        prompt_len=len(prompt),
        generated=[1] * len(tokens),
        logprobs=logprobs,
        versions=[version] * len(tokens),
        **({} if experts is None else _experts(experts)),
    )
    return CapturedCompletion(
        run=run,
        # An id goes into a subject: one token, checked whoever made it.
        response_id=msgspec.convert(response["id"], SubjectToken),
        user=user,
        segment=segment,
        text=str(choice["message"]["content"] or ""),
        finish_reason=str(choice["finish_reason"]),
        served_at=served_at,
    )


def _experts(experts: np.ndarray) -> dict[str, Any]:
    _, layers, top_k = experts.shape
    return {"routed_experts": experts.astype("<u2").tobytes(), "moe_layers": layers, "top_k": top_k}


def tokens_run(response: dict[str, Any]) -> int:
    """How many tokens of a whole answer went through the model (all but the last)."""
    (choice,) = response["choices"]
    return len(response["prompt_token_ids"]) + len(choice["token_ids"]) - 1


class Bus:
    """The server's one connection to NATS, made in the background and kept: until it is
    up, `jetstream()` is None and nothing that serves a request waits for it."""

    def __init__(self, config: ServingConfig) -> None:
        self.config = config
        self.nc = None

    async def keep_connected(self) -> None:
        while self.nc is None:
            try:
                self.nc = await connect(
                    self.config.nats_url,
                    connect_timeout=2,
                    allow_reconnect=True,
                    max_reconnect_attempts=-1,
                    reconnect_time_wait=0.5,
                )
            except (nats.errors.Error, OSError, TimeoutError) as error:
                log.warning("NATS at %s: %s; trying again", self.config.nats_url, error)
                await asyncio.sleep(1.0)

    def jetstream(self):
        if self.nc is None or not self.nc.is_connected:
            return None
        return self.nc.jetstream(domain=self.config.jetstream_domain)


# Stored only on a subject without a message; else JetStream answers `_SUBJECT_TAKEN`.
_ONCE = {"Nats-Expected-Last-Subject-Sequence": "0"}
_SUBJECT_TAKEN = 10071
_TOO_LARGE = 10054  # JetStream's answer to a message over the stream's max_msg_size


class Captures:
    """A bounded buffer of captures and the task that stores them in the run's stream."""

    def __init__(
        self, bus: Bus, size: int, on_dropped: Callable[[str], None] = lambda response_id: None
    ) -> None:
        self.bus = bus
        self.queue: asyncio.Queue[CapturedCompletion] = asyncio.Queue(size)
        self.on_dropped = on_dropped  # told the response id of a capture never stored

    def offer(self, capture: CapturedCompletion) -> bool:
        """Whether the buffer took it: a full one drops it, counted."""
        try:
            self.queue.put_nowait(capture)
        except asyncio.QueueFull:
            captured.labels("dropped_buffer_full").inc()
            return False
        finally:
            buffered.set(self.queue.qsize())
        return True

    async def store_forever(self) -> None:
        while True:
            capture = await self.queue.get()
            data = encode_captured(capture)
            subject = capture_subject(capture.run, capture.response_id)
            while (outcome := await self._store(subject, data)) is None:
                log.debug("capture of %s waits for NATS", capture.response_id)
                await asyncio.sleep(0.5)
            captured.labels(outcome).inc()
            buffered.set(self.queue.qsize())
            if outcome not in ("stored", "duplicate"):
                self.on_dropped(capture.response_id)

    async def _store(self, subject: str, data: bytes) -> str | None:
        """What became of one capture; None: NATS is away, try again."""
        js = self.bus.jetstream()
        if js is None:
            return None
        try:
            # A retry after a lost ack finds its subject taken (JetStream checks that before
            # the id): its capture is there, a duplicate, not a drop.
            await js.publish(subject, data, timeout=5, headers=_ONCE)
        except nats.errors.MaxPayloadError:
            return "dropped_too_large"  # no retry makes it fit
        except nats.js.errors.APIError as error:  # the stream said no: it would again
            if error.err_code == _SUBJECT_TAKEN:
                return "duplicate"
            if error.err_code == _TOO_LARGE:  # the server's payload is larger than the stream's
                return "dropped_too_large"
            log.warning("capture on %s refused by its stream: %s", subject, error)
            return "dropped_refused"
        except (nats.errors.Error, TimeoutError):
            return None
        return "stored"


def decode_request(body: bytes) -> dict[str, Any] | None:
    try:
        request = msgspec.json.decode(body)
    except msgspec.DecodeError:
        return None
    return request if isinstance(request, dict) else None

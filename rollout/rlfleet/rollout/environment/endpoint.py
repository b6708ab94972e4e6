"""An OpenAI-compatible chat-completions endpoint on the worker's engine, one key per episode.

A harness written against the OpenAI API (`/v1/chat/completions`, whole or streamed, with
`tools` and `tool_calls`) drives the model here, unchanged: each episode is given the
endpoint's address and a key of its own, and every call made with that key is captured
for training. A call's messages are rendered with the model's own chat template (its
tokenizer's, tools included), and the model's tool calls are read back by vLLM's
tool-call parser for the model's family, so the model keeps its native format.

Nothing is re-tokenised for the trainer. The captured tokens are the rendered prompt and
the sampled ids, with each sampled token's processed log-prob, routed experts and policy
version. A call whose rendered text extends the text of the episode so far (the previous
prompt, what was sampled, then the new turns) continues the same segment: only the new
turns are tokenised, as observations, so the sampled ids stay as they were even where
decoding and encoding again would not give them back. One that does not (a template that
drops or rewrites past turns) starts a new segment, and is counted
(`rlfleet_rollout_resegmented_calls_total`).

A relay that multiplexes many episodes over one client (verifiers' interception server)
presents the endpoint's `relay_key` instead, and names each call's episode by the session
id it sends (`X-Session-ID`), bound to the episode with `bind` before its first call.

What is sampled is the policy's own distribution at the run's temperature: a request's
temperature is overridden, and any control that would change the distribution (top-p,
top-k, logit bias, penalties, guided decoding) is refused, because the trainer would
learn text the policy did not choose, scored as if it had.
"""

from __future__ import annotations

import asyncio
import functools
import json
import logging
import secrets
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import httpx
import openai
import pydantic
from aiohttp import web

from rlfleet.api.wire import Segment
from rlfleet.launch.settings import SessionConfig
from rlfleet.rollout.engine import metrics
from rlfleet.rollout.environment.plugins import EpisodeFailed
from rlfleet.rollout.environment.session import Window, request_seed, sampling

if TYPE_CHECKING:  # vLLM only where a request is sent (`session.sampling`)
    from rlfleet.rollout.engine.driver import Completion, Engine

log = logging.getLogger(__name__)

ROUTE = "/v1/chat/completions"
MODELS_ROUTE = "/v1/models"  # what some agents ask first
SESSION_HEADER = "X-Session-ID"  # how a relay names the episode a call belongs to
MAX_REQUEST_BYTES = 64 << 20  # a request's body: a long episode's whole conversation
# Request fields that change the distribution tokens are sampled from, and the value that
# leaves it alone (None: only unset leaves it alone).
_NEUTRAL: dict[str, Any] = {
    "top_p": 1.0,
    "top_k": -1,
    "min_p": 0.0,
    "logit_bias": None,
    "presence_penalty": 0.0,
    "frequency_penalty": 0.0,
    "repetition_penalty": 1.0,
    "min_tokens": 0,
    "bad_words": None,
    "allowed_token_ids": None,
    "response_format": None,
    "structured_outputs": None,
}


class Refused(Exception):
    """A request the endpoint answers with an OpenAI-shaped error."""

    def __init__(self, status: int, reason: str, message: str) -> None:
        self.status, self.reason = status, reason
        super().__init__(message)


@dataclass
class EpisodeCapture:
    """What one episode's calls have made: its closed segments and the open window."""

    key: str
    seed: int
    segments: list[Segment] = field(default_factory=list)
    window: Window | None = None
    text: str = ""  # what the open window's tokens spell, special tokens included
    calls: int = 0
    resegmented: int = 0
    failure: EpisodeFailed | None = None  # the first cap the episode broke
    sessions: list[str] = field(default_factory=list)  # a relay's names for it
    lock: asyncio.Lock = field(default_factory=asyncio.Lock)  # one call at a time

    def all_segments(self) -> list[Segment]:
        """Every segment, the open one closed, dropping a window nothing was sampled in."""
        window = self.window
        tail = [window.segment()] if window is not None and window.generated else []
        return self.segments + tail


class Endpoint:
    """The worker's episode endpoint: `open` an episode, hand its harness `base_url` and
    the capture's key, `close` it when the harness is done and take its segments."""

    def __init__(
        self, engine: Engine, session: SessionConfig, tool_call_parser: str, model: str
    ) -> None:
        self.engine = engine
        self.session = session
        self.tool_call_parser = tool_call_parser
        self.model = model  # the name responses carry
        self.base_url = ""  # once started
        self._episodes: dict[str, EpisodeCapture] = {}
        self.relay_key = secrets.token_urlsafe(24)
        self._sessions: dict[str, EpisodeCapture] = {}  # a relay's session id -> episode
        self._runner: web.AppRunner | None = None
        # One connection pool for every episode's client: a client of its own made each
        # episode an SSL context (53 ms of loading CA files) it never used.
        self._http = httpx.AsyncClient(timeout=None, limits=httpx.Limits(max_connections=None))
        # vLLM's parsers log a traceback for every call the model got wrong, which a
        # policy early in training makes by the thousand; the call is returned as text.
        logging.getLogger("vllm.tool_parsers").setLevel(logging.CRITICAL)

    async def start(self, host: str = "127.0.0.1", port: int = 0) -> None:
        app = web.Application(client_max_size=MAX_REQUEST_BYTES)
        app.router.add_post(ROUTE, self._handle)
        app.router.add_get(MODELS_ROUTE, self._models)
        self._runner = web.AppRunner(app, access_log=None)
        await self._runner.setup()
        site = web.TCPSite(self._runner, host, port)
        await site.start()
        bound = site._server.sockets[0].getsockname()  # type: ignore[union-attr]
        self.base_url = f"http://{bound[0]}:{bound[1]}/v1"

    async def close(self) -> None:
        await self._http.aclose()
        if self._runner is not None:
            await self._runner.cleanup()

    def client(self, capture: EpisodeCapture) -> openai.AsyncOpenAI:
        """An OpenAI client for the episode: on this endpoint, with its key, no retries
        (a refused call is the harness's to see)."""
        return openai.AsyncOpenAI(
            base_url=self.base_url, api_key=capture.key, max_retries=0, http_client=self._http
        )

    def open(self, seed: int) -> EpisodeCapture:
        capture = EpisodeCapture(secrets.token_urlsafe(24), seed)
        self._episodes[capture.key] = capture
        return capture

    def bind(self, capture: EpisodeCapture, session: str) -> None:
        """Calls a relay makes under `session` are the episode's, until it is closed."""
        capture.sessions.append(session)
        self._sessions[session] = capture

    def close_episode(self, capture: EpisodeCapture) -> None:
        """Ends the episode: its key and a relay's names for it are refused from now on."""
        self._episodes.pop(capture.key, None)
        for session in capture.sessions:
            self._sessions.pop(session, None)

    async def _handle(self, request: web.Request) -> web.StreamResponse:
        try:
            capture = self._episode(request)
            body = await _json_body(request)
            async with capture.lock:
                if capture.key not in self._episodes:
                    raise Refused(401, "key", "the episode has ended")
                return await self._chat(request, capture, body)
        except Refused as refused:
            metrics.endpoint_refused.labels(refused.reason).inc()
            return _error(refused.status, refused.reason, str(refused))

    async def _models(self, request: web.Request) -> web.Response:
        try:
            self._episode(request)
        except Refused as refused:
            metrics.endpoint_refused.labels(refused.reason).inc()
            return _error(refused.status, refused.reason, str(refused))
        model = {"id": self.model, "object": "model", "owned_by": "rlfleet"}
        return web.json_response({"object": "list", "data": [model]})

    def _episode(self, request: web.Request) -> EpisodeCapture:
        scheme, _, key = request.headers.get("Authorization", "").partition(" ")
        if scheme.lower() != "bearer":
            capture = None
        elif secrets.compare_digest(key, self.relay_key):
            capture = self._sessions.get(request.headers.get(SESSION_HEADER, ""))
        else:
            capture = self._episodes.get(key)
        if capture is None:
            raise Refused(401, "key", "no episode under way has this key")
        return capture

    async def _chat(
        self, request: web.Request, capture: EpisodeCapture, body: dict
    ) -> web.StreamResponse:
        chat = _parse(body)
        window = _extend(capture, self._render(chat), self._encode)
        prompt_tokens = len(window.tokens)
        max_tokens = self._budget(capture, chat, prompt_tokens)
        completion = await self._sample(capture, window, chat, max_tokens)
        sampled = self._decode(completion.token_ids)
        capture.text += sampled
        text = reply_text(
            sampled, self._turn_end(completion), completion.text if chat.stop else None
        )
        message, finish = self._message(chat, completion, text)
        response = _completion_body(self.model, message, finish, prompt_tokens, completion)
        if chat.stream:
            usage = chat.stream_options is not None and chat.stream_options.include_usage
            return await _stream(request, response, usage=bool(usage))
        return web.json_response(response)

    def _encode(self, text: str) -> list[int]:
        return list(self.engine.llm.get_tokenizer().encode(text, add_special_tokens=False))

    def _decode(self, ids: list[int]) -> str:
        return self.engine.llm.get_tokenizer().decode(ids, skip_special_tokens=False)

    @functools.cached_property
    def _special_ids(self) -> frozenset[int]:
        return frozenset(self.engine.llm.get_tokenizer().all_special_ids)

    def _turn_end(self, completion: Completion) -> str:
        """The text of the token that ended the model's turn, "" if none did."""
        ids = completion.token_ids
        if completion.finish_reason != "stop" or not ids or ids[-1] not in self._special_ids:
            return ""
        return self._decode(ids[-1:])

    def _render(self, chat) -> str:
        tokenizer = self.engine.llm.get_tokenizer()
        tools = [tool.model_dump(exclude_none=True) for tool in chat.tools or []] or None
        try:
            text = tokenizer.apply_chat_template(
                [_plain(message) for message in chat.messages],
                tools=tools,
                add_generation_prompt=True,
                tokenize=False,
            )
        except Exception as error:  # the template's own: jinja's, or its raise_exception
            raise Refused(400, "request", f"the chat template refused: {error}") from error
        return text

    def _budget(self, capture: EpisodeCapture, chat, context: int) -> int:
        """The call's most new tokens; a broken cap fails the episode."""
        session = self.session
        if capture.calls >= session.max_turns:
            capture.failure = capture.failure or EpisodeFailed(
                "turns", f"more than {session.max_turns} calls"
            )
            raise Refused(400, "caps", f"the episode's {session.max_turns} calls are spent")
        wanted = chat.max_completion_tokens or chat.max_tokens or session.turn_tokens
        max_tokens = min(wanted, session.turn_tokens)
        if context + max_tokens > session.context_tokens:
            capture.failure = capture.failure or EpisodeFailed(
                "context", f"{context} tokens and a turn do not fit {session.context_tokens}"
            )
            raise Refused(400, "caps", f"the context ({context} tokens) is full")
        return max_tokens

    async def _sample(
        self, capture: EpisodeCapture, window: Window, chat, max_tokens: int
    ) -> Completion:
        stop = [chat.stop] if isinstance(chat.stop, str) else list(chat.stop or [])
        seed = request_seed(capture.seed, capture.calls)
        params = sampling(max_tokens, self.session.temperature, stop, seed)
        capture.calls += 1
        completion = await self.engine.generate(list(window.tokens), params)
        window.add_completion(completion)
        return completion

    def _message(self, chat, completion: Completion, text: str) -> tuple[dict, str]:
        """The assistant message, tool calls parsed out, and its finish reason."""
        finish = "length" if completion.finish_reason == "length" else "stop"
        message: dict[str, Any] = {"role": "assistant", "content": text}
        if not chat.tools or chat.tool_choice == "none":
            return message, finish
        from vllm.tool_parsers.abstract_tool_parser import ToolParserManager

        parser = ToolParserManager.get_tool_parser(self.tool_call_parser)(
            self.engine.llm.get_tokenizer(), chat.tools
        )
        parsed = parser.extract_tool_calls(text, chat)
        if parsed.tools_called:
            message["content"] = parsed.content or None
            message["tool_calls"] = [call.model_dump() for call in parsed.tool_calls]
            finish = "tool_calls"
        return message, finish


def _parse(body: dict):
    """The request as vLLM's own OpenAI model reads it, with what may not be honoured
    refused by name."""
    from vllm.entrypoints.openai.chat_completion.protocol import ChatCompletionRequest

    try:
        chat = ChatCompletionRequest.model_validate(body)
    except pydantic.ValidationError as error:
        first = error.errors()[0]
        where = ".".join(str(part) for part in first["loc"])
        raise Refused(400, "request", f"{where}: {first['msg']}") from None
    if chat.n != 1:
        raise Refused(400, "request", "n: one choice per call (groups are the worker's)")
    for name, neutral in _NEUTRAL.items():
        if name in chat.model_fields_set and getattr(chat, name) not in (None, neutral):
            raise Refused(
                400,
                "request",
                f"{name}: rollouts sample the policy as it is, at the run's"
                " temperature; controls that change what is sampled are refused",
            )
    for message in chat.messages:
        for call in message.get("tool_calls") or []:
            _check_arguments(call)
    return chat


def _check_arguments(call: dict) -> None:
    arguments = (call.get("function") or {}).get("arguments")
    if isinstance(arguments, str):
        try:
            json.loads(arguments)
        except ValueError:
            raise Refused(
                400, "request", f"tool_calls: arguments of {call.get('id')!r} are not JSON"
            ) from None


def _plain(message: dict) -> dict:
    """A message for the template: text content parts joined into one string."""
    content = message.get("content")
    if isinstance(content, list):
        text = "".join(part.get("text", "") for part in content if isinstance(part, dict))
        message = {**message, "content": text}
    return message


def reply_text(sampled: str, turn_end: str, cut_at_stop: str | None) -> str:
    """The reply as the harness is given it: the sampled text as the capture spells it,
    special tokens and a character cut short kept (vLLM's own text drops both), less the
    token that ended the turn. So a harness that sends the reply back extends the
    episode's window, on the sampled ids, instead of starting a new one from text encoded
    again. A request's stop string is vLLM's to cut: `cut_at_stop` is its text then."""
    if cut_at_stop is not None:
        return cut_at_stop
    return sampled.removesuffix(turn_end)


def _extend(capture: EpisodeCapture, text: str, encode: Callable[[str], list[int]]) -> Window:
    """The window this call samples in: the open one, its new turns added as observations,
    if the rendered `text` extends what it spells; else a new one (the old closed as a
    segment)."""
    window = capture.window
    if window is not None and window.generated and text.startswith(capture.text):
        window.add_observation(encode(text[len(capture.text) :]))
        capture.text = text
        return window
    if window is not None and window.generated:
        capture.segments.append(window.segment())
        capture.resegmented += 1
        metrics.resegmented_calls.inc()
    prompt = encode(text)
    capture.window, capture.text = Window(tokens=prompt, prompt_len=len(prompt)), text
    return capture.window


async def _json_body(request: web.Request) -> dict:
    try:
        body = await request.json()
    except (ValueError, web.HTTPRequestEntityTooLarge) as error:
        raise Refused(400, "request", f"the body is not a JSON object: {error}") from None
    if not isinstance(body, dict):
        raise Refused(400, "request", "the body is not a JSON object")
    return body


def _completion_body(
    model: str, message: dict, finish: str, prompt_tokens: int, completion: Completion
) -> dict:
    return {
        "id": f"chatcmpl-{secrets.token_hex(12)}",
        "object": "chat.completion",
        "created": int(time.time()),
        "model": model,
        "choices": [{"index": 0, "message": message, "finish_reason": finish}],
        "usage": {
            "prompt_tokens": prompt_tokens,
            "completion_tokens": len(completion.token_ids),
            "total_tokens": prompt_tokens + len(completion.token_ids),
        },
    }


async def _stream(request: web.Request, whole: dict, usage: bool) -> web.StreamResponse:
    """The completion as server-sent chunks: the message, then its finish reason, then
    (if asked for) its usage."""
    response = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
    await response.prepare(request)
    choice = whole["choices"][0]
    delta = dict(choice["message"])
    for index, call in enumerate(delta.get("tool_calls") or []):
        call["index"] = index
    head = {key: whole[key] for key in ("id", "created", "model")}
    head["object"] = "chat.completion.chunk"
    chunks = [
        {"index": 0, "delta": delta, "finish_reason": None},
        {"index": 0, "delta": {}, "finish_reason": choice["finish_reason"]},
    ]
    events = [head | {"choices": [chunk]} for chunk in chunks]
    if usage:
        events.append(head | {"choices": [], "usage": whole["usage"]})
    for event in events:
        await response.write(f"data: {json.dumps(event)}\n\n".encode())
    await response.write(b"data: [DONE]\n\n")
    await response.write_eof()
    return response


def _error(status: int, reason: str, message: str) -> web.Response:
    body = {"error": {"message": message, "type": "invalid_request_error", "code": reason}}
    return web.json_response(body, status=status)

"""`python -m rlfleet.rollout.production.serving (CONFIG.json | --rlrun [SPEC]) [vLLM's
arguments]`: a production pool's vLLM server with capture, feedback and policy versions, as ASGI
middleware.

The pool runs vLLM's own OpenAI-compatible server; this command starts it with a
`ServingConfig` (the file named in `RLFLEET_SERVING_SETTINGS`; the run's NATS user in
`RLFLEET_NATS_CREDS`): one a local run wrote, or, in a pool's pod, one made from the
run's spec the region mounts and the pod's environment (its NATS server, region and
replica set; `pods.Placement`), written under its state folder. It adds to vLLM's
arguments what the middleware needs (`vllm_arguments`): the middleware itself, and
processed log-probs, those of the distribution each token was sampled from (temperature
applied), which is what the trainer's off-policy correction divides by, and the worker
extension that records routed experts (`--enforce-eager` too when the run replays them).
Chat completions are captured (`rlfleet.rollout.production.capture`), streamed or whole; `POST
/v1/feedback` is answered here (`rlfleet.rollout.production.feedback`); every other request passes
through untouched.

A chat completion's id is the server's own: a client's request id (header `X-Request-Id`,
body `request_id`) never reaches vLLM, so no two responses share an id and a client
cannot name another's. Its user is who the pool's gateway says it authenticated (the
header the pool's feedback folder names, `FEEDBACK_DIR_ENV`), never the body's `user`.
An answer that may be captured carries the token its user's feedback on it must bear
(`feedback.TOKEN_HEADER`), and nothing that tells which set of servers, or which
version, answered: a client that knew could reward one set and punish the other.

It takes requests once its engine has sampled a token (`warm_up`).
A server in a replica set also serves the version its set is told to, switched in place
(`rlfleet.rollout.production.versions`), so weightsync goes into its workers as well.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import random
import secrets
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import msgspec
import numpy as np

from rlfleet.launch import components, pods
from rlfleet.launch.caches import own_caches
from rlfleet.launch.production import FEEDBACK_DIR_ENV, ServingConfig
from rlfleet.launch.settings import from_json, to_json
from rlfleet.launch.stopping import log_with_vllm
from rlfleet.rollout.engine import vllm_experts
from rlfleet.rollout.production import capture
from rlfleet.rollout.production.capture import Asked, Bus, Captures, Skip
from rlfleet.rollout.production.feedback import (
    MAX_BODY_BYTES,
    TOKEN_HEADER,
    FeedbackDesk,
    PoolFeedback,
    Served,
)
from rlfleet.rollout.production.versions import VersionFollower
from rlfleet.weightsync import vllm_options

log = logging.getLogger(__name__)

SETTINGS_ENV = "RLFLEET_SERVING_SETTINGS"
MIDDLEWARE = "rlfleet.rollout.production.serving.CaptureMiddleware"  # as vLLM imports it, by name
COMPLETIONS, FEEDBACK = "/v1/chat/completions", "/v1/feedback"
# A client's name for its request, which vLLM would make the response's id.
REQUEST_ID_HEADER = b"x-request-id"


async def _read_body(receive, limit: int | None = None) -> bytes | None:
    """The request's body; None once it passes `limit` bytes (the rest is not kept)."""
    chunks, size = [], 0
    while True:
        message = await receive()
        chunk = message.get("body", b"")
        size += len(chunk)
        if limit is None or size <= limit:
            chunks.append(chunk)
        if not message.get("more_body"):
            return b"".join(chunks) if limit is None or size <= limit else None


def _replay(body: bytes, receive):
    """`receive` for the app: the body read already, then the client's own messages (the
    app reads past the body only to learn of a disconnect, and abort the request)."""
    sent = False

    async def replayed():
        nonlocal sent
        if sent:
            return await receive()
        sent = True
        return {"type": "http.request", "body": body, "more_body": False}

    return replayed


def pool_feedback() -> PoolFeedback:
    """The pool's feedback key and user header, from the folder `FEEDBACK_DIR_ENV` names;
    ValueError (or OSError) when they are not there: a pool's server needs them."""
    folder = os.environ.get(FEEDBACK_DIR_ENV)
    if not folder:
        raise ValueError(f"{FEEDBACK_DIR_ENV} is not set: where is the pool's feedback Secret?")
    return PoolFeedback.from_dir(Path(folder))


async def _refuse(send, status: int, message: str, param: str | None) -> None:
    """An error answered as OpenAI's API shapes it, naming the field at fault."""
    error = {"message": message, "type": "invalid_request_error", "param": param, "code": status}
    body = msgspec.json.encode({"error": error})
    await _respond(send, status, body, [(b"content-type", b"application/json")])


@dataclass(frozen=True)
class Serving:
    """A chat completion being served to be captured: the request as sent to vLLM, what
    its client asked for, its user, and the id the server gave its answer."""

    request: dict
    asked: Asked
    user: str
    response_id: str


async def _respond(send, status: int, body: bytes, headers: list) -> None:
    headers = [(k, v) for k, v in headers if k.lower() != b"content-length"]
    headers.append((b"content-length", str(len(body)).encode()))
    await send({"type": "http.response.start", "status": status, "headers": headers})
    await send({"type": "http.response.body", "body": body})


class CaptureMiddleware:
    def __init__(self, app) -> None:
        log_with_vllm()  # this is vLLM's server process: its handlers are the pod's log
        self.app = app
        self.config = from_json(Path(os.environ[SETTINGS_ENV]).read_bytes(), ServingConfig)
        self.bus = Bus(self.config)
        keys = [key for key in [os.environ.get("VLLM_API_KEY", "")] if key]
        self.pool = pool_feedback()
        self.desk = FeedbackDesk(self.config, self.bus, keys, self.pool)
        self.captures = Captures(self.bus, self.config.buffer, self.desk.remembered.not_captured)
        self._tasks: list[asyncio.Task] = []
        self._experts: asyncio.Task[vllm_experts.Taker | None] | None = None

    def _start(self, app) -> None:
        """The connection, the drain and the version follower run in the server's loop,
        begun as it starts (its lifespan) or by its first request."""
        if self._tasks:
            return
        if self.config.routed_experts:
            self._experts = asyncio.create_task(self._record_experts(app.state), name="experts")
        self._tasks = [
            asyncio.create_task(self.bus.keep_connected(), name="nats"),
            asyncio.create_task(self.captures.store_forever(), name="captures"),
        ]
        if self.config.replica_set is not None:
            follower = VersionFollower(self.config, self.bus)
            self._tasks.append(asyncio.create_task(follower.run(app.state), name="versions"))

    @staticmethod
    async def _record_experts(state) -> vllm_experts.Taker | None:
        """The engine's workers record routed experts from the server's start; None if they
        could not be made to (an MoE model's completions then go uncaptured, counted)."""
        try:
            taker = vllm_experts.Taker(state.engine_client)
            log.info("recording the routed experts of %d MoE layers", await taker.start())
            return taker
        except Exception:
            log.exception("the engine's workers record no routed experts")
            return None

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] in ("http", "lifespan"):
            self._start(scope["app"])
        if scope["type"] == "lifespan":
            return await self.app(scope, receive, _ready_once_warm(scope["app"], send))
        if scope["type"] != "http" or scope["method"] != "POST":
            return await self.app(scope, receive, send)
        if scope["path"] == FEEDBACK:
            headers = {name.lower(): value for name, value in scope["headers"]}
            body = await _read_body(receive, MAX_BODY_BYTES)
            answer = await self.desk.answer(body, headers)
            body, json = msgspec.json.encode(answer.body), (b"content-type", b"application/json")
            return await _respond(send, answer.status, body, [json])
        if scope["path"] == COMPLETIONS:
            return await self._completion(scope, receive, send)
        return await self.app(scope, receive, send)

    def _admit(self, headers: dict[bytes, bytes], request: dict) -> tuple[dict, Asked] | Skip:
        if headers.get(capture.OPT_OUT_HEADER, b"").lower() == b"off":
            return Skip.OPTED_OUT
        if random.random() >= self.config.sample_rate:
            return Skip.SAMPLED_OUT
        return capture.prepare(request, self.config.temperature)

    async def _completion(self, scope, receive, send) -> None:
        headers = {name.lower(): value for name, value in scope["headers"]}
        # vLLM never sees the client's request id: the response's id is the server's own.
        kept = [h for h in scope["headers"] if h[0].lower() != REQUEST_ID_HEADER]
        scope = {**scope, "headers": kept}
        request = capture.decode_request(await _read_body(receive))
        user = self.pool.user(headers)
        if request is None:
            capture.skipped.labels(Skip.UNREADABLE).inc()
            return await _refuse(send, 400, "the request body is not a JSON object", None)
        if user is None:
            header = self.pool.user_header.decode()
            return await _refuse(send, 400, f"header {header} names no user", header)
        ours = secrets.token_hex(16)
        request = {**request, "request_id": ours}
        admitted = self._admit(headers, request)
        if isinstance(admitted, Skip):
            capture.skipped.labels(admitted).inc()
            return await self.app(scope, _replay(msgspec.json.encode(request), receive), send)
        served = Serving(*admitted, user, f"chatcmpl-{ours}")  # vLLM's name for its answer
        token = (TOKEN_HEADER, self.pool.token(served.response_id, user).encode())
        engine = scope["app"].state.engine_client
        if self._experts is not None:
            await asyncio.shield(self._experts)  # recording before the first request runs
        before = await engine.get_weight_version()
        if served.request.get("stream"):
            return await self._streamed(scope, receive, send, served, token, before)
        start: dict = {}
        chunks: list[bytes] = []

        async def hold(message) -> None:  # the whole answer, to take out what capture added
            if message["type"] == "http.response.start":
                start.update(message)
            elif message["type"] == "http.response.body":
                chunks.append(message.get("body", b""))

        await self.app(scope, _replay(msgspec.json.encode(served.request), receive), hold)
        answer, after = b"".join(chunks), await engine.get_weight_version()
        if start.get("status") != 200:
            capture.skipped.labels(Skip.FAILED).inc()
            return await _respond(send, start["status"], answer, start.get("headers", []))
        reply = await self._capture(answer, served, before, after)
        await _respond(send, 200, reply, [*start.get("headers", []), token])

    async def _streamed(
        self, scope, receive, send, served: Serving, token: tuple[bytes, bytes], before: str
    ) -> None:
        """A streamed completion, begun at vLLM's weight version `before`: relayed event by
        event as vLLM sends it, each as the client asked, and captured once it has ended.
        Its headers carry its feedback `token` (its id is the server's, known before it).
        Its end goes out once its capture is remembered: feedback never comes before it."""
        stream, status, end = capture.Streamed(served.asked), 0, None

        async def relay(message) -> None:
            nonlocal status, end
            if message["type"] == "http.response.start":
                status = message["status"]
                headers = [
                    h for h in message.get("headers", []) if h[0].lower() != b"content-length"
                ]
                if status == 200:
                    headers.append(token)
                message = {**message, "headers": headers}  # what is given back changes size
            elif message["type"] == "http.response.body" and status == 200:
                last = not message.get("more_body", False)
                message = {**message, "body": stream.relay(message.get("body", b""), last)}
                if last:
                    end = message
                    return
            await send(message)

        await self.app(scope, _replay(msgspec.json.encode(served.request), receive), relay)
        after = await scope["app"].state.engine_client.get_weight_version()
        if status != 200:
            capture.skipped.labels(Skip.FAILED).inc()
        elif stream.unreadable:
            capture.skipped.labels(Skip.UNREADABLE).inc()
        elif not stream.finished:
            capture.skipped.labels(Skip.UNFINISHED).inc()
        else:
            await self._record(stream.response(), served, before, after)
        if end is not None:
            await send(end)

    def _version(self, engine_version: str) -> int:
        """vLLM's weight version as a policy version: "default" is the served checkpoint's."""
        return self.config.base_version if engine_version == "default" else int(engine_version)

    async def _capture(self, answer: bytes, served: Serving, before: str, after: str) -> bytes:
        """The answer as the client asked for it; its capture offered to the buffer."""
        try:
            response = msgspec.json.decode(answer)
            reply = msgspec.json.encode(capture.give_back(response, served.asked))
        except (KeyError, TypeError, AttributeError, msgspec.DecodeError):
            capture.skipped.labels(Skip.UNREADABLE).inc()
            return answer
        await self._record(response, served, before, after)
        return reply

    async def _record(self, response: dict, served: Serving, before: str, after: str) -> None:
        """The capture of a whole answer offered to the buffer, if one version made it and,
        of an MoE model, the experts of every token it ran were kept; never under another
        id than the server gave it (its token names that one)."""
        user = served.user
        try:
            if response["id"] != served.response_id:
                raise ValueError(f"answered as {response['id']!r}, not {served.response_id!r}")
            experts = await self._routed(response) if before == after else Skip.VERSION_CHANGED
            if isinstance(experts, Skip):
                capture.skipped.labels(experts).inc()  # feedback on it: not captured
                self.desk.remembered.add(served.response_id, Served(user, time.time(), False))
                return
            version = self._version(before)
            captured = capture.extract(
                self.config.run, response, user, version, time.time(), experts
            )
        except (ValueError, KeyError, TypeError, msgspec.DecodeError):
            capture.skipped.labels(Skip.UNREADABLE).inc()
            return
        # A capture the buffer cannot take is never stored: feedback on it would be orphaned.
        buffered = self.captures.offer(captured)
        self.desk.remembered.add(captured.response_id, Served(user, captured.served_at, buffered))

    async def _routed(self, response: dict) -> np.ndarray | Skip | None:
        """The experts an MoE model routed the answer's tokens to (None for a dense model,
        or a run that does not replay them), or Skip.NO_EXPERTS if none were kept."""
        if self._experts is None:
            return None
        taker = await asyncio.shield(self._experts)
        if taker is None:
            return Skip.NO_EXPERTS
        if not taker.layers:
            return None
        rows = await taker.take(response["id"], capture.tokens_run(response))
        return Skip.NO_EXPERTS if rows is None else rows


def vllm_arguments(config: ServingConfig, given: list[str]) -> list[str]:
    """vLLM's server arguments for a pool's server: the user's, then the middleware's."""
    for flag in ("--logprobs-mode", "--worker-extension-cls", "--weight-transfer-config"):
        if any(arg == flag or arg.startswith(f"{flag}=") for arg in given):
            raise ValueError(f"{flag} is rlfleet's to set on a pool's server")
    # The workers record routed experts, and follow the run's weights in a replica set.
    options = vllm_options(worker_extension=vllm_experts.EXTENSION)
    needed = [
        *("--logprobs-mode", "processed_logprobs"),
        *("--middleware", MIDDLEWARE),
        *("--worker-extension-cls", options["worker_extension_cls"]),
    ]
    if config.routed_experts and "--enforce-eager" not in given:
        needed.append("--enforce-eager")
    if config.replica_set is not None:
        needed += ["--weight-transfer-config", json.dumps(options["weight_transfer_config"])]
    return [*given, *needed]


def _ready_once_warm(app, send):
    """`send` for the app's lifespan: its start-up completes, and the server takes requests,
    once the engine has sampled a token with log-probs (`warm_up`)."""

    async def sent(message) -> None:
        if message["type"] == "lifespan.startup.complete":
            await warm_up(app.state.engine_client)
        await send(message)

    return sent


# Tokens of the warm-up's prompt. On this project's CPU (AMX), a fresh vLLM engine whose
# first prompt had four tokens or fewer died (SIGILL in its CPU attention kernel); one
# with five or more did not, and shorter prompts were served after it.
WARM_UP_TOKENS = 16


async def warm_up(engine) -> None:
    """One token with its log-prob, before any user's request. vLLM compiles the kernel
    that ranks a sampled token's log-prob (`batched_count_greater_than`, torch.compile)
    the first time a request asks for log-probs, which every captured completion does,
    and its own start-up samples none. A fresh server's first completions waited for it:
    20-31 s on this project's 2-core machine, with cold compile caches as every pod has.
    A failure here is logged, not raised: the first request would compile it instead."""
    from vllm import SamplingParams

    started = time.perf_counter()
    params = SamplingParams(max_tokens=1, logprobs=0)
    prompt = {"prompt_token_ids": [0] * WARM_UP_TOKENS}
    try:
        async for _ in engine.generate(prompt, params, "rlfleet-warm-up"):
            pass
    except Exception:
        log.exception("warming up failed: the first completion will compile what it needs")
        return
    log.info("warmed up: one token with log-probs in %.1fs", time.perf_counter() - started)


def settings_and_arguments(argv: list[str]) -> tuple[Path, ServingConfig, list[str]]:
    """The server's settings, the file its middleware reads them from, and vLLM's
    arguments. `--rlrun` takes the mounted spec's path when one follows (else
    `SPEC_FILE`), and writes the settings it makes under the pod's state folder."""
    if not argv:
        raise ValueError("no settings: CONFIG.json or --rlrun [SPEC]")
    if argv[0] != "--rlrun":
        path = Path(argv[0]).resolve()
        return path, from_json(path.read_bytes(), ServingConfig), argv[1:]
    given = len(argv) > 1 and not argv[1].startswith("-")
    run, spec = pods.read_spec(Path(argv[1] if given else pods.SPEC_FILE))
    at = pods.Placement.from_env(os.environ)
    config = components.SERVING.for_pod(run, spec, at)
    path = (Path(at.state_dir) / "serving.json").resolve()
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(to_json(config))
    return path, config, argv[2 if given else 1 :]


def main() -> None:
    try:
        settings, config, given = settings_and_arguments(sys.argv[1:])
        arguments = vllm_arguments(config, given)
    except (OSError, msgspec.DecodeError, ValueError) as error:
        sys.exit(
            f"rlfleet.rollout.production.serving: cannot serve with "
            f"{' '.join(sys.argv[1:3])}: {error}"
        )
    try:
        pool_feedback()  # checked here, where a pod's log shows why it stopped
    except (OSError, ValueError) as error:
        sys.exit(f"rlfleet.rollout.production.serving: no feedback key and user header: {error}")
    own_caches(None)  # a pod's under the root its environment names
    os.environ[SETTINGS_ENV] = str(settings)
    server = [sys.executable, "-m", "vllm.entrypoints.openai.api_server", *arguments]
    os.execv(sys.executable, server)


if __name__ == "__main__":
    main()

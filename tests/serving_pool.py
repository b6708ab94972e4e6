"""A production pool's vLLM server for tests: the real OpenAI-compatible server with
rlfleet's middleware, started as a pool runs it, reaching the run's streams on a real NATS
hub through a region's leaf node (behind a gate, to cut it), and clients that speak to it
as users behind the pool's gateway do: each request names its user in the gateway's
header, and feedback carries the token the answer came with."""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
import urllib.error
import urllib.request
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

from conftest import scrape, wait_for
from nats.js.errors import NotFoundError
from tcp_gate import TcpGate

from rlfleet.api.inferencepool import FEEDBACK_KEY_FILE, USER_HEADER_FILE
from rlfleet.api.wire import (
    BusRole,
    CapturedCompletion,
    capture_stream,
    capture_subject,
    decode_captured,
)
from rlfleet.bus.streams import ensure_run_streams
from rlfleet.launch.production import FEEDBACK_DIR_ENV, ServingConfig
from rlfleet.launch.settings import to_json
from rlfleet.local.nats import HUB_DOMAIN, StandaloneNats
from rlfleet.local.processes import free_port
from rlfleet.models.tiny import init_model
from rlfleet.rollout.production.feedback import TOKEN_HEADER, PoolFeedback

API_KEY = "pool-key-for-tests"
FEEDBACK_KEY = "pool-feedback-key-for-tests"
USER_HEADER = "x-forwarded-user"  # the pool's gateway's
# The pool's key as its servers hold it: the tokens they would give, for tests that make
# captures of their own.
SIGNER = PoolFeedback(FEEDBACK_KEY.encode(), USER_HEADER.encode())


GIVEN = "the token the response came with"  # `Pool.feedback`'s default


@dataclass(frozen=True)
class Answered:
    status: int
    body: dict
    headers: dict[str, str]  # lower-cased names


@dataclass
class Pool:
    url: str
    run: str
    nats: StandaloneNats
    gate: TcpGate
    model: Path
    log: Path  # the server's stdout and stderr, as a pod's log holds them
    # What each user was given with each answer: response id -> (user, feedback token).
    given: dict[str, tuple[str, str]] = field(default_factory=dict)

    def ask(
        self,
        content: str,
        user: str = "ada",
        headers: dict | None = None,
        body_user: str | None = None,
        **fields,
    ):
        """A chat completion asked as `user` (the gateway's say; the body's `user` is
        `body_user`, if given), answered whole."""
        body = chat_body(content, **{"max_tokens": 6, **fields})
        if body_user is not None:
            body["user"] = body_user
        headers = {USER_HEADER: user} | (headers or {})
        answered = self.request("/v1/chat/completions", body, headers)
        token = answered.headers.get(TOKEN_HEADER.decode())
        if answered.status == 200 and token is not None:
            self.given[answered.body["id"]] = (user, token)
        return answered

    def chat(self, content: str, headers: dict | None = None, user: str = "ada", **fields):
        return self.ask(content, user, headers, **fields).body

    def request(self, path: str, body, headers: dict | None = None, key: str | None = API_KEY):
        data = body if isinstance(body, bytes) else json.dumps(body).encode()
        request = urllib.request.Request(f"{self.url}{path}", data=data, method="POST")
        request.add_header("content-type", "application/json")
        if key is not None:
            request.add_header("authorization", f"Bearer {key}")
        for name, value in (headers or {}).items():
            request.add_header(name, value)
        try:
            with urllib.request.urlopen(request, timeout=60) as response:
                return Answered(response.status, json.load(response), _lower(response.headers))
        except urllib.error.HTTPError as error:
            return Answered(error.code, json.load(error), _lower(error.headers))

    def post(self, path: str, body, headers: dict | None = None, key: str | None = API_KEY):
        answered = self.request(path, body, headers, key)
        return answered.status, answered.body

    def stream(self, content: str, user: str = "ada", **fields) -> list[str]:
        """A streamed chat completion's server-sent events' data, in order."""
        return self.streamed(content, user, **fields)[0]

    def streamed(self, content: str, user: str = "ada", **fields) -> tuple[list[str], dict]:
        """A streamed chat completion's server-sent events' data, in order, and its
        headers."""
        body = json.dumps(chat_body(content, **{"max_tokens": 6, "stream": True, **fields}))
        request = urllib.request.Request(
            f"{self.url}/v1/chat/completions", data=body.encode(), method="POST"
        )
        request.add_header("content-type", "application/json")
        request.add_header("authorization", f"Bearer {API_KEY}")
        request.add_header(USER_HEADER, user)
        with urllib.request.urlopen(request, timeout=60) as response:
            assert response.status == 200
            headers = _lower(response.headers)
            events = response.read().decode().split("\n\n")
        assert events.pop() == ""  # every event whole
        assert all(e.startswith("data: ") for e in events)
        data = [e.removeprefix("data: ") for e in events]
        if TOKEN_HEADER.decode() in headers:
            self.given[json.loads(data[0])["id"]] = (user, headers[TOKEN_HEADER.decode()])
        return data, headers

    def feedback(
        self,
        response_id: str,
        kind: str = "accepted",
        user: str | None = None,
        token: str | None = GIVEN,
        **fields,
    ):
        """An event on `response_id` posted as the user it was given to, with its token,
        unless told another `user` or `token` (None: none)."""
        given_user, given_token = self.given.get(response_id, ("ada", None))
        token = given_token if token is GIVEN else token
        body = {"response_id": response_id, "event_id": uuid.uuid4().hex, "kind": kind}
        body |= ({} if token is None else {"token": token}) | fields
        user = given_user if user is None else user
        return self.post("/v1/feedback", body, {USER_HEADER: user})

    def metric(self, name: str) -> float:
        return scrape(f"{self.url}/metrics").get(name, 0.0)

    def stored(self, stream: str, subject: str) -> bytes | None:
        async def get() -> bytes | None:
            nc = await self.nats.bed.hub.connect()
            try:
                message = await nc.jetstream().get_last_msg(stream, subject)
                return message.data
            except NotFoundError:
                return None
            finally:
                await nc.close()

        return asyncio.run(get())

    def capture(self, response_id: str) -> CapturedCompletion | None:
        data = self.stored(capture_stream(self.run), capture_subject(self.run, response_id))
        return None if data is None else decode_captured(data)


def _lower(headers) -> dict[str, str]:
    return {name.lower(): value for name, value in headers.items()}


def chat_body(content: str, **fields) -> dict:
    return {
        "model": "tiny",
        "messages": [{"role": "user", "content": content}],
        "seed": 7,  # sampled at the pool's temperature, the same tokens every time
        **fields,
    }


def feedback_folder(root: Path) -> Path:
    """The pool's feedback Secret as its pods mount it."""
    folder = root / "feedback"
    folder.mkdir()
    (folder / FEEDBACK_KEY_FILE).write_text(FEEDBACK_KEY)
    (folder / USER_HEADER_FILE).write_text(USER_HEADER)
    return folder


@contextmanager
def serving_pool(nats_servers: StandaloneNats, root: Path, **settings) -> Iterator[Pool]:
    """A pool's server for a run of its own, with `settings` over `ServingConfig`'s."""
    run = "serving-" + uuid.uuid4().hex[:6]

    async def streams() -> None:
        nc = await nats_servers.bed.hub.connect()
        assert await ensure_run_streams(nc, run, HUB_DOMAIN, [nats_servers.region]) == []
        await nc.close()

    asyncio.run(streams())
    leaf = nats_servers.bed.leaves[nats_servers.region]
    gate = TcpGate(int(leaf.url.rsplit(":", 1)[1]))
    creds = root / "serving.creds"
    creds.write_text(nats_servers.bed.run_user(run, BusRole.SERVING))
    config = ServingConfig(run=run, nats_url=gate.url, jetstream_domain=HUB_DOMAIN, **settings)
    (root / "settings.json").write_bytes(to_json(config))
    port = free_port()
    env = os.environ | {
        "RLFLEET_NATS_CREDS": str(creds),
        "VLLM_API_KEY": API_KEY,
        FEEDBACK_DIR_ENV: str(feedback_folder(root)),
        "VLLM_CPU_KVCACHE_SPACE": "1",
        "TOKENIZERS_PARALLELISM": "false",
    }
    model = init_model("tiny-moe", root / "model")
    command = [  # as a pool runs it: rlfleet's launcher, then vLLM's own arguments
        *(sys.executable, "-m", "rlfleet.rollout.production.serving", str(root / "settings.json")),
        *("--model", str(model), "--served-model-name", "tiny", "--port", str(port)),
        *("--dtype", "bfloat16", "--max-model-len", "512", "--seed", "0"),
    ]
    log = (root / "server.log").open("wb")
    server = subprocess.Popen(command, env=env, stdout=log, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    try:
        wait_for("the pool's vLLM server", lambda: _healthy(url, server, root), timeout=300)
        yield Pool(url, run, nats_servers, gate, model, root / "server.log")
    finally:
        server.terminate()
        server.wait(60)
        gate.close()


def _healthy(url: str, server: subprocess.Popen, root: Path) -> bool:
    if server.poll() is not None:
        raise AssertionError((root / "server.log").read_text()[-3000:])
    try:
        with urllib.request.urlopen(f"{url}/health", timeout=2) as response:
            return response.status == 200
    except OSError:
        return False

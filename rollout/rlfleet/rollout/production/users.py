"""`python -m rlfleet.rollout.production.users CONFIG.json`: simulated users of a production pool.

For the local real-time run and its benchmark: production needs users, and these speak
only HTTP to the pool's servers, as real ones do. Each user asks a question of the suite
(chat completions, as `user-N`, named in the header the pool's gateway would set once it
authenticated them; some questions far more often than others, as in any product), reads
the answer and, unless they are one of the silent ones, says what they think of it
(`POST /v1/feedback`, with the feedback token the answer came with): accepted when it is
right, rejected when it is wrong, the opposite now and then by mistake. What they think is the
suite's answer, which the model never sees: the preference the run has to learn from
their signals alone. While `inverted_while` exists every user says the opposite, as a
client whose instrumentation broke would report.

Requests go to the servers in turn, as a Service spreads them, so a canary set of one
server in two answers about half of them. Each request is recorded as a JSON line
(`Record`): the benchmark reads back what was served, by whom, how fast, and whether
the feedback on it was stored. Which version answered a user cannot tell (no answer says
so); the benchmark reads it from the run's captures, by response id.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
import os
import random
import time
import uuid

import httpx
import msgspec

from rlfleet.launch.production import UsersConfig
from rlfleet.launch.stopping import process_settings, run_until_signalled
from rlfleet.rollout.environment.rewards import matches
from rlfleet.rollout.environment.tasks import load_suite, suite_path
from rlfleet.rollout.production.feedback import TOKEN_HEADER

log = logging.getLogger(__name__)

TIMEOUT_S = 120.0  # a request's, whatever the pool is doing


class Record(msgspec.Struct, frozen=True):
    """One request, as its user saw it."""

    at: float  # when it was sent
    server: str  # its name
    user: str
    task: str
    status: int  # the completion's HTTP status; 0: no answer at all
    latency_ms: float
    response_id: str | None = None
    right: bool | None = None
    said: str | None = None  # the feedback kind sent; None: silent
    inverted: bool = False
    feedback_status: int | None = None  # 200: stored


class Population:
    def __init__(self, config: UsersConfig, api_key: str) -> None:
        self.config = config
        self.tasks = load_suite(suite_path(config.suite))
        self.headers = {"Authorization": f"Bearer {api_key}"}
        self.servers = itertools.cycle(config.servers.items())
        self.rng = random.Random(config.seed)
        self.rng.shuffle(self.tasks)  # which questions are popular
        self.weights = [1 / (n + 1) ** config.popularity for n in range(len(self.tasks))]

    async def run(self, stop: asyncio.Event) -> None:
        limits = httpx.Limits(max_connections=self.config.users)
        self.config.record.parent.mkdir(parents=True, exist_ok=True)
        with self.config.record.open("a") as out:
            async with httpx.AsyncClient(timeout=TIMEOUT_S, limits=limits) as client:
                await self.until_serving(client, stop)
                users = [
                    asyncio.create_task(self.user(client, n, out, stop))
                    for n in range(self.config.users)
                ]
                await stop.wait()
                for user in users:
                    user.cancel()
                await asyncio.gather(*users, return_exceptions=True)

    async def until_serving(self, client: httpx.AsyncClient, stop: asyncio.Event) -> None:
        """Users come once production is up: every server answers its health check."""
        waiting = dict(self.config.servers)
        while waiting and not stop.is_set():
            for name, url in list(waiting.items()):
                with contextlib.suppress(httpx.HTTPError):
                    if (await client.get(f"{url}/health")).status_code == 200:
                        del waiting[name]
            await asyncio.sleep(1.0)
        log.info("%d users start on %d servers", self.config.users, len(self.config.servers))

    async def user(self, client: httpx.AsyncClient, n: int, out, stop: asyncio.Event) -> None:
        name = f"user-{n}"
        silent = n < round(self.config.users * self.config.silent_share)
        while not stop.is_set():
            record = await self.ask(client, name, silent)
            out.write(msgspec.json.encode(record).decode() + "\n")
            out.flush()
            await asyncio.sleep(self.rng.expovariate(1 / self.config.think_s))

    async def ask(self, client: httpx.AsyncClient, user: str, silent: bool) -> Record:
        task = self.rng.choices(self.tasks, self.weights)[0]
        server, url = next(self.servers)
        body = {
            "model": self.config.model,
            "messages": [{"role": "user", "content": task.prompt}],
            "max_tokens": self.config.max_tokens,
            "user": user,
        }
        sent = time.time()
        started = time.perf_counter()
        # As the pool's gateway forwards it, once it has authenticated the user.
        headers = self.headers | {self.config.user_header: user}
        try:
            answer = await client.post(f"{url}/v1/chat/completions", json=body, headers=headers)
        except httpx.HTTPError as error:
            log.warning("%s: no answer from %s: %r", user, server, error)
            return Record(sent, server, user, task.id, 0, _ms(started))
        base = Record(sent, server, user, task.id, answer.status_code, _ms(started))
        if answer.status_code != 200:
            return base
        reply = answer.json()
        assert task.answer is not None
        right = matches(reply["choices"][0]["message"]["content"] or "", task.answer)
        base = msgspec.structs.replace(base, response_id=reply["id"], right=right)
        token = answer.headers.get(TOKEN_HEADER.decode())
        if silent or token is None:  # none: an answer the pool does not capture
            return base
        inverted = self.config.inverted_while is not None and self.config.inverted_while.exists()
        likes = right != (self.rng.random() < self.config.noise)
        kind = "accepted" if likes != inverted else "rejected"
        event = {"response_id": reply["id"], "event_id": uuid.uuid4().hex, "kind": kind}
        status = await self.tell(client, url, event | {"token": token}, headers)
        return msgspec.structs.replace(base, said=kind, inverted=inverted, feedback_status=status)

    async def tell(self, client: httpx.AsyncClient, url: str, event: dict, headers: dict) -> int:
        """Sends the event until it is stored or refused: a 503 (NATS away) is retried
        with the same event id, as a client should, so it is recorded once."""
        for attempt in range(10):
            try:
                told = await client.post(f"{url}/v1/feedback", json=event, headers=headers)
                if told.status_code != 503:
                    return told.status_code
            except httpx.HTTPError:
                pass
            await asyncio.sleep(min(2**attempt * 0.1, 5.0))
        return 503


def _ms(started: float) -> float:
    return round((time.perf_counter() - started) * 1000, 2)


def main() -> None:
    config = process_settings("rlfleet.rollout.production.users", UsersConfig)
    logging.getLogger("httpx").setLevel(logging.WARNING)  # every request is in the record
    api_key = os.environ.get("VLLM_API_KEY", "")
    run_until_signalled(Population(config, api_key).run)


if __name__ == "__main__":
    main()

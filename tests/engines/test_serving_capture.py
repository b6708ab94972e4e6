"""A production pool's vLLM server captures what it serves, takes feedback on it, and
switches the version it serves in place when told: the real OpenAI-compatible server
with rlfleet's middleware, over HTTP, reaching the run's streams on a real NATS hub
through a region's leaf node, as the run's serving user. NATS is cut from under it by
a gate in the link, as a partition would."""

from __future__ import annotations

import asyncio
import json
import threading
import time
import uuid
from collections.abc import Iterator

import msgspec
import numpy as np
import pytest
from conftest import wait_for
from nats.js.errors import NotFoundError
from prometheus_client import REGISTRY
from router_agreement import agreement, trainer_model
from serving_pool import SIGNER, USER_HEADER, Pool, serving_pool

from rlfleet.api.inferencepool import ServedVersion
from rlfleet.api.wire import (
    BusRole,
    CapturedCompletion,
    Segment,
    ServingTarget,
    capture_stream,
    capture_subject,
    decode_feedback,
    encode,
    encode_captured,
    feedback_stream,
    feedback_subject,
    serving_subject,
)
from rlfleet.bus.connection import CREDENTIALS_ENV
from rlfleet.bus.streams import ensure_run_streams
from rlfleet.launch.production import ServingConfig
from rlfleet.local.nats import StandaloneNats
from rlfleet.models.tiny import read_weights, train_step
from rlfleet.operator.served import read_served
from rlfleet.rollout.engine import vllm_experts
from rlfleet.rollout.production.capture import Asked, Bus, Captures, Streamed, extract
from rlfleet.rollout.production.feedback import TOKEN_HEADER
from rlfleet.rollout.production.serving import MIDDLEWARE, vllm_arguments
from rlfleet.weightsync import Publisher, SyncConfig, WeightStream

WINDOW_S = 4.0  # the pool's feedback window
BUFFER = 3  # captures the server holds while NATS is away
SYNC = SyncConfig(shard_bytes=256 << 10, chunk_bytes=64 << 10)


@pytest.fixture(scope="module")
def pool(nats_servers: StandaloneNats, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Pool]:
    with serving_pool(
        nats_servers,
        tmp_path_factory.mktemp("serving"),
        feedback_window_s=WINDOW_S,
        custom_kinds=["copied"],
        buffer=BUFFER,
        replica_set="stable",
        weights_domain=nats_servers.region,
        weightsync=SYNC,
        poll_s=0.2,
        routed_experts=True,
    ) as started:
        yield started


def test_a_fresh_server_survives_a_short_prompt_as_its_first_request(pool: Pool):
    """First in this module: the pool's server has answered no request before it. On this
    project's CPU a fresh vLLM engine whose first prompt had four tokens or fewer died
    (SIGILL in its attention kernel); the server samples once before it takes requests
    (`rlfleet.rollout.production.serving.warm_up`), which also compiles what log-probs need."""
    body = {"model": "tiny", "prompt": [5, 6], "max_tokens": 2, "logprobs": 0}
    status, answer = pool.post("/v1/completions", body)
    assert status == 200, answer
    assert answer["usage"]["prompt_tokens"] == 2
    assert pool.chat("two plus two?")["choices"][0]["message"]["content"] is not None


def test_a_served_completion_is_captured_and_the_client_sees_only_what_it_asked(pool: Pool):
    plain = pool.chat("two plus two?", user="ada")
    (choice,) = plain["choices"]
    assert choice["logprobs"] is None and choice["token_ids"] is None
    assert plain["prompt_token_ids"] is None
    # The same request asking for what capture takes: the capture holds exactly that.
    full = pool.chat("two plus two?", logprobs=True, return_token_ids=True)
    assert full["choices"][0]["message"] == choice["message"]
    captured = wait_for("the capture", lambda: pool.capture(plain["id"]), timeout=30)
    segment = captured.segment
    completion = full["choices"][0]["token_ids"]
    assert segment.tokens == full["prompt_token_ids"] + completion
    assert segment.prompt_len == len(full["prompt_token_ids"])
    expected = [entry["logprob"] for entry in full["choices"][0]["logprobs"]["content"]]
    assert segment.logprobs == pytest.approx(expected, abs=1e-5)
    assert segment.versions == [0] * len(completion)  # the served checkpoint, version 0
    assert (captured.user, captured.text) == ("ada", choice["message"]["content"])
    # The experts the tiny MoE routed every token it ran to: the trainer replays them.
    assert (segment.moe_layers, segment.top_k) == (2, 2)
    experts = np.frombuffer(segment.routed_experts, "<u2").reshape(-1, 2, 2)
    assert len(experts) == len(segment.tokens) - 1
    assert min(agreement(trainer_model(pool.model), [(segment.tokens, experts)])) > 0.9
    other = wait_for("the other capture", lambda: pool.capture(full["id"]), timeout=30)
    assert other.segment.routed_experts == segment.routed_experts  # the same tokens

    opted_out = pool.chat("two plus two?", headers={"x-rlfleet-capture": "off"})
    assert opted_out["choices"][0]["message"] == choice["message"]
    # Sampled at another temperature than the trainer scores at: served, not captured.
    greedy = pool.chat("two plus two?", temperature=0)
    time.sleep(1)
    assert pool.capture(opted_out["id"]) is None and pool.capture(greedy["id"]) is None


def test_a_streamed_completion_is_relayed_as_asked_and_captured_whole(pool: Pool):
    events = pool.stream("two plus two?", user="lin")
    assert events[-1] == "[DONE]"
    chunks = [json.loads(event) for event in events[:-1]]
    # Capture asked vLLM for token ids and log-probs; no chunk carries them to this client.
    assert all(chunk.get("prompt_token_ids") is None for chunk in chunks)
    choices = [choice for chunk in chunks for choice in chunk["choices"]]
    assert all(c.get("logprobs") is None and c.get("token_ids") is None for c in choices)
    text = "".join(choice["delta"].get("content") or "" for choice in choices)
    # The same request whole, asking for them (the same seed: the same tokens).
    full = pool.chat("two plus two?", logprobs=True, return_token_ids=True)
    (answer,) = full["choices"]
    assert text == answer["message"]["content"]
    captured = wait_for("the stream's capture", lambda: pool.capture(chunks[0]["id"]), timeout=30)
    assert captured.segment.tokens == full["prompt_token_ids"] + answer["token_ids"]
    assert captured.segment.prompt_len == len(full["prompt_token_ids"])
    expected = [entry["logprob"] for entry in answer["logprobs"]["content"]]
    assert captured.segment.logprobs == pytest.approx(expected, abs=1e-5)
    assert (captured.user, captured.text) == ("lin", text)
    assert captured.finish_reason == answer["finish_reason"]
    # Its headers went before its id was in any chunk: they carry its token all the same.
    assert pool.given[chunks[0]["id"]][0] == "lin"
    assert pool.feedback(chunks[0]["id"]) == (200, {"status": "recorded", "late": False})
    whole = wait_for("the whole one's capture", lambda: pool.capture(full["id"]), timeout=30)
    assert captured.segment.routed_experts == whole.segment.routed_experts
    assert len(whole.segment.routed_experts) == 2 * 2 * 2 * (len(whole.segment.tokens) - 1)

    # A client that asks for them gets them in its chunks, as vLLM sends them.
    asked = [json.loads(e) for e in pool.stream("two plus two?", return_token_ids=True)[:-1]]
    assert asked[0]["prompt_token_ids"] == full["prompt_token_ids"]
    streamed = [t for chunk in asked for c in chunk["choices"] for t in c.get("token_ids") or []]
    assert streamed == answer["token_ids"]


def _chunk(token: int, **choice) -> dict:
    """A streamed chunk as vLLM sends it for a request that asked for everything."""
    entry = {"index": 0, "delta": {"content": f"t{token}"}, "token_ids": [token], **choice}
    entry["logprobs"] = {"content": [{"token": f"t{token}", "logprob": -0.5}]}
    first = {"prompt_token_ids": [1, 2]} if not token else {}
    return {"id": "chatcmpl-s", "choices": [entry]} | first


def test_a_stream_cut_anywhere_is_relayed_in_whole_events_and_read_once():
    """vLLM's events can reach the middleware split at any byte."""
    chunks = [_chunk(0), _chunk(1, finish_reason="stop"), {"id": "chatcmpl-s", "choices": []}]
    sent = b"".join(b"data: " + json.dumps(c).encode() + b"\n\n" for c in chunks)
    sent += b": a comment\n\ndata: [DONE]\n\n"
    stream = Streamed(Asked(logprobs=False, token_ids=False))
    relayed = b"".join(
        stream.relay(sent[at : at + 7], last=at + 7 >= len(sent)) for at in range(0, len(sent), 7)
    )
    *events, end = relayed.split(b"\n\n")
    assert end == b"" and events[-2:] == [b": a comment", b"data: [DONE]"]
    given = [json.loads(e.removeprefix(b"data: ")) for e in events[:-2]]
    assert [g["choices"][0]["delta"] for g in given[:2]] == [{"content": "t0"}, {"content": "t1"}]
    choices = [c for g in given for c in g["choices"]]
    assert all(c["logprobs"] is None and c["token_ids"] is None for c in choices)
    assert all(g["prompt_token_ids"] is None for g in given)
    assert stream.finished and not stream.unreadable
    captured = extract("run", stream.response(), "lin", 3, 0.0)
    assert (captured.segment.tokens, captured.segment.logprobs) == ([1, 2, 0, 1], [-0.5, -0.5])
    assert (captured.text, captured.finish_reason) == ("t0t1", "stop")
    assert captured.segment.versions == [3, 3]

    # Not of the shape expected: relayed as it came, and the stream is not captured.
    broken = Streamed(Asked(logprobs=False, token_ids=False))
    assert broken.relay(b"data: {oops\n\n", last=True) == b"data: {oops\n\n"
    assert broken.unreadable
    # Cut before its last token (the client left): an event's start passes as it came.
    cut = Streamed(Asked(logprobs=True, token_ids=True))
    first = b"data: " + json.dumps(_chunk(0)).encode() + b"\n\n"
    assert cut.relay(first + b"data: {", last=True).endswith(b"\n\ndata: {")
    assert not cut.finished


def test_feedback_gets_an_answer_for_each_kind_of_request(pool: Pool):
    answered = pool.ask("name a colour", user="grace")
    served = answered.body["id"]
    wait_for("the capture", lambda: pool.capture(served), timeout=30)
    token = pool.given[served][1]
    assert answered.headers[TOKEN_HEADER.decode()] == token

    def refused(answer: tuple[int, dict], status: int, param: str | None, says: str = "") -> bool:
        """An OpenAI-shaped error naming the field at fault."""
        code, body = answer
        error = body["error"]
        assert (code, error["param"], error["code"]) == (status, param, status), body
        assert says in error["message"] and error["type"], body
        return True

    nobody = "chatcmpl-nobody-served-this"
    assert refused(pool.feedback(nobody, token=SIGNER.token(nobody, "ada")), 404, "response_id")
    assert refused(pool.feedback(served, kind="loved"), 400, "kind", "'loved'")
    incomplete = {"response_id": served, "kind": "accepted", "token": token}
    assert refused(pool.post("/v1/feedback", incomplete), 400, "event_id")
    assert refused(pool.post("/v1/feedback", b"{not json"), 400, None)
    huge = {"response_id": served, "event_id": "e-2", "kind": "edited", "text": "x" * 60_000}
    assert refused(pool.post("/v1/feedback", huge), 413, None)
    assert refused(pool.feedback(served, kind="edited"), 400, "text", "final text")
    assert refused(pool.feedback(served, kind="thumbs", value=0.5), 400, "value")
    event = {"response_id": served, "event_id": "e-1", "kind": "accepted", "token": token}
    as_grace = {USER_HEADER: "grace"}
    assert refused(pool.post("/v1/feedback", event, as_grace, key=None), 401, None)
    assert refused(pool.post("/v1/feedback", event, as_grace, key="wrong"), 401, None)

    recorded = (200, {"status": "recorded", "late": False})
    assert pool.post("/v1/feedback", event, as_grace) == recorded
    assert pool.post("/v1/feedback", event, as_grace) == (200, {"status": "duplicate"})
    assert pool.feedback(served, kind="copied", value=-0.5)[0] == 200  # the pool's own kind
    assert pool.feedback(served, kind="edited", text="teal")[0] == 200

    subject = feedback_subject(pool.run, served, "e-1")
    stored = decode_feedback(pool.stored(feedback_stream(pool.run), subject))
    assert (stored.kind, stored.user, stored.late) == ("accepted", "grace", False)
    assert _messages(pool, feedback_subject(pool.run, served)) == 3  # the retry stored once

    time.sleep(WINDOW_S)
    assert pool.feedback(served)[1] == {"status": "recorded", "late": True}


def test_feedback_on_another_servers_capture_is_checked_in_the_stream(pool: Pool):
    segment = Segment(tokens=[5, 6, 7], prompt_len=2, generated=[1], logprobs=[-0.5], versions=[0])
    elsewhere = CapturedCompletion(
        pool.run, "chatcmpl-elsewhere", "lin", segment, "red", "stop", time.time()
    )

    async def publish() -> None:
        nc = await pool.nats.bed.hub.connect()
        subject = capture_subject(pool.run, elsewhere.response_id)
        await nc.jetstream().publish(subject, encode_captured(elsewhere))
        await nc.close()

    asyncio.run(publish())
    # The token the server that served it gave: every server of the pool holds its key.
    token = SIGNER.token(elsewhere.response_id, "lin")
    answer = pool.feedback(elsewhere.response_id, "thumbs", user="lin", token=token, value=1)
    assert answer == (200, {"status": "recorded", "late": False})


def test_with_nats_cut_requests_are_served_and_captures_wait_or_are_dropped_counted(pool: Pool):
    before_dropped = pool.metric('rlfleet_serving_captures_total{outcome="dropped_buffer_full"}')
    pool.gate.close()
    try:
        # One capture is being stored when NATS goes; BUFFER more wait behind it.
        held = BUFFER + 1
        ids = [pool.chat(f"count to {n}")["id"] for n in range(held + 2)]
        assert all(ids)  # every request served
        status, body = pool.feedback(ids[0])
        assert status == 503 and "retry" in body["error"]["message"]
        dropped = pool.metric('rlfleet_serving_captures_total{outcome="dropped_buffer_full"}')
        assert dropped - before_dropped == 2
    finally:
        pool.gate.open()
    # What the buffer held is stored once NATS is back; what it could not hold is not.
    for response_id in ids[:held]:
        wait_for("a buffered capture", lambda r=response_id: pool.capture(r), timeout=60)
    assert [pool.capture(r) for r in ids[held:]] == [None, None]
    assert pool.feedback(ids[0])[0] == 200
    # Feedback on a dropped one is acknowledged, not stored: no capture would match it.
    assert [pool.feedback(r) for r in ids[held:]] == [(200, {"status": "not_captured"})] * 2
    assert sum(_messages(pool, feedback_subject(pool.run, r)) for r in ids[held:]) == 0


def _messages(pool: Pool, subjects: str) -> int:
    async def count() -> int:
        nc = await pool.nats.bed.hub.connect()
        info = await nc.jetstream().stream_info(feedback_stream(pool.run), subjects_filter=subjects)
        await nc.close()
        return sum((info.state.subjects or {}).values())

    return asyncio.run(count())


def test_a_set_told_a_version_serves_it_in_place_back_and_ahead_no_request_fails(
    pool: Pool, tmp_path
):
    before = pool.chat("what is seven?", max_tokens=12, logprobs=True)
    assert _serves(pool, 0, "")  # the checkpoint it started from, digest unknown
    v1 = train_step(pool.model, tmp_path / "v1", lr=1e-2)

    def tell(version: int, standby: int | None = None) -> None:
        """Writes the stable set's target, as the conductor does."""
        target = ServingTarget(pool.run, "stable", version, time.time(), standby=standby)

        async def publish() -> None:
            nc = await pool.nats.bed.hub.connect()
            await nc.jetstream().publish(serving_subject(pool.run, "stable"), encode(target))
            await nc.close()

        asyncio.run(publish())

    async def versions() -> list[str]:
        nc = await pool.nats.bed.hub.connect()
        publisher = Publisher(WeightStream(nc, pool.run, SYNC), SYNC)
        digests = [
            (await publisher.publish(read_weights(model), version))[0].state_digest
            for version, model in enumerate((pool.model, v1))
        ]
        await nc.close()
        return digests

    digests = asyncio.run(versions())
    dropped, spanned = (
        'rlfleet_serving_captures_total{outcome="dropped_buffer_full"}',
        'rlfleet_serving_capture_skipped_total{reason="version_changed"}',
    )
    uncaptured_before = pool.metric(dropped) + pool.metric(spanned)
    served: list[tuple[int, str]] = []
    stop = threading.Event()

    def traffic() -> None:  # requests in flight all through the switch
        while not stop.is_set():
            answered = pool.ask("count on", max_tokens=24)
            served.append((answered.status, answered.body.get("id", "")))

    clients = [threading.Thread(target=traffic) for _ in range(3)]
    for client in clients:
        client.start()
    try:
        # Some traffic is served by version 0 first: the switch comes while it flows.
        wait_for("traffic before the switch", lambda: len(served) >= 3, timeout=60)
        tell(1)
        wait_for(
            "version 1 served",
            lambda: pool.metric("rlfleet_serving_policy_version") == 1,
            timeout=120,
        )
        time.sleep(1)
    finally:
        stop.set()
        for client in clients:
            client.join()
    assert {status for status, _ in served} == {200}, served
    # The traffic spanned the switch: served by version 0, then by 1 (those sampled
    # across it are not captured).
    wait_for(
        "the last captures stored",
        lambda: pool.metric("rlfleet_serving_capture_buffered") == 0,
        timeout=60,
    )
    captures = [pool.capture(response_id) for _, response_id in served]
    assert {tuple(set(c.segment.versions)) for c in captures if c} == {(0,), (1,)}
    # Feedback on one that spanned it, or that this pool's small buffer dropped (three
    # clients outpace it), is acknowledged: there is nothing to learn from it.
    uncaptured = pool.metric(dropped) + pool.metric(spanned) - uncaptured_before
    assert pool.metric(spanned) > 0
    told = [
        pool.feedback(r)
        for (_, r), captured in zip(served, captures, strict=True)
        if captured is None
    ]
    assert sum(answer == (200, {"status": "not_captured"}) for answer in told) == uncaptured
    after = pool.chat("what is seven?", max_tokens=12, logprobs=True)
    captured = wait_for("the capture", lambda: pool.capture(after["id"]), timeout=30)
    assert set(captured.segment.versions) == {1}
    assert after["choices"][0]["logprobs"] != before["choices"][0]["logprobs"]

    assert _serves(pool, 1, digests[1])
    # On-call reads the switch in the pod's log too, with the version and its digest.
    assert f"set stable serves version 1 (digest {digests[1]})" in pool.log.read_text()

    # Rolled back: it serves version 0 again, bit for bit.
    tell(0)
    wait_for("version 0 again", lambda: _serves(pool, 0, digests[0]), timeout=120)
    again = pool.chat("what is seven?", max_tokens=12, logprobs=True)
    assert again["choices"][0]["logprobs"] == before["choices"][0]["logprobs"]

    # With version 1 as its standby (a candidate under its canary), it holds it and still
    # serves version 0, bit for bit; told version 1 then, it writes what it holds without
    # fetching it again.
    fetched = "holding version 1 ("
    assert pool.log.read_text().count(fetched) == 1
    tell(0, standby=1)
    wait_for("version 1 fetched ahead", lambda: pool.log.read_text().count(fetched) == 2)
    assert _serves(pool, 0, digests[0])
    still = pool.chat("what is seven?", max_tokens=12, logprobs=True)
    assert still["choices"][0]["logprobs"] == before["choices"][0]["logprobs"]
    tell(1)
    wait_for("version 1 served again", lambda: _serves(pool, 1, digests[1]), timeout=120)
    assert pool.log.read_text().count(fetched) == 2

    # With version 0 as its standby (a canary's way back), it rebuilds it and still serves
    # version 1; rolled back then, it serves version 0 bit for bit, rebuilt once.
    rebuilt = "holding version 0 ("
    rebuilds = pool.log.read_text().count(rebuilt)
    tell(1, standby=0)
    wait_for("version 0 rebuilt", lambda: pool.log.read_text().count(rebuilt) == rebuilds + 1)
    assert _serves(pool, 1, digests[1])
    tell(0)
    wait_for("version 0 served again", lambda: _serves(pool, 0, digests[0]), timeout=120)
    restored = pool.chat("what is seven?", max_tokens=12, logprobs=True)
    assert restored["choices"][0]["logprobs"] == before["choices"][0]["logprobs"]
    assert pool.log.read_text().count(rebuilt) == rebuilds + 1


def _serves(pool: Pool, version: int, digest: str) -> bool:
    """Whether the server says it serves `version` with exactly that state digest, as the
    pool's region operator reads it for the InferencePool's status."""
    host, port = pool.url.removeprefix("http://").rsplit(":", 1)
    said = read_served(host, int(port), timeout_s=10)
    return said == ServedVersion(
        run=pool.run, replica_set="stable", version=version, digest=digest, replicas=1
    )


def test_the_launcher_keeps_the_arguments_capture_depends_on():
    plain = ServingConfig(run="r", nats_url="nats://x")
    arguments = vllm_arguments(plain, ["--model", "m"])
    assert arguments[:2] == ["--model", "m"]
    assert "processed_logprobs" in arguments and MIDDLEWARE in arguments
    assert "--weight-transfer-config" not in arguments  # it follows no versions
    extension = arguments[arguments.index("--worker-extension-cls") + 1]
    assert extension == vllm_experts.EXTENSION  # it can record routed experts
    assert "--enforce-eager" not in arguments  # and need not: it may run compiled
    replaying = msgspec.structs.replace(plain, routed_experts=True)
    assert "--enforce-eager" in vllm_arguments(replaying, [])  # the recorder needs eager
    following = msgspec.structs.replace(plain, replica_set="canary")
    assert "--weight-transfer-config" in vllm_arguments(following, [])
    with pytest.raises(ValueError, match="--logprobs-mode is rlfleet's"):
        vllm_arguments(plain, ["--logprobs-mode=raw_logprobs"])


def test_a_capture_too_large_for_a_message_is_dropped_counted_and_the_next_stored(
    nats_servers: StandaloneNats, tmp_path, monkeypatch: pytest.MonkeyPatch
):
    run = "capture-" + uuid.uuid4().hex[:6]
    (tmp_path / "serving.creds").write_text(nats_servers.bed.run_user(run, BusRole.SERVING))
    monkeypatch.setenv(CREDENTIALS_ENV, str(tmp_path / "serving.creds"))
    config = ServingConfig(run=run, nats_url=nats_servers.bed.hub.url)

    def completion(response_id: str, tokens: int) -> CapturedCompletion:
        segment = Segment(
            tokens=[7] * (tokens + 1),
            prompt_len=1,
            generated=[1] * tokens,
            logprobs=[-0.123456789] * tokens,
            versions=[0] * tokens,
        )
        return CapturedCompletion(run, response_id, "", segment, "", "length", time.time())

    def too_large() -> float:
        sample = {"outcome": "dropped_too_large"}
        return REGISTRY.get_sample_value("rlfleet_serving_captures_total", sample) or 0.0

    async def scenario() -> None:
        admin = await nats_servers.bed.hub.connect()
        await ensure_run_streams(admin, run, None)
        bus = Bus(config)
        await bus.keep_connected()
        dropped: list[str] = []
        captures = Captures(bus, 4, on_dropped=dropped.append)
        storing = asyncio.create_task(captures.store_forever())
        before = too_large()
        assert captures.offer(completion("long", 100_000))  # ~1.4 MB: more than a message
        assert captures.offer(completion("short", 10))
        js = admin.jetstream()
        deadline = time.monotonic() + 30
        while True:
            try:
                await js.get_last_msg(capture_stream(run), capture_subject(run, "short"))
                break
            except NotFoundError:
                assert time.monotonic() < deadline, "the capture after it was never stored"
                await asyncio.sleep(0.1)
        assert too_large() == before + 1 and dropped == ["long"]  # feedback on it: not_captured
        with pytest.raises(NotFoundError):
            await js.get_last_msg(capture_stream(run), capture_subject(run, "long"))
        storing.cancel()
        await bus.nc.close()
        await admin.close()

    asyncio.run(scenario())

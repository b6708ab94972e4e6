"""Attacks on production feedback, each one test, each against the real parts: a pool's
real vLLM server with rlfleet's middleware (one, in the canary set, shared by every
attack here), the run's streams on a real NATS hub reached through a region's leaf node,
and the run's real collector reading them.

Production feedback decides what production serves: a candidate trained on it is
promoted, and a canary is judged on it. An attack succeeds when one client steers that:
its events counted on responses not served to it, under users it is not, more often
than the caps allow, with values a kind does not take, or aimed at the set of servers it
learnt answered it. Each test asserts that it does not.
"""

from __future__ import annotations

import asyncio
import time
import uuid
from collections.abc import Iterator

import pytest
from conftest import wait_for
from serving_pool import USER_HEADER, Pool, chat_body, serving_pool

from rlfleet.api.wire import (
    CyclePhase,
    CycleState,
    Feedback,
    decode_trajectory,
    encode,
    feedback_stream,
    feedback_subject,
    trajectory_stream,
)
from rlfleet.launch.production import CollectorConfig, SignalRewards
from rlfleet.local.nats import StandaloneNats
from rlfleet.rollout.production.collector import Collector
from rlfleet.rollout.production.feedback import TOKEN_HEADER, PoolFeedback
from rlfleet.weightsync import SyncConfig

MAX_EVENTS = 4  # the pool's max_events_per_response
MAX_PER_USER = 3  # the run's max_per_user
SYNC = SyncConfig(shard_bytes=256 << 10, chunk_bytes=64 << 10)

attack = pytest.mark.attack("feedback")


@pytest.fixture(scope="module")
def pool(nats_servers: StandaloneNats, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Pool]:
    with serving_pool(
        nats_servers,
        tmp_path_factory.mktemp("attacks-feedback"),
        max_events_per_response=MAX_EVENTS,
        replica_set="canary",  # a set a client would like to know it reached
        weights_domain=nats_servers.region,
        weightsync=SYNC,
        poll_s=0.2,
        routed_experts=True,
    ) as started:
        yield started


def _served(pool: Pool, user: str, content: str = "name a colour", **fields) -> str:
    """A response served to `user` and captured: its id (`pool.given` holds its token)."""
    answered = pool.ask(content, user, **fields)
    assert answered.status == 200, answered.body
    response_id = answered.body["id"]
    wait_for("the capture", lambda: pool.capture(response_id), timeout=30)
    return response_id


def _token(pool: Pool, response_id: str) -> str | None:
    """The feedback token the response came with (None: it came with none)."""
    return pool.given.get(response_id, ("", None))[1]


def _stored(pool: Pool, response_id: str) -> int:
    """Feedback events stored on the response."""

    async def count() -> int:
        nc = await pool.nats.bed.hub.connect()
        try:
            subjects = feedback_subject(pool.run, response_id)
            info = await nc.jetstream().stream_info(
                feedback_stream(pool.run), subjects_filter=subjects
            )
            return sum((info.state.subjects or {}).values())
        finally:
            await nc.close()

    return asyncio.run(count())


def _refused(answer: tuple[int, dict], statuses: tuple[int, ...], param: str) -> None:
    status, body = answer
    assert status in statuses, body
    assert body["error"]["param"] == param, body


def _collector(pool: Pool) -> Collector:
    rewards = SignalRewards(
        window_s=0.01, max_per_user=MAX_PER_USER, max_events_per_response=MAX_EVENTS
    )
    config = CollectorConfig(
        run=pool.run,
        nats_url=pool.nats.bed.hub.url,
        rewards=rewards,
        interval_s=0,
        min_samples=1,
        settle_s=0,
    )
    return Collector(config)


async def _collect(pool: Pool, act) -> object:
    """What `act(collector, js)` gives, as the run's collector against the hub."""
    nc = await pool.nats.bed.hub.connect()
    try:
        return await act(_collector(pool), nc.jetstream())
    finally:
        await nc.close()


@attack
def test_feedback_without_a_token(pool: Pool):
    """Whoever holds the pool's API key (every client) posts on a response id they know."""
    victims = _served(pool, "victim")
    before = pool.metric('rlfleet_serving_feedback_total{outcome="unauthorized"}')
    body = {"response_id": victims, "event_id": uuid.uuid4().hex, "kind": "rejected"}
    _refused(pool.post("/v1/feedback", body, {USER_HEADER: "mallory"}), (401,), "token")
    _refused(pool.post("/v1/feedback", body, {USER_HEADER: "victim"}), (401,), "token")
    assert _stored(pool, victims) == 0
    assert pool.metric('rlfleet_serving_feedback_total{outcome="unauthorized"}') == before + 2


@attack
def test_forged_token(pool: Pool):
    """A token made up, or made under another pool's key."""
    mine = _served(pool, "mallory")
    other_pool = PoolFeedback(b"another pool's key", USER_HEADER.encode())
    before = pool.metric('rlfleet_serving_feedback_total{outcome="forbidden"}')
    for token in (None, "A" * 43, other_pool.token(mine, "mallory")):
        _refused(pool.feedback(mine, "thumbs", token=token, value=1), (401, 403), "token")
    assert _stored(pool, mine) == 0
    assert pool.metric('rlfleet_serving_feedback_total{outcome="forbidden"}') == before + 2


@attack
def test_token_of_another_response(pool: Pool):
    """A client's own token, sent with the id of a response served to someone else."""
    own_token = _token(pool, _served(pool, "mallory"))
    victims = _served(pool, "victim")
    answer = pool.feedback(victims, "rejected", user="mallory", token=own_token)
    _refused(answer, (403,), "token")
    assert _stored(pool, victims) == 0


@attack
def test_token_of_another_user(pool: Pool):
    """A victim's token for its response leaks (a log, a shared link): another user posts
    with it, as themselves."""
    victims = _served(pool, "victim")
    leaked = _token(pool, victims)
    _refused(pool.feedback(victims, "rejected", user="mallory", token=leaked), (403,), "token")
    _refused(pool.feedback(victims, "rejected", user="", token=leaked), (403,), "token")
    assert _stored(pool, victims) == 0
    assert pool.feedback(victims, "accepted")[0] == 200  # the victim's own still counts


@attack
def test_client_request_id_header_reused(pool: Pool):
    """Two requests (two users) with one `X-Request-Id`: vLLM would make it both
    responses' id, one event naming both captures."""
    chosen = {"x-request-id": "chosen-by-the-client"}
    first = pool.ask("name a colour", "mallory", chosen)
    second = pool.ask("name a colour", "victim", chosen)
    ids = [first.body["id"], second.body["id"]]
    assert ids[0] != ids[1] and not any("chosen" in i for i in ids)
    for response_id, user in zip(ids, ("mallory", "victim"), strict=True):
        captured = wait_for("the capture", lambda r=response_id: pool.capture(r), timeout=30)
        assert captured.user == user  # one capture under each id, its own
    assert "chosen" not in str(first.headers) + str(second.headers)


@attack
def test_body_request_id_reused(pool: Pool):
    """The same, with vLLM's `request_id` in the request body."""
    ids = [
        pool.ask("name a colour", user, request_id="chosen-in-the-body").body["id"]
        for user in ("mallory", "victim")
    ]
    assert ids[0] != ids[1] and not any("chosen" in i for i in ids)
    for response_id, user in zip(ids, ("mallory", "victim"), strict=True):
        captured = wait_for("the capture", lambda r=response_id: pool.capture(r), timeout=30)
        assert captured.user == user


@attack
def test_user_rotation_through_the_body(pool: Pool):
    """One client names a new `user` in each request body to walk past the cycle's
    per-user cap, accepting every answer it got."""
    mine = [
        _served(pool, "rotator", f"say {n}", body_user=f"sock-{n}") for n in range(2 * MAX_PER_USER)
    ]
    assert {pool.capture(r).user for r in mine} == {"rotator"}  # the gateway's, not the body's
    for response_id in mine:
        assert pool.feedback(response_id, "accepted")[0] == 200

    async def cycle(collector: Collector, js) -> list[str]:
        await collector.cycle(js, None, 1, time.time())
        info = await js.stream_info(trajectory_stream(pool.run))
        trained = []
        for seq in range(info.state.first_seq, info.state.last_seq + 1):
            message = await js.get_msg(trajectory_stream(pool.run), seq)
            trained.append(decode_trajectory(message.data).task_id)
        return trained

    trained = asyncio.run(_collect(pool, cycle))
    assert 0 < len(set(trained) & set(mine)) <= MAX_PER_USER


@attack
def test_two_verdicts_from_one_user(pool: Pool):
    """`accepted` then `rejected` from the response's user both counted (breakdown
    accepted 1.0, rejected -1.0, reward 0): signals stacked on one response."""
    mine = [_served(pool, "fickle", "name a shape") for _ in range(2)]  # each other's baseline
    for kind in ("accepted", "rejected"):
        assert pool.feedback(mine[0], kind)[0] == 200
        time.sleep(0.01)  # received one after the other
    assert pool.feedback(mine[1], "accepted")[0] == 200

    async def cycle(collector: Collector, js) -> dict[str, dict[str, float]]:
        # A cycle number of its own: the trajectories of another test's cycle 1 took its ids.
        report = await collector.cycle(js, None, 77, time.time())
        assert report is not None and report.superseded_feedback >= 1
        info = await js.stream_info(trajectory_stream(pool.run))
        found = {}
        for seq in range(info.state.first_seq, info.state.last_seq + 1):
            trajectory = decode_trajectory(
                (await js.get_msg(trajectory_stream(pool.run), seq)).data
            )
            found[trajectory.task_id] = trajectory.reward_breakdown
        return found

    trained = asyncio.run(_collect(pool, cycle))
    assert trained[mine[0]] == {"rejected": -1.0}  # the user's last word, alone
    assert trained[mine[1]] == {"accepted": 1.0}


@attack
def test_value_on_a_kind_that_takes_none(pool: Pool):
    """`rejected` with a value of -1 scored +1: the value times rejected's weight."""
    mine = _served(pool, "mallory")
    for kind in ("rejected", "accepted", "retried"):
        _refused(pool.feedback(mine, kind, value=-1), (400,), "value")
    assert _stored(pool, mine) == 0


@attack
def test_an_id_with_a_final_newline(pool: Pool):
    """`e1\n` passed the id pattern (`$` matches before a final newline) and reached a NATS
    subject: answered 503, retry, so a client retried it for ever."""
    mine = _served(pool, "mallory")
    for event_id in ("e1\n", "e1\r", "e\n1"):
        _refused(pool.feedback(mine, event_id=event_id), (400,), "event_id")
    assert _stored(pool, mine) == 0


@attack
def test_flooding_events_on_one_response(pool: Pool):
    """Events without end on one response: the feedback stream (bounded in count, and
    refusing new messages when full) would refuse every other user's."""
    mine = _served(pool, "mallory")
    answers = [pool.feedback(mine, "accepted") for _ in range(MAX_EVENTS + 3)]
    assert [status for status, _ in answers[:MAX_EVENTS]] == [200] * MAX_EVENTS
    for answer in answers[MAX_EVENTS:]:
        _refused(answer, (409,), "response_id")
    assert _stored(pool, mine) == MAX_EVENTS


@attack
def test_flooding_one_response_past_every_server(pool: Pool):
    """Events spread over many servers of the pool, each of which counts only its own:
    more than the cap get stored. The collector would load them all, and the later ones
    (a `rejected` after the first `thumbs` up) would change the reward."""
    since = time.time()
    mine = _served(pool, "mallory")
    user = pool.capture(mine).user

    async def flood() -> None:
        nc = await pool.nats.bed.hub.connect()
        js = nc.jetstream()
        for n in range(3 * MAX_EVENTS):  # as the pool's servers store what they take
            kind, value = ("thumbs", 1.0) if n < MAX_EVENTS else ("rejected", None)
            event_id = f"e{n}"
            event = Feedback(pool.run, mine, event_id, kind, value, None, user, time.time(), False)
            await js.publish(feedback_subject(pool.run, mine, event_id), encode(event))
        await nc.close()

    asyncio.run(flood())
    assert _stored(pool, mine) == 3 * MAX_EVENTS
    state = CycleState(pool.run, 7, CyclePhase.CANARY, since, 0)
    live = asyncio.run(_collect(pool, lambda c, js: c.tally(js, state, None)))
    tally = live.by_version[0]
    assert (tally.count, tally.total) == (1, 1.0)  # its first events only: thumbs up


@attack
def test_reading_which_set_served(pool: Pool):
    """A client that learns which set (canary or stable) or version answered rewards one
    and punishes the other, and the canary is judged on their difference."""
    answered = pool.ask("name a colour", "mallory")
    events, streamed = pool.streamed("name a colour", "mallory")
    for headers in (answered.headers, streamed):
        told = {name for name in headers if name.startswith("x-rlfleet-")}
        assert told == {TOKEN_HEADER.decode()}, headers
        assert not any(
            word in f"{name}: {value}".lower()
            for name, value in headers.items()
            for word in ("canary", "stable", "version", "replica")
        ), headers
    answer = dict(answered.body, choices=None)  # what the model said aside
    chunks = [e for e in events if e != "[DONE]"]
    for said in (str(answer), *chunks[:1]):
        assert "canary" not in said and "rlfleet" not in said, said


@attack
def test_canary_tally_dominated_by_one_user(pool: Pool):
    """One client answers many of the canary's completions, all rejected: the canary's
    live reward is theirs, and the candidate is rolled back (or, all accepted, promoted)."""
    since = time.time()
    loud = [_served(pool, "loud", f"count to {n}") for n in range(3 * MAX_PER_USER)]
    honest = [_served(pool, user, f"spell {user}") for user in ("ada", "grace") for _ in (1, 2)]
    for response_id in loud:
        assert pool.feedback(response_id, "rejected")[0] == 200
    for response_id in honest:
        assert pool.feedback(response_id, "accepted")[0] == 200
    state = CycleState(pool.run, 9, CyclePhase.CANARY, since, 0)
    live = asyncio.run(_collect(pool, lambda c, js: c.tally(js, state, None)))
    tally = live.by_version[0]
    assert (tally.count, tally.total) == (MAX_PER_USER + 4, 4.0 - MAX_PER_USER)


@attack
def test_impersonation_through_the_body(pool: Pool):
    """A client the gateway names no one names a victim in the body: its completions
    would be the victim's, using up the victim's share of the cycle, and its events
    would be stored as the victim's."""
    answered = pool.request(
        "/v1/chat/completions", chat_body("name a colour", user="victim", max_tokens=4)
    )
    response_id = answered.body["id"]
    captured = wait_for("the capture", lambda: pool.capture(response_id), timeout=30)
    assert captured.user == ""
    token = answered.headers[TOKEN_HEADER.decode()]
    _refused(pool.feedback(response_id, user="victim", token=token), (403,), "token")

"""The collector closes production cycles on a real NATS hub, as the run's collector user:
captures and feedback stored as a pool's servers store them become trajectories the
trainer accepts, each completion decided in exactly one cycle, across a restart."""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import time
import uuid

import pytest
from conftest import wait_for

from rlfleet.api.wire import (
    BusRole,
    CapturedCompletion,
    CyclePhase,
    CycleState,
    Feedback,
    Segment,
    capture_subject,
    cycle_state_subject,
    cycle_subject,
    decode_trajectory,
    encode,
    encode_captured,
    feedback_subject,
    trajectory_stream,
)
from rlfleet.bus.connection import CREDENTIALS_ENV, connect
from rlfleet.bus.streams import cycle_stream, ensure_run_streams
from rlfleet.launch.production import CollectorConfig, SignalRewards
from rlfleet.launch.settings import to_json
from rlfleet.local.nats import StandaloneNats
from rlfleet.rollout.production import collector as collector_module
from rlfleet.rollout.production.collector import Collector
from rlfleet.rollout.production.history import prompt_key
from rlfleet.trainer.validation import ModelShape, problem

WINDOW_S = 10.0
SHAPE = ModelShape(vocab_size=256, moe_layers=0, num_experts=0, top_k=0)


def _capture(
    run: str, response_id: str, user: str, served_at: float, prompt: tuple[int, int] = (7, 8)
) -> CapturedCompletion:
    segment = Segment(
        tokens=[*prompt, 9, 10], prompt_len=2, generated=[1, 1], logprobs=[-0.2, -0.7],
        versions=[0, 0],
    )  # fmt: skip
    return CapturedCompletion(run, response_id, user, segment, "four", "stop", served_at)


def _event(capture: CapturedCompletion, kind: str, value=None, text=None, late=False):
    return Feedback(
        capture.run, capture.response_id, uuid.uuid4().hex, kind, value, text, capture.user,
        capture.served_at + 1, late,
    )  # fmt: skip


async def _store(nc, captures, events) -> None:
    js = nc.jetstream()
    for capture in captures:
        await js.publish(
            capture_subject(capture.run, capture.response_id), encode_captured(capture)
        )
    for event in events:
        subject = feedback_subject(event.run, event.response_id, event.event_id)
        await js.publish(subject, encode(event))


async def _trajectories(nc, run: str) -> list:
    js = nc.jetstream()
    info = await js.stream_info(trajectory_stream(run))
    found = []
    for seq in range(info.state.first_seq, info.state.last_seq + 1):
        found.append(decode_trajectory((await js.get_msg(trajectory_stream(run), seq)).data))
    return found


def test_cycles_take_each_completion_once_and_score_it_from_its_signals(
    nats_servers: StandaloneNats, tmp_path, monkeypatch: pytest.MonkeyPatch
):
    run = "collect-" + uuid.uuid4().hex[:6]
    bed = nats_servers.bed
    (tmp_path / "serving.creds").write_text(bed.run_user(run, BusRole.SERVING))
    (tmp_path / "collector.creds").write_text(bed.run_user(run, BusRole.COLLECTOR))
    config = CollectorConfig(
        run=run,
        nats_url=bed.hub.url,
        rewards=SignalRewards(window_s=WINDOW_S, max_per_user=3, group_size=4),
        interval_s=0,
        min_samples=5,
        settle_s=0,
    )
    past = time.time() - 100
    ada = [_capture(run, f"ada-{i}", "ada", past + i) for i in range(5)]
    grace = [_capture(run, f"grace-{i}", "grace", past + 5 + i) for i in range(3)]
    lin, anonymous = _capture(run, "lin", "lin", past + 8), _capture(run, "anon", "", past + 9)
    recent = _capture(run, "recent", "ada", time.time())
    events = [
        *(_event(c, "accepted") for c in ada),  # the cap takes three of them
        _event(grace[0], "rejected"),
        _event(grace[1], "thumbs", -1.0),  # grace[2]: silence
        _event(lin, "accepted", late=True),
        _event(anonymous, "edited", text="four"),
        _event(recent, "accepted"),
    ]

    async def scenario():
        admin = await bed.hub.connect()
        await ensure_run_streams(admin, run, None)
        serving = await connect(bed.hub.url, tmp_path / "serving.creds")
        await _store(serving, [*ada, *grace, lin, anonymous, recent], events)

        monkeypatch.setenv(CREDENTIALS_ENV, str(tmp_path / "collector.creds"))
        nc = await connect(config.nats_url)
        js = nc.jetstream()
        collector = Collector(config)
        first = await collector.cycle(js, await collector.restore(js), 1, time.time())
        assert first is not None and first.cycle == 1
        assert (first.captured, first.with_feedback, first.trained_on) == (10, 8, 6)
        assert first.dropped == {"user_cap": 2, "no_signal": 2}
        assert first.signals == {"accepted": 3, "rejected": 1, "thumbs": 1, "edited": 1}
        assert first.late_feedback == 1
        trained = await _trajectories(admin, run)
        rewards = {t.task_id: t.reward for t in trained}
        assert rewards == {
            "ada-0": 1.0, "ada-1": 1.0, "ada-2": 1.0, "grace-0": -1.0, "grace-1": -1.0, "anon": 1.0
        }  # fmt: skip
        assert sorted(
            len([t for t in trained if t.group_id == g]) for g in {"cycle-1/0", "cycle-1/1"}
        ) == [3, 3]
        assert all(problem(t, SHAPE, run, needs_experts=False) is None for t in trained)

        # A canary after it tallies each answered completion with what the cycles closed
        # expected of it: of ada, who accepted all she was served, more than of grace.
        asked = prompt_key(recent)
        expects = collector.history.expected
        assert expects(asked, "ada") > expects(asked, "") > expects(asked, "grace")
        canary = CycleState(run, 2, CyclePhase.CANARY, recent.served_at, 0, candidate=1)
        tallied = await collector.tally(js, canary, first)
        assert list(tallied.by_version) == [0]  # the recent completion, accepted
        tally = tallied.by_version[0]
        assert (tally.count, tally.total, tally.expected_total) == (1, 1.0, expects(asked, "ada"))

        # A restarted collector goes on after the last cycle: the recent completion's
        # window is still open, so there is nothing to close yet.
        again = Collector(config)
        last = await again.restore(js)
        assert last == first
        assert again.history == collector.history  # cycle 1, replayed
        assert await again.cycle(js, last, 2, time.time()) is None
        later = [_capture(run, f"later-{i}", f"u{i}", time.time()) for i in range(4)]
        await _store(serving, later, [_event(c, "accepted") for c in later])
        second = await again.cycle(js, last, 2, time.time() + WINDOW_S + 1)
        assert (second.cycle, second.captured, second.trained_on) == (2, 5, 5)
        assert second.dropped == {}
        assert len(await _trajectories(admin, run)) == 11  # nothing of cycle 1 again
        for client in (admin, serving, nc):
            await client.close()

    asyncio.run(scenario())


def _answered(run: str, number: int, said) -> tuple[list, list]:
    """Cycle `number`'s captures, each of (prompt, user, liked), and each one's event:
    accepted if liked, else rejected; served a while ago, so every window has closed."""
    past = time.time() - 100
    captures, events = [], []
    for n, (prompt, user, liked) in enumerate(said):
        capture = _capture(run, f"c{number}-{n}", user, past + n / 100, (prompt, 100))
        captures.append(capture)
        events.append(_event(capture, "accepted" if liked else "rejected"))
    return captures, events


def _screening_config(nats_servers: StandaloneNats, tmp_path) -> CollectorConfig:
    """A run whose cycles close at 10 answers, its pool server's and collector's users
    written in `tmp_path`: the feedback screen's tests."""
    run = "collect-" + uuid.uuid4().hex[:6]
    bed = nats_servers.bed
    (tmp_path / "serving.creds").write_text(bed.run_user(run, BusRole.SERVING))
    (tmp_path / "collector.creds").write_text(bed.run_user(run, BusRole.COLLECTOR))
    rewards = SignalRewards(window_s=WINDOW_S, max_per_user=100, group_size=4)
    return CollectorConfig(
        run=run, nats_url=bed.hub.url, rewards=rewards, interval_s=0, min_samples=10, settle_s=0
    )


async def _screening_clients(nats_servers: StandaloneNats, config, tmp_path, monkeypatch):
    """The run's streams made; an admin's client, a pool server's and the collector's."""
    admin = await nats_servers.bed.hub.connect()
    await ensure_run_streams(admin, config.run, None)
    serving = await connect(config.nats_url, tmp_path / "serving.creds")
    monkeypatch.setenv(CREDENTIALS_ENV, str(tmp_path / "collector.creds"))
    return admin, serving, await connect(config.nats_url)


def test_a_cycle_whose_feedback_runs_against_history_is_held_back_not_trained_on(
    nats_servers: StandaloneNats, tmp_path, monkeypatch: pytest.MonkeyPatch
):
    """As when a client's instrumentation breaks: users accept what they rejected before
    on the same prompts, and reject what they accepted."""
    config = _screening_config(nats_servers, tmp_path)
    run = config.run

    def cycle(number: int, inverted: bool) -> tuple[list, list]:
        """Two answers to each of 40 prompts: the even ones liked, the odd ones not."""
        said = ((n % 40, f"u{n % 10}", (n % 40 % 2 == 0) != inverted) for n in range(80))
        return _answered(run, number, said)

    async def scenario():
        admin, serving, nc = await _screening_clients(nats_servers, config, tmp_path, monkeypatch)
        js, collector, last = nc.jetstream(), Collector(config), None
        reports = []
        for number, inverted in ((1, False), (2, False), (3, True), (4, False)):
            await _store(serving, *cycle(number, inverted))
            last = await collector.cycle(js, last, number, time.time())
            assert last is not None
            reports.append(last)
            trained = len(await _trajectories(admin, run))
            if number == 3:
                assert trained == 160  # nothing of the inverted cycle
        assert [r.trained_on for r in reports] == [80, 80, 0, 80]
        assert [bool(r.held_back) for r in reports] == [False, False, True, False]
        assert "run against what history expects" in reports[2].held_back
        assert "correlation -1.00 over 80 answers" in reports[2].held_back
        assert trained == 240 and all(r.distrusted == 0 for r in reports)
        for client in (admin, serving, nc):
            await client.close()

    asyncio.run(scenario())


def test_a_restarted_collector_distrusts_whom_it_did_and_knows_its_history(
    nats_servers: StandaloneNats, tmp_path, monkeypatch: pytest.MonkeyPatch
):
    """A user who reports the opposite from cycle 2 on is distrusted there; cycle 3 is
    held back. A collector started afresh on the same streams drops that user and expects
    what the first expected, as if it had never stopped, also once the cycle that found
    the user is older than those it replays."""
    config = _screening_config(nats_servers, tmp_path)
    run = config.run

    def cycle(number: int) -> tuple[list, list]:
        """Two answers to each of 40 prompts, the even ones liked; from cycle 2 the second
        of each goes to a user who says the opposite; in cycle 3 everyone does."""
        said = []
        for n in range(80):
            prompt, liar = n // 2, number > 1 and n % 2 == 1
            user = "liar" if liar else f"u{n % 10}"
            said.append((prompt, user, (prompt % 2 == 0) != (liar or number == 3)))
        return _answered(run, number, said)

    async def scenario():
        admin, serving, nc = await _screening_clients(nats_servers, config, tmp_path, monkeypatch)
        js, collector, last = nc.jetstream(), Collector(config), None
        reports = []
        for number in range(1, 5):
            await _store(serving, *cycle(number))
            last = await collector.cycle(js, last, number, time.time())
            reports.append(last)
        assert [r.trained_on for r in reports] == [80, 40, 0, 40]
        assert [r.distrusted_users for r in reports] == [(), ("liar",), (), ()]
        assert [bool(r.held_back) for r in reports] == [False, False, True, False]

        restored = Collector(config)
        assert await restored.restore(js) == reports[-1]
        assert restored.screen.distrusted == {"liar"}
        assert restored.history == collector.history
        users = {user for user in collector.screen.users if user != "liar"}
        assert {u: restored.screen.users[u] for u in users} == {
            u: collector.screen.users[u] for u in users
        }

        # Replaying only the last cycle trained on (cycle 4; 3 was held back): the user
        # found in cycle 2 is still dropped, by the report that named them.
        monkeypatch.setattr(collector_module, "REPLAYED_CYCLES", 1)
        shorter = Collector(config)
        await shorter.restore(js)
        assert shorter.screen.distrusted == {"liar"}
        assert "liar" not in shorter.history.users
        assert set(shorter.history.users) == {f"u{n}" for n in range(0, 10, 2)}
        for client in (admin, serving, nc):
            await client.close()

    asyncio.run(scenario())


def test_the_collector_runs_as_its_own_process_until_signalled(nats_servers, tmp_path):
    run = "collect-" + uuid.uuid4().hex[:6]
    bed = nats_servers.bed
    (tmp_path / "collector.creds").write_text(bed.run_user(run, BusRole.COLLECTOR))
    rewards = SignalRewards(window_s=WINDOW_S)
    config = CollectorConfig(
        run=run, nats_url=bed.hub.url, rewards=rewards, interval_s=0, min_samples=2, poll_s=0.2
    )
    (tmp_path / "collector.json").write_bytes(to_json(config))
    captures = [_capture(run, f"c{i}", f"u{i}", time.time() - 100) for i in range(3)]

    async def store() -> None:
        admin = await bed.hub.connect()
        await ensure_run_streams(admin, run, None)
        await _store(admin, captures, [_event(c, "accepted") for c in captures])
        # The conductor's word that cycle 1 is collecting: without it nothing closes.
        state = CycleState(run=run, number=1, phase=CyclePhase.COLLECTING, since=0, serving=0)
        await admin.jetstream().publish(cycle_state_subject(run), encode(state))
        await admin.close()

    async def reports() -> int:
        admin = await bed.hub.connect()
        info = await admin.jetstream().stream_info(cycle_stream(run), subjects_filter=">")
        await admin.close()
        return (info.state.subjects or {}).get(cycle_subject(run), 0)

    asyncio.run(store())
    env = os.environ | {CREDENTIALS_ENV: str(tmp_path / "collector.creds")}
    command = [
        sys.executable,
        "-m",
        "rlfleet.rollout.production.collector",
        str(tmp_path / "collector.json"),
    ]
    collector = subprocess.Popen(command, env=env, stderr=subprocess.PIPE, text=True)
    try:
        wait_for("a cycle report", lambda: asyncio.run(reports()) == 1, timeout=60)
    finally:
        collector.send_signal(signal.SIGTERM)
        _, errors = collector.communicate(timeout=30)
    assert collector.returncode == 0, errors
    assert "cycle 1: 3 completions, 3 answered, 3 trajectories" in errors

    (tmp_path / "bad.json").write_text('{"run": "x"}')
    bad = subprocess.run(
        [*command[:-1], str(tmp_path / "bad.json")], capture_output=True, text=True, timeout=60
    )
    assert bad.returncode == 1 and "nats_url" in bad.stderr and "Traceback" not in bad.stderr


def test_a_cycle_full_of_silence_closes_so_the_collector_goes_on(nats_servers, tmp_path):
    run = "collect-" + uuid.uuid4().hex[:6]
    config = CollectorConfig(
        run=run,
        nats_url=nats_servers.bed.hub.url,
        rewards=SignalRewards(window_s=WINDOW_S),
        interval_s=0,
        min_samples=5,
        max_samples=3,
        settle_s=0,
    )
    silent = [_capture(run, f"s{i}", "ada", time.time() - 100) for i in range(4)]

    async def scenario():
        admin = await nats_servers.bed.hub.connect()
        await ensure_run_streams(admin, run, None)
        await _store(admin, silent, [])
        collector, js = Collector(config), admin.jetstream()
        first = await collector.cycle(js, None, 1, time.time())
        assert (first.captured, first.trained_on, first.dropped) == (3, 0, {"no_signal": 3})
        assert await collector.cycle(js, first, 2, time.time()) is None  # one left, unanswered
        await admin.close()

    asyncio.run(scenario())

"""Users' signals to rewards and baseline groups: a pure decision, tried on cases with known
answers and on generated cycles for the properties every cycle must keep."""

from __future__ import annotations

from collections import Counter

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from rlfleet.api.wire import CapturedCompletion, Feedback, Segment
from rlfleet.launch.production import SignalRewards
from rlfleet.rollout.production.signals import Dropped, batch, reward, score_cycle

RUN = "live"
REWARDS = SignalRewards(max_per_user=3, group_size=4)


def capture(
    response_id: str, user: str = "ada", served_at: float = 0.0, text: str = "four", prompt=1
):
    segment = Segment(
        tokens=[prompt, 2, 3], prompt_len=2, generated=[1], logprobs=[-0.1], versions=[0]
    )
    return CapturedCompletion(RUN, response_id, user, segment, text, "stop", served_at)


def event(kind: str, value: float | None = None, text: str | None = None, **fields) -> Feedback:
    fields = {"received_at": 1.0, "late": False, "event_id": f"e-{kind}"} | fields
    return Feedback(RUN, "r", kind=kind, value=value, text=text, user="ada", **fields)


@pytest.mark.parametrize(
    ("events", "expected"),
    [
        ([event("accepted")], 1.0),
        ([event("rejected")], -1.0),
        ([event("retried")], -0.5),
        ([event("thumbs", -1.0)], -1.0),
        ([event("edited", text="four")], 1.0),  # kept as it was
        ([event("edited", text="")], -1.0),  # nothing of it survived
        ([event("copied")], 0.0),  # a kind with no weight counts nothing
        # One verdict per user and response, whatever the kinds: the later one.
        ([event("thumbs", 1.0), event("thumbs", -1.0, received_at=2.0, event_id="e2")], -1.0),
        ([event("accepted"), event("rejected", received_at=2.0)], -1.0),
        ([event("rejected"), event("accepted", received_at=2.0)], 1.0),
        ([event("accepted"), event("retried", received_at=2.0)], -0.5),
        ([event("accepted"), event("thumbs", 1.0, received_at=2.0)], 1.0),
        # A kind with no weight is no verdict, and replaces none.
        ([event("rejected"), event("copied", received_at=2.0)], -1.0),
    ],
)
def test_a_completions_reward_from_its_signals(events, expected):
    assert reward(capture("r"), events, REWARDS).reward == pytest.approx(expected)


def test_a_later_verdict_replaces_the_earlier_and_is_counted():
    """accepted then rejected by the one user a response's token names both counted
    (breakdown accepted 1.0, rejected -1.0, reward 0): the last word stands alone."""
    events = [
        event("accepted"),
        event("copied", received_at=2.0),
        event("rejected", received_at=3.0),
    ]
    scored = reward(capture("r"), events, REWARDS)
    assert (scored.reward, scored.breakdown, scored.replaced) == (-1.0, {"rejected": -1.0}, 1)
    samples = score_cycle([capture("r")], {"r": events}, REWARDS)
    assert samples.superseded == 1 and samples.scored[0].reward == -1.0


def test_a_value_counts_only_on_a_kind_that_takes_one():
    """A `rejected` sent with a value of -1 once scored +1 (the value times rejected's
    weight). The pool's servers refuse such events; one stored anyway scores as the kind
    says, and a pool's own kind still counts its value."""
    assert reward(capture("r"), [event("rejected", -1.0)], REWARDS).reward == -1.0
    assert reward(capture("r"), [event("accepted", -1.0)], REWARDS).reward == 1.0
    valued = SignalRewards(weights={"copied": 0.5})
    assert reward(capture("r"), [event("copied", -1.0)], valued).reward == -0.5


def test_a_response_id_is_trained_on_once_whatever_captures_name_it():
    """Two captures under one response id would both take its feedback: the first is
    trained on, the second dropped, counted."""
    twice = [capture("r", "ada", served_at=1.0), capture("r", "lin", served_at=2.0)]
    samples = score_cycle(twice, {"r": [event("accepted")]}, REWARDS)
    assert [s.capture.user for s in samples.scored] == ["ada"]
    assert samples.dropped[Dropped.DUPLICATE] == 1


def test_late_feedback_and_silence_teach_nothing():
    assert reward(capture("r"), [event("accepted", late=True)], REWARDS) is None
    samples = score_cycle(
        [capture("a"), capture("b")], {"a": [event("accepted", late=True)]}, REWARDS
    )
    assert samples.scored == [] and samples.dropped[Dropped.NO_SIGNAL] == 2
    assert samples.late == 1


users = st.sampled_from(["ada", "grace", "", "lin"])
kinds = st.sampled_from(["accepted", "rejected", "retried", "follow-up", "copied"])
prompts = st.integers(1, 12)


@st.composite
def cycles(draw):
    count = draw(st.integers(0, 40))
    captures = [  # prompts of a few kinds: some asked often, some once
        capture(f"c{i}", draw(users), served_at=draw(st.floats(0, 100)), prompt=draw(prompts))
        for i in range(count)
    ]
    feedback = {
        c.response_id: [event(k, late=draw(st.booleans())) for k in draw(st.sets(kinds))]
        for c in captures
    }
    return captures, feedback


@settings(max_examples=200, deadline=None)
@given(cycles(), st.integers(2, 10))
def test_every_capture_is_trained_on_once_or_dropped_with_a_reason(cycle, group_size):
    captures, feedback = cycle
    samples = score_cycle(captures, feedback, REWARDS)
    trajectories = batch(samples, "cycle-1", group_size, "serving")
    trained = {s.capture.response_id: s.capture for s in samples.scored}
    assert len(samples.scored) + sum(samples.dropped.values()) - samples.dropped[
        Dropped.NO_BASELINE
    ] == len(captures)
    assert len(trajectories) + samples.dropped[Dropped.NO_BASELINE] == len(samples.scored)
    assert sorted(t.task_id for t in trajectories) == sorted(
        {t.task_id for t in trajectories}
    )  # none twice
    per_user = {}
    for t in trajectories:
        user = next(c.user for c in captures if c.response_id == t.task_id)
        per_user[user] = per_user.get(user, 0) + 1
        assert -1 <= t.reward <= 1
    assert all(n <= REWARDS.max_per_user for n in per_user.values())
    groups = {}
    for t in trajectories:
        groups.setdefault(t.group_id, []).append(t)
    sizes = [len(g) for g in groups.values()]
    assert all(2 <= size <= max(group_size, 3) for size in sizes)  # 3 for 3 in groups of 2
    # A group is of one prompt, or of prompts asked once in the cycle, never a mix.
    asked = Counter(c.segment.tokens[0] for c in captures if c.response_id in trained)
    for group in groups.values():
        prompts_in = {trained[t.task_id].segment.tokens[0] for t in group}
        assert len(prompts_in) == 1 or all(asked[p] == 1 for p in prompts_in)
    for group in groups.values():
        assert sorted(t.attempt for t in group) == list(range(len(group)))
        assert all(t.group_size == len(group) for t in group)


def test_completions_of_one_prompt_are_each_others_baseline():
    """A popular question asked four times is one group, so each answer is judged against
    the others' rewards for the same question; the questions asked once share a group."""
    popular = [capture(f"p{i}", f"u{i}", prompt=7, served_at=i) for i in range(4)]
    once = [capture(f"o{i}", f"v{i}", prompt=20 + i, served_at=10 + i) for i in range(3)]
    kinds = ["accepted", "rejected", "rejected", "rejected", "accepted", "accepted", "rejected"]
    feedback = {c.response_id: [event(kind)] for c, kind in zip(popular + once, kinds, strict=True)}
    samples = score_cycle(popular + once, feedback, REWARDS)
    trajectories = batch(samples, "cycle-1", 8, "serving")
    groups: dict[str, set[str]] = {}
    for t in trajectories:
        groups.setdefault(t.group_id, set()).add(t.task_id)
    assert sorted(groups.values(), key=len) == [{"o0", "o1", "o2"}, {"p0", "p1", "p2", "p3"}]
    # One left alone has nothing to compare with.
    lonely = score_cycle(popular + once[:1], feedback, REWARDS)
    assert len(batch(lonely, "cycle-1", 8, "serving")) == 4
    assert lonely.dropped[Dropped.NO_BASELINE] == 1

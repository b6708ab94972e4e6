"""How the trainer batches trajectories into steps: a pure function of what arrived."""

from __future__ import annotations

from rlfleet.api.wire import Segment, Trajectory
from rlfleet.trainer.groups import GroupBuffer, Received
from rlfleet.trainer.rows import split_by_tokens

TOKENS = 10


def _item(
    seq: int, group: str, attempt: int, version: int = 0, arrived: float = 0.0, size: int = 2
) -> Received:
    segment = Segment(
        tokens=list(range(TOKENS)),
        prompt_len=4,
        generated=[1] * 6,
        logprobs=[-1.0] * 6,
        versions=[version] * 6,
    )
    trajectory = Trajectory(
        run="r",
        task_id=group,
        group_id=group,
        group_size=size,
        attempt=attempt,
        reward=0.0,
        reward_breakdown={},
        segments=[segment],
        worker="w",
        created_at=0.0,
    )
    return Received(seq, trajectory, arrived)


def _fill(buffer: GroupBuffer, groups: str, version: int = 0) -> None:
    seq = len(buffer.holds())
    for name in groups:
        for attempt in range(2):
            seq += 1
            buffer.add(_item(seq, name, attempt, version))


def test_a_step_waits_for_its_budget_of_complete_groups() -> None:
    buffer = GroupBuffer(timeout_s=60)
    _fill(buffer, "a")
    buffer.add(_item(99, "b", 0))  # half a group is not ready
    assert buffer.take(token_budget=30, token_cap=60, now=1.0) == []
    buffer.add(_item(100, "b", 1))
    taken = buffer.take(token_budget=30, token_cap=60, now=1.0)
    assert [[i.trajectory.group_id for i in g] for g in taken] == [["a", "a"], ["b", "b"]]
    assert buffer.groups == {}


def test_a_step_takes_what_is_ready_up_to_its_cap_oldest_first() -> None:
    buffer = GroupBuffer(timeout_s=60)
    _fill(buffer, "abcde")
    taken = buffer.take(token_budget=20, token_cap=60, now=1.0)
    assert [g[0].trajectory.group_id for g in taken] == ["a", "b", "c"]
    assert set(buffer.groups) == {"d", "e"}


def test_a_step_of_a_fixed_group_count_takes_exactly_that_many_oldest_first() -> None:
    buffer = GroupBuffer(timeout_s=60)
    _fill(buffer, "ab")
    buffer.add(_item(99, "c", 0))  # half a group is not ready
    assert buffer.take_groups(3, now=1.0) == []
    _fill(buffer, "de")
    taken = buffer.take_groups(3, now=1.0)
    assert [g[0].trajectory.group_id for g in taken] == ["a", "b", "d"]
    assert set(buffer.groups) == {"c", "e"}


def test_stale_trajectories_leave_the_buffer_to_be_counted() -> None:
    buffer = GroupBuffer(timeout_s=60)
    _fill(buffer, "ab", version=0)
    _fill(buffer, "c", version=3)
    dropped = buffer.drop_stale(version=4, max_staleness=2)
    assert sorted(i.trajectory.group_id for i in dropped) == ["a", "a", "b", "b"]
    assert set(buffer.groups) == {"c"}


def test_a_group_that_never_fills_trains_late_or_expires() -> None:
    buffer = GroupBuffer(timeout_s=60)
    buffer.add(_item(1, "lonely", 0, arrived=0.0))
    assert buffer.expire(now=30.0) == []
    assert [i.seq for i in buffer.expire(now=61.0)] == [1]
    # Two of three attempts are enough to compare, once the third is overdue.
    buffer.add(_item(2, "late", 0, size=3))
    buffer.add(_item(3, "late", 1, size=3))
    assert buffer.take(token_budget=20, token_cap=40, now=30.0) == []
    assert [i.seq for i in buffer.take(token_budget=20, token_cap=40, now=61.0)[0]] == [2, 3]


def test_an_attempt_published_twice_is_held_once() -> None:
    # A rollout worker that died after publishing runs the task again: same group and
    # attempts, new stream sequences. The group must not grow past its size.
    buffer = GroupBuffer(timeout_s=60)
    assert buffer.add(_item(1, "a", 0))
    assert not buffer.add(_item(2, "a", 0))
    assert buffer.add(_item(3, "a", 1))
    taken = buffer.take(token_budget=1, token_cap=60, now=1.0)
    assert [[i.seq for i in g] for g in taken] == [[1, 3]]


def test_the_buffer_takes_no_more_than_a_few_steps_worth_and_frees_room_as_steps_go() -> None:
    buffer = GroupBuffer(timeout_s=60)
    # Steps of 20 to 40 tokens: room until 8 steps' caps (320 tokens, 16 groups) are held.
    _fill(buffer, "abcdefghijklmno")  # 15 groups of 2 attempts, 300 tokens
    assert buffer.has_room(step_groups=None, step_token_cap=40)
    _fill(buffer, "p")
    assert not buffer.has_room(step_groups=None, step_token_cap=40)
    buffer.take(token_budget=20, token_cap=40, now=1.0)
    assert buffer.has_room(step_groups=None, step_token_cap=40)
    # Counted in groups when a step is a number of groups, half-filled ones included:
    # 14 are left.
    assert not buffer.has_room(step_groups=1, step_token_cap=40)
    assert buffer.has_room(step_groups=2, step_token_cap=40)
    buffer.add(_item(500, "q", 0))
    buffer.add(_item(501, "r", 0))  # 16 groups: two steps' 8 each
    assert not buffer.has_room(step_groups=2, step_token_cap=40)


def _answer(prompt: list[int], answer: int) -> Segment:
    return Segment(
        tokens=prompt + [7] * answer,
        prompt_len=len(prompt),
        generated=[1] * answer,
        logprobs=[-1.0] * answer,
        versions=[0] * answer,
    )


def test_micro_batches_keep_a_group_together_and_stay_within_the_budget() -> None:
    # Two groups of four, arriving interleaved, with answers of different lengths.
    first, second = [1, 2, 3, 4], [5, 6, 7, 8, 9, 10]
    items = [
        (_answer(prompt, answer), 0.0) for answer in (1, 5, 2, 4) for prompt in (second, first)
    ]
    budget = 4 * 11  # four rows of the longest sequence, 6 + 5 tokens
    batches = split_by_tokens(items, budget)
    assert sorted(len(batch) for batch in batches) == [4, 4]
    for batch in batches:
        # One prompt per micro-batch: it runs through the model once.
        assert len({tuple(s.tokens[: s.prompt_len]) for s, _ in batch}) == 1
        assert len(batch) * max(len(s.tokens) for s, _ in batch) <= budget
    assert sum(len(batch) for batch in split_by_tokens(items, 1)) == len(items)

"""What a production pool's history expects of a completion's reward
(`rlfleet.rollout.production.history`): the covariate a canary's difference is adjusted by."""

from __future__ import annotations

import pytest

from rlfleet.api.wire import CapturedCompletion, Segment
from rlfleet.rollout.production.history import DECAY, FORGOTTEN, PRIOR, RewardHistory, prompt_key


def capture(prompt: list[int], completion: list[int], user: str = "ada") -> CapturedCompletion:
    tokens = prompt + completion
    return CapturedCompletion(
        run="live",
        response_id="chatcmpl-" + "-".join(map(str, tokens)),
        user=user,
        segment=Segment(
            tokens=tokens,
            prompt_len=len(prompt),
            generated=[1] * len(completion),
            logprobs=[0.0] * len(completion),
            versions=[3] * len(completion),
        ),
        text="",
        finish_reason="stop",
        served_at=1e9,
    )


def test_a_history_that_knows_nothing_expects_nothing():
    assert RewardHistory().expected("any prompt", "anyone") == 0.0


def test_an_easy_prompt_is_expected_to_do_better_than_a_hard_one_the_more_it_was_seen():
    history = RewardHistory()
    history.learn(
        [("easy", f"u{n}", 1.0) for n in range(8)]
        + [("hard", f"u{n}", -1.0) for n in range(8)]
        + [("once", "u0", 1.0)]
    )
    mean = 1 / 17
    assert history.expected("easy", "new") == pytest.approx(mean + 8 * (1 - mean) / (8 + PRIOR))
    assert history.expected("hard", "new") < mean < history.expected("easy", "new")
    # Seen once, it is shrunk halfway to everyone's mean; never seen, it is that mean.
    assert history.expected("once", "new") == pytest.approx(mean + (1 - mean) / (1 + PRIOR))
    assert history.expected("unseen", "new") == pytest.approx(mean)


def test_a_user_who_rewards_more_is_expected_to_again():
    history = RewardHistory()
    history.learn([(f"p{n}", "kind", 1.0) for n in range(10)] + [("p0", "harsh", -1.0)] * 10)
    assert history.expected("p5", "kind") > history.expected("p5", "harsh")


def test_older_cycles_count_less_and_are_forgotten():
    history = RewardHistory()
    history.learn([("old", "ada", 1.0)])
    history.learn([("new", "ada", -1.0)])
    assert history.prompts["old"].weight == DECAY
    cycles = 1
    while "old" in history.prompts:
        history.learn([])
        cycles += 1
    assert DECAY**cycles < FORGOTTEN <= DECAY ** (cycles - 1)


def test_a_prompt_is_known_by_its_tokens_whatever_was_answered_to_whom():
    asked = prompt_key(capture([5, 6, 7], [8, 9]))
    assert prompt_key(capture([5, 6, 7], [10], user="bob")) == asked
    assert prompt_key(capture([5, 6], [7, 8, 9])) != asked

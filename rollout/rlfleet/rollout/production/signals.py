"""Users' feedback on production completions, made rewards the trainer learns from.

Pure: the collector gives it a cycle's captures and the feedback stored on them, and
gets back trajectories and counts of what was left out and why.

A completion's reward is its user's verdict: the latest on-time signal of a kind that has
a weight, weighted (`SignalRewards.weights`: accepted +1, rejected -1, an edit scored by
how much of the answer survived, and so on) and clipped to [-1, 1]. One verdict per
user and response, whatever the kinds (only the completion's user holds its token):
accepted then rejected is a rejection, the user's last word, where summing every kind
made it 0 and let one client stack signals. The verdicts replaced are counted
(`superseded`). A signal of a kind without weight (`copied`, by default) is no verdict
and replaces none. A value counts only on a kind that takes one (thumbs, a pool's own
kinds): the pool's servers refuse it elsewhere, and one stored anyway changes nothing.
Feedback after the window was decided without it (the stream keeps it, marked late).
A completion nobody answered within the window teaches nothing and is dropped, counted:
silence is not a rejection (many clients never send feedback at all). No user counts for
more than `max_per_user` completions of a cycle, and a response id for more than one.

**The baseline.** Production traffic has no GRPO groups of its own, but the trainer's
group normalisation needs a baseline. Completions of one prompt (a popular question, a
retry) are grouped together: their mean reward is the baseline of each, which knows the
prompt's difficulty, as GRPO's does. The rest are grouped `group_size` at a time in the
order they were served (`batch`), and each group's mean is its members' baseline: a
batch-mean baseline, as REINFORCE uses. Both keep no state across cycles, so a restart
resumes exactly and a drifting accept rate is followed at once (a running mean per task
kind would not). The batch mean's cost is variance (the baseline does not know the
prompt's difficulty), paid by larger groups; a member's own reward in the mean shrinks
its advantage by 1/group_size.
"""

from __future__ import annotations

import difflib
import math
from collections import Counter
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from enum import StrEnum

from rlfleet.api.wire import CapturedCompletion, Feedback, FeedbackKind, Trajectory, takes_value
from rlfleet.launch.production import SignalRewards

# An edit is compared on at most this much text: difflib's matching grows with the square.
SIMILARITY_CHARS = 4096


class Dropped(StrEnum):
    NO_SIGNAL = "no_signal"  # nobody answered within the window
    USER_CAP = "user_cap"  # its user had given this cycle `max_per_user` already
    # The cycle's only completion of a prompt not asked twice: nothing to compare with.
    NO_BASELINE = "no_baseline"
    DUPLICATE = "duplicate"  # a second capture under a response id: its feedback is the first's
    # Its user's feedback runs against the pool's history (`rlfleet.rollout.production.agreement`).
    DISTRUSTED = "distrusted"


@dataclass(frozen=True)
class Scored:
    capture: CapturedCompletion
    reward: float
    breakdown: dict[str, float]  # the verdict's kind and its part of the reward
    replaced: int = 0  # earlier verdicts of the user the last one replaced


@dataclass
class CycleSamples:
    scored: list[Scored] = field(default_factory=list)
    dropped: Counter[Dropped] = field(default_factory=Counter)
    late: int = 0  # feedback events that came after their window
    superseded: int = 0  # verdicts a later one of the same user replaced


def similarity(a: str, b: str) -> float:
    """How much of `a` survives in `b`, 0 to 1."""
    return difflib.SequenceMatcher(None, a[:SIMILARITY_CHARS], b[:SIMILARITY_CHARS]).ratio()


def _signal(event: Feedback, capture: CapturedCompletion) -> float:
    """One signal's score before its weight, -1 to 1."""
    if event.kind == FeedbackKind.EDITED:
        return 2 * similarity(capture.text, event.text or "") - 1
    if event.value is None or not takes_value(event.kind):
        return 1.0
    return min(1.0, max(-1.0, event.value))


def reward(
    capture: CapturedCompletion, events: Iterable[Feedback], rewards: SignalRewards
) -> Scored | None:
    """The completion's reward, its user's latest on-time verdict, and how many earlier
    verdicts it replaced; None if it had no on-time feedback."""
    on_time = sorted((e for e in events if not e.late), key=lambda e: e.received_at)
    if not on_time:
        return None
    verdicts = [e for e in on_time if rewards.weights.get(e.kind, 0.0)]
    if not verdicts:  # answered, with no verdict
        return Scored(capture, 0.0, {on_time[-1].kind: 0.0})
    last = verdicts[-1]
    value = min(1.0, max(-1.0, rewards.weights[last.kind] * _signal(last, capture)))
    return Scored(capture, value, {last.kind: value}, replaced=len(verdicts) - 1)


def score_cycle(
    captures: Iterable[CapturedCompletion],
    feedback: Mapping[str, list[Feedback]],
    rewards: SignalRewards,
) -> CycleSamples:
    """Every capture of a cycle scored or dropped with its reason, in the order served;
    `feedback` maps a response id to the events stored on it."""
    samples = CycleSamples()
    taken: Counter[str] = Counter()
    seen: set[str] = set()
    for capture in sorted(captures, key=lambda c: (c.served_at, c.response_id)):
        if capture.response_id in seen:
            samples.dropped[Dropped.DUPLICATE] += 1
            continue
        seen.add(capture.response_id)
        events = feedback.get(capture.response_id, [])
        samples.late += sum(event.late for event in events)
        scored = reward(capture, events, rewards)
        samples.superseded += scored.replaced if scored is not None else 0
        if scored is None:
            samples.dropped[Dropped.NO_SIGNAL] += 1
        elif taken[capture.user] >= rewards.max_per_user:
            samples.dropped[Dropped.USER_CAP] += 1
        else:
            taken[capture.user] += 1
            samples.scored.append(scored)
    return samples


def batch(samples: CycleSamples, cycle: str, group_size: int, worker: str) -> list[Trajectory]:
    """The cycle's scored completions as trajectories, in baseline groups of at most
    `group_size` (or three, where two would leave one alone), at least two each: first
    the completions that share a prompt, then the rest in the order served. A completion
    with nothing to compare with (the only one of the rest) is dropped, counted."""
    by_prompt: dict[tuple[int, ...], list[Scored]] = {}
    for scored in samples.scored:
        segment = scored.capture.segment
        by_prompt.setdefault(tuple(segment.tokens[: segment.prompt_len]), []).append(scored)
    shared = [group for group in by_prompt.values() if len(group) > 1]
    alone = [group[0] for group in by_prompt.values() if len(group) == 1]
    if len(alone) == 1:  # nothing to compare it with
        samples.dropped[Dropped.NO_BASELINE] += 1
        alone = []
    groups = [g for members in [*shared, alone] for g in _split(members, group_size)]
    return [
        _trajectory(scored, f"{cycle}/{index}", len(group), attempt, worker)
        for index, group in enumerate(groups)
        for attempt, scored in enumerate(group)
    ]


def _split(members: list[Scored], group_size: int) -> list[list[Scored]]:
    """`members` in groups as near to `group_size` as splits them evenly, two at least."""
    count = len(members)
    groups = min(math.ceil(count / group_size), count // 2)
    found, start = [], 0
    for index in range(groups):
        size = count // groups + (index < count % groups)
        found.append(members[start : start + size])
        start += size
    return found


def _trajectory(scored: Scored, group: str, size: int, attempt: int, worker: str) -> Trajectory:
    capture = scored.capture
    return Trajectory(
        run=capture.run,
        task_id=capture.response_id,
        group_id=group,
        group_size=size,
        attempt=attempt,
        reward=scored.reward,
        reward_breakdown=scored.breakdown,
        segments=[capture.segment],
        worker=worker,
        created_at=capture.served_at,
    )

"""`python -m rlfleet.rollout.production.collector CONFIG.json`: a production run's collector. What
its pool served and what users said of it, turned cycle by cycle into trajectories for
the trainer (`rlfleet.rollout.production.signals` decides).

The capture stream is read in order from where the last cycle stopped, which the cycle
report records (`CycleReport.capture_seq`) and a restarted collector reads back, so each
completion is decided in exactly one cycle. A restarted collector also gets back what it
knew (`Collector.restore`): the users the reports name as distrusted, and the history it
replays from the last cycles' captures and feedback. A completion is taken once its feedback
window has closed (and `settle_s` more, for events still in flight); reading stops at
the first that is not ready, so none is skipped. Its events are read from the feedback
stream by subject, its first `max_events_per_response` only: the pool's servers refuse
more, and however many got past several of them, no more are loaded. A cycle closes
when `interval_s` has passed since the last one and at least `min_samples` of the
completions it would take were answered (or it holds `max_samples`, answered or not, so
silence cannot stall the collector); its trajectories are published (a retry after a
crash is deduplicated by id within the stream's window), then its report. Before that,
its feedback is screened against the pool's history (`rlfleet.rollout.production.agreement`): a
cycle whose rewards run against it is held back (no trajectories; its report says why),
and a user whose feedback does so over the run is distrusted and dropped from then on,
from the canary's tally too.

The run's conductor paces it: a cycle closes only while the conductor's state says that
cycle is collecting, so the trainer never learns from the next cycle's traffic while a
candidate is still being judged. During a canary it also tallies users' rewards so far
on the completions served since the canary began, by the version that served them
(`LiveRewards`): what the conductor judges the canary on, each reward with what the
cycles it closed before expected of it (`rlfleet.rollout.production.history`). There too no user
counts for more than `max_per_user` completions of a version, and a response id for one.
"""

from __future__ import annotations

import asyncio
import logging
import math
import sys
import time
from collections import Counter
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

import msgspec
import prometheus_client

from rlfleet.api.wire import (
    MAX_NAMED_USERS,
    CapturedCompletion,
    CyclePhase,
    CycleReport,
    CycleState,
    Feedback,
    LiveRewards,
    RewardTally,
    capture_stream,
    capture_subject,
    cycle_groups,
    cycle_state_subject,
    cycle_subject,
    decode_captured,
    decode_cycle_report,
    decode_cycle_state,
    decode_feedback,
    encode,
    encode_trajectory,
    feedback_stream,
    feedback_subject,
    live_subject,
    trajectory_subject,
)
from rlfleet.bus.connection import connect
from rlfleet.bus.reading import decoded, messages, newest
from rlfleet.bus.streams import cycle_stream
from rlfleet.launch import components
from rlfleet.launch.production import CollectorConfig
from rlfleet.launch.stopping import run_until_signalled, wait_set
from rlfleet.rollout.production.agreement import FeedbackScreen, Screened
from rlfleet.rollout.production.history import RewardHistory, prompt_key
from rlfleet.rollout.production.signals import CycleSamples, batch, reward, score_cycle

log = logging.getLogger(__name__)

cycles_closed = prometheus_client.Counter("rlfleet_collector_cycles_total", "Cycles closed")
published = prometheus_client.Counter(
    "rlfleet_collector_trajectories_total", "Trajectories published for the trainer"
)
malformed = prometheus_client.Counter(
    "rlfleet_collector_malformed_total", "Captures or feedback events unreadable, skipped"
)
tally_capped = prometheus_client.Counter(
    "rlfleet_collector_canary_user_capped_total",
    "Answered completions left out of a canary's tally: their user had max_per_user there",
)

held_back = prometheus_client.Counter(
    "rlfleet_collector_cycles_held_back_total",
    "Cycles not trained on: their feedback ran against the pool's history",
)
distrusted = prometheus_client.Counter(
    "rlfleet_collector_users_distrusted_total",
    "Users whose feedback ran against the pool's history, dropped from then on",
)

WORKER = "collector"  # what the trajectories name as their worker
# Cycles trained on that a restarted collector replays into its history (held-back ones
# between them are passed over): older ones' rewards are about forgotten
# (`rlfleet.rollout.production.history.FORGOTTEN`).
REPLAYED_CYCLES = 8


@dataclass
class _Tally:
    """A canary's live rewards as they come in (`Collector.tally`)."""

    canary: tuple[int, float]  # its cycle and when it began
    cursor: int  # the capture stream's last sequence read
    pending: dict[str, CapturedCompletion] = field(default_factory=dict)  # no feedback yet
    by_version: dict[int, RewardTally] = field(default_factory=dict)
    seen: set[str] = field(default_factory=set)  # response ids read: each counts once
    taken: Counter[tuple[int, str]] = field(default_factory=Counter)  # (version, user)


class Collector:
    def __init__(self, config: CollectorConfig) -> None:
        self.config = config
        self.live: _Tally | None = None
        # What the cycles closed so far expect of a completion: a canary's covariate.
        self.history = RewardHistory()
        # Which users' feedback agrees with that history: poisoned feedback is not trained on.
        self.screen = FeedbackScreen()

    async def run(self, stopping: asyncio.Event) -> None:
        nc = await connect(self.config.nats_url)
        try:
            js = nc.jetstream(domain=self.config.jetstream_domain)
            last = await self.restore(js)
            while not stopping.is_set():
                state = await self.conductor_state(js)
                if state is not None and may_close(state, last):
                    last = await self.cycle(js, last, state.number, time.time()) or last
                elif state is not None and state.phase == CyclePhase.CANARY:
                    await self.tally(js, state, last)
                await wait_set(stopping, self.config.poll_s)
        finally:
            await nc.close()

    async def restore(self, js) -> CycleReport | None:
        """What the collector knew when it last stopped, from what the streams keep; the
        last cycle's report, from whose `capture_seq` it goes on. Whom it distrusts, every
        report names; history and the users' records, the last `REPLAYED_CYCLES` cycles
        trained on are replayed into (captures and feedback as they closed with, judged
        as their reports say: a held-back cycle is not replayed, a distrusted user is
        dropped from the cycle that found them). Captures older than the streams keep
        are gone: history is then thinner, as after a quiet week."""
        run = self.config.run
        stream, subject = cycle_stream(run), cycle_subject(run)
        reports = [
            report
            async for _, report in decoded(
                js, stream, subject, decode_cycle_report, 0, malformed.inc
            )
        ]
        if not reports:
            return None
        trained = [at for at, report in enumerate(reports) if not report.held_back]
        first = trained[-REPLAYED_CYCLES] if len(trained) > REPLAYED_CYCLES else 0
        for report in reports[:first]:
            self.screen.distrusted.update(report.distrusted_users)
        if unnamed := sum(max(r.distrusted - len(r.distrusted_users), 0) for r in reports):
            log.warning(
                "%d distrusted users are not named in the cycle reports kept (more than %d "
                "in a cycle, or an older collector's): trusted again", unnamed, MAX_NAMED_USERS,
            )  # fmt: skip
        after = reports[first - 1].capture_seq if first else 0
        for report in reports[first:]:
            if not report.held_back:
                await self._replay(js, report, after)
            after = report.capture_seq
        log.info(
            "restored from %d cycle reports: %d users distrusted, history of %d prompts",
            len(reports), len(self.screen.distrusted), len(self.history.prompts),
        )  # fmt: skip
        return reports[-1]

    async def _replay(self, js, report: CycleReport, after: int) -> None:
        captures = []
        async for seq, capture in self._captures(js, after):
            if seq > report.capture_seq:
                break
            if capture is not None:
                captures.append(capture)
        samples = self.screen.replay(
            score_cycle(captures, await self._feedback(js, captures), self.config.rewards),
            self.history,
            report.distrusted_users,
        )
        self._learn(samples)

    async def conductor_state(self, js) -> CycleState | None:
        run = self.config.run
        subject = cycle_state_subject(run)
        return await newest(js, cycle_stream(run), subject, decode_cycle_state, malformed.inc)

    async def tally(self, js, state: CycleState, last: CycleReport | None) -> LiveRewards:
        """Rewards so far on what was served since the canary began, by version; published.
        Each capture is read once; its feedback is looked up until some comes or its
        window closes (silence: nothing to tally)."""
        run, rewards = self.config.run, self.config.rewards
        if self.live is None or self.live.canary != (state.number, state.since):
            self.live = _Tally((state.number, state.since), last.capture_seq if last else 0)
        live = self.live
        async for seq, capture in self._captures(js, live.cursor):
            if len(live.pending) >= self.config.max_samples:
                break  # the rest wait for the next poll
            live.cursor = seq
            if capture is None or capture.served_at < state.since:
                continue
            if capture.response_id not in live.seen:
                live.seen.add(capture.response_id)
                live.pending[capture.response_id] = capture
        now = time.time()
        for response_id, capture in list(live.pending.items()):
            events = [e for e in await self._events(js, response_id) if not e.late]
            trusted = capture.user not in self.screen.distrusted
            scored = reward(capture, events, rewards) if events and trusted else None
            version = capture.segment.versions[0]
            if scored is not None and live.taken[version, capture.user] >= rewards.max_per_user:
                tally_capped.inc()
            elif scored is not None:
                live.taken[version, capture.user] += 1
                expected = self.history.expected(prompt_key(capture), capture.user)
                live.by_version[version] = live.by_version.get(version, RewardTally()).add(
                    scored.reward, expected
                )
            if events or now - capture.served_at > rewards.window_s:
                del live.pending[response_id]
        tallied = LiveRewards(run=run, cycle=state.number, by_version=live.by_version, at=now)
        await js.publish(live_subject(run), encode(tallied))
        return tallied

    async def cycle(
        self, js, last: CycleReport | None, number: int, now: float
    ) -> CycleReport | None:
        """Close cycle `number` if it is due and has enough answered completions."""
        if last is not None and now - last.finished_at < self.config.interval_s:
            return None
        captures, seq = await self._ready_captures(js, last.capture_seq if last else 0, now)
        feedback = await self._feedback(js, captures)
        answered = sum(any(not e.late for e in events) for events in feedback.values())
        # A cycle full of completions nobody answered closes anyway, so the next is read.
        if answered < self.config.min_samples and len(captures) < self.config.max_samples:
            return None
        screened = self.screen.screen(
            score_cycle(captures, feedback, self.config.rewards), self.history
        )
        samples = screened.samples
        for user, record in screened.distrusted.items():
            distrusted.inc()
            log.warning(
                "cycle %d: %s's feedback runs against the pool's history (%s): dropped "
                "from now on", number, user, record.describe(),
            )  # fmt: skip
        if screened.held_back:
            log.warning("cycle %d held back: %s", number, screened.held_back)
            held_back.inc()
            trajectories = []
        else:
            trajectories = batch(
                samples, cycle_groups(number), self.config.rewards.group_size, WORKER
            )
        run = self.config.run
        for trajectory in trajectories:
            msg_id = f"{run}/{trajectory.group_id}/{trajectory.attempt}"
            await js.publish(
                trajectory_subject(run),
                encode_trajectory(trajectory),
                headers={"Nats-Msg-Id": msg_id},
            )
        published.inc(len(trajectories))
        report = self._report(number, seq, captures, answered, screened, len(trajectories))
        await js.publish(cycle_subject(run), encode(report))
        cycles_closed.inc()
        if not screened.held_back:
            self._learn(samples)
        log.info(
            "cycle %d: %d completions, %d answered, %d trajectories, reward %.3f",
            number, report.captured, answered, report.trained_on, report.reward_mean,
        )  # fmt: skip
        return report

    def _learn(self, samples: CycleSamples) -> None:
        self.history.learn(
            (prompt_key(s.capture), s.capture.user, s.reward) for s in samples.scored
        )

    def _report(
        self,
        number: int,
        seq: int,
        captures: list[CapturedCompletion],
        answered: int,
        screened: Screened,
        trained_on: int,
    ) -> CycleReport:
        samples = screened.samples
        signals = Counter(kind for scored in samples.scored for kind in scored.breakdown)
        rewards = [scored.reward for scored in samples.scored]
        served = [c.served_at for c in captures]
        return CycleReport(
            run=self.config.run,
            cycle=number,
            capture_seq=seq,
            captured=len(captures),
            with_feedback=answered,
            trained_on=trained_on,
            dropped={str(reason): count for reason, count in samples.dropped.items()},
            signals=dict(signals),
            late_feedback=samples.late,
            superseded_feedback=samples.superseded,
            reward_mean=math.fsum(rewards) / len(rewards) if rewards else 0.0,
            served_from=min(served, default=0.0),
            served_to=max(served, default=0.0),
            finished_at=time.time(),
            held_back=screened.held_back,
            distrusted=len(screened.distrusted),
            distrusted_users=tuple(sorted(screened.distrusted)[:MAX_NAMED_USERS]),
        )

    async def _ready_captures(
        self, js, after: int, now: float
    ) -> tuple[list[CapturedCompletion], int]:
        """Captures after sequence `after` whose window has closed, in order, up to the
        first that has not (or `max_samples`); and the last sequence taken."""
        ready = now - self.config.rewards.window_s - self.config.settle_s
        captures, seq = [], after
        async for at, capture in self._captures(js, after):
            if capture is not None:
                if len(captures) >= self.config.max_samples or capture.served_at > ready:
                    break
                captures.append(capture)
            seq = at  # an unreadable one is passed over for good
        return captures, seq

    async def _captures(
        self, js, after: int
    ) -> AsyncIterator[tuple[int, CapturedCompletion | None]]:
        """The run's captures after sequence `after`, in order, with their sequences; an
        unreadable one is counted and comes as None."""
        run = self.config.run
        async for message in messages(js, capture_stream(run), capture_subject(run), after):
            try:
                capture = decode_captured(message.data)
                if capture.run != run:
                    raise msgspec.ValidationError(f"a capture of run {capture.run!r}")
            except msgspec.DecodeError:
                malformed.inc()
                capture = None
            yield message.seq, capture

    async def _feedback(self, js, captures: list[CapturedCompletion]) -> dict[str, list[Feedback]]:
        """Each capture's events, by response id."""
        return {c.response_id: await self._events(js, c.response_id) for c in captures}

    async def _events(self, js, response_id: str) -> list[Feedback]:
        """The response's first `max_events_per_response` events, the unreadable counted."""
        run, events, read = self.config.run, [], 0
        subject = feedback_subject(run, response_id)
        async for message in messages(js, feedback_stream(run), subject, 0):
            if read == self.config.rewards.max_events_per_response:
                break
            read += 1
            try:
                event = decode_feedback(message.data)
            except msgspec.DecodeError:
                malformed.inc()
                continue
            if (event.run, event.response_id) == (run, response_id):
                events.append(event)
            else:
                malformed.inc()
        return events


def may_close(state: CycleState | None, last: CycleReport | None) -> bool:
    """Whether the conductor's state lets a cycle close: it collects one not closed yet.
    Cycles are the conductor's to number: one an on-call order ended while collecting
    is never closed, and what it had gathered goes to the next."""
    closed = last.cycle if last else 0
    return state is not None and state.phase == CyclePhase.COLLECTING and state.number > closed


def main() -> None:
    config = components.component_settings(sys.argv[1:], components.COLLECTOR)
    if config.metrics_port is not None:
        prometheus_client.start_http_server(config.metrics_port)
    run_until_signalled(Collector(config).run)


if __name__ == "__main__":
    main()

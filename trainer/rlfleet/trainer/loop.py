"""The asynchronous training loop: trajectories in, policy versions out.

Rank 0 runs the `Trainer`; the job's other ranks `follow` it (`rlfleet.trainer.follower`;
`rlfleet.trainer.distributed` says why one reader feeds them all).

Per step: take full GRPO groups up to the token budget, one optimiser step, save a
checkpoint that names the stream sequences it consumed, publish the new weights, and
only then acknowledge those sequences. A trainer killed anywhere resumes from its last
checkpoint: trajectories it had not trained on are redelivered; ones the checkpoint
already holds are recognised by sequence and acknowledged without training twice.

A production run's trainer (`production`) also follows its conductor: it keeps the
checkpoint of the version production serves, and that version on the weight stream (for
a canary's rollback and the gate's evaluation), and when a candidate is refused it goes
back to it (`TrainerReset`), weights and optimiser, so the next candidate grows from
what users saw. Versions count on: the next one after a reset is a new number.
"""

from __future__ import annotations

import asyncio
import json
import logging
import sys
import time

import msgspec
import nats.errors
import prometheus_client
from nats.aio.msg import Msg

from rlfleet.api.wire import (
    CyclePhase,
    DropReason,
    FinishedCycle,
    StepReport,
    Trajectory,
    TrajectoryDrop,
    cycle_state_subject,
    decode_cycle_state,
    decode_trainer_reset,
    decode_trajectory,
    encode,
    step_subject,
    trainer_reset_subject,
    trajectory_id,
    trajectory_stream,
)
from rlfleet.bus import connection
from rlfleet.bus.patience import TRANSIENT, patiently
from rlfleet.bus.reading import newest
from rlfleet.bus.streams import (
    TRAINER_ACK_WAIT_S,
    TRAINER_CONSUMER,
    bind_consumer,
    bind_stream,
    cycle_stream,
    step_stream,
)
from rlfleet.launch.settings import TrainerConfig
from rlfleet.trainer import distributed, metrics
from rlfleet.trainer.distributed import Kind, Order
from rlfleet.trainer.follower import publish, rank_publisher
from rlfleet.trainer.groups import GroupBuffer, Received, staleness
from rlfleet.trainer.held_out import HeldOut
from rlfleet.trainer.policy import Policy, StepResult
from rlfleet.trainer.rows import Rows
from rlfleet.trainer.step import Batch, assemble, step_report
from rlfleet.trainer.tracking import TRACKING_FLUSH_S, Tracker
from rlfleet.trainer.validation import problem

log = logging.getLogger(__name__)

FETCH_WAIT_S = 0.2  # the longest a fetch waits for trajectories before the loop goes on
CONDUCTOR_POLL_S = 1.0  # how often a production run's trainer reads its conductor's word


class Trainer:
    def __init__(self, config: TrainerConfig) -> None:
        self.config = config
        self.buffer = GroupBuffer(timeout_s=config.group_timeout_s)
        self.messages: dict[int, Msg] = {}  # held stream sequence -> message to acknowledge
        self.consumed: set[int] = set()  # sequences the last checkpoint trained on
        self.step = 0
        self.dropped_stale = 0
        self.rejected = 0
        self.stopping = asyncio.Event()
        self.ready_at = time.perf_counter()  # when the trainer last became free to train
        self.ack_wait_s = TRAINER_ACK_WAIT_S  # its consumer's, once bound
        self.log_path = config.checkpoint_dir / "steps.jsonl"
        # Every trajectory acknowledged without training, and why: with the step log, what
        # accounts for each one the stream holds (a redelivered drop is written again).
        self.drops_path = config.checkpoint_dir / "drops.jsonl"
        self.resets = 0  # the conductor's resets applied (`TrainerReset.number`)
        # A production run's serving version and the one before it, whose checkpoints
        # and weights are kept to go back to.
        self.pinned: tuple[int, ...] = ()
        self.cycle_phase: CyclePhase | None = None  # a production run's, as last read
        self.cycle_history: list[FinishedCycle] = []
        # The trajectories of a production run's last cycles, to score the next on (in
        # every checkpoint).
        self.held_out = HeldOut()
        self.conductor_due = 0.0
        self.tracker = Tracker(config.tracking) if config.tracking is not None else None

    @property
    def version(self) -> int:
        return self.step

    @property
    def max_staleness(self) -> int:
        """A production run's cycles bound staleness instead: a cycle's trajectories are
        all of the serving version, taken before the next cycle is collected; and after a
        reset version numbers run ahead of the weights' distance from it."""
        return sys.maxsize if self.config.production else self.config.max_staleness

    async def run(self) -> None:
        config = self.config
        config.checkpoint_dir.mkdir(parents=True, exist_ok=True)
        if config.metrics_port is not None:
            prometheus_client.start_http_server(config.metrics_port)
        self.policy = await asyncio.to_thread(Policy, config)
        state = await asyncio.to_thread(self.policy.load)
        self._resume(state)
        if state is None and config.production:  # version 0 is a serving version too
            await asyncio.to_thread(self.policy.save, 0, self._client_state([], None))
        nc = await connection.connect(config.nats_url, max_reconnect_attempts=-1)
        try:
            js = nc.jetstream(domain=config.jetstream_domain)
            for stream in (trajectory_stream(config.run), step_stream(config.run)):
                await bind_stream(js, stream)
            self.publisher = await rank_publisher(nc, config)
            self.publisher.pinned = min(self.pinned, default=None)  # and all after it
            # The run's owner made the consumer: its ack wait is the one kept to.
            stream = trajectory_stream(config.run)
            consumer = await bind_consumer(js, stream, TRAINER_CONSUMER)
            self.ack_wait_s = consumer.config.ack_wait or self.ack_wait_s
            subscription = await js.pull_subscribe_bind(durable=TRAINER_CONSUMER, stream=stream)
            await self._publish_weights()
            self.ready_at = time.perf_counter()
            holding = asyncio.create_task(self._keep_held())
            try:
                while not self.stopping.is_set() and not self._done():
                    await self._follow_conductor(js)
                    await self._receive(subscription)
                    if not await self._maybe_step(js) and distributed.world() > 1:
                        await asyncio.to_thread(self._order, Kind.IDLE)
            finally:
                holding.cancel()
            if distributed.world() > 1:
                await asyncio.to_thread(self._order, Kind.STOP)
        finally:
            await nc.close()
            if self.tracker is not None:  # the last steps too, unless it is down
                await asyncio.to_thread(self.tracker.flush, TRACKING_FLUSH_S)

    async def _keep_held(self) -> None:
        """Tells JetStream, a third of the ack wait apart, that every trajectory held is in
        progress: a live trainer keeps them however long a step or a group takes, and a
        killed one's come back to its successor after one short ack wait, still fresh."""
        while True:
            await asyncio.sleep(self.ack_wait_s / 3)
            for msg in list(self.messages.values()):
                try:
                    await msg.in_progress()
                except TRANSIENT as error:  # NATS restarting: the next round tells it again
                    log.warning("keeping held trajectories: %r", error)
                    break

    def _step_token_cap(self) -> int:
        return self.config.max_step_tokens or 2 * self.config.step_tokens

    def _done(self) -> bool:
        return self.config.max_steps is not None and self.step >= self.config.max_steps

    def _resume(self, state: dict | None) -> None:
        if state is None:
            log.info("starting run %s from %s", self.config.run, self.config.model)
            return
        self.step = state["step"]
        self.consumed = set(state["consumed"])
        self.dropped_stale = state["dropped_stale"]
        self.rejected = state["rejected"]
        self.resets, pinned = state.get("resets", 0), state.get("pinned")
        self.held_out = HeldOut.decode(state.get("held_out"))
        # One version, an int, in checkpoints from before the one before it was kept too.
        self.pinned = (
            tuple(pinned) if isinstance(pinned, list) else () if pinned is None else (pinned,)
        )
        # The step log line is written after the checkpoint; a crash between them loses it.
        # (A production run's version 0 checkpoint has no step to log.)
        if state["report"] is not None and self.step not in self._logged_steps():
            self._append_log(state["report"])
        log.info("resumed at step %d (policy version %d)", self.step, self.version)

    def _logged_steps(self) -> set[int]:
        if not self.log_path.exists():
            return set()
        return {json.loads(line)["step"] for line in self.log_path.read_text().splitlines()}

    def _append_log(self, report: dict) -> None:
        with self.log_path.open("a") as f:
            f.write(json.dumps(report) + "\n")

    async def _receive(self, subscription) -> None:
        if not self.buffer.has_room(self.config.step_groups, self._step_token_cap()):
            await asyncio.sleep(FETCH_WAIT_S)  # a step frees room
            return
        try:
            messages = await subscription.fetch(batch=256, timeout=FETCH_WAIT_S)
        except (TimeoutError, nats.errors.TimeoutError):  # nothing yet
            return
        except TRANSIENT as error:  # NATS restarting: the loop comes round again
            log.warning("fetching: %r", error)
            await asyncio.sleep(FETCH_WAIT_S)
            return
        now = time.monotonic()
        for msg in messages:
            seq = msg.metadata.sequence.stream
            if seq in self.consumed:
                # Trained on before a restart, but its acknowledgement never landed.
                metrics.trajectories.labels("duplicate").inc()
                log.info("stream sequence %d was trained on before the restart: acknowledged", seq)
                await msg.ack()
                continue
            if seq in self.messages:
                self.messages[seq] = msg  # a redelivery of one we hold: ack the newest
                continue
            trajectory = self._accept(msg.data, seq)
            if trajectory is None:
                self._record_drops([(seq, None)], "rejected")
                await msg.term()  # it can never become valid: do not redeliver
                continue
            if staleness(trajectory, self.version) > self.max_staleness:
                self._drop_stale([Received(seq, trajectory, now)])
                await msg.ack()
                continue
            if not self.buffer.add(Received(seq, trajectory, now)):
                metrics.trajectories.labels("duplicate").inc()
                log.info(
                    "group %s already holds attempt %d: acknowledged",
                    trajectory.group_id,
                    trajectory.attempt,
                )
                await msg.ack()
                continue
            self.messages[seq] = msg

    def _accept(self, data: bytes, seq: int) -> Trajectory | None:
        try:
            trajectory = decode_trajectory(data)
            reason = problem(
                trajectory, self.policy.shape, self.config.run, needs_experts=self.policy.replay
            )
        except (msgspec.ValidationError, msgspec.DecodeError) as error:
            trajectory, reason = None, f"malformed: {error}"
        if reason is None:
            return trajectory
        self.rejected += 1
        label = reason.split(":", 1)[0]
        metrics.rejected.labels(label).inc()
        metrics.trajectories.labels("rejected").inc()
        log.warning("rejected trajectory at stream sequence %d: %s", seq, reason)
        return None

    def _record_drops(self, drops: list[tuple[int, Trajectory | None]], reason: DropReason) -> None:
        """Written before the acknowledgement: a written line survives the process's
        SIGKILL, so every acknowledged drop is on record."""
        with self.drops_path.open("ab") as f:
            for seq, trajectory in drops:
                named = None if trajectory is None else trajectory_id(trajectory)
                f.write(msgspec.json.encode(TrajectoryDrop(seq, named, reason)) + b"\n")

    def _drop_stale(self, items: list[Received]) -> None:
        self._record_drops([(i.seq, i.trajectory) for i in items], "stale")
        for item in items:
            self.dropped_stale += 1
            metrics.trajectories.labels("stale").inc()
            log.warning(
                "dropped stale trajectory %s/%d: policy version %d is %d behind %d (max %d)",
                item.trajectory.group_id,
                item.trajectory.attempt,
                item.trajectory.policy_version,
                staleness(item.trajectory, self.version),
                self.version,
                self.max_staleness,
            )

    async def _ack(self, seqs) -> None:
        # All at once: one round trip each, a step's worth (128 in the demo) took 15 ms in
        # sequence against 3 at once (bench/acks.py). A lost ack is redelivered and known
        # by the checkpoint's `consumed`.
        async with asyncio.TaskGroup() as acks:  # one failing for good cancels the rest
            for seq in seqs:
                if (msg := self.messages.pop(seq, None)) is not None:
                    what = f"acknowledging stream sequence {seq}"
                    acks.create_task(patiently(msg.ack_sync, what))

    def _order(self, kind: Kind, step: int = 0) -> None:
        distributed.send([Order(kind, step)] * distributed.world())

    def _deal(self, micro_batches: list[Rows], tokens: int, held_out: list[Rows]) -> StepResult:
        """Deals the step's micro-batches (and held-out ones) to the ranks and trains on
        rank 0's share."""
        world = distributed.world()
        shares = zip(
            distributed.share(micro_batches, world), distributed.share(held_out, world), strict=True
        )
        orders = [
            Order(Kind.STEP, self.step + 1, share, tokens, self.pinned, rows)
            for share, rows in shares
        ]
        mine = distributed.send(orders)
        return self.policy.train_step(mine.micro_batches, tokens, mine.held_out)

    async def _maybe_step(self, js) -> bool:
        """Trains one step if one is ready; returns whether it did."""
        now = time.monotonic()
        await self._drop_unusable(now)
        groups = self._take(now)
        if not groups:
            return False
        started = time.perf_counter()
        waited = started - self.ready_at
        config = self.config
        batch = assemble(groups, config.micro_batch_tokens, self.policy.pad_id, config.production)
        result = await self._train(batch)
        # Made before the commit, whose checkpoint holds it (`_resume`).
        totals = (self.dropped_stale, self.rejected)
        report = step_report(
            config.run,
            self.step,
            self.version,
            batch,
            result,
            totals=totals,
            started=started,
            waited=waited,
        )
        weights = await self._commit(batch, report)
        await self._report(js, report, result, weights)
        return True

    async def _drop_unusable(self, now: float) -> None:
        """Acknowledges what can no longer be trained on: trajectories gone stale, and
        those of groups that never filled."""
        stale = self.buffer.drop_stale(self.version, self.max_staleness)
        expired = self.buffer.expire(now)
        if expired:
            metrics.trajectories.labels("expired").inc(len(expired))
            log.warning("dropped %d trajectories whose groups never filled", len(expired))
            self._record_drops([(i.seq, i.trajectory) for i in expired], "expired")
        self._drop_stale(stale)
        await self._ack(item.seq for item in stale + expired)

    def _take(self, now: float) -> list[list[Received]]:
        """The next step's groups, or none while no step is ready."""
        # A production cycle trains once it is collected (all its trajectories are out);
        # its last groups may not fill a step, and nothing more comes until the cycle is
        # decided: its trainer takes what is ready, up to a step.
        partial = self.config.production
        if partial and self.cycle_phase != CyclePhase.TRAINING:
            return []
        if self.config.step_groups is not None:
            return self.buffer.take_groups(self.config.step_groups, now, partial)
        return self.buffer.take(self.config.step_tokens, self._step_token_cap(), now, partial)

    async def _train(self, batch: Batch) -> StepResult:
        """One policy step on the batch, scored too on an earlier cycle's held-out rows;
        then this cycle's micro-batches are held out for a later one (before the step's
        checkpoint, which holds them)."""
        pad_id = self.policy.pad_id
        held_out = self.held_out.rows_for(batch.cycle, self.cycle_history, pad_id)
        result = await asyncio.to_thread(self._deal, batch.micro_batches, batch.tokens, held_out)
        self.held_out.keep(batch.cycle, batch.made)
        return result

    async def _commit(self, batch: Batch, report: StepReport) -> tuple[int, float]:
        """Makes the trained version the current one, in the order that loses no
        trajectory and trains none twice: a checkpoint that names the stream sequences
        the step consumed, the version's weights published, and only then those
        sequences acknowledged. Killed anywhere, the trainer resumes from its last
        checkpoint: what it had not trained on is redelivered; what the checkpoint holds
        is known by sequence (`consumed`) and acknowledged without training. Returns the
        weights' bytes and seconds (`_publish_weights`)."""
        self.step += 1
        seqs = batch.seqs
        record = msgspec.to_builtins(report)
        await asyncio.to_thread(
            self.policy.save, self.step, self._client_state(seqs, record), self.pinned
        )
        self.consumed = set(seqs)
        weights = await self._publish_weights()
        await self._ack(seqs)
        self.ready_at = time.perf_counter()
        return weights

    async def _report(
        self, js, report: StepReport, result: StepResult, weights: tuple[int, float]
    ) -> None:
        """Logs the committed step, with its weights' size, sends its report and counts
        it."""
        weight_bytes, weight_seconds = weights
        report = msgspec.structs.replace(
            report, weight_bytes=weight_bytes, weight_seconds=round(weight_seconds, 3)
        )
        if self.tracker is not None:
            report = self.tracker.told(report)
        # With the weights' size; a crash before this line is mended on resume (`_resume`).
        self._append_log(msgspec.to_builtins(report))
        # Stored before it counts as sent: the task feed paces itself by these reports.
        await patiently(
            lambda: js.publish(step_subject(self.config.run), encode(report)),
            f"publishing step {self.step}'s report",
        )
        if self.tracker is not None:
            self.tracker.step(report)
        metrics.steps.inc()
        metrics.nonfinite.inc(result.nonfinite_micro_batches)
        metrics.trajectories.labels("trained").inc(len(report.trajectories))
        for stat in ("mean_abs", "max_abs", "kl"):
            metrics.mismatch.labels(stat).set(getattr(result.mismatch, stat))
        log.info(
            "step %d: %d trajectories, %d tokens, reward %.3f, loss %.4f, staleness %.2f, "
            "mismatch |dlogp| mean %.2e max %.2e kl %.2e, %.2fs",
            self.step,
            len(report.trajectories),
            result.tokens,
            report.reward_mean,
            result.loss,
            report.staleness_mean,
            result.mismatch.mean_abs,
            result.mismatch.max_abs,
            result.mismatch.kl,
            report.step_seconds,
        )
        if result.held_out_gain is not None:
            log.info(
                "step %d: held-out gain %+.3e per token on an earlier cycle's trajectories",
                self.step,
                result.held_out_gain,
            )

    def _client_state(self, consumed: list[int], report: dict | None) -> dict:
        """What a checkpoint holds beside the model: what a resumed trainer goes on from."""
        return {
            "step": self.step,
            "consumed": consumed,
            "dropped_stale": self.dropped_stale,
            "rejected": self.rejected,
            "resets": self.resets,
            "pinned": list(self.pinned),
            "report": report,
            "held_out": self.held_out.encode(),
        }

    async def _follow_conductor(self, js) -> None:
        """A production run's: note the serving version, and go back to it when told."""
        if not self.config.production or time.monotonic() < self.conductor_due:
            return
        self.conductor_due = time.monotonic() + CONDUCTOR_POLL_S
        run = self.config.run
        state = await newest(js, cycle_stream(run), cycle_state_subject(run), decode_cycle_state)
        if state is not None and state.run == run:
            self.pinned = (state.serving,) + (() if state.previous is None else (state.previous,))
            self.publisher.pinned = min(self.pinned)
            self.cycle_phase = state.phase
            self.cycle_history = state.history
        reset = await newest(
            js, cycle_stream(run), trainer_reset_subject(run), decode_trainer_reset
        )
        if reset is None or reset.run != run or reset.number <= self.resets:
            return
        if distributed.world() > 1:
            await asyncio.to_thread(self._order, Kind.RESTORE, reset.version)
        if await asyncio.to_thread(self.policy.restore, reset.version):
            log.warning("reset %d: back to version %d's weights", reset.number, reset.version)
        else:
            log.error("reset %d: no checkpoint of version %d", reset.number, reset.version)
        self.resets = reset.number  # saved with the next step: a crash before it resets again

    async def _publish_weights(self) -> tuple[int, float]:
        """Publishes the current version; returns the bytes a follower fetches for it (the
        delta when there is one) and the seconds publishing took."""
        started = time.perf_counter()
        manifests = await publish(self.policy, self.publisher, self.version)
        metrics.policy_version.set(self.version)
        shipped = next((m for m in manifests if m.kind == "delta"), manifests[0])
        return sum(s.size for s in shipped.shards), time.perf_counter() - started

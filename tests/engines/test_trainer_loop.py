"""The trainer process (DeepSpeed, CPU accelerator) fed over real NATS JetStream."""

from __future__ import annotations

import asyncio
import contextlib
import json
import math
import os
import signal
import subprocess
import sys
import time
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path

import msgspec
import nats.js.errors
import numpy as np
import pytest
from transformers import AutoTokenizer

from rlfleet.api.wire import (
    CycleOutcome,
    CyclePhase,
    CycleState,
    FinishedCycle,
    Segment,
    TrainerReset,
    Trajectory,
    cycle_groups,
    cycle_state_subject,
    decode_manifest,
    encode,
    encode_trajectory,
    trainer_reset_subject,
    trajectory_stream,
    trajectory_subject,
    weights_prefix,
    weights_stream,
)
from rlfleet.bus.streams import (
    TRAINER_ACK_WAIT_S,
    TRAINER_CONSUMER,
    ConsumerWaits,
    ensure_run_streams,
)
from rlfleet.local.nats import HUB_DOMAIN, NatsServer, StandaloneNats
from rlfleet.local.processes import run_in_session

PROBES = Path(__file__).parents[1] / "probes"
ENGINE_ENV = {"VLLM_CPU_KVCACHE_SPACE": "1", "TOKENIZERS_PARALLELISM": "false"}
GROUP = 4
LENGTH = 30  # tokens per trajectory; two groups fill a 200-token step


def trajectory(run: str, group: str, attempt: int, version: int, **fields) -> Trajectory:
    rng = np.random.default_rng(abs(hash((group, attempt))) % 2**32)
    prompt, n = 8, LENGTH
    segment = dict(
        tokens=rng.integers(0, 256, n).tolist(),
        prompt_len=prompt,
        generated=[1] * (n - prompt),
        logprobs=(-rng.random(n - prompt) * 6).tolist(),
        versions=[version] * (n - prompt),
        routed_experts=rng.integers(0, 8, (n - 1) * 2 * 2).astype("<u2").tobytes(),
        moe_layers=2,
        top_k=2,
    ) | fields.pop("segment", {})
    return Trajectory(
        run=run,
        task_id=group,
        group_id=group,
        group_size=GROUP,
        attempt=attempt,
        reward=float(rng.random()),
        reward_breakdown={"exactAnswer": 1.0},
        segments=[Segment(**segment)],
        worker="test",
        created_at=time.time(),
        **fields,
    )


def group(run: str, name: str, version: int) -> list[bytes]:
    return [encode_trajectory(trajectory(run, name, a, version)) for a in range(GROUP)]


async def make_streams(hub: NatsServer, run: str, ack_wait_s: float = TRAINER_ACK_WAIT_S) -> None:
    """The run's streams and consumers, as whoever starts a run makes them; the trainer's
    consumer waits `ack_wait_s` for an acknowledgement."""
    nc = await hub.connect()
    try:
        await ensure_run_streams(nc, run, HUB_DOMAIN, waits=ConsumerWaits(trainer_s=ack_wait_s))
    finally:
        await nc.close()


async def publish(hub: NatsServer, run: str, payloads: list[bytes]) -> None:
    nc = await hub.connect()
    try:
        js = nc.jetstream(domain=HUB_DOMAIN)
        for payload in payloads:
            await js.publish(trajectory_subject(run), payload)
    finally:
        await nc.close()


class TrainerProcess:
    def __init__(self, directory: Path, model: Path, hub: NatsServer, **settings) -> None:
        self.run = f"t{uuid.uuid4().hex[:8]}"
        self.directory = directory
        self.config = directory / "trainer.json"
        self.config.write_text(
            json.dumps(
                {
                    "run": self.run,
                    "nats_url": hub.url,
                    "jetstream_domain": HUB_DOMAIN,
                    "model": str(model),
                    "checkpoint_dir": str(directory / "checkpoints"),
                    "step_tokens": 200,  # two groups a step
                    "max_step_tokens": 200,
                    "weightsync": {"snapshot_every": 4},
                }
                | settings
            )
        )
        self.log = directory / "trainer.log"
        self.env = hub.client_env()
        self.proc: subprocess.Popen | None = None

    def start(self) -> None:
        env = os.environ | self.env | {"DS_ACCELERATOR": "cpu", "TOKENIZERS_PARALLELISM": "false"}
        with self.log.open("a") as log:
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "rlfleet.trainer", str(self.config)],
                env=env,
                stdout=log,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )

    def steps(self) -> list[dict]:
        path = self.directory / "checkpoints" / "steps.jsonl"
        if not path.exists():
            return []
        return [json.loads(line) for line in path.read_text().splitlines()]

    def wait(self, condition: Callable[[], bool], timeout: float = 240) -> None:
        deadline = time.monotonic() + timeout
        while not condition():
            assert self.proc is not None
            if self.proc.poll() is not None and not condition():
                raise AssertionError(f"trainer exited {self.proc.returncode}:\n{self.tail()}")
            if time.monotonic() > deadline:
                raise AssertionError(f"timed out waiting on the trainer:\n{self.tail()}")
            time.sleep(0.2)

    def tail(self) -> str:
        return "\n".join(self.log.read_text().splitlines()[-30:])

    def kill(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait()


@contextlib.contextmanager
def trainer(
    tmp_path: Path,
    tiny_moe: Path,
    servers: StandaloneNats,
    ack_wait_s: float = TRAINER_ACK_WAIT_S,
    **settings,
) -> Iterator[TrainerProcess]:
    process = TrainerProcess(tmp_path, tiny_moe, servers.bed.hub, **settings)
    asyncio.run(make_streams(servers.bed.hub, process.run, ack_wait_s))
    try:
        yield process
    finally:
        process.kill()


def trained(process: TrainerProcess) -> list[str]:
    return [t for step in process.steps() for t in step["trajectories"]]


def test_stale_and_malformed_trajectories_never_reach_the_optimiser(
    tmp_path: Path, tiny_moe: Path, nats_servers: StandaloneNats
) -> None:
    hub = nats_servers.bed.hub
    with trainer(tmp_path, tiny_moe, nats_servers, max_staleness=1, max_steps=3) as process:
        run = process.run
        good = trajectory(run, "x", 0, 0)
        as_dict = msgspec.msgpack.decode(encode_trajectory(good))
        malformed = [
            b"not a trajectory",
            msgspec.msgpack.encode(as_dict | {"schema": "rlfleet.io/trajectory/v9"}),
            msgspec.msgpack.encode(as_dict | {"reward": math.nan}),
            msgspec.msgpack.encode(
                as_dict | {"segments": [as_dict["segments"][0] | {"logprobs": [-1.0]}]}
            ),
            encode_trajectory(trajectory(run, "x", 1, 0, segment={"tokens": [999] * LENGTH})),
            encode_trajectory(
                trajectory(
                    run,
                    "x",
                    2,
                    0,
                    segment={"routed_experts": np.full((LENGTH - 1) * 4, 8, "<u2").tobytes()},
                )
            ),
        ]
        asyncio.run(publish(hub, run, malformed + group(run, "a", 0) + group(run, "b", 0)))
        process.start()
        process.wait(lambda: len(process.steps()) == 1)
        # One version behind is within the bound.
        asyncio.run(publish(hub, run, group(run, "c", 0) + group(run, "d", 0)))
        process.wait(lambda: len(process.steps()) == 2)
        # Now version 0 is two behind: e and f are dropped; g and h (version 2) train.
        asyncio.run(
            publish(
                hub,
                run,
                group(run, "e", 0) + group(run, "f", 0) + group(run, "g", 2) + group(run, "h", 2),
            )
        )
        process.wait(lambda: len(process.steps()) == 3)
        assert process.proc is not None and process.proc.wait(timeout=60) == 0
    steps = process.steps()
    assert {t.split("/")[0] for t in trained(process)} == set("abcdgh")
    assert steps[-1]["dropped_stale_total"] == 2 * GROUP
    assert steps[-1]["rejected_total"] == len(malformed)
    assert [s["policy_version"] for s in steps] == [1, 2, 3]
    assert all(s["weight_bytes"] > 0 for s in steps)  # the log tells what each step shipped
    # Each group's rewards go out with its step, for the feed's curriculum.
    outcomes = [o for s in steps for o in s["outcomes"]]
    assert sorted(o["task_id"] for o in outcomes) == list("abcdgh")
    assert all(len(o["rewards"]) == GROUP for o in outcomes)
    log = process.log.read_text()
    for reason in ("malformed", "token_out_of_range", "expert_out_of_range", "is not finite"):
        assert reason in log
    assert "dropped stale trajectory e/0: policy version 0 is 2 behind 2 (max 1)" in log
    # Each drop is on record before its acknowledgement, for an audit of what was lost.
    drops = [json.loads(line) for line in (process.directory / "checkpoints" / "drops.jsonl")
             .read_text().splitlines()]  # fmt: skip
    assert sorted(d["trajectory"] for d in drops if d["reason"] == "stale") == sorted(
        f"{task}/{attempt}" for task in "ef" for attempt in range(GROUP)
    )
    assert [d["trajectory"] for d in drops if d["reason"] == "rejected"] == [None] * len(malformed)


async def _held_and_waiting(hub: NatsServer, run: str) -> tuple[int, int]:
    """The trainer's consumer: trajectories it holds unacknowledged, and those the stream
    has not given it yet."""
    nc = await hub.connect()
    try:
        info = await nc.jetstream().consumer_info(trajectory_stream(run), "trainer")
        return info.num_ack_pending, info.num_pending
    except nats.js.errors.NotFoundError:
        return 0, -1  # the trainer has not started taking yet
    finally:
        await nc.close()


def test_a_flood_of_trajectories_waits_on_the_stream_not_in_the_trainer(
    tmp_path: Path, tiny_moe: Path, nats_servers: StandaloneNats
) -> None:
    """Groups that never fill (one attempt each) past a few steps' worth: the trainer takes
    one fetch of them and leaves the rest on the stream until the group timeout frees
    room; nothing is lost."""
    hub = nats_servers.bed.hub
    with trainer(tmp_path, tiny_moe, nats_servers, step_groups=1, group_timeout_s=20) as process:
        flood = [encode_trajectory(trajectory(process.run, f"g{i}", 0, 0)) for i in range(300)]
        asyncio.run(publish(hub, process.run, flood))
        process.start()
        process.wait(lambda: asyncio.run(_held_and_waiting(hub, process.run))[0] > 0, 300)
        time.sleep(3)  # without the bound, the next fetch takes the rest in 0.2 s
        held, waiting = asyncio.run(_held_and_waiting(hub, process.run))
        assert held <= 256 and waiting == 300 - held
        # Expired groups leave, so the rest come in and expire too.
        process.wait(lambda: asyncio.run(_held_and_waiting(hub, process.run)) == (0, 0), 120)
    assert "dropped 256 trajectories whose groups never filled" in process.log.read_text()


def test_a_killed_trainer_resumes_without_losing_or_repeating_trajectories(
    tmp_path: Path, tiny_moe: Path, nats_servers: StandaloneNats
) -> None:
    hub = nats_servers.bed.hub
    names = "abcdef"
    # Two optimiser passes per batch: the optimiser state they leave is what resumes, the
    # learning rate's schedule with it (updates 0, 2 and 4 start the steps).
    schedule = {
        "learning_rate": 1e-3,
        "learning_rate_warmup_steps": 2,
        "learning_rate_decay_steps": 4,
        "learning_rate_floor": 0.25,
    }
    with trainer(
        tmp_path, tiny_moe, nats_servers, max_steps=3, ack_wait_s=3, updates_per_step=2, **schedule
    ) as process:
        run = process.run
        asyncio.run(publish(hub, run, [p for name in names for p in group(run, name, 0)]))
        process.start()
        # Killed the moment step 1 is checkpointed: before its weights or acknowledgements
        # go out, and before its log line, which the resume writes.
        latest = process.directory / "checkpoints" / "latest"
        process.wait(latest.exists)
        process.kill()
        killed_at = int(latest.read_text().strip().removeprefix("step-"))
        process.start()
        process.wait(lambda: len(process.steps()) == 3)
        assert process.proc is not None and process.proc.wait(timeout=60) == 0
    ids = trained(process)
    assert sorted(ids) == sorted(f"{name}/{a}" for name in names for a in range(GROUP))
    assert [s["step"] for s in process.steps()] == [1, 2, 3]
    assert f"resumed at step {killed_at}" in process.log.read_text()
    rates = [s["learning_rate"] for s in process.steps()]
    assert rates == pytest.approx([5e-4, 1e-3, 6.25e-4])


def test_a_trainer_keeps_what_it_holds_and_its_successor_gets_it_back(
    tmp_path: Path, tiny_moe: Path, nats_servers: StandaloneNats
) -> None:
    hub = nats_servers.bed.hub

    async def consumer(run: str) -> tuple[int, int]:
        """The trainer's consumer's (held, given again); (0, 0) before it subscribes."""
        nc = await hub.connect()
        try:
            js = nc.jetstream(domain=HUB_DOMAIN)
            info = await js.consumer_info(trajectory_stream(run), TRAINER_CONSUMER)
            return info.num_ack_pending, info.num_redelivered
        except nats.js.errors.NotFoundError:
            return 0, 0
        finally:
            await nc.close()

    with trainer(tmp_path, tiny_moe, nats_servers, max_steps=1, ack_wait_s=2) as process:
        run = process.run
        held = group(run, "a", 0)
        asyncio.run(publish(hub, run, held[:-1]))  # a group short of its last attempt
        process.start()
        process.wait(lambda: asyncio.run(consumer(run))[0] == GROUP - 1)
        time.sleep(4 * 2)  # four ack waits: held all along, never given to anyone again
        assert asyncio.run(consumer(run)) == (GROUP - 1, 0)
        # Killed: its successor gets what it held after one ack wait, and trains it.
        process.kill()
        asyncio.run(publish(hub, run, held[-1:] + group(run, "b", 0)))
        process.start()
        process.wait(lambda: len(process.steps()) == 1)
    assert sorted(trained(process)) == sorted(f"{n}/{a}" for n in "ab" for a in range(GROUP))


def test_trainer_raises_the_reward_of_a_fixed_policy_on_a_verifiable_task(
    tmp_path: Path, tiny_moe: Path, nats_servers: StandaloneNats
) -> None:
    hub = nats_servers.bed.hub
    rounds, groups, group_size, max_tokens = 16, 8, 4, 12
    prompt = "<|im_start|>user\nWrite the number {n:04d}.<|im_end|>\n<|im_start|>assistant\n"
    prompt_tokens = len(AutoTokenizer.from_pretrained(tiny_moe)(prompt.format(n=0)).input_ids)
    round_tokens = groups * group_size * (prompt_tokens + max_tokens)
    with trainer(
        tmp_path,
        tiny_moe,
        nats_servers,
        jetstream_domain=None,
        max_staleness=0,
        learning_rate=1e-2,
        # Synchronous: one step per round, on the whole round (leftovers would go stale).
        step_tokens=round_tokens,
        max_step_tokens=round_tokens,
        max_steps=rounds - 1,
    ) as process:
        process.start()
        args = tmp_path / "rollout.json"
        args.write_text(
            json.dumps(
                {
                    "checkpoint": str(tiny_moe),
                    "nats_url": hub.url,
                    "run": process.run,
                    "prompt": prompt,
                    "rounds": rounds,
                    "groups": groups,
                    "group_size": group_size,
                    "max_tokens": max_tokens,
                }
            )
        )
        out = tmp_path / "rollout-report.json"
        result = run_in_session(
            [sys.executable, str(PROBES / "rollout_digits.py"), str(args), str(out)],
            env={**os.environ, **ENGINE_ENV, **hub.client_env()},
            timeout=900,
        )
        assert result.returncode == 0, result.stderr[-3000:] + process.tail()
    report = json.loads(out.read_text())["rounds"]
    rewards = [r["reward"] for r in report]
    # Each round samples from the version trained on every round before it.
    assert [r["version"] for r in report] == list(range(rounds))
    first, last = sum(rewards[:3]) / 3, sum(rewards[-3:]) / 3
    assert last > first + 0.15, rewards
    assert "dropped stale" not in process.log.read_text()


def test_a_restarted_production_trainer_still_scores_a_candidate_on_the_cycle_before(
    tmp_path: Path, tiny_moe: Path, nats_servers: StandaloneNats
) -> None:
    """The trajectories held out of a promoted cycle are in the checkpoint: a trainer
    killed between two cycles scores the next cycle's step on them (`held_out_gain`), so
    a crash does not let one candidate skip the check."""
    hub = nats_servers.bed.hub
    with trainer(tmp_path, tiny_moe, nats_servers, max_steps=2, production=True) as process:
        run = process.run

        def cycle(number: int, *history: FinishedCycle) -> None:
            """Cycle `number`, collected: its trajectories are in the trainer's buffer."""
            names = [f"{cycle_groups(number)}/{name}" for name in "ab"]
            asyncio.run(publish(hub, run, [p for name in names for p in group(run, name, 0)]))
            time.sleep(2)  # fetched (every 0.2 s) before the trainer may train on them
            state = CycleState(
                run=run,
                number=number,
                phase=CyclePhase.TRAINING,
                since=0,
                serving=len(history),
                history=list(history),
            )
            asyncio.run(_conduct(hub, state))

        process.start()
        cycle(1)
        process.wait(lambda: len(process.steps()) == 1)
        process.kill()
        process.start()
        cycle(2, FinishedCycle(1, CycleOutcome.PROMOTED, candidate=1, why=""))
        process.wait(lambda: len(process.steps()) == 2)
    first, second = process.steps()
    assert first["held_out_gain"] is None  # nothing before cycle 1
    assert second["held_out_gain"] is not None
    assert "resumed at step 1" in process.log.read_text()


async def _state_digest(hub: NatsServer, run: str, version: int) -> str:
    """The state digest the trainer published for `version` (on its delta or snapshot)."""
    nc = await hub.connect()
    try:
        js = nc.jetstream(domain=HUB_DOMAIN)
        for kind in ("delta", "full"):
            subject = f"{weights_prefix(run)}.{version}.manifest.{kind}"
            with contextlib.suppress(nats.js.errors.NotFoundError):
                message = await js.get_last_msg(weights_stream(run), subject)
                return decode_manifest(message.data).state_digest
        raise AssertionError(f"no manifest of version {version}")
    finally:
        await nc.close()


async def _conduct(hub: NatsServer, message: CycleState | TrainerReset) -> None:
    """Publishes what a production run's conductor would."""
    nc = await hub.connect()
    try:
        run = message.run
        subject = (
            cycle_state_subject(run)
            if isinstance(message, CycleState)
            else trainer_reset_subject(run)
        )
        await nc.jetstream(domain=HUB_DOMAIN).publish(subject, encode(message))
    finally:
        await nc.close()


def test_a_production_trainer_told_to_reset_trains_on_from_the_serving_weights(
    tmp_path: Path, tiny_moe: Path, nats_servers: StandaloneNats
) -> None:
    """After two steps and a reset to version 0, the next version is bit for bit what a
    fresh trainer makes from version 0 on the same batch: weights and optimiser went back,
    and the version number went on."""
    hub = nats_servers.bed.hub
    (tmp_path / "reset").mkdir()
    with trainer(tmp_path / "reset", tiny_moe, nats_servers, max_steps=3, production=True) as a:

        def cycle(number: int, phase: CyclePhase) -> None:
            state = CycleState(run=a.run, number=number, phase=phase, since=0, serving=0)
            asyncio.run(_conduct(hub, state))

        def collected(names: str) -> None:
            """A cycle's trajectories, all in the trainer's buffer before it may train on
            them: its steps take the same groups every time."""
            asyncio.run(publish(hub, a.run, [p for name in names for p in group(a.run, name, 0)]))
            time.sleep(2)  # fetched (every 0.2 s); the conductor is read every second
            cycle(len(names), CyclePhase.TRAINING)

        cycle(1, CyclePhase.COLLECTING)
        # Killed once version 0's checkpoint is saved, before any step: it comes back.
        a.start()
        a.wait((tmp_path / "reset" / "checkpoints" / "latest").exists)
        a.kill()
        a.start()
        collected("abcd")
        a.wait(lambda: len(a.steps()) == 2)
        cycle(5, CyclePhase.COLLECTING)
        asyncio.run(_conduct(hub, TrainerReset(run=a.run, number=1, version=0)))
        a.wait(lambda: "reset 1: back to version 0" in a.log.read_text())
        collected("ef")
        a.wait(lambda: len(a.steps()) == 3)
        after_reset = asyncio.run(_state_digest(hub, a.run, 3))
        assert a.proc is not None and a.proc.wait(timeout=60) == 0
    (tmp_path / "fresh").mkdir()
    with trainer(tmp_path / "fresh", tiny_moe, nats_servers, max_steps=1) as b:
        asyncio.run(publish(hub, b.run, [p for name in "ef" for p in group(b.run, name, 0)]))
        b.start()
        b.wait(lambda: len(b.steps()) == 1)
        fresh = asyncio.run(_state_digest(hub, b.run, 1))
    assert after_reset == fresh
    assert after_reset != asyncio.run(_state_digest(hub, a.run, 2))
    # The serving version's checkpoint was kept, as the newest two were.
    kept = sorted(p.name for p in (tmp_path / "reset" / "checkpoints").glob("step-*"))
    assert kept == ["step-00000000", "step-00000002", "step-00000003"]

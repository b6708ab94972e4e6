"""Bad input at every door a message comes in by: each reader refuses it, saying why, and
no reader dies of it.

A door is what a component does with the bytes it takes off a subject: the trainer's
check of a trajectory, a rollout worker's of a task, the feed's and the hub operator's
decoding of step and evaluation reports, a receiver's of a weight manifest and of a
version's shards. Each is fed a corpus of inputs that are wrong by construction (wrong
run, wrong schema, out-of-range ids and sizes, NaN, forged versions, bases, digests and
shard headers), then random truncations and byte flips. A corpus input must be refused;
truncated JSON or msgpack must be refused; and whatever the bytes, a reader may only
refuse (its declared errors), never raise anything else.
"""

from __future__ import annotations

import copy
import json
import math
import struct
from collections.abc import Callable
from dataclasses import dataclass, field
from functools import partial

import msgspec
import numpy as np
import pytest
import torch
import zstandard
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from rlfleet.api.wire import (
    CapturedCompletion,
    CycleEvent,
    CycleOutcome,
    CyclePhase,
    CycleState,
    EvaluationReport,
    EvaluationRequest,
    Feedback,
    FinishedCycle,
    GroupOutcome,
    LiveRewards,
    RewardTally,
    Segment,
    ServeOrder,
    ShardRef,
    StepReport,
    Task,
    TaskMessage,
    TrainerReset,
    Trajectory,
    decode_captured,
    decode_cycle_state,
    decode_evaluation_report,
    decode_evaluation_request,
    decode_feedback,
    decode_live_rewards,
    decode_manifest,
    decode_serve_order,
    decode_step_report,
    decode_trainer_reset,
    decode_trajectory,
)
from rlfleet.rollout.worker.loop import read_task
from rlfleet.trainer.validation import ModelShape, problem
from rlfleet.weightsync.codec import Piece
from rlfleet.weightsync.config import SyncConfig
from rlfleet.weightsync.errors import WeightsyncError
from rlfleet.weightsync.shards import (
    MAGIC,
    ShardHeader,
    apply_version,
    checksum,
    encode_version,
)
from rlfleet.weightsync.state import WeightState

RUN = "team-a_bad"
SHAPE = ModelShape(vocab_size=256, moe_layers=2, num_experts=8, top_k=2)


class Refused(Exception):
    """A reader's verdict that it cannot act on the input (its reason in the message)."""


# What a reader may raise on input: anything else is a crash.
REFUSALS = (msgspec.DecodeError, ValueError, WeightsyncError, Refused)


def take_trajectory(data: bytes) -> None:
    """The trainer's door (`TrainerLoop._accept`): decode, then its checks."""
    reason = problem(decode_trajectory(data), SHAPE, RUN, needs_experts=True)
    if reason is not None:
        raise Refused(reason)


def take_task(data: bytes) -> None:
    read_task(data, RUN)  # a rollout worker's door


def _segment(**fields) -> dict:
    n, prompt = 12, 4
    rng = np.random.default_rng(0)
    return {
        "tokens": rng.integers(0, 256, n).tolist(),
        "prompt_len": prompt,
        "generated": [1] * (n - prompt),
        "logprobs": [-0.5] * (n - prompt),
        "versions": [3] * (n - prompt),
        "routed_experts": rng.integers(0, 8, (n - 1) * 2 * 2).astype("<u2").tobytes(),
        "moe_layers": 2,
        "top_k": 2,
    } | fields


def _trajectory() -> dict:
    return msgspec.to_builtins(  # bytes kept as bytes: a trajectory travels as msgpack
        Trajectory(
            run=RUN,
            task_id="t",
            group_id="t@1",
            group_size=4,
            attempt=0,
            reward=1.0,
            reward_breakdown={"exactAnswer": 1.0},
            segments=[Segment(**_segment())],
            worker="region-a/w",
            created_at=1e9,
        ),
        builtin_types=(bytes,),
    )


def _task() -> dict:
    return msgspec.to_builtins(
        TaskMessage(run=RUN, task=Task(id="t", suite="rules", prompt="1+1?", answer="2"))
    )


def _step() -> dict:
    return msgspec.to_builtins(
        StepReport(
            run=RUN,
            step=3,
            policy_version=3,
            trajectories=["t@1/0"],
            groups=1,
            tokens=100,
            reward_mean=0.5,
            loss=0.1,
            staleness_mean=0.5,
            staleness_max=1,
            mismatch_mean_abs=0.0,
            mismatch_max_abs=0.0,
            mismatch_kl=0.0,
            clipped_fraction=0.0,
            dropped_stale_total=0,
            rejected_total=0,
            step_seconds=1.0,
            finished_at=1e9,
            outcomes=[GroupOutcome("t", [0.0, 1.0])],
        )
    )


def _evaluation() -> dict:
    return msgspec.to_builtins(
        EvaluationReport(
            run=RUN,
            suite="rules",
            policy_version=3,
            reward=0.5,
            pass_at_k=0.75,
            attempts=4,
            tasks=10,
            finished_at=1e9,
        )
    )


def _set(document: dict, path: str, value) -> dict:
    """A copy of `document` with the field at `path` ("a.0.b"; "-b" deletes b) set."""
    out = copy.deepcopy(document)
    *parents, last = path.split(".")
    place = out
    for key in parents:
        place = place[int(key)] if isinstance(place, list) else place[key]
    if last.startswith("-"):
        del place[last[1:]]
    elif isinstance(place, list):
        place[int(last)] = value
    else:
        place[last] = value
    return out


NAN = float("nan")


def _captured() -> dict:
    segment = Segment(**_segment(routed_experts=b"", moe_layers=0, top_k=0))
    return msgspec.to_builtins(
        CapturedCompletion(RUN, "chatcmpl-1", "ada", segment, "four", "stop", 1e9),
        builtin_types=(bytes,),
    )


def _feedback() -> dict:
    return msgspec.to_builtins(
        Feedback(RUN, "chatcmpl-1", "event-1", "thumbs", 1.0, None, "ada", 1e9, late=False)
    )


def _live() -> dict:
    tally = RewardTally().add(1.0).add(-0.5)
    return msgspec.to_builtins(LiveRewards(RUN, 2, {4: tally, 3: tally}, 1e9), str_keys=True)


def _cycle_state() -> dict:
    done = FinishedCycle(1, CycleOutcome.PROMOTED, 4, "not worse", 1e9)
    event = CycleEvent("CanaryStarted", "version 6 on the canary set")
    return msgspec.to_builtins(
        CycleState(RUN, 2, CyclePhase.CANARY, 1e9, 4, 6, 12, [done], [event])
    )


@dataclass
class Door:
    name: str
    valid: Callable[[], dict]
    write: Callable[[dict], bytes]  # a document as its sender writes it
    take: Callable[[bytes], object]
    # (field path, bad value): each makes the document wrong, whatever else it holds
    corpus: list[tuple[str, object]] = field(default_factory=list)


def _msgpack(document: dict) -> bytes:
    return msgspec.msgpack.encode(document)


def _json(document: dict) -> bytes:
    # NaN and infinities written as JSON's readers of other languages would see them.
    return json.dumps(document, allow_nan=True).encode()


# An unknown field is no fault: a newer release may write it (`rlfleet.api.wire`'s rules;
# tests/unit/test_wire_evolution.py), and every door takes it (below).
COMMON = [("schema", "rlfleet.io/something-else/v1"), ("-run", None)]

DOORS = [
    Door(
        "trajectory",
        _trajectory,
        _msgpack,
        take_trajectory,
        [
            *COMMON,
            ("run", "team-b_other"),
            ("reward", NAN),
            ("reward", math.inf),
            ("reward_breakdown", {"exactAnswer": NAN}),
            ("created_at", -math.inf),
            ("attempt", -1),
            ("attempt", 4),
            ("group_size", 0),
            ("group_size", 10**6),
            ("segments", []),
            ("segments.0.tokens.0", -1),
            ("segments.0.tokens.11", 256),
            ("segments.0.tokens.11", 2**40),
            ("segments.0.prompt_len", 0),
            ("segments.0.prompt_len", 12),
            ("segments.0.generated.0", 2),
            ("segments.0.generated.0", -1),
            ("segments.0.logprobs.0", 0.5),
            ("segments.0.logprobs.0", NAN),
            ("segments.0.versions.0", -3),
            ("segments.0.routed_experts", b"\x00" * 7),
            ("segments.0.routed_experts", b"\xff\x00" * 44),  # expert 255 of 8
            ("segments.0.moe_layers", -2),
            ("segments.0.top_k", 3),
            ("segments.0.-logprobs", None),
        ],
    ),
    Door(
        "task",
        _task,
        _json,
        take_task,
        [
            *COMMON,
            ("run", "team-b_other"),
            ("group_size", 1),
            ("group_size", 10**6),
            ("min_policy_version", -1),
            ("task.files", {"../escape": "x"}),
            ("task.files", {"/etc/passwd": "x"}),
            ("task.hidden_tests", {"t.py": "x"}),
            ("task.protected", ["not-there"]),
            ("task.environment", {"name": "../bad", "setup": "true"}),
            ("task.tools", "yes"),
            ("task.-prompt", None),
        ],
    ),
    Door(
        "step report",
        _step,
        _json,
        decode_step_report,
        [
            *COMMON,
            ("step", -1),
            ("policy_version", -5),
            ("tokens", -100),
            ("loss", NAN),
            ("reward_mean", None),
            ("outcomes.0.rewards", []),
            ("outcomes.0.rewards", [NAN, 1.0]),
            ("trajectories", "t@1/0"),
        ],
    ),
    Door(
        "evaluation report",
        _evaluation,
        _json,
        decode_evaluation_report,
        [
            *COMMON,
            ("reward", NAN),
            ("reward", math.inf),
            ("pass_at_k", 2.0),
            ("attempts", 0),
            ("tasks", -1),
            ("policy_version", -1),
        ],
    ),
    Door(
        "captured completion",  # read by a pool's servers, to check feedback against
        _captured,
        _msgpack,
        decode_captured,
        [
            *COMMON,
            ("response_id", "a.b"),  # ids go into subjects: one token
            ("response_id", ">"),
            ("response_id", ""),
            ("served_at", NAN),
            ("segment.generated.0", 0),  # all of a served completion is generated
            ("segment.logprobs.0", NAN),
            ("-segment", None),
        ],
    ),
    Door(
        "feedback",
        _feedback,
        _json,
        decode_feedback,
        [
            *COMMON,
            ("event_id", "a b"),
            ("event_id", "x" * 129),
            ("kind", "Accepted!"),
            ("value", 0.5),  # thumbs are 1 or -1
            ("value", NAN),
            ("received_at", math.inf),
            ("kind", "edited"),  # with no final text
            ("late", "no"),
        ],
    ),
    Door(  # read by the conductor, to judge a canary
        "live rewards",
        _live,
        _json,
        decode_live_rewards,
        [
            *COMMON,
            ("cycle", 0),
            ("by_version", {"-1": {"count": 1, "total": 1.0, "total_squares": 1.0}}),
            ("by_version", {"x": {}}),
            ("by_version.4.count", -1),
            ("by_version.4.total", NAN),
            ("by_version.4.total_squares", -1.0),
            ("at", math.inf),
        ],
    ),
    Door(  # read by the collector, the trainer and the hub operator
        "cycle state",
        _cycle_state,
        _json,
        decode_cycle_state,
        [
            *COMMON,
            ("number", 0),
            ("phase", "Deploying"),
            ("serving", -1),
            ("since", NAN),
            ("history", [{"number": 1, "outcome": "Shipped", "candidate": 1, "why": ""}]),
            ("history", [{"number": 1, "outcome": "Promoted", "candidate": 1, "why": ""}] * 21),
            ("events.0.reason", "not a reason"),
            ("-phase", None),
        ],
    ),
    Door(
        "evaluation request",
        lambda: msgspec.to_builtins(EvaluationRequest(RUN, 2, [6, 4])),
        _json,
        decode_evaluation_request,
        [*COMMON, ("cycle", 0), ("versions", []), ("versions", [1, 2, 3]), ("versions.0", -6)],
    ),
    Door(
        "trainer reset",
        lambda: msgspec.to_builtins(TrainerReset(RUN, 2, 4)),
        _json,
        decode_trainer_reset,
        [*COMMON, ("number", 0), ("version", -4), ("version", "4")],
    ),
    Door(  # read by the conductor, as the hub passes an on-call order on
        "serve order",
        lambda: msgspec.to_builtins(ServeOrder(RUN, 1, 4)),
        _json,
        decode_serve_order,
        [*COMMON, ("number", 0), ("number", 1.5), ("version", -1), ("-version", None)],
    ),
]


@dataclass
class Tally:
    tried: int = 0
    accepted: list[str] = field(default_factory=list)
    crashes: list[str] = field(default_factory=list)

    def feed(
        self,
        what: str,
        attempt: Callable[[], object],
        must_refuse: bool,
        refusals: tuple[type[Exception], ...] = REFUSALS,
    ) -> None:
        """One bad input through a door: refused as the reader refuses (`refusals`), or
        taken (counted when it `must_refuse`), or a crash (anything else it raises)."""
        self.tried += 1
        try:
            attempt()
        except refusals:
            return
        except Exception as error:
            self.crashes.append(f"{what}: {error!r}")
            return
        if must_refuse:
            self.accepted.append(what)

    def wrong(self) -> list[str]:
        return self.accepted + self.crashes


TALLY = Tally()


@pytest.mark.parametrize("door", DOORS, ids=lambda d: d.name)
def test_every_door_refuses_its_corpus_of_bad_input(door: Door) -> None:
    door.take(door.write(door.valid()))  # the check can pass: a good message goes in
    door.take(door.write(door.valid() | {"from_a_newer_release": [1]}))  # and a newer one
    before = len(TALLY.wrong())
    for path, value in door.corpus:
        data = door.write(_set(door.valid(), path, value))
        TALLY.feed(f"{door.name} {path}={value!r}", partial(door.take, data), True)
    assert len(TALLY.wrong()) == before, TALLY.wrong()


@pytest.mark.parametrize("door", DOORS, ids=lambda d: d.name)
@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(data=st.data())
def test_no_door_dies_of_truncated_or_flipped_bytes(door: Door, data: st.DataObject) -> None:
    good = door.write(door.valid())
    cut = data.draw(st.integers(0, len(good) - 1), label="cut")
    before = len(TALLY.wrong())
    TALLY.feed(f"{door.name} cut at {cut}", partial(door.take, good[:cut]), True)
    flips = data.draw(st.lists(st.tuples(st.integers(0, len(good) - 1), st.integers(1, 255))))
    flipped = bytearray(good)
    for at, mask in flips:
        flipped[at] ^= mask
    TALLY.feed(f"{door.name} flipped {flips}", partial(door.take, bytes(flipped)), False)
    assert len(TALLY.wrong()) == before, TALLY.wrong()


# Weight versions: a receiver holding version 0 is handed version 1's manifest and shards.

CONFIG = SyncConfig(shard_bytes=4 << 10, chunk_bytes=1 << 10)  # several shards a version


@pytest.fixture(scope="module")
def versions() -> tuple[WeightState, object]:
    generator = torch.Generator().manual_seed(5)
    first = {f"w{i}": torch.randn(64, 64, generator=generator).bfloat16() for i in range(4)}
    second = {n: t + 1e-2 * torch.randn(t.shape, generator=generator) for n, t in first.items()}
    second = {n: t.bfloat16() for n, t in second.items()}
    base = encode_version(RUN, 0, first, None, CONFIG)
    state = WeightState()
    apply_version(state, base.manifest, base.shards)
    return state, encode_version(RUN, 1, second, WeightState.copy_of(first, 0), CONFIG)


def _receive(state: WeightState, manifest_json: bytes, shards: list[bytes]) -> None:
    """A receiver's door: the manifest off its subject, then the version's shards, applied
    to a copy of what it holds (all or nothing)."""
    try:  # `Receiver._take`: what it catches there is a refusal
        manifest = decode_manifest(manifest_json)
    except (msgspec.DecodeError, ValueError) as error:
        raise Refused(str(error)) from error
    if manifest.run != RUN:
        raise Refused(f"manifest of run {manifest.run}")
    held = WeightState.copy_of(state.tensors, state.version)
    apply_version(held, manifest, shards)  # `Receiver._walk`: only WeightsyncError is


RECEIVER_REFUSALS = (Refused, WeightsyncError)


def _forged(manifest: dict, piece: Piece, sections: list[bytes]) -> tuple[dict, bytes]:
    """Shard 0 replaced by one holding `piece`, with a checksum and size that match."""
    header = ShardHeader(RUN, manifest["version"], 0, [piece])
    packed = zstandard.compress(msgspec.msgpack.encode(header))
    data = b"".join([MAGIC, struct.pack("<I", len(packed)), packed, *sections])
    ref = ShardRef(index=0, size=len(data), raw_size=8, checksum=checksum(data), tensors=["w0"])
    return _set(manifest, "shards.0", msgspec.to_builtins(ref)), data


def test_a_receiver_refuses_forged_manifests_and_shards(versions) -> None:
    state, version = versions
    manifest = msgspec.to_builtins(version.manifest)
    _receive(state, _json(manifest), version.shards)  # the version itself goes in
    tried: list[tuple[str, dict, list[bytes]]] = []
    for path, value in [
        *COMMON,
        ("run", "team-b_other"),
        ("version", -1),
        ("base_version", None),  # a delta on nothing
        ("base_version", 1),  # a delta on itself
        ("kind", "full"),  # a snapshot with a base
        ("state_bytes", -1),
        ("state_digest", "0" * 64),  # forged: the state after applying differs
        ("shards.0.size", 1 << 40),  # a claim that would make a receiver allocate a TiB
        ("shards.0.size", -1),
        ("shards.1.index", 0),
        ("shards.0.checksum", "not-hex"),
        ("shards.0.checksum", "0" * 32),  # forged: the bytes do not hash to it
        ("shards", []),
    ]:
        tried.append((f"{path}={value!r}", _set(manifest, path, value), version.shards))
    shards = list(version.shards)
    tried.append(("a truncated shard", manifest, [shards[0][:-1], *shards[1:]]))
    assert len(shards) > 1
    tried.append(("shards swapped", manifest, shards[::-1]))
    section = [b"\x00" * 8]
    for what, piece in [
        (
            "a piece claiming a 2**40-element tensor",
            Piece("w9", "bfloat16", (2**20, 2**20), 0, 4, "raw", (8,)),
        ),
        ("a piece of an unknown dtype", Piece("w0", "complex512", (64, 64), 0, 4, "raw", (8,))),
        ("a piece beyond its tensor", Piece("w0", "bfloat16", (64, 64), 4094, 4, "dense", (8,))),
        ("a delta piece of another shape", Piece("w0", "bfloat16", (32, 128), 0, 4, "dense", (8,))),
        ("sections not adding up", Piece("w0", "bfloat16", (64, 64), 0, 4, "dense", (80,))),
    ]:
        document, data = _forged(manifest, piece, section)
        tried.append((what, document, [data, *shards[1:]]))
    before = len(TALLY.wrong())
    for what, document, data in tried:
        receive = partial(_receive, state, _json(document), data)
        TALLY.feed(f"receiver {what}", receive, True, RECEIVER_REFUSALS)
    assert len(TALLY.wrong()) == before, TALLY.wrong()


def test_bad_input_tally() -> None:
    """The figures (`bad_inputs_tried`, `bad_inputs_accepted`, `crashes`) over this file's
    tests, in the run that ran them all."""
    print(
        json.dumps(
            {
                "bad_inputs_tried": TALLY.tried,
                "bad_inputs_accepted": len(TALLY.accepted),
                "crashes": len(TALLY.crashes),
            }
        )
    )
    assert TALLY.wrong() == []

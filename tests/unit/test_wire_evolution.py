"""Messages survive a rolling upgrade: what a newer release writes, today's reader takes.

Mid-upgrade, components of two releases talk: a newer trainer's step report reaches an
older hub, a newer feed's task an older region. So every message that crosses between
processes is encoded here as a newer writer would (a field this reader does not know, in
the message and in every struct inside it, in msgpack and in JSON), and today's reader must
take it with every field it knows equal. What the reader knows stays strict: a wrong type,
a value out of its bounds, or another tag (a change of meaning) is still refused.

The messages are found, not listed: every `WireMessage`, the structs that cross processes
without being one (`ROOTS`), and every struct reachable from those. A new one fails here
until `EXAMPLES` has a valid instance of it. Structs that forbid unknown fields are found in
every module of rlfleet, and each must be in `STRICT`, saying why it may be.
"""

from __future__ import annotations

import copy
import importlib
import re
import typing
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import msgspec
import pytest
from msgspec import inspect

from rlfleet.api import wire
from rlfleet.api.wire import (
    AnswerStats,
    CapturedCompletion,
    CycleEvent,
    CycleOutcome,
    CyclePhase,
    CycleReport,
    CycleState,
    Environment,
    EvaluationReport,
    EvaluationRequest,
    Feedback,
    FinishedCycle,
    GroupOutcome,
    LiveRewards,
    RewardTally,
    Segment,
    ServeOrder,
    ServingTarget,
    ShardRef,
    StepReport,
    Task,
    TaskMessage,
    TrainerReset,
    Trajectory,
    TrajectoryDrop,
    WeightManifest,
    WireMessage,
)
from rlfleet.trainer.held_out import Kept, _Stored
from rlfleet.weightsync.ranks import ManifestReport, RankEncoding, RankReport
from rlfleet.weightsync.state import TensorEntry

ROOT = Path(__file__).resolve().parents[2]

# Structs that cross between processes (which may run two releases) without being a
# `WireMessage`: the ranks' reports a trainer's ranks gather, the trainer's drop log (read
# by other tools) and the held-out trajectories its checkpoint keeps (an upgraded or rolled
# back trainer reads them).
ROOTS: list[type[msgspec.Struct]] = [RankReport, ManifestReport, TrajectoryDrop, _Stored]

# Structs that forbid unknown fields, and why they may: none of them crosses between two
# releases, or its fields are positions. By module, or by `module.QualName`.
STRICT = {
    "rlfleet.launch.settings": "built by the release that reads them, at the pod's start",
    "rlfleet.launch.production": "built by the release that reads them, at the pod's start",
    "rlfleet.api.profile": "a file people write: an unknown field is a misspelling",
    "rlfleet.api.traffic": "a file people write: an unknown field is a misspelling",
    "rlfleet.rollout.environment.tools": "a model's tool call: the model is told it is wrong",
    "rlfleet.rollout.production.feedback.FeedbackRequest": "a client's request for the desk",
    "rlfleet.weightsync.codec.Piece": "array-like; the shard's MAGIC versions its layout",
    "rlfleet.weightsync.shards.ShardHeader": "array-like; the shard's MAGIC versions it",
    "rlfleet.weightsync.state.TensorEntry": "array-like: positions, not names",
}

RUN = "team-a_evolve"
SHARD = ShardRef(index=0, size=100, raw_size=200, checksum="0123456789abcdef" * 2, tensors=["w"])
MANIFEST = WeightManifest(
    run=RUN,
    version=5,
    base_version=4,
    kind="delta",
    shards=[SHARD],
    removed=["gone"],
    state_digest="ab" * 16,
    state_bytes=200,
    tensor_count=1,
    created_at=1e9,
)
SEGMENT = Segment(
    tokens=[1, 2, 3, 4, 5],
    prompt_len=2,
    generated=[1, 0, 1],
    logprobs=[-0.5, 0.0, -1.0],
    versions=[3, 3, 4],
    routed_experts=bytes(range(16)),  # 4 tokens run x 2 layers x top-1, uint16
    moe_layers=2,
    top_k=1,
)
SERVED = Segment(
    tokens=[1, 2, 3, 4], prompt_len=2, generated=[1, 1], logprobs=[-0.1, -0.2], versions=[4, 4]
)
ENVIRONMENT = Environment(name="env-1", setup="pip install -e .", files={"setup.py": "x"})
TASK = Task(
    id="t",
    suite="coding",
    prompt="fix it",
    answer="4",
    files={"a.py": "x", "test_a.py": "t"},
    hidden_tests={"hidden/test_b.py": "y"},
    test_command="pytest",
    protected=["test_a.py"],
    rubric={"style": "clear"},
    tools=True,
    environment=ENVIRONMENT,
)
OUTCOME = GroupOutcome(task_id="t", rewards=[0.0, 1.0])
ANSWERS = AnswerStats(answers=10, empty=1, tokens=300, tool_calls=4, malformed_tool_calls=1)
TALLY = RewardTally(count=2, total=0.5, total_squares=1.25)
FINISHED = FinishedCycle(
    number=1, outcome=CycleOutcome.PROMOTED, candidate=4, why="not worse", finished_at=1e9
)
EVENT = CycleEvent(reason="CanaryStarted", message="version 6 on the canary set")
ENCODING = RankEncoding(
    shards=[SHARD], tensors=[TensorEntry("w", "bfloat16", (2, 3), b"\x01" * 16)], removed=["x"]
)
KEPT = Kept(segments=[SEGMENT], advantages=[0.5])

# A valid instance of every struct that crosses, each field away from its default where it
# has one, so that every field is seen to survive.
EXAMPLES: dict[type[msgspec.Struct], Callable[[], msgspec.Struct]] = {
    ShardRef: lambda: SHARD,
    WeightManifest: lambda: MANIFEST,
    Segment: lambda: SEGMENT,
    Trajectory: lambda: Trajectory(
        run=RUN,
        task_id="t",
        group_id="cycle-3/t",
        group_size=4,
        attempt=1,
        reward=0.5,
        reward_breakdown={"exactAnswer": 0.5},
        segments=[SEGMENT],
        worker="region-a/w",
        created_at=1e9,
    ),
    Environment: lambda: ENVIRONMENT,
    Task: lambda: TASK,
    TaskMessage: lambda: TaskMessage(run=RUN, task=TASK, group_size=8, min_policy_version=2),
    GroupOutcome: lambda: OUTCOME,
    StepReport: lambda: StepReport(
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
        mismatch_mean_abs=0.01,
        mismatch_max_abs=0.1,
        mismatch_kl=0.001,
        clipped_fraction=0.02,
        dropped_stale_total=1,
        rejected_total=2,
        step_seconds=1.0,
        finished_at=1e9,
        weight_bytes=1 << 20,
        weight_seconds=0.5,
        wait_seconds=0.25,
        outcomes=[OUTCOME],
        held_out_gain=-0.1,
    ),
    TrajectoryDrop: lambda: TrajectoryDrop(seq=7, trajectory="t@1/0", reason="stale"),
    AnswerStats: lambda: ANSWERS,
    EvaluationReport: lambda: EvaluationReport(
        run=RUN,
        suite="rules",
        policy_version=3,
        reward=0.5,
        pass_at_k=0.75,
        attempts=4,
        tasks=10,
        finished_at=1e9,
        task_rewards={"t": 0.5},
        answers=ANSWERS,
    ),
    CapturedCompletion: lambda: CapturedCompletion(
        run=RUN,
        response_id="chatcmpl-1",
        user="ada",
        segment=SERVED,
        text="four",
        finish_reason="stop",
        served_at=1e9,
    ),
    Feedback: lambda: Feedback(
        run=RUN,
        response_id="chatcmpl-1",
        event_id="event-1",
        kind="thumbs",
        value=1.0,
        text=None,
        user="ada",
        received_at=1e9,
        late=False,
    ),
    CycleReport: lambda: CycleReport(
        run=RUN,
        cycle=2,
        capture_seq=10,
        captured=5,
        with_feedback=4,
        trained_on=3,
        dropped={"no-feedback": 1},
        signals={"thumbs": 3},
        late_feedback=1,
        reward_mean=0.2,
        served_from=1e9,
        served_to=1e9 + 60,
        finished_at=1e9 + 120,
        held_back="",
        distrusted=1,
        distrusted_users=("user-7",),
    ),
    RewardTally: lambda: TALLY,
    LiveRewards: lambda: LiveRewards(run=RUN, cycle=2, by_version={4: TALLY, 6: TALLY}, at=1e9),
    FinishedCycle: lambda: FINISHED,
    CycleEvent: lambda: EVENT,
    CycleState: lambda: CycleState(
        run=RUN,
        number=2,
        phase=CyclePhase.CANARY,
        since=1e9,
        serving=4,
        candidate=6,
        collected=12,
        history=[FINISHED],
        events=[EVENT],
        previous=3,
        orders=1,
    ),
    EvaluationRequest: lambda: EvaluationRequest(run=RUN, cycle=2, versions=[6, 4]),
    TrainerReset: lambda: TrainerReset(run=RUN, number=2, version=4),
    ServeOrder: lambda: ServeOrder(run=RUN, number=1, version=4),
    ServingTarget: lambda: ServingTarget(
        run=RUN, replica_set="canary", version=6, set_at=1e9, standby=4
    ),
    RankEncoding: lambda: ENCODING,
    RankReport: lambda: RankReport(
        rank=1, base_version=3, encodings=[ENCODING], error="rank 1: out of memory"
    ),
    ManifestReport: lambda: ManifestReport(manifests=[MANIFEST], error=None),
    Kept: lambda: KEPT,
    _Stored: lambda: _Stored(by_cycle={3: [KEPT]}),
}


def _subclasses(cls: type) -> Iterator[type]:
    for sub in cls.__subclasses__():
        yield sub
        yield from _subclasses(sub)


def _types(info: inspect.Type, into_structs: bool = True) -> Iterator[inspect.Type]:
    """Every type `info` holds, itself included, at any depth (past a struct's fields too,
    unless not `into_structs`)."""
    yield info
    if isinstance(info, inspect.StructType):
        inner = [field.type for field in info.fields] if into_structs else []
    elif isinstance(info, inspect.Metadata):
        inner = [info.type]
    elif isinstance(info, inspect.UnionType):
        inner = list(info.types)
    elif isinstance(info, inspect.DictType):
        inner = [info.key_type, info.value_type]
    elif isinstance(info, inspect.TupleType):
        inner = list(info.item_types)
    elif isinstance(info, inspect.ListType | inspect.VarTupleType | inspect.SetType):
        inner = [info.item_type]
    else:
        inner = []
    for member in inner:
        yield from _types(member, into_structs)


def _structs(info: inspect.Type) -> Iterator[type[msgspec.Struct]]:
    """Every struct type `info` holds, itself included, at any depth."""
    return (t.cls for t in _types(info) if isinstance(t, inspect.StructType))


def _name(cls: type) -> str:
    return f"{cls.__module__}.{cls.__qualname__}"


def _crossing() -> list[type[msgspec.Struct]]:
    """Every struct that crosses between processes, by name."""
    messages = [m for m in _subclasses(WireMessage) if m.__struct_config__.tag is not None]
    found = {s for root in [*messages, *ROOTS] for s in _structs(inspect.type_info(root))}
    return sorted(found, key=_name)


def _forbids(cls: type[msgspec.Struct]) -> bool:
    return cls.__struct_config__.forbid_unknown_fields


CROSSING = _crossing()
# What a newer writer may add a field to: the array-like are strict (`STRICT`).
LENIENT = [c for c in CROSSING if not c.__struct_config__.array_like]
MESSAGES = [c for c in CROSSING if issubclass(c, WireMessage)]


def _example(cls: type[msgspec.Struct]) -> msgspec.Struct:
    if cls not in EXAMPLES:
        pytest.fail(
            f"{_name(cls)} crosses between processes and has no example: add a valid "
            f"instance of it to EXAMPLES in {Path(__file__).name}"
        )
    return EXAMPLES[cls]()


# Codecs as the wire's readers use them: each message goes by one of these.
CODECS = {
    "json": (
        lambda value: msgspec.to_builtins(value, str_keys=True),
        msgspec.json.encode,
        msgspec.json.decode,
    ),
    "msgpack": (
        lambda value: msgspec.to_builtins(value, builtin_types=(bytes,)),
        msgspec.msgpack.encode,
        msgspec.msgpack.decode,
    ),
}

# What a newer writer adds: before the known fields (and the tag) and after them, and not
# a scalar, so that a reader must skip a whole nested value.
EARLY = "zz_added_by_a_newer_release"
LATE = "added_later_still"
ADDED = {"nested": [1, 2.5, "three", None, {"deep": True}], "bits": b"\x00\xff"}


def _newer(value: Any, info: inspect.Type) -> Any:
    """`value` (builtins, as decoded) as a newer writer would write it: every struct in it
    that takes unknown fields has two more."""
    if isinstance(info, inspect.Metadata):
        return _newer(value, info.type)
    if isinstance(info, inspect.UnionType):
        for member in info.types:
            if isinstance(member, inspect.StructType) and isinstance(value, dict):
                return _newer(value, member)
            if isinstance(member, inspect.ListType | inspect.DictType) and isinstance(
                value, list | dict
            ):
                return _newer(value, member)
        return value
    if isinstance(info, inspect.StructType) and not info.array_like:
        assert isinstance(value, dict)
        fields = {f.encode_name: f.type for f in info.fields}
        known = {k: _newer(v, fields[k]) if k in fields else v for k, v in value.items()}
        return {EARLY: ADDED} | known | {LATE: [ADDED]}
    if isinstance(info, inspect.ListType | inspect.VarTupleType) and isinstance(value, list):
        return [_newer(item, info.item_type) for item in value]
    if isinstance(info, inspect.DictType) and isinstance(value, dict):
        return {k: _newer(v, info.value_type) for k, v in value.items()}
    return value


def _written(codec: str, value: Any) -> bytes:
    return CODECS[codec][1](value)


def _read(cls: type[msgspec.Struct], codec: str, data: bytes) -> msgspec.Struct:
    return CODECS[codec][2](data, type=cls)


def _builtins(cls: type[msgspec.Struct], codec: str) -> Any:
    return CODECS[codec][0](_example(cls))


def _readers() -> dict[type, Callable[[bytes], object]]:
    """The wire's own decoders (`decode_*`), by the message they return."""
    found = {}
    for name in dir(wire):
        function = getattr(wire, name)
        if name.startswith("decode_") and callable(function) and name != "decode_strict":
            found[typing.get_type_hints(function, vars(wire))["return"]] = function
    return found


READERS = _readers()


def test_what_crosses_is_found_and_each_has_an_example() -> None:
    names = {c.__name__ for c in CROSSING}
    # Each kind of message is found: a tagged one, one inside it, one that is no message.
    assert {"StepReport", "Segment", "RankReport", "TensorEntry", "Kept"} <= names
    assert len(MESSAGES) >= 14
    missing = [_name(c) for c in LENIENT if c not in EXAMPLES]
    assert not missing, f"add a valid instance of each to EXAMPLES: {missing}"
    assert not [_name(c) for c in EXAMPLES if c not in LENIENT]  # no stale example


def test_only_structs_that_never_cross_two_releases_forbid_unknown_fields() -> None:
    """Every struct in every module of rlfleet: one that forbids unknown fields is in
    `STRICT` (a new strict one fails here), and none that crosses does unless it is
    array-like."""
    for top in ("core", "trainer", "rollout", "weightsync", "operator"):
        for path in sorted((ROOT / top / "rlfleet").rglob("*.py")):
            parts = path.relative_to(ROOT / top).with_suffix("").parts
            if parts[-1] == "__main__":
                continue
            module = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
            try:
                importlib.import_module(module)
            except ImportError as error:  # an optional dependency this machine lacks
                if (error.name or "").startswith("rlfleet"):
                    raise
    structs = {c for c in _subclasses(msgspec.Struct) if c.__module__.startswith("rlfleet.")}
    assert len(structs) > 40
    strict = [c for c in structs if _forbids(c)]
    unexplained = [
        _name(c) for c in strict if _name(c) not in STRICT and c.__module__ not in STRICT
    ]
    assert not unexplained, f"forbid unknown fields with no reason in STRICT: {unexplained}"
    crossing_strict = [_name(c) for c in CROSSING if _forbids(c) and _name(c) not in STRICT]
    assert not crossing_strict, (
        f"cross between releases and forbid unknown fields: {crossing_strict}"
    )
    assert not [_name(c) for c in LENIENT if _forbids(c)]


@pytest.mark.parametrize("codec", CODECS)
@pytest.mark.parametrize("cls", LENIENT, ids=lambda c: c.__name__)
def test_a_newer_writers_message_is_read_with_every_known_field(
    cls: type[msgspec.Struct], codec: str
) -> None:
    example = _example(cls)
    info = inspect.type_info(cls)
    newer = _newer(_builtins(cls, codec), info)
    assert EARLY in newer and LATE in newer
    assert _read(cls, codec, _written(codec, newer)) == example


@pytest.mark.parametrize("cls", [c for c in MESSAGES if c in READERS], ids=lambda c: c.__name__)
def test_the_wire_readers_take_a_newer_writers_message(cls: type[WireMessage]) -> None:
    """Through the very function a component reads the message with, in its codec."""
    reader = READERS[cls]
    example = _example(cls)
    codec = next(  # the reader's codec: the one it reads today's message in
        c for c in CODECS if _takes(reader, _written(c, _builtins(cls, c))) == example
    )
    newer = _newer(_builtins(cls, codec), inspect.type_info(cls))
    assert reader(_written(codec, newer)) == example


def _takes(reader: Callable[[bytes], object], data: bytes) -> object:
    try:
        return reader(data)
    except msgspec.DecodeError:  # ValidationError included
        return None


def test_every_message_that_has_a_reader_is_read_by_one() -> None:
    # Wire messages without a `decode_*` are read by msgspec with their type directly.
    assert len(READERS) >= 12


@pytest.mark.parametrize("codec", CODECS)
def test_a_union_of_every_message_tells_each_by_its_tag_with_unknown_fields(codec: str) -> None:
    union = typing.Union[tuple(MESSAGES)]  # noqa: UP007 (built at run time)
    for cls in MESSAGES:
        newer = _newer(_builtins(cls, codec), inspect.type_info(cls))
        assert CODECS[codec][2](_written(codec, newer), type=union) == _example(cls)


@pytest.mark.parametrize("codec", CODECS)
@pytest.mark.parametrize("cls", MESSAGES, ids=lambda c: c.__name__)
def test_a_change_of_meaning_takes_a_new_tag_which_the_reader_refuses(
    cls: type[WireMessage], codec: str
) -> None:
    tag = cls.__struct_config__.tag
    assert re.fullmatch(r"rlfleet\.io/[a-z-]+/v\d+", tag), tag
    next_tag = re.sub(r"/v(\d+)$", lambda m: f"/v{int(m.group(1)) + 1}", tag)
    newer = _newer(_builtins(cls, codec), inspect.type_info(cls)) | {"schema": next_tag}
    with pytest.raises(msgspec.ValidationError, match="Invalid value"):
        _read(cls, codec, _written(codec, newer))
    with pytest.raises(msgspec.ValidationError):
        CODECS[codec][2](_written(codec, newer), type=typing.Union[tuple(MESSAGES)])  # noqa: UP007


def _kinds(info: inspect.Type) -> list[inspect.Type]:
    """The types a value of `info` may be: its union's members, metadata taken off."""
    if isinstance(info, inspect.Metadata):
        return _kinds(info.type)
    if isinstance(info, inspect.UnionType):
        return [kind for member in info.types for kind in _kinds(member)]
    return [info]


_ARRAYS = (inspect.ListType, inspect.VarTupleType, inspect.TupleType, inspect.SetType)


def _wrong_type(info: inspect.Type) -> object:
    """A value of no type `info` takes."""
    kinds = _kinds(info)
    takes_arrays = any(
        isinstance(k, _ARRAYS) or (isinstance(k, inspect.StructType) and k.array_like)
        for k in kinds
    )
    assert not (takes_arrays and any(isinstance(k, inspect.StrType) for k in kinds))
    return "a string where none goes" if takes_arrays else [["an array where none goes"]]


def _out_of_bounds(info: inspect.Type, example: Any) -> Iterator[tuple[str, object]]:
    """Values out of a bound `info` sets, each with the bound, from the field's example."""
    for kind in _kinds(info):
        if isinstance(kind, inspect.IntType | inspect.FloatType):
            step = 1 if isinstance(kind, inspect.IntType) else 0.5
            if kind.ge is not None:
                yield f"ge={kind.ge}", kind.ge - step
            if kind.gt is not None:
                yield f"gt={kind.gt}", kind.gt
            if kind.le is not None:
                yield f"le={kind.le}", kind.le + step
            if kind.lt is not None:
                yield f"lt={kind.lt}", kind.lt
        elif isinstance(kind, inspect.StrType):
            if kind.pattern is not None:
                candidates = ["", "not a token!", "../x", "x" * 300]
                bad = next(c for c in candidates if not re.search(kind.pattern, c))
                yield f"pattern={kind.pattern}", bad
            if kind.max_length is not None:
                yield f"max_length={kind.max_length}", "x" * (kind.max_length + 1)
        elif isinstance(kind, inspect.ListType | inspect.VarTupleType | inspect.DictType):
            if kind.min_length:
                yield f"min_length={kind.min_length}", [] if isinstance(example, list) else {}
            if kind.max_length is not None and isinstance(example, list) and example:
                yield f"max_length={kind.max_length}", example[:1] * (kind.max_length + 1)
            if isinstance(kind, inspect.DictType):
                if isinstance(example, dict) and example:
                    key = next(iter(example))
                    for bound, bad in _out_of_bounds(kind.value_type, example[key]):
                        yield f"value {bound}", {**example, key: bad}
            elif isinstance(example, list) and example:
                for bound, bad in _out_of_bounds(kind.item_type, example[0]):
                    yield f"item {bound}", [bad, *example[1:]]


def _mutations(cls: type[msgspec.Struct], codec: str) -> Iterator[tuple[str, Any]]:
    """A newer writer's message made wrong in one known field: a wrong type, or each of
    the field's bounds passed."""
    info = inspect.type_info(cls)
    document = _newer(_builtins(cls, codec), info)
    for field in info.fields:
        kinds = _kinds(field.type)
        if any(isinstance(k, inspect.AnyType | inspect.RawType) for k in kinds):
            continue
        wrong = copy.deepcopy(document)
        wrong[field.encode_name] = _wrong_type(field.type)
        yield f"{field.name} of a wrong type", wrong
        for bound, bad in _out_of_bounds(field.type, document.get(field.encode_name)):
            wrong = copy.deepcopy(document)
            wrong[field.encode_name] = bad
            yield f"{field.name} past {bound}", wrong


@pytest.mark.parametrize("codec", CODECS)
@pytest.mark.parametrize("cls", LENIENT, ids=lambda c: c.__name__)
def test_a_known_field_of_a_wrong_type_or_out_of_bounds_is_still_refused(
    cls: type[msgspec.Struct], codec: str
) -> None:
    taken = []
    for what, document in _mutations(cls, codec):
        try:
            _read(cls, codec, _written(codec, document))
        except msgspec.ValidationError:
            continue
        taken.append(what)
    assert not taken, f"{cls.__name__} took: {taken}"


def test_bounds_are_tried_on_every_kind_of_bound() -> None:
    tried = [w for c in LENIENT for w, _ in _mutations(c, "json") if " past " in w]
    for bound in ("ge=", "le=", "pattern=", "min_length=", "max_length=", "item ", "value "):
        assert any(bound in what for what in tried), bound
    assert len(tried) >= 60


def test_a_checked_invariant_still_refuses_a_newer_writers_message() -> None:
    """`__post_init__` checks run on what the reader knows, unknown fields or not."""
    newer = _newer(_builtins(Trajectory, "msgpack"), inspect.type_info(Trajectory))
    newer["attempt"] = newer["group_size"]
    with pytest.raises(msgspec.ValidationError, match="outside a group"):
        wire.decode_trajectory(msgspec.msgpack.encode(newer))
    newer = _newer(_builtins(Segment, "json"), inspect.type_info(Segment))
    newer["logprobs"] = newer["logprobs"][:-1]
    with pytest.raises(msgspec.ValidationError, match="logprobs has 2 entries"):
        msgspec.json.decode(msgspec.json.encode(newer), type=Segment)


@pytest.mark.parametrize(
    ("document", "message"),
    [
        ({"hint": 1}, "Object contains unknown field `hint`"),
        (
            {"environment": {"name": "e", "setup": "", "setpu": "x"}},
            "Object contains unknown field `setpu` - at `$.environment`",
        ),
    ],
)
def test_a_document_people_write_is_still_refused_an_unknown_field(
    document: dict, message: str
) -> None:
    """Suites are written by people: there an unknown field is a misspelling
    (`decode_strict`), while the same task on the wire takes one."""
    task = msgspec.json.encode({"id": "a", "suite": "s", "prompt": "p"} | document)
    with pytest.raises(msgspec.ValidationError, match=f"^{re.escape(message)}$"):
        wire.decode_strict(task, Task)
    assert msgspec.json.decode(task, type=Task).id == "a"
    assert wire.decode_strict(msgspec.json.encode(TASK), Task) == TASK


def test_every_pattern_a_message_checks_matches_the_whole_string() -> None:
    """msgspec checks a pattern with Python's `re.search`, whose `$` also matches before a
    final newline: a feedback event id `e1\\n` passed `^...$` and reached a NATS subject
    (answered 503, retry, instead of 400). Each pattern ends in `\\Z`."""
    found = {
        t.pattern
        for cls in CROSSING
        for field in inspect.type_info(cls).fields
        for t in _types(field.type, into_structs=False)
        if isinstance(t, inspect.StrType) and t.pattern is not None
    }
    assert len(found) >= 4
    assert [p for p in found if not p.endswith("\\Z")] == []
    for token in ("e1\n", "e1\r", "e\n1"):
        with pytest.raises(msgspec.ValidationError):
            msgspec.convert(token, wire.SubjectToken)
    assert msgspec.convert("e1", wire.SubjectToken) == "e1"

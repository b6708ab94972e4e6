"""Messages on the wire between components: versioned msgspec structs, one home for all.

Each message carries its schema as a tag; decoding anything else (another schema, an
older version, a stray message on our subject) raises `msgspec.ValidationError`, which
the reader counts and logs instead of acting on it.

How a message changes, so that components of two releases read each other mid-upgrade (a
newer trainer's step report reaches an older hub; a newer feed's task, an older region):

- Readers accept fields they do not know and skip them: no struct here forbids unknown
  fields. Everything a reader does know stays as strict as ever: types, bounds, patterns
  and the `__post_init__` checks refuse a message just as before.
- A field may be added when an older reader loses nothing by skipping it: it has a
  default, and the default means what the message meant before the field existed. The
  reader of the newer release must take the message without it too.
- A field is never removed, renamed, retyped, narrowed or given another meaning in
  place; nor may a new field change what the old ones mean. Any of these takes a new tag
  (`.../v2`), which an older reader refuses (and counts) rather than misreads; the
  writer publishes the old tag until every reader takes the new one.
- Array-like structs (a shard's header and pieces, `rlfleet.weightsync`) have positions,
  not names, so they stay strict; their layout is versioned by the shard's magic.
- Documents people write (a task suite) are read with `decode_strict`, where a misspelt
  field is an error, not a newer writer's addition.
"""

from __future__ import annotations

import hashlib
import math
from enum import StrEnum
from pathlib import PurePosixPath
from typing import Annotated, Any, Literal, TypeVar

import msgspec


class WireMessage(msgspec.Struct, frozen=True, tag_field="schema"):
    """A tagged message. Unknown fields are skipped, never an error: see the module's rules."""


# Bounds a reader holds every message to, whoever sent it: a number out of them is refused
# at decoding (`msgspec.ValidationError`), before anything is allocated or acted on.
Count = Annotated[int, msgspec.Meta(ge=0)]
# A shard is fetched into one buffer of its size: a receiver allocates no more than this.
MAX_SHARD_BYTES = 60 << 20
# Attempts per task (`spec.rollout.groupSize` has the same bound): a trainer holds a
# group until all its attempts are in.
MAX_GROUP_SIZE = 1024


def _finite(what: str, *values: float) -> None:
    for value in values:
        if not math.isfinite(value):
            raise ValueError(f"{what}: {value} is not finite")


class ShardRef(msgspec.Struct, frozen=True):
    """One shard of a weight version: bounded in size, fetched and verified on its own."""

    index: Count
    size: Annotated[int, msgspec.Meta(ge=0, le=MAX_SHARD_BYTES)]  # encoded bytes, as stored
    raw_size: Count  # model bytes its pieces cover
    checksum: Annotated[str, msgspec.Meta(pattern=r"^[0-9a-f]{32}\Z")]  # xxh3-128, hex
    tensors: list[str]


class WeightManifest(WireMessage, tag="rlfleet.io/weight-manifest/v1"):
    """Everything a receiver needs to build `version` and prove it holds exactly it.

    A ``full`` version stands alone; a ``delta`` applies to ``base_version`` only. The
    state digest covers every tensor's name, dtype, shape and bits after applying.
    """

    run: str
    version: Count
    base_version: Count | None
    kind: Literal["full", "delta"]
    shards: list[ShardRef]
    removed: list[str]
    state_digest: str
    state_bytes: Count
    tensor_count: Count
    created_at: float

    def __post_init__(self) -> None:
        if (self.kind == "delta") != (self.base_version is not None):
            raise ValueError(f"a {self.kind} version with base_version {self.base_version}")
        if self.base_version is not None and self.base_version >= self.version:
            raise ValueError(f"version {self.version} is a delta on a later {self.base_version}")
        indices = [ref.index for ref in self.shards]
        if len(set(indices)) != len(indices):  # ranks number theirs apart: unique, not 0..n-1
            raise ValueError("two shards share an index")


class Segment(msgspec.Struct, frozen=True):
    """One context window of an episode: what the model saw and what it produced in it.

    `tokens[:prompt_len]` is the window's start (system prompt, task, and after a
    summary the summary); the rest alternates the model's tokens (`generated` 1) and
    observations the harness inserted (`generated` 0), which are never trained on.
    `logprobs` is the behaviour policy's log-prob of each token after the prompt (0 where
    not generated), `versions` the policy version that generated it (weights can change
    mid-episode). `routed_experts` is uint16 little-endian, shape
    [len(tokens) - 1, moe_layers, top_k]: the experts the engine used for every token it
    ran through the model (the last token is produced, never run); empty for dense models.
    """

    tokens: list[Count]
    prompt_len: int
    generated: list[Annotated[int, msgspec.Meta(ge=0, le=1)]]
    logprobs: list[float]
    versions: list[Count]
    routed_experts: bytes = b""
    moe_layers: Count = 0
    top_k: Count = 0

    def __post_init__(self) -> None:
        completion = len(self.tokens) - self.prompt_len
        if self.prompt_len < 1 or completion < 1:
            raise ValueError(f"prompt_len {self.prompt_len} leaves no prompt or no completion")
        for name in ("generated", "logprobs", "versions"):
            entries = len(getattr(self, name))
            if entries != completion:
                raise ValueError(f"{name} has {entries} entries for {completion} completion tokens")
        if not all(math.isfinite(lp) and lp <= 0 for lp in self.logprobs):
            raise ValueError("logprobs must be finite and <= 0")
        expected = 2 * (len(self.tokens) - 1) * self.moe_layers * self.top_k
        if len(self.routed_experts) != expected:
            raise ValueError(
                f"routed_experts has {len(self.routed_experts)} bytes; "
                f"{len(self.tokens) - 1} tokens x {self.moe_layers} layers x top-{self.top_k} "
                f"need {expected}"
            )


class Trajectory(WireMessage, tag="rlfleet.io/trajectory/v1"):
    """One finished attempt at a task, as a rollout worker publishes it for the trainer.

    Attempts of one task share `group_id`; the trainer normalises rewards within a
    group (GRPO). Every segment of a summarised episode is credited the final reward.
    """

    run: str
    task_id: str
    group_id: str
    group_size: Annotated[int, msgspec.Meta(ge=1, le=MAX_GROUP_SIZE)]
    attempt: int
    reward: float
    reward_breakdown: dict[str, float]
    segments: list[Segment]
    worker: str
    created_at: float

    def __post_init__(self) -> None:
        _finite("reward and created_at", self.reward, self.created_at)
        _finite("reward_breakdown", *self.reward_breakdown.values())
        if not 0 <= self.attempt < self.group_size:
            raise ValueError(f"attempt {self.attempt} is outside a group of {self.group_size}")
        if not self.segments:
            raise ValueError("a trajectory needs at least one segment")

    @property
    def policy_version(self) -> int:
        """The oldest policy version that generated any of its tokens."""
        return min(min(s.versions) for s in self.segments)

    @property
    def generated_tokens(self) -> int:
        return sum(sum(s.generated) for s in self.segments)


def check_relative_path(path: str) -> None:
    """Raise unless `path` names a place inside a working tree (it is written there)."""
    parts = PurePosixPath(path).parts
    if not parts or PurePosixPath(path).is_absolute() or ".." in parts:
        raise ValueError(f"path {path!r} must be relative and stay inside the working tree")


class Environment(msgspec.Struct, frozen=True, omit_defaults=True):
    """What tasks start from besides their own files, set up once per run and pool: a tree,
    then a command run in it (a repository's dependencies installed, a build). Every
    attempt at a task naming it, and its grading, starts from a fork of the result."""

    name: Annotated[str, msgspec.Meta(pattern=r"^[A-Za-z0-9][A-Za-z0-9._-]{0,63}\Z")]
    setup: str  # run by /bin/sh in the tree, with no network; exit 0 or the set-up failed
    files: dict[str, str] = {}

    def __post_init__(self) -> None:
        for path in self.files:
            check_relative_path(path)

    @property
    def snapshot(self) -> str:
        """The pool's name for it: its name and a digest of what it is, so a changed
        set-up is a new snapshot, never a stale one."""
        digest = hashlib.sha256(msgspec.json.encode(self)).hexdigest()[:16]
        return f"{self.name}-{digest}"


class Task(msgspec.Struct, frozen=True, omit_defaults=True):
    """A task as data: what the model is asked, what it starts from, how it is graded."""

    id: str
    suite: str
    prompt: str
    answer: str | None = None  # for exact-answer tasks
    files: dict[str, str] = {}  # the starting working tree
    hidden_tests: dict[str, str] = {}  # only ever written into the grading sandbox
    test_command: str | None = None  # run in the grading sandbox; exit 0 passes
    protected: list[str] = []  # may be read, never changed or deleted (visible tests)
    rubric: dict[str, str] = {}  # judge dimension -> what it means
    tools: bool = True  # False: a bare question, asked without the tool protocol
    environment: Environment | None = None  # forked under `files` in each sandbox
    # The conversation the model continues, as a user's data holds it ({role, content}
    # each); `prompt` is then its last user message (rlfleet's agent asks that alone).
    messages: list[dict[str, str]] = []
    metadata: dict[str, Any] = {}  # a user's own columns, for their environment

    def __post_init__(self) -> None:
        if self.environment is not None and not self.tools:
            raise ValueError("a bare question has no sandbox to set an environment up in")
        for path in [*self.files, *self.hidden_tests]:
            check_relative_path(path)
        if clash := sorted(set(self.files) & set(self.hidden_tests)):
            raise ValueError(f"hidden tests {clash} would be visible in the starting tree")
        if missing := sorted(set(self.protected) - set(self.files)):
            raise ValueError(f"protected paths {missing} are not in files")
        if self.hidden_tests and self.test_command is None:
            raise ValueError("hidden tests need a test_command")


class TaskMessage(WireMessage, tag="rlfleet.io/rollout-task/v1"):
    """One task for the rollout workers of a run, to be attempted `group_size` times."""

    run: str
    task: Task
    # The worker's default if unset.
    group_size: Annotated[int, msgspec.Meta(ge=2, le=MAX_GROUP_SIZE)] | None = None
    # The oldest policy version that may attempt it: the trainer would drop anything older
    # as stale by the time it gets there (the feed's staleness-aware admission).
    min_policy_version: Count = 0


def encode(message: WireMessage) -> bytes:
    return msgspec.json.encode(message)


T = TypeVar("T")


def decode_strict(data: bytes | str, kind: type[T]) -> T:
    """JSON `data` as `kind`, refusing any field `kind` does not know, at any depth: for
    documents people write (a task suite), where an unknown field is a misspelling that
    would otherwise be skipped. Messages between components are read leniently instead
    (see the module's rules), so that a newer writer's added field is no error."""
    value = msgspec.json.decode(data, type=kind)
    if where := _unknown_field(msgspec.json.decode(data), msgspec.inspect.type_info(kind)):
        raise msgspec.ValidationError(where)
    return value


def _unknown_field(value: Any, info: msgspec.inspect.Type, at: str = "$") -> str | None:
    """The first field in `value` (decoded JSON, known to decode as `info`) that `info`
    does not know, in msgspec's words; None if there is none."""
    inspect = msgspec.inspect
    if isinstance(info, inspect.Metadata):
        return _unknown_field(value, info.type, at)
    if isinstance(info, inspect.UnionType):  # what `value` decoded as: one member at most
        for member in info.types:
            if isinstance(member, inspect.StructType) and isinstance(value, dict):
                if member.tag_field is None or value.get(member.tag_field) == member.tag:
                    return _unknown_field(value, member, at)
            elif _holds(member, value):
                return _unknown_field(value, member, at)
        return None
    if isinstance(info, inspect.StructType) and isinstance(value, dict):
        fields = {field.encode_name: field for field in info.fields}
        for key, item in value.items():
            if key == info.tag_field:
                continue
            if key not in fields:
                where = f" - at `{at}`" if at != "$" else ""
                return f"Object contains unknown field `{key}`{where}"
            if found := _unknown_field(item, fields[key].type, f"{at}.{key}"):
                return found
    elif _holds(info, value) and isinstance(value, list):
        for index, item in enumerate(value):
            if found := _unknown_field(item, info.item_type, f"{at}[{index}]"):
                return found
    elif _holds(info, value):
        for item in value.values():
            if found := _unknown_field(item, info.value_type, f"{at}[...]"):
                return found
    return None


_SEQUENCES = (
    msgspec.inspect.ListType,
    msgspec.inspect.VarTupleType,
    msgspec.inspect.SetType,
    msgspec.inspect.FrozenSetType,
)


def _holds(info: msgspec.inspect.Type, value: Any) -> bool:
    """`info` is a collection of the kind `value` is (an array, or an object as a dict)."""
    if isinstance(info, _SEQUENCES):
        return isinstance(value, list)
    return isinstance(info, msgspec.inspect.DictType) and isinstance(value, dict)


def decode_manifest(data: bytes) -> WeightManifest:
    return msgspec.json.decode(data, type=WeightManifest)


# Trajectories carry binary expert ids, so they travel as msgpack.
def encode_trajectory(trajectory: Trajectory) -> bytes:
    return msgspec.msgpack.encode(trajectory)


def decode_trajectory(data: bytes) -> Trajectory:
    return msgspec.msgpack.decode(data, type=Trajectory)


def trajectory_id(trajectory: Trajectory) -> str:
    """`<group_id>/<attempt>`: how step reports, the drop log and publishers name it."""
    return f"{trajectory.group_id}/{trajectory.attempt}"


def cycle_groups(cycle: int) -> str:
    """The prefix of a production cycle's group ids, as its collector names them."""
    return f"cycle-{cycle}"


def cycle_of(group_id: str) -> int | None:
    """The production cycle a group belongs to, or None for a group of no cycle."""
    head, _, rest = group_id.partition("/")
    number = head.removeprefix("cycle-")
    return int(number) if rest and head != number and number.isdigit() else None


class GroupOutcome(msgspec.Struct, frozen=True):
    """The rewards one group of attempts at a task earned, as the trainer trained on them."""

    task_id: str
    rewards: list[float]

    def __post_init__(self) -> None:
        if not 1 <= len(self.rewards) <= MAX_GROUP_SIZE:
            raise ValueError(f"a group of {len(self.rewards)} rewards")
        _finite("rewards", *self.rewards)

    @property
    def uniform(self) -> bool:
        """Every attempt earned the same: GRPO's advantages are all 0, it taught nothing."""
        return max(self.rewards) - min(self.rewards) < 1e-6


class StepReport(WireMessage, tag="rlfleet.io/trainer-step/v1"):
    """What one optimiser step did, as the trainer announces it after the step is durable."""

    run: str
    step: Count
    policy_version: Count
    trajectories: list[str]  # "<group_id>/<attempt>" of each trajectory trained on
    groups: Count
    tokens: Count  # generated tokens trained on
    reward_mean: float
    loss: float
    staleness_mean: float
    staleness_max: int
    mismatch_mean_abs: float  # |trainer log-prob - behaviour log-prob| over generated tokens
    mismatch_max_abs: float
    mismatch_kl: float
    clipped_fraction: float
    dropped_stale_total: Count
    rejected_total: Count
    step_seconds: float
    finished_at: float
    # The version this step made, as weightsync shipped it: encoded bytes of what a
    # receiver holding the previous version fetches, and the seconds publishing took.
    weight_bytes: Count = 0
    weight_seconds: float = 0.0
    # Seconds the trainer sat waiting for trajectories before this step, since the previous
    # version was published (or since it started): the pipeline's idle time.
    wait_seconds: float = 0.0
    # The learning rate of the step's first optimiser update, as the run's schedule had it.
    learning_rate: float = 0.0
    # Each group trained on, so the feed can tell which tasks still teach the policy.
    outcomes: list[GroupOutcome] = []
    # A production run's: how this step moved the policy on trajectories of a cycle before
    # (the newer of the two before whose candidate was promoted), not trained on: advantage x
    # change in log-prob, per generated token. Below zero, the step moved against what
    # users said then, as a candidate trained on inverted feedback does; None, nothing held.
    held_out_gain: float | None = None
    # With `spec.tracking`: how long the run's tracker has failed (0: it answers), and the
    # step reports it could not keep (`rlfleet.trainer.tracking`).
    tracking_unreachable_seconds: float = 0.0
    tracking_dropped_total: Count = 0


DropReason = Literal["stale", "expired", "rejected"]


class TrajectoryDrop(msgspec.Struct, frozen=True):
    """A trajectory the trainer acknowledged without training it, one a line of its
    `drops.jsonl`: with the step log, what accounts for every trajectory on the stream."""

    seq: Count  # its stream sequence
    trajectory: str | None  # "<group_id>/<attempt>"; None: it could not be read
    reason: DropReason


class AnswerStats(msgspec.Struct, frozen=True):
    """How a version answered a suite, apart from how well: what a production gate's drift
    bounds compare between a candidate and the serving version."""

    answers: Count
    empty: Count  # answers with no text but whitespace
    tokens: Count  # generated, over all answers
    tool_calls: Count = 0
    malformed_tool_calls: Count = 0

    def __post_init__(self) -> None:
        if self.empty > self.answers or self.malformed_tool_calls > self.tool_calls:
            raise ValueError("more empty answers or malformed calls than there were")

    @property
    def empty_rate(self) -> float:
        return self.empty / self.answers if self.answers else 0.0

    @property
    def mean_tokens(self) -> float:
        return self.tokens / self.answers if self.answers else 0.0

    @property
    def malformed_rate(self) -> float:
        return self.malformed_tool_calls / self.tool_calls if self.tool_calls else 0.0


class EvaluationReport(WireMessage, tag="rlfleet.io/evaluation/v1"):
    """A policy version's score on the run's evaluation suite (`spec.evaluation`), as the
    run's evaluator announces it; the hub operator holds the run to the gate's floor."""

    run: str
    suite: str
    policy_version: Count
    reward: float  # mean over every attempt at every task
    pass_at_k: Annotated[float, msgspec.Meta(ge=0, le=1)]  # share of tasks some attempt got right
    attempts: Annotated[int, msgspec.Meta(ge=1)]  # per task: the k of pass@k
    tasks: Count
    finished_at: float
    # Each task's mean reward by task id, so two versions compare item by item, and how
    # the version answered (absent from reports written before either existed).
    task_rewards: dict[str, float] = {}
    answers: AnswerStats | None = None

    def __post_init__(self) -> None:
        _finite("reward and finished_at", self.reward, self.finished_at)
        _finite("task_rewards", *self.task_rewards.values())


def decode_evaluation_report(data: bytes) -> EvaluationReport:
    return msgspec.json.decode(data, type=EvaluationReport)


def decode_task_message(data: bytes) -> TaskMessage:
    return msgspec.json.decode(data, type=TaskMessage)


def decode_step_report(data: bytes) -> StepReport:
    return msgspec.json.decode(data, type=StepReport)


# A response or client event id as it appears in a subject: one token, no wildcards.
# Patterns end in `\Z`, not `$`: msgspec checks them with Python's `re.search`, whose `$`
# also matches before a final newline.
SubjectToken = Annotated[str, msgspec.Meta(pattern=r"^[A-Za-z0-9_-]{1,128}\Z")]
FeedbackKindName = Annotated[str, msgspec.Meta(pattern=r"^[a-z][a-z0-9-]{0,31}\Z")]


class CapturedCompletion(WireMessage, tag="rlfleet.io/captured-completion/v1"):
    """One completion a production pool served, as its server captured it: what the model
    saw and sampled (one segment, every completion token generated), keyed by the
    response id its client got back and will name in feedback."""

    run: str
    response_id: SubjectToken
    # Who was served, as the pool's gateway authenticated them ("" when it named no one),
    # never the request body's say: caps count per user, and only they post feedback on it.
    user: str
    segment: Segment
    text: str  # the answer as the client read it: an edit's final text is compared with it
    finish_reason: str
    served_at: float

    def __post_init__(self) -> None:
        _finite("served_at", self.served_at)
        if not all(self.segment.generated):
            raise ValueError("a captured completion is all generated tokens")


class FeedbackKind(StrEnum):
    """What a user did with a response; a pool may declare more kinds of its own."""

    ACCEPTED = "accepted"
    REJECTED = "rejected"
    EDITED = "edited"  # `text` holds the user's final version
    RETRIED = "retried"
    FOLLOW_UP = "follow-up"
    THUMBS = "thumbs"  # `value` is 1 (up) or -1 (down)


# The built-in kinds that carry a value; the others carry none, and a value sent with one
# is refused by the pool's servers and never scored (a `rejected` with a value of -1 would
# score +1). A pool's own kinds may carry one.
VALUED_KINDS = frozenset({FeedbackKind.THUMBS})
_BUILT_IN_KINDS = frozenset(FeedbackKind)


def takes_value(kind: str) -> bool:
    return kind in VALUED_KINDS or kind not in _BUILT_IN_KINDS


class Feedback(WireMessage, tag="rlfleet.io/feedback/v1"):
    """One client event about a captured completion, stored once per `event_id`."""

    run: str
    response_id: SubjectToken
    event_id: SubjectToken
    kind: FeedbackKindName
    value: float | None
    text: str | None
    user: str  # the captured completion's, whose feedback token the client sent
    received_at: float
    late: bool  # it came after the pool's feedback window closed on the completion

    def __post_init__(self) -> None:
        _finite("value and received_at", self.received_at, self.value or 0.0)
        if self.kind == FeedbackKind.EDITED and self.text is None:
            raise ValueError("an edited response's feedback needs its final text")
        if self.kind == FeedbackKind.THUMBS and self.value not in (1.0, -1.0):
            raise ValueError(f"thumbs take a value of 1 or -1, not {self.value}")


# Users one cycle report names: a thousand of the longest names the servers take (256
# bytes) keep it well under a report's bound.
MAX_NAMED_USERS = 1000


class CycleReport(WireMessage, tag="rlfleet.io/production-cycle/v1"):
    """What one cycle of a production run collected, as its collector announces it once
    the cycle's trajectories are published: the collector resumes after `capture_seq`."""

    run: str
    cycle: Annotated[int, msgspec.Meta(ge=1)]
    capture_seq: Count  # the capture stream's last sequence this cycle took
    captured: Count  # completions it took
    with_feedback: Count  # of those, answered within the window
    trained_on: Count  # trajectories published for the trainer
    dropped: dict[str, Count]  # by reason (`rlfleet.rollout.production.signals.Dropped`)
    signals: dict[str, Count]  # the trained-on completions' on-time signals, by kind
    late_feedback: Count
    reward_mean: float  # over the trajectories
    served_from: float  # the first and last completion it took were served then
    served_to: float
    finished_at: float
    # Why the cycle's feedback is not trained on ("": it is), and how many users this
    # cycle found to disagree with the pool's history (`rlfleet.rollout.production.agreement`).
    held_back: Annotated[str, msgspec.Meta(max_length=1024)] = ""
    distrusted: Count = 0
    # Those users (the first `MAX_NAMED_USERS`), as the pool's servers named them: a
    # restarted collector drops them again. Only the run's own components read this
    # stream, and its captures name users too.
    distrusted_users: Annotated[
        tuple[Annotated[str, msgspec.Meta(max_length=1024)], ...],
        msgspec.Meta(max_length=MAX_NAMED_USERS),
    ] = ()
    # Verdicts a later one of the same user on the same response replaced.
    superseded_feedback: Count = 0

    def __post_init__(self) -> None:
        _finite("times and reward_mean", self.reward_mean, self.served_from, self.served_to)
        _finite("finished_at", self.finished_at)


def decode_cycle_report(data: bytes) -> CycleReport:
    return msgspec.json.decode(data, type=CycleReport)


class RewardTally(msgspec.Struct, frozen=True):
    """Users' rewards on some answered completions: count, sum and sum of squares, so
    that tallies add up and a mean's spread is known without keeping every reward. With
    each reward, what the pool's history expected of it (0 when it expected nothing): their
    sums let a canary's difference be adjusted by it (`rlfleet.operator.promotion`)."""

    count: Count = 0
    total: float = 0.0
    total_squares: Annotated[float, msgspec.Meta(ge=0)] = 0.0
    expected_total: float = 0.0
    expected_squares: Annotated[float, msgspec.Meta(ge=0)] = 0.0
    products: float = 0.0  # of each reward and its expectation

    def __post_init__(self) -> None:
        _finite(
            "a tally's sums",
            self.total,
            self.total_squares,
            self.expected_total,
            self.expected_squares,
            self.products,
        )

    def add(self, reward: float, expected: float = 0.0) -> RewardTally:
        return RewardTally(
            self.count + 1,
            self.total + reward,
            self.total_squares + reward**2,
            self.expected_total + expected,
            self.expected_squares + expected**2,
            self.products + reward * expected,
        )

    @property
    def mean(self) -> float:
        return self.total / self.count if self.count else 0.0

    @property
    def expected_mean(self) -> float:
        return self.expected_total / self.count if self.count else 0.0


class LiveRewards(WireMessage, tag="rlfleet.io/live-rewards/v1"):
    """Users' rewards so far on the completions of the cycle being collected whose
    feedback is in, by the policy version that served them, as the collector tallies
    them: what a canary is judged on, the candidate's against the serving version's."""

    run: str
    cycle: Annotated[int, msgspec.Meta(ge=1)]
    by_version: dict[int, RewardTally]
    at: float

    def __post_init__(self) -> None:
        _finite("at", self.at)
        if any(version < 0 for version in self.by_version):
            raise ValueError("a policy version is never negative")


def decode_live_rewards(data: bytes) -> LiveRewards:
    return msgspec.json.decode(data, type=LiveRewards)


class CyclePhase(StrEnum):
    COLLECTING = "Collecting"
    TRAINING = "Training"
    EVALUATING = "Evaluating"
    CANARY = "Canary"


class CycleOutcome(StrEnum):
    SKIPPED = "Skipped"  # nothing to train on
    REJECTED = "Rejected"
    ROLLED_BACK = "RolledBack"
    PROMOTED = "Promoted"
    OVERRIDDEN = "Overridden"  # an on-call order ended it (`ServeOrder`)
    TIMED_OUT = "TimedOut"  # training or evaluating its candidate outlasted the deadline


class FinishedCycle(msgspec.Struct, frozen=True):
    number: Annotated[int, msgspec.Meta(ge=1)]
    outcome: CycleOutcome
    candidate: Count | None
    why: str
    finished_at: float = 0.0


class CycleEvent(msgspec.Struct, frozen=True):
    """A transition as on-call reads it: a Kubernetes event's reason and message."""

    reason: Annotated[str, msgspec.Meta(pattern=r"^[A-Z][A-Za-z]{0,63}\Z")]
    message: str


# Finished cycles a run's cycle state keeps (and its status shows).
CYCLE_HISTORY = 20


class CycleState(WireMessage, tag="rlfleet.io/cycle-state/v1"):
    """Where a production run's cycles stand, as its conductor publishes it after every
    transition: its own memory across restarts, what the hub operator shows in the run's
    status, and what the collector reads to know which cycle it may close. `events` are
    the transition's that wrote it."""

    run: str
    number: Annotated[int, msgspec.Meta(ge=1)]  # the cycle under way
    phase: CyclePhase
    since: float  # when the phase began
    serving: Count  # the version production's stable set serves
    candidate: Count | None = None
    collected: Count = 0  # trajectories the collector published for this cycle
    history: Annotated[list[FinishedCycle], msgspec.Meta(max_length=CYCLE_HISTORY)] = []
    events: list[CycleEvent] = []
    # The version served before `serving`, kept (weights and checkpoint) to go back to.
    previous: Count | None = None
    orders: Count = 0  # the newest on-call order (`ServeOrder.number`) carried out

    def __post_init__(self) -> None:
        _finite("since", self.since)


def servable(
    phase: CyclePhase, serving: int, previous: int | None, candidate: int | None
) -> list[int]:
    """The versions an on-call order may have production serve: those whose weights and
    checkpoint are kept, the serving one, the one before it, and a candidate under
    evaluation or in its canary."""
    kept = {serving} | ({previous} if previous is not None else set())
    if phase in (CyclePhase.EVALUATING, CyclePhase.CANARY) and candidate is not None:
        kept.add(candidate)
    return sorted(kept)


def decode_cycle_state(data: bytes) -> CycleState:
    return msgspec.json.decode(data, type=CycleState)


class EvaluationRequest(WireMessage, tag="rlfleet.io/evaluation-request/v1"):
    """The versions a production run's evaluator is to score on the whole suite, for the
    gate of `cycle`: the candidate and the serving version, on the same items."""

    run: str
    cycle: Annotated[int, msgspec.Meta(ge=1)]
    versions: Annotated[list[Count], msgspec.Meta(min_length=1, max_length=2)]


def decode_evaluation_request(data: bytes) -> EvaluationRequest:
    return msgspec.json.decode(data, type=EvaluationRequest)


class TrainerReset(WireMessage, tag="rlfleet.io/trainer-reset/v1"):
    """The trainer's weights go back to `version`'s (the serving one), as its next
    candidate must grow from what users saw, not from a candidate that was refused.
    `number` counts a run's resets, so the trainer applies each once."""

    run: str
    number: Annotated[int, msgspec.Meta(ge=1)]
    version: Count


def decode_trainer_reset(data: bytes) -> TrainerReset:
    return msgspec.json.decode(data, type=TrainerReset)


class ServeOrder(WireMessage, tag="rlfleet.io/serve-order/v1"):
    """An on-call engineer's order (`spec.production.order`, which `rlfleet promote` and
    `rlfleet rollback` write), as the hub operator passes it to the run's conductor:
    production serves `version` on every replica set now, and the cycle under way ends.
    `number` counts a run's orders, so the conductor carries out each once."""

    run: str
    number: Annotated[int, msgspec.Meta(ge=1)]
    version: Count


def decode_serve_order(data: bytes) -> ServeOrder:
    return msgspec.json.decode(data, type=ServeOrder)


class ServingTarget(WireMessage, tag="rlfleet.io/serving-target/v1"):
    """The policy version one set of a production pool's servers is to serve (the canary
    set, or the stable rest), as whoever runs the run's cycles decides it. `standby`
    names the version the set may be told next: a candidate under its gate or its canary,
    or, for the canary set, the version its candidate replaced (a rollback). Its servers
    fetch or rebuild it while they serve `version`, so the switch, when it comes, is only
    the write."""

    run: str
    replica_set: SubjectToken
    version: Count
    set_at: float
    standby: Count | None = None


def decode_serving_target(data: bytes) -> ServingTarget:
    return msgspec.json.decode(data, type=ServingTarget)


def encode_captured(captured: CapturedCompletion) -> bytes:
    return msgspec.msgpack.encode(captured)  # token lists: smaller and faster than JSON


def decode_captured(data: bytes) -> CapturedCompletion:
    return msgspec.msgpack.decode(data, type=CapturedCompletion)


def decode_feedback(data: bytes) -> Feedback:
    return msgspec.json.decode(data, type=Feedback)


class BusRole(StrEnum):
    """Who a run's NATS user is. Each component connects as a user of its own, allowed
    only what that component does (`rlfleet.bus.permissions.role_permissions`); the observer is
    for people and tools: it reads all of the run and changes nothing."""

    TRAINER = "trainer"
    ROLLOUT = "rollout"
    FEED = "feed"
    EVALUATOR = "evaluator"
    SERVING = "serving"  # a production pool's servers: capture and feedback
    COLLECTOR = "collector"  # turns captures and feedback into trajectories, by cycle
    CONDUCTOR = "conductor"  # runs a production run's cycles: gate, canary, promotion
    OBSERVER = "observer"


# Subjects and streams shared by the components of one run.
def trajectory_stream(run: str) -> str:
    return f"TRAJ-{run}"


def trajectory_subject(run: str) -> str:
    return f"rlfleet.trajectories.{run}"


def step_subject(run: str) -> str:
    return f"rlfleet.trainer.{run}.steps"


def evaluation_subject(run: str) -> str:
    return f"rlfleet.evaluator.{run}.evaluations"


def task_stream(run: str) -> str:
    return f"TASKS-{run}"


def task_subject(run: str) -> str:
    return f"rlfleet.tasks.{run}"


def weights_stream(run: str) -> str:
    return f"WEIGHTS-{run}"


def weights_prefix(run: str) -> str:
    """Every subject of a run's weights begins with this (see weightsync's `Subjects`)."""
    return f"rlfleet.weights.{run}"


def capture_stream(run: str) -> str:
    return f"CAPTURE-{run}"


def capture_subject(run: str, response_id: str = "*") -> str:
    return f"rlfleet.capture.{run}.{response_id}"


def serving_stream(run: str) -> str:
    return f"SERVING-{run}"


def serving_subject(run: str, replica_set: str = "*") -> str:
    return f"rlfleet.serving.{run}.{replica_set}"


def cycle_subject(run: str) -> str:
    return f"rlfleet.collector.{run}.cycles"


def live_subject(run: str) -> str:
    return f"rlfleet.collector.{run}.live"


def conductor_subjects(run: str) -> str:
    """Every subject the run's conductor publishes on."""
    return f"rlfleet.conductor.{run}.*"


def cycle_state_subject(run: str) -> str:
    return f"rlfleet.conductor.{run}.state"


def evaluation_request_subject(run: str) -> str:
    return f"rlfleet.conductor.{run}.evaluate"


def trainer_reset_subject(run: str) -> str:
    return f"rlfleet.conductor.{run}.reset"


def serve_order_subject(run: str) -> str:
    """The hub operator's orders to the conductor. On the conductor's stream subjects:
    the conductor may publish there too, but it would only be ordering itself."""
    return f"rlfleet.conductor.{run}.order"


def feedback_stream(run: str) -> str:
    return f"FEEDBACK-{run}"


def feedback_subject(run: str, response_id: str = "*", event_id: str = "*") -> str:
    return f"rlfleet.feedback.{run}.{response_id}.{event_id}"


# One weights message carries at most this much of a shard (the stream takes no more). A
# server counts headers against its max_payload (1 MiB by default) and a leaf node drops
# its link on an oversized message, so leave room for the direct-get headers.
WEIGHT_CHUNK_BYTES = (1 << 20) - (4 << 10)

"""Who may do what on NATS: the users of each run, and a region's leaf node.

The hub operator mints one user per component of each run (`mint_run_user`), allowed only
what that component does with the run's subjects and streams (`role_access`), and the
component's pods connect with it. A run's user JWT expires (`USER_TTL_S`): whoever minted
it signs it again before then (`renewal_due`) and writes the new one where the pods read
it. Policy only: the keys and JWTs are `rlfleet.bus.credentials`, connecting and revoking
`rlfleet.bus.connection`.
"""

from __future__ import annotations

import hmac
from dataclasses import dataclass

from rlfleet.api.wire import (
    BusRole,
    capture_stream,
    capture_subject,
    conductor_subjects,
    cycle_subject,
    evaluation_subject,
    feedback_stream,
    feedback_subject,
    live_subject,
    serving_stream,
    serving_subject,
    step_subject,
    task_stream,
    task_subject,
    trajectory_stream,
    trajectory_subject,
    weights_prefix,
    weights_stream,
)
from rlfleet.bus.credentials import CLIENT, USER, NKey, Permissions, expires_at, mint_user
from rlfleet.bus.streams import (
    TRAINER_CONSUMER,
    WORKER_CONSUMER,
    cycle_stream,
    evaluation_stream,
    step_stream,
)

# How long a run's user JWT is valid: a leaked one stops working after this at the latest.
USER_TTL_S = 24 * 3600.0
# A user is signed again once this share of its life is left: room for the new one to reach
# the pods (a Secret's mounted file follows it within about a minute) and for an owner
# that was down a while.
RENEW_WHEN_LEFT = 1 / 3

RUN_USER_PREFIX = "run:"  # run:<run>:<role>; its replies come to `run_inbox(run, role)`
RUN_INBOXES = "_RUN_INBOX"  # the first token of every run user's reply subjects


def run_user_key(signer_seed: str, incarnation: str, role: BusRole) -> NKey:
    """The key of one of a run's users: the same through the run's life, so that signing
    it again (a renewal, an owner restarted) needs no record of it, and so that the keys
    of a deleted run can be named to revoke them; another for a run made again under the
    same name (another `incarnation`: its Kubernetes uid)."""
    secret = NKey.from_seed(signer_seed).raw_seed
    raw = hmac.new(secret, f"rlfleet-user/{incarnation}/{role}".encode(), "sha256").digest()
    return NKey(USER, raw)


def run_user_keys(signer_seed: str, incarnation: str) -> list[str]:
    """The public keys of every user of one incarnation of a run."""
    return [run_user_key(signer_seed, incarnation, role).public for role in BusRole]


def mint_run_user(
    signer_seed: str,
    account: str,
    run: str,
    role: BusRole,
    incarnation: str,
    ttl_s: float = USER_TTL_S,
) -> str:
    """The user (.creds text) one of a run's components connects as: allowed what that
    component does with the run's subjects and streams, nothing else, as a client (never
    as a leaf node), for `ttl_s`."""
    return mint_user(
        signer_seed,
        account,
        f"{RUN_USER_PREFIX}{run}:{role}",
        role_permissions(run, role),
        ttl_s=ttl_s,
        user=run_user_key(signer_seed, incarnation, role),
        connections=(CLIENT,),
    )


def renewal_due(credentials: str, now: float, ttl_s: float) -> bool:
    """Whether a user (.creds text) minted for `ttl_s` is to be signed again: less than
    `RENEW_WHEN_LEFT` of its life is left (or it has none)."""
    expires = expires_at(credentials)
    return expires is not None and expires - now < ttl_s * RENEW_WHEN_LEFT


def run_inbox(run: str, role: BusRole) -> str:
    """The reply subjects of one of a run's users: no other user may subscribe to them, of
    this run or another, so none reads another's replies."""
    return f"{RUN_INBOXES}.{run}.{role}"


@dataclass(frozen=True)
class Access:
    """What one role does with a run's subjects and streams. No role makes, changes or
    deletes a consumer, nor lists streams: it reads through direct gets, and takes
    messages from the durable consumer made for it with the run's streams."""

    publishes: tuple[str, ...] = ()  # subjects it writes into their streams
    # (stream, durable consumer) it takes messages from, acknowledging each
    consumes: tuple[tuple[str, str], ...] = ()
    reads: tuple[str, ...] = ()  # streams it looks into: info, one message, direct gets
    # (stream, durable consumer) whose state it reads (acknowledged through, pending),
    # taking nothing from it
    watches: tuple[tuple[str, str], ...] = ()
    purges: tuple[str, ...] = ()  # streams whose old messages it removes
    listens: tuple[str, ...] = ()  # subjects it subscribes to without a consumer


@dataclass(frozen=True)
class _RunStreams:
    """A run's streams by what they hold, and the subjects that announce a new version."""

    steps: str
    evaluations: str
    tasks: str
    trajectories: str
    weights: str
    captures: str
    feedback: str
    cycles: str
    serving: str
    # A new version's manifest wakes a receiver, which reads it from its stream.
    manifests: str

    @classmethod
    def of(cls, run: str) -> _RunStreams:
        return cls(
            steps=step_stream(run),
            evaluations=evaluation_stream(run),
            tasks=task_stream(run),
            trajectories=trajectory_stream(run),
            weights=weights_stream(run),
            captures=capture_stream(run),
            feedback=feedback_stream(run),
            cycles=cycle_stream(run),
            serving=serving_stream(run),
            manifests=f"{weights_prefix(run)}.*.manifest.*",
        )

    @property
    def everything(self) -> tuple[str, ...]:
        return (
            *(self.steps, self.evaluations, self.tasks, self.trajectories, self.weights),
            *(self.captures, self.feedback, self.cycles, self.serving),
        )


def role_access(run: str, role: BusRole) -> Access:
    """The one table of who does what on a run's NATS (each component's code is the
    reference: what it publishes, binds to and consumes)."""
    streams = _RunStreams.of(run)
    if role == BusRole.OBSERVER:
        return _observer_access(run, streams)
    if role in _PRODUCTION_ROLES:
        return _production_access(run, role, streams)
    return _training_access(run, role, streams)


# A production run's own components: its pool's servers, collector and conductor.
_PRODUCTION_ROLES = (BusRole.SERVING, BusRole.COLLECTOR, BusRole.CONDUCTOR)


def _training_access(run: str, role: BusRole, s: _RunStreams) -> Access:
    """What the components of a run that learns from rollouts do."""
    match role:
        case BusRole.TRAINER:  # learns from trajectories; reports steps; publishes weights
            return Access(
                publishes=(step_subject(run), f"{weights_prefix(run)}.>"),
                consumes=((s.trajectories, TRAINER_CONSUMER),),
                # Cycles: a production run's resets, back to the serving version.
                reads=(s.trajectories, s.steps, s.weights, s.cycles),
                purges=(s.weights,),  # retires versions older than the kept snapshots
            )
        case BusRole.ROLLOUT:  # takes tasks; publishes trajectories; follows weights
            return Access(
                publishes=(trajectory_subject(run),),
                consumes=((s.tasks, WORKER_CONSUMER),),
                reads=(s.tasks, s.trajectories, s.weights),
                listens=(s.manifests,),
            )
        case BusRole.FEED:  # follows step reports; publishes tasks
            return Access(
                publishes=(task_subject(run),),
                reads=(s.steps, s.tasks),
                listens=(step_subject(run),),  # a new report wakes it
            )
        case BusRole.EVALUATOR:  # follows weights; publishes evaluation reports
            return Access(
                publishes=(evaluation_subject(run),),
                # Cycles: what a gate asks it to score.
                reads=(s.evaluations, s.weights, s.cycles),
                listens=(s.manifests,),
            )


def _production_access(run: str, role: BusRole, s: _RunStreams) -> Access:
    """What a production run's own components do."""
    match role:
        case BusRole.SERVING:  # captures what it serves; records feedback; loads versions
            return Access(
                publishes=(capture_subject(run), feedback_subject(run)),
                # Captures: is a response id one of ours. Serving: its set's version.
                reads=(s.captures, s.weights, s.serving),
                listens=(s.manifests,),
            )
        case BusRole.COLLECTOR:  # reads captures and feedback; publishes trajectories
            return Access(
                publishes=(trajectory_subject(run), cycle_subject(run), live_subject(run)),
                reads=(s.captures, s.feedback, s.cycles, s.trajectories),
            )
        case BusRole.CONDUCTOR:  # reads reports; publishes its state and its orders
            return Access(
                publishes=(conductor_subjects(run), serving_subject(run)),
                reads=(s.steps, s.evaluations, s.cycles, s.serving),
            )


def _observer_access(run: str, s: _RunStreams) -> Access:
    """The observer reads everything, writes nothing, acknowledges nothing."""
    return Access(
        reads=s.everything,
        # How far the trainer has acknowledged: an audit's "nothing lost".
        watches=((s.trajectories, TRAINER_CONSUMER),),
        listens=(
            step_subject(run),
            evaluation_subject(run),
            task_subject(run),
            trajectory_subject(run),
            capture_subject(run),
            feedback_subject(run),
            cycle_subject(run),
            live_subject(run),
            conductor_subjects(run),
            serving_subject(run),
        ),
    )


# The JetStream API is reached on the local domain or through another one's prefix (the
# hub's, from a region; a region's mirror, from the hub).
_API = ("$JS.API", "$JS.*.API")


def role_permissions(run: str, role: BusRole) -> Permissions:
    """NATS permissions for `role_access`: each stream operation as its JetStream API
    subject, so a user may not create, update, delete or purge a stream it only uses,
    list streams, make a consumer, or take from (or acknowledge for) a consumer not its
    own."""
    access = role_access(run, role)
    publish = list(access.publishes)
    for api in _API:
        for stream in access.reads:
            publish += [
                f"{api}.STREAM.INFO.{stream}",
                f"{api}.STREAM.MSG.GET.{stream}",
                f"{api}.DIRECT.GET.{stream}",
                f"{api}.DIRECT.GET.{stream}.>",
            ]
        for stream, consumer in (*access.consumes, *access.watches):
            publish.append(f"{api}.CONSUMER.INFO.{stream}.{consumer}")
        for stream, consumer in access.consumes:
            publish.append(f"{api}.CONSUMER.MSG.NEXT.{stream}.{consumer}")
        publish += [f"{api}.STREAM.PURGE.{stream}" for stream in access.purges]
    for stream, consumer in access.consumes:
        publish += [f"$JS.ACK.{stream}.{consumer}.>", f"$JS.ACK.*.*.{stream}.{consumer}.>"]
    inbox = f"{run_inbox(run, role)}.>"
    return Permissions(publish=publish, subscribe=[*access.listens, inbox])


def leaf_permissions(hub_domain: str, region: str) -> Permissions:
    """What a region's leaf node may carry to and from the hub, as the user it logs in
    with there (every client at the leaf is bound by its own user besides): the region's
    work (trajectories, captures and feedback published into the hub's streams; tasks
    pulled from, and acknowledged to, the workers' consumer; streams read), its weights'
    mirror (the ephemeral consumer it makes on the hub, and what that delivers), and the
    hub's requests to the region's JetStream and their answers. Not a stream made,
    changed, purged or deleted at the hub, nor a durable consumer made, deleted or pulled
    from there but the workers', nor a step, weight, task or order published there: a
    region's credentials cannot steer training."""
    hub, mine = f"$JS.{hub_domain}.API", f"$JS.{region}.API"
    api = [
        f"{hub}.STREAM.INFO.*",
        f"{hub}.STREAM.MSG.GET.*",
        f"{hub}.DIRECT.GET.>",
        f"{hub}.CONSUMER.INFO.*.{WORKER_CONSUMER}",
        f"{hub}.CONSUMER.MSG.NEXT.*.{WORKER_CONSUMER}",
        # The weights' mirror's: an ephemeral consumer, which this subject cannot name, so
        # cannot be a durable one (the server refuses a durable name here).
        f"{hub}.CONSUMER.CREATE.*",
    ]
    work = [trajectory_subject("*"), capture_subject("*"), feedback_subject("*")]
    acks = [f"$JS.ACK.*.{WORKER_CONSUMER}.>", f"$JS.ACK.*.*.*.{WORKER_CONSUMER}.>"]
    # The region's JetStream answers the hub's operator (its own user's `_INBOX`) and the
    # trainer (its run user's inbox), which keep the region's weights mirror.
    replies = ["_INBOX.>", f"{RUN_INBOXES}.*.{BusRole.TRAINER}.>"]
    return Permissions(
        publish=[*api, *work, *acks, "$JS.FC.>", *replies],  # FC: the mirror's consumer's
        subscribe=[
            f"{mine}.>",  # the hub's operator and trainer keep the region's mirror
            f"{weights_prefix('*')}.*.manifest.*",  # a new version wakes its receivers
            "$JSC.R.>",  # the hub's answer when the mirror makes its consumer
            "$JS.M.>",  # what the mirror's consumer delivers
            "$JS.FC.>",
            "_INBOX.>",
            # Answers to the region's components, its rollout workers and pool servers.
            *(f"{RUN_INBOXES}.*.{role}.>" for role in (BusRole.ROLLOUT, BusRole.SERVING)),
        ],
    )

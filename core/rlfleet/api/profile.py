"""A cost profile: what one unit of the pipeline's work costs, as rlfleet measured it.

`rlfleet plan` models a run from these numbers and nothing else, so they are typed and
versioned (the tag), and each says where it comes from. `bench/profile.py` measures them on
the machine it runs on; for hardware nobody has measured here yet, a user writes the same
file from their own figures (a GPU's tokens per second, a link's bandwidth) and replaces
them once rlfleet has run there.
"""

from __future__ import annotations

from typing import Annotated

import msgspec

Positive = Annotated[float, msgspec.Meta(gt=0)]
NonNegative = Annotated[float, msgspec.Meta(ge=0)]


# Strict, unlike the wire's messages: people write this file, and an unknown field in it
# is a misspelling to point out, not a newer writer's addition.
class _Costs(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    pass


class TrainerCosts(_Costs, kw_only=True):
    """One optimiser step: `step_overhead_s + tokens * seconds_per_token / speedup(ranks)`,
    where `speedup(n) = 1 + (n - 1) * rank_efficiency` (`bench/trainer_ranks.py` measures the
    efficiency as its two-rank speedup less one)."""

    seconds_per_token: Positive  # one rank's step seconds per generated token trained on
    step_overhead_s: NonNegative  # what a step costs whatever its size
    publish_s: NonNegative  # from a step's end to its version on the hub's stream
    rank_efficiency: Annotated[float, msgspec.Meta(ge=0, le=1)] = 1.0


class RolloutCosts(_Costs, kw_only=True):
    """One rollout engine (a lent replica's GPUs together, or a CPU core here) when busy."""

    tokens_per_s: Positive  # generated tokens per second of one engine, all its groups
    groups_at_once: Annotated[int, msgspec.Meta(ge=1)]  # an engine's concurrent groups
    tokens_per_attempt: Positive  # mean generated tokens of one attempt at a task
    # The spread of a group's tokens (standard deviation over mean): groups of one batch
    # finish apart, so engines and the feed's looks are not in step.
    group_tokens_cv: NonNegative = 0.0
    load_s: NonNegative  # generation paused while an engine loads a policy version
    # From a version at hand until an engine starts loading it: engines poll for newer
    # versions, and how soon they look differs while they generate and while they wait.
    notice_busy_s: NonNegative = 0.0
    notice_idle_s: NonNegative = 0.0
    gpus_per_engine: Annotated[int, msgspec.Meta(ge=1)] = 1
    engines_per_device: Annotated[int, msgspec.Meta(ge=1)] = 1  # >1: engines share a device
    # How a device's speed falls when it runs fewer groups than it has room for: with k of
    # n, `tokens_per_s * (k / n) ** batch_exponent`. 0: compute-bound (a CPU: each group
    # goes faster); 1: memory-bound decoding (a GPU at modest batch: each group's speed is
    # the same, so an engine given one group does a fraction of the work).
    batch_exponent: Annotated[float, msgspec.Meta(ge=0, le=1)] = 0.0


class WeightCosts(_Costs, kw_only=True):
    """A version's way from the hub's stream to an engine generating with it:
    `latency_s + bytes_per_version / gbps`, where `gbps` is the slower of the region's link
    and `receive_gbps`, then `RolloutCosts.load_s`."""

    bytes_per_version: Annotated[int, msgspec.Meta(ge=0)]  # what a region fetches per version
    latency_s: NonNegative  # what does not grow with bytes: round trips, the engine's poll
    # One receiver's fetch, decode and apply (`bench/weightsync.py`); None: not measured.
    receive_gbps: Positive | None = None


class RegionLink(_Costs, kw_only=True):
    region: str
    gbps: Positive  # the hub-to-region link's bandwidth, gigabytes per second


class Profile(
    msgspec.Struct,
    frozen=True,
    forbid_unknown_fields=True,
    kw_only=True,
    tag="rlfleet.io/profile/v1",
    tag_field="kind",
):
    """Everything `rlfleet plan` needs; `measured_on` says which machine it is true of."""

    measured_on: str
    trainer: TrainerCosts
    rollout: RolloutCosts
    weights: WeightCosts
    links: list[RegionLink] = []  # the hub's link to each region, where it is the slower


def decode_profile(data: bytes) -> Profile:
    """A profile from its YAML or JSON; raises msgspec.ValidationError naming the bad
    field, msgspec.DecodeError for a file that is neither."""
    return msgspec.yaml.decode(data, type=Profile)


def encode_profile(profile: Profile) -> bytes:
    return msgspec.json.format(msgspec.json.encode(profile), indent=2) + b"\n"

"""A day of traffic on a fleet's InferencePools: what `rlfleet plan --traffic` lends from.

Each pool is an InferencePool manifest (the file `kubectl apply` takes) in a named region,
with its traffic signal (the metric its `spec.traffic` reads, summed over the pool)
at each hour of a day, in UTC. Typed and versioned, like a cost profile.
"""

from __future__ import annotations

from typing import Annotated

import msgspec

HOURS = 24


# Strict, unlike the wire's messages: people write this file, and an unknown field in it
# is a misspelling to point out, not a newer writer's addition.
class PoolTraffic(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    region: str
    pool: str  # an InferencePool manifest, relative to the traffic file
    hourly_load: Annotated[
        list[Annotated[float, msgspec.Meta(ge=0)]], msgspec.Meta(min_length=HOURS, max_length=HOURS)
    ]


class Traffic(
    msgspec.Struct,
    frozen=True,
    forbid_unknown_fields=True,
    tag="rlfleet.io/traffic/v1",
    tag_field="kind",
):
    pools: Annotated[list[PoolTraffic], msgspec.Meta(min_length=1)]


def decode_traffic(data: bytes) -> Traffic:
    """Traffic from its YAML or JSON; raises msgspec.ValidationError naming the bad field."""
    return msgspec.yaml.decode(data, type=Traffic)

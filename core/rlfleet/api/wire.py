"""Messages on the wire between components: versioned msgspec structs, one home for all.

Each message carries its schema as a tag; decoding anything else (another schema, an
older version, a stray message on our subject) raises `msgspec.ValidationError`, which
the reader counts and logs instead of acting on it.
"""

from __future__ import annotations

from typing import Literal

import msgspec


class WireMessage(msgspec.Struct, frozen=True, forbid_unknown_fields=True, tag_field="schema"):
    pass


class ShardRef(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """One shard of a weight version: bounded in size, fetched and verified on its own."""

    index: int
    size: int  # encoded bytes, as stored
    raw_size: int  # model bytes its pieces cover
    checksum: str  # xxh3-128 of the encoded shard, hex
    tensors: list[str]


class WeightManifest(WireMessage, tag="rlfleet.io/weight-manifest/v1"):
    """Everything a receiver needs to build `version` and prove it holds exactly it.

    A ``full`` version stands alone; a ``delta`` applies to ``base_version`` only. The
    state digest covers every tensor's name, dtype, shape and bits after applying.
    """

    run: str
    version: int
    base_version: int | None
    kind: Literal["full", "delta"]
    shards: list[ShardRef]
    removed: list[str]
    state_digest: str
    state_bytes: int
    tensor_count: int
    created_at: float


def encode(message: WireMessage) -> bytes:
    return msgspec.json.encode(message)


def decode_manifest(data: bytes) -> WeightManifest:
    return msgspec.json.decode(data, type=WeightManifest)

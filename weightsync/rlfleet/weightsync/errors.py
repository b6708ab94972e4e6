"""Why weightsync refuses an input. Each is counted and logged by whoever catches it."""


class WeightsyncError(Exception):
    """Base class: the input was refused and nothing of it was applied."""

    reason = "error"


class CorruptShard(WeightsyncError):
    """A shard's bytes do not decode to what its manifest promises."""

    reason = "corrupt_shard"


class UnknownBase(WeightsyncError):
    """A delta against a version this receiver does not hold."""

    reason = "unknown_base"


class NotOurs(WeightsyncError):
    """A message without our schema on a subject we read."""

    reason = "not_ours"


class DigestMismatch(WeightsyncError):
    """The state after applying a version is not the state its manifest describes."""

    reason = "digest_mismatch"

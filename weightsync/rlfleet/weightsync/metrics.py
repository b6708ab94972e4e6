"""Prometheus metrics of weightsync; the process that hosts it exposes them."""

from prometheus_client import Counter, Gauge

REJECTED = Counter(
    "rlfleet_weightsync_rejected_total",
    "Inputs weightsync refused (corrupt shards, unknown bases, foreign messages), by reason.",
    ["reason"],
)
APPLIED = Counter(
    "rlfleet_weightsync_versions_applied_total", "Versions applied by receivers, by kind.", ["kind"]
)
FETCHED_BYTES = Counter(
    "rlfleet_weightsync_fetched_bytes_total", "Shard bytes fetched by receivers."
)
PUBLISHED_BYTES = Counter(
    "rlfleet_weightsync_published_bytes_total", "Shard bytes published, by kind.", ["kind"]
)
VERSION = Gauge("rlfleet_weightsync_version", "The version a receiver holds, verified.")

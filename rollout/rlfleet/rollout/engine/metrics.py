"""Prometheus metrics of the rollout worker."""

from prometheus_client import Counter, Gauge, Histogram

trajectories = Counter("rlfleet_rollout_trajectories_total", "Trajectories published")
sessions = Counter(
    "rlfleet_rollout_sessions_total",
    "Finished sessions, by how they ended",
    ["ended"],  # answered, submitted, turns, sandbox, context
)
cheats = Counter("rlfleet_rollout_cheats_total", "Attempts scored zero as cheating")
tasks_rejected = Counter("rlfleet_rollout_tasks_rejected_total", "Malformed task messages")
sandbox_claim = Histogram(
    "rlfleet_rollout_sandbox_claim_seconds",
    "Time to claim an attempt's sandbox from the environment pool, its tree written in",
    buckets=(0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1, 2, 5, 30),
)
claim_timeouts = Counter(
    "rlfleet_rollout_claim_timeouts_total",
    "Attempts failed because no sandbox came free within the claim deadline",
)
engine_workers = Gauge(
    "rlfleet_rollout_engine_workers", "Devices (vLLM workers) of this process's engine"
)
policy_version = Gauge("rlfleet_rollout_policy_version", "Policy version the engine runs")
generated_tokens = Counter("rlfleet_rollout_generated_tokens_total", "Tokens sampled")
awaiting_version = Gauge(
    "rlfleet_rollout_tasks_awaiting_version",
    "Tasks held until the engine runs the newest policy they may be attempted by",
)
version_wait = Counter(
    "rlfleet_rollout_version_wait_seconds_total",
    "Seconds tasks spent waiting for a newer policy version",
)
episodes_failed = Counter(
    "rlfleet_rollout_episodes_failed_total",
    "Attempts that yielded nothing to train on, by reason; their groups are tried again",
    ["reason"],  # harness, deadline, reward, turns, context, ...
)
endpoint_refused = Counter(
    "rlfleet_rollout_endpoint_refused_total",
    "Requests the episode endpoint refused, by reason",
    ["reason"],  # key (unknown, or its episode over), request (malformed), caps
)
resegmented_calls = Counter(
    "rlfleet_rollout_resegmented_calls_total",
    "Endpoint calls whose rendered prompt did not extend the episode's tokens so far, so"
    " they started a new segment (a template that drops or rewrites past turns)",
)

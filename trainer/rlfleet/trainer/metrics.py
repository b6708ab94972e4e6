"""Prometheus metrics of the trainer."""

from prometheus_client import Counter, Gauge

trajectories = Counter(
    "rlfleet_trainer_trajectories_total",
    "Trajectories received, by what became of them",
    ["outcome"],  # trained, stale, rejected, duplicate, expired
)
rejected = Counter(
    "rlfleet_trainer_rejected_total", "Trajectories rejected as malformed, by reason", ["reason"]
)
steps = Counter("rlfleet_trainer_steps_total", "Optimiser steps taken")
nonfinite = Counter(
    "rlfleet_trainer_nonfinite_micro_batches_total",
    "Micro-batches left out of a step because their loss was not finite",
)
policy_version = Gauge("rlfleet_trainer_policy_version", "Newest policy version published")
mismatch = Gauge(
    "rlfleet_trainer_logprob_mismatch",
    "Trainer vs inference log-probs on the last step's generated tokens",
    ["stat"],  # mean_abs, max_abs, kl
)

"""The production pool: a serving vLLM that captures what it serves, users' feedback on it,
and the collector that turns both into trajectories (real-time RL). Reaches nothing of the
rollout worker."""
